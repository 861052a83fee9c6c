"""Composition and one training step: the ONE place the order of parallelisms is written.

:func:`build` composes, on every rank: mesh -> stage model chunks (tensor-parallel, only this
stage's layers) -> data-parallel wrapper per chunk -> optimizer per chunk -> schedule.

:func:`train_step` runs one optimizer step: this rank's microbatches of the (layout-independent)
global batch through the pipeline schedule, gradient finalisation (dp buckets, sp and tied
embedding sums), the global gradient norm and clipping, and the AdamW update, then the agreement
on the update and the loss of the step, as Megatron-LM drives Megatron-Core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from .. import comm
from ..config import TrainConfig
from ..config.megatron_fsdp_checks import ddp_overlaps_param_gather, fsdp_reduces_in_bf16
from ..context_parallel import get_batch_on_this_cp_rank
from ..data import Corpus, microbatches
from ..data_parallel import (
    DistributedDataParallel,
    DistributedOptimizer,
    MainParamsOptimizer,
    ParamGather,
    finalize_model_grads,
    no_weight_decay_cond,
    paused,
)
from ..data_parallel.clip_grads import GradNorm
from ..data_parallel.megatron_fsdp import FullyShardedDataParallel
from ..device import get_device
from ..mesh import ParallelMesh
from ..models import GPTModel, ParallelOptions
from ..models.hf import load_hf_weights
from ..moe import MoEAuxLossAutoScaler, is_moe_layer, moe_step_stats, reset_moe_stats
from ..pipeline_parallel import stage_layers, stage_role
from ..pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    forward_backward_zero_bubble,
)
from ..tensor_parallel.random import model_parallel_seed
from .lr_schedule import run_learning_rate
from .megatron_lm_loop import after_step, broadcast_batch, rerun_vote
from .step_stats import agree, params_norm, reduce_loss

__all__ = ["Run", "build", "train_step", "forward_step", "evaluate"]

_SCHEDULES = {"none": forward_backward_no_pipelining,
              "1f1b": forward_backward_pipelining_without_interleaving,
              "interleaved": forward_backward_pipelining_with_interleaving,
              "zb-h1": forward_backward_zero_bubble}


@dataclass
class Run:
    """Everything one rank holds for a training run."""

    cfg: TrainConfig
    mesh: ParallelMesh
    corpus: Corpus
    chunks: list[GPTModel]
    ddps: list[DistributedDataParallel]
    optimizers: list
    device: torch.device
    grad_norm: GradNorm
    step: int = 0
    tokens: int = 0
    first_step: int = 0
    """The first step this process runs (after a resume, the checkpoint's)."""
    started: float = 0.0
    """When the run was launched (``time.time()``): ``--exit-duration-in-mins`` counts from it."""

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cfg.dtype == "bf16" else torch.float32


def build(cfg: TrainConfig, mesh: ParallelMesh, corpus: Corpus, *,
          init_from_hf: str | None = None) -> Run:
    """Compose the run on this rank (same call, same order, on every rank).

    ``init_from_hf``: a Hugging Face GPT-2 folder whose weights replace the initial ones; each
    rank reads its own shards, before the data-parallel wrapper and the optimizer see them."""
    device = get_device()
    model_parallel_seed(cfg.seed, mesh.tp.rank, device)
    p, options = cfg.parallel, ParallelOptions.of(cfg)
    L, vpp = cfg.model.num_layers, mesh.vpp
    chunks = []
    for c, layers in enumerate(stage_layers(L, p.pp, mesh.pp.rank, vpp)):
        role = stage_role(L, p.pp, mesh.pp.rank, vpp, c)
        # made on the device itself: a 1B model's counter-based init takes minutes on CPU cores
        with torch.device(device):
            chunks.append(GPTModel(cfg.model, mesh, layer_ids=layers, pre_process=role.is_first,
                                   post_process=role.is_last, options=options))
        chunks[-1].setup_embeddings_and_output_layer()  # as Megatron's constructor does
    if init_from_hf is not None:
        load_hf_weights(chunks, init_from_hf, cfg.model, mesh.tp.rank)
    zero, with_step = cfg.distributed_optimizer, cfg.overlap_param_gather_with_optimizer_step
    ddps = [_data_parallel(cfg, mesh, chunk, c) for c, chunk in enumerate(chunks)]
    for c, d in enumerate(ddps if ddp_overlaps_param_gather(cfg) else []):  # after a step
        ParamGather(d, aligned=cfg.schedule == "interleaved" and cfg.align_param_gather,
                    with_optimizer_step=with_step and c == 0)
    opt_cls, o = DistributedOptimizer if zero else MainParamsOptimizer, cfg.optim
    optimizers = [opt_cls(d, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                          weight_decay=o.weight_decay, no_weight_decay_cond=no_weight_decay_cond)
                  for d in ddps]
    return Run(cfg, mesh, corpus, chunks, ddps, optimizers, device,
               GradNorm(ddps, mesh, sharded=zero, dense_optimizers=2 if with_step else 1,
                        one_optimizer=cfg.use_megatron_fsdp))


def _data_parallel(cfg: TrainConfig, mesh: ParallelMesh, chunk, c: int):
    """Model chunk ``c``'s data-parallel wrapper: Megatron-FSDP under ``--use-megatron-fsdp``,
    else Megatron's DDP with Megatron-LM's arguments (bucketing off after the first chunk)."""
    average = not cfg.calculate_per_token_loss  # per token: the plain sum
    if cfg.use_megatron_fsdp:
        return FullyShardedDataParallel(chunk, mesh, bucket_size=cfg.bucket_size, average=average,
                                        data_parallel_sharding_strategy=cfg.
                                        data_parallel_sharding_strategy,
                                        grad_reduce_in_fp32=not fsdp_reduces_in_bf16(cfg),
                                        instances=cfg.num_distributed_optimizer_instances)
    return DistributedDataParallel(
        chunk, mesh, overlap_grad_reduce=cfg.overlap_grad_reduce, bucket_size=cfg.bucket_size,
        use_distributed_optimizer=cfg.distributed_optimizer, tail_splits=cfg.bucket_tail_splits,
        disable_bucketing=c > 0 or cfg.overlap_param_gather_with_optimizer_step, average=average,
        instances=cfg.num_distributed_optimizer_instances)


def forward_step(data_iterator, model: GPTModel, token_sum: bool = False):
    """Megatron's ``forward_step_func``: read a microbatch where the chunk needs one (with
    context parallelism, this cp rank's chunks of it and their global positions); ``token_sum``
    (``--calculate-per-token-loss``): the loss is the sum, with the token count (int32)."""
    tokens, labels, *positions = next(data_iterator)
    out = model(tokens if model.pre_process else None, labels if model.post_process else None,
                position_ids=positions[0] if positions else None)

    def loss_func(per_token):  # [b, s] on the last stage
        per_token = per_token.float()
        loss = per_token.mean()  # Megatron's loss / num_tokens: the microbatch's mean
        report = torch.stack([per_token.detach().sum(),
                              torch.tensor(float(per_token.numel()), device=per_token.device)])
        if token_sum:
            return per_token.sum(), torch.tensor(per_token.numel(), dtype=torch.int), report
        return loss, report      # Megatron's "lm loss": [sum, tokens] (fp32)
    return out, loss_func


def _microbatches(run: Run, mbs: list, chunk: GPTModel):
    """A chunk's microbatches, read as its forward step asks for them: broadcast over tp first
    under ``--megatron-lm-loop`` (Megatron-LM's ``get_batch_on_this_tp_rank``), then this cp
    rank's chunks r and 2cp-1-r of the sequence (``get_batch_on_this_cp_rank``)."""
    mesh = run.mesh
    for tokens, labels in mbs:
        if run.cfg.megatron_lm_loop:
            tokens, labels = broadcast_batch(tokens, labels, mesh, first=chunk.pre_process,
                                             last=chunk.post_process)
        if mesh.cp.size > 1:
            yield get_batch_on_this_cp_rank(tokens, labels, mesh.cp.rank, mesh.cp.size)
        else:
            yield tokens, labels


def _run_schedule(run: Run, batch: torch.Tensor, forward_only: bool) -> list:
    cfg, mesh = run.cfg, run.mesh
    mbs = [(t.to(run.device), lab.to(run.device)) for t, lab in
           microbatches(batch, mesh.dp.rank, mesh.dp.size, batch.shape[0] // (
               cfg.micro_batch_size * mesh.dp.size))]
    iters = [_microbatches(run, mbs, chunk) for chunk in run.chunks]
    schedule = _SCHEDULES[cfg.schedule]
    interleaved = cfg.schedule == "interleaved"
    kw = dict(mesh=mesh, hidden_size=cfg.model.hidden_size, dtype=run.dtype,
              sequence_parallel=cfg.parallel.uses_sequence_parallel,
              overlap_p2p_comm=cfg.overlap_p2p_comm)
    if not forward_only:
        kw.update(no_sync_func=[d.no_sync for d in run.ddps],
                  calculate_per_token_loss=cfg.calculate_per_token_loss,
                  finalize_model_grads_func=lambda _, *n: finalize_model_grads(run.ddps, mesh, *n))
        if cfg.overlap_grad_reduce and cfg.align_grad_reduce:  # Megatron-LM's grad_sync_func
            kw["grad_sync_func"] = [d.start_grad_sync for d in run.ddps]
        gather = run.ddps[0].param_gather  # --align-param-gather: the schedule launches them
        if gather is not None and gather.aligned and gather.enabled:
            kw["param_sync_func"] = [d.param_gather.start_all for d in run.ddps]
    for chunk in run.chunks:
        chunk.train(not forward_only)
    if cfg.model.num_experts:  # the aux loss's gradient is scaled as the schedule scales the
        # loss; per token, Megatron multiplies it by the router's tokens x tp x cp (= b x s; the
        # MoE layer multiplies a cp slice's share by cp already)
        MoEAuxLossAutoScaler.set_loss_scale(cfg.micro_batch_size * cfg.model.seq_length
                                            // mesh.cp.size if cfg.calculate_per_token_loss
                                            else 1.0 / len(mbs))
    step = partial(forward_step, token_sum=cfg.calculate_per_token_loss)
    return schedule(step, iters if interleaved else iters[0],
                    run.chunks if interleaved else run.chunks[0], len(mbs),
                    cfg.model.seq_length // mesh.cp.size, cfg.micro_batch_size, forward_only,
                    **kw)


def train_step(run: Run, step: int) -> dict:
    """One optimizer step after ``step`` done (iteration ``step + 1``, the number every output
    gives it), as Megatron-LM's ``train_step`` drives Megatron-Core; returns
    ``{"loss", "grad_norm", "lr"}`` (``"loss"`` only on the last pipeline stage, ``None``
    elsewhere: Megatron reports it from the last rank).

    After the schedule (and its ``finalize_model_grads``): the optimizer step — the global
    gradient norm (:meth:`GradNorm.total`), clipping, the Adam update (the distributed optimizer
    then all-gathers the parameters) — then the update flag (int32 MIN) and the norm (fp32 MAX)
    agreed over the model-parallel group, and on the last stage the loss: the per-token sum and
    the token count (fp32 ``[2]``) summed over dp x cp. A non-finite gradient norm skips the
    update (``"skipped": True``; every rank computed the same norm); the data of the step is
    consumed all the same, so a run that recovers stays on the same batches. Under
    ``--megatron-lm-loop`` (the default) Megatron-LM's loop adds its own collectives around
    this (:mod:`.megatron_lm_loop`): the batch broadcast as each microbatch is read, the rerun
    vote after the schedule, the log's learning rate and the timers' barriers at the end.
    """
    cfg, mesh = run.cfg, run.mesh
    batch = run.corpus.global_batch(step, cfg.global_batch_size)
    for opt in run.optimizers:
        opt.zero_grad()
    moe = cfg.model.num_experts
    if moe:
        reset_moe_stats(run.chunks)
    losses = _run_schedule(run, batch, forward_only=False)
    loop = cfg.megatron_lm_loop
    if loop and cfg.rerun_mode != "disabled":
        rerun_vote(mesh, run.device)
    o = cfg.optim
    lr = run_learning_rate(o, step, cfg.steps)
    grad_norm = run.grad_norm.total(run.device)  # Megatron's optimizer.step() from here ...
    ok = math.isfinite(grad_norm)
    if ok:
        run.grad_norm.clip(grad_norm, o.clip_grad)
    zeros = run.grad_norm.count_zeros(run.device) if cfg.run.log_num_zeros_in_grad else None
    if ok:
        for opt in run.optimizers:
            opt.lr = lr
            opt.step()                               # ... to here
    ok, grad_norm, zeros = agree(run, ok, grad_norm, zeros)
    out = {"loss": reduce_loss(run, losses), "grad_norm": grad_norm, "lr": lr}
    if zeros is not None:
        out["num_zeros"] = zeros
    if cfg.run.log_params_norm:  # Megatron-LM's loop, before training_log
        out["params_norm"] = params_norm(run)
    if after_step(mesh, cfg, step, step == run.first_step, lr, run.started, run.device):
        out["exit"] = True  # --exit-duration-in-mins: some rank has run that long
    if moe:
        out.update(_moe_metrics(cfg, _moe_stats(run), mesh.dp_cp.size * cfg.num_microbatches))
    run.step = step + 1
    run.tokens += cfg.tokens_per_step
    return out if ok else {**out, "skipped": True}


def _moe_stats(run: Run) -> torch.Tensor:
    """The MoE statistics summed over every rank (paraloom's logging; Megatron-LM logs its own
    MoE losses differently): one float64 all-reduce after the step."""
    cfg = run.cfg
    stats = moe_step_stats(run.chunks, cfg.model.num_layers, cfg.model.num_experts, run.device)
    comm.all_reduce(stats, run.mesh.world, phase="optimizer", kind="world",
                    site="train_step:moe_stats", split="MoE aux/z losses, drops, tokens/expert")
    return stats


def _moe_metrics(cfg: TrainConfig, stats: torch.Tensor, microbatches: int) -> dict:
    """``aux_loss`` (mean over the step's microbatches of the sum over MoE layers, coefficient
    included), ``z_loss`` when on, ``tokens_per_expert`` per MoE layer (the step's routed
    assignments after any drops) and ``dropped_tokens`` with a capacity factor."""
    m = cfg.model
    table = stats[3:].view(m.num_layers, m.num_experts)  # the stats of moe_step_stats
    out = {"aux_loss": stats[0].item() / microbatches}
    if m.moe_z_loss_coeff:
        out["z_loss"] = stats[1].item() / microbatches
    out["tokens_per_expert"] = {str(i): [round(v) for v in table[i].tolist()]
                                for i in range(m.num_layers) if is_moe_layer(m, i)}
    if m.moe_expert_capacity_factor is not None:
        out["dropped_tokens"] = round(stats[2].item())
    return out


@torch.no_grad()
def evaluate(run: Run, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss per token over ``batches`` (each ``[b, s]``, every rank given the same),
    forward only."""
    mesh = run.mesh
    total = torch.zeros(2, dtype=torch.float64, device=run.device)  # [sum, tokens]
    with paused(run.ddps):  # Megatron-LM's evaluate: parameters gathered, pre-hooks off
        for tokens, labels in batches:
            batch = torch.cat([tokens, labels[:, -1:]], dim=1)  # back to [b, s + 1] windows
            losses = _run_schedule(run, batch, forward_only=True)
            if losses and mesh.tp.rank == 0:
                total += torch.stack(losses).double().sum(0)
    comm.all_reduce(total, mesh.world, phase="forward", kind="loss", site="evaluate:loss")
    return (total[0] / total[1]).item()
