"""The formulas' view of a run: :func:`comm_view` turns a :class:`~paraloom.config.TrainConfig`
(what ``paraloom train`` runs and writes as ``config.json``) into the :class:`CommConfig` the
formulas read. It is the one place a run becomes a ``CommConfig``: ``check`` reads a run folder's
``config.json`` through :meth:`TrainConfig.from_dict` (the same classes, defaults and migration
of older folders as ``--resume``) and comes here; the derived settings (MLP width, padded
vocabulary, microbatches per step) are the configuration's own properties, not decided again.
"""

from __future__ import annotations

import dataclasses

from ..config.megatron_fsdp_checks import ddp_overlaps_param_gather, fsdp_reduces_in_bf16
from ..config.train import TrainConfig
from .moe_formulas import moe_from_run
from .spec import Architecture, CommConfig

__all__ = ["comm_view", "view_of_saved"]


def comm_view(cfg: TrainConfig) -> CommConfig:
    """A train step of ``cfg`` (gradient sync, loss reduction) as the formulas see it: its
    layout, switches and dtypes (bf16 activations and parameters: 2 bytes; fp32 main grads:
    4 bytes)."""
    m, p = cfg.model, cfg.parallel
    model = dataclasses.asdict(m)
    return CommConfig(
        layers=m.num_layers, hidden=m.hidden_size, heads=m.num_attention_heads,
        seq_len=m.seq_length, vocab=cfg.padded_vocab_size, ffn=m.ffn,
        micro_batch=cfg.micro_batch_size, num_microbatches=cfg.num_microbatches,
        tp=p.tp, pp=p.pp, dp=p.dp, vpp=p.vpp, sequence_parallel=p.uses_sequence_parallel,
        recompute=cfg.recompute, distributed_optimizer=cfg.distributed_optimizer,
        instances=cfg.num_distributed_optimizer_instances,
        megatron_fsdp=cfg.data_parallel_sharding_strategy if cfg.use_megatron_fsdp else None,
        dp_grad_bytes=2 if fsdp_reduces_in_bf16(cfg) else None,
        overlap_param_gather=ddp_overlaps_param_gather(cfg),
        param_gather_forward=ddp_overlaps_param_gather(cfg),
        param_gather_with_optimizer_step=cfg.overlap_param_gather_with_optimizer_step,
        align_param_gather=cfg.align_param_gather,
        overlap_grad_reduce=cfg.overlap_grad_reduce, align_grad_reduce=cfg.align_grad_reduce,
        bucket_size=cfg.bucket_size, bucket_tail_splits=cfg.bucket_tail_splits,
        schedule=cfg.schedule, dtype_bytes=2 if cfg.dtype == "bf16" else 4, grad_bytes=4,
        arch=Architecture.from_model(model), cp=p.cp, cp_comm_type=p.cp_comm_type,
        cp_a2a=p.cp_sizes[0] if p.cp_comm_type == "a2a+p2p" and p.cp > 1 else 1,
        moe=moe_from_run(model, dataclasses.asdict(p), cfg.micro_batch_size),
        megatron_lm_loop=cfg.megatron_lm_loop, rerun_vote=cfg.rerun_mode != "disabled",
        cross_entropy_fusion=m.cross_entropy_loss_fusion,
        exit_vote=cfg.run.exit_duration_mins is not None,
        per_token_loss=cfg.calculate_per_token_loss, params_norm=cfg.run.log_params_norm,
        num_zeros=cfg.run.log_num_zeros_in_grad,
        total_steps=cfg.steps, log_interval=cfg.run.log_interval)


def view_of_saved(saved: dict) -> CommConfig:
    """:func:`comm_view` of a run's ``config.json`` (``ValueError`` naming what it cannot
    read)."""
    return comm_view(TrainConfig.from_dict(saved))
