"""Composition and one training step: the ONE place the order of parallelisms is written.

:func:`build` composes, on every rank::

    mesh -> stage model chunks (tensor-parallel, only this stage's layers)
         -> data-parallel wrapper per chunk -> optimizer per chunk -> schedule

:func:`train_step` runs one optimizer step: this rank's microbatches of the (layout-independent)
global batch through the pipeline schedule, gradient finalisation (dp buckets, sp and tied
embedding sums), the global gradient norm and clipping, and the AdamW update. The step's loss and
gradient norm are reduced in one small all-reduce over every rank (kind ``loss``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import comm
from ..config import TrainConfig
from ..context_parallel import get_batch_on_this_cp_rank
from ..data import Corpus, microbatches
from ..data_parallel import (
    DistributedDataParallel,
    DistributedOptimizer,
    MainParamsOptimizer,
    finalize_model_grads,
    no_weight_decay_cond,
)
from ..data_parallel.clip_grads import GradNorm
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
from .lr_schedule import learning_rate

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
        # parameters are created (and initialised) on the device itself: a 1B-parameter model's
        # counter-based initialisation takes a second on a GPU and minutes on a few CPU cores
        with torch.device(device):
            chunks.append(GPTModel(cfg.model, mesh, layer_ids=layers, pre_process=role.is_first,
                                   post_process=role.is_last, options=options))
    if init_from_hf is not None:
        load_hf_weights(chunks, init_from_hf, cfg.model, mesh.tp.rank)
    zero = cfg.distributed_optimizer
    ddps = [DistributedDataParallel(chunk, mesh, overlap_grad_reduce=cfg.overlap_grad_reduce,
                                    bucket_size=cfg.bucket_size, use_distributed_optimizer=zero)
            for chunk in chunks]
    opt_cls, o = DistributedOptimizer if zero else MainParamsOptimizer, cfg.optim
    optimizers = [opt_cls(d, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                          weight_decay=o.weight_decay, no_weight_decay_cond=no_weight_decay_cond)
                  for d in ddps]
    return Run(cfg, mesh, corpus, chunks, ddps, optimizers, device,
               GradNorm(ddps, mesh, sharded=zero))


def forward_step(data_iterator, model: GPTModel):
    """Megatron's ``forward_step_func``: read a microbatch where the chunk needs one (with
    context parallelism, this cp rank's chunks of it and their global positions)."""
    tokens, labels, *positions = next(data_iterator)
    out = model(tokens if model.pre_process else None, labels if model.post_process else None,
                position_ids=positions[0] if positions else None)

    def loss_func(per_token):  # [b, s] on the last stage
        loss = per_token.float().mean()
        return loss, loss.detach()
    return out, loss_func


def _run_schedule(run: Run, batch: torch.Tensor, forward_only: bool) -> list:
    cfg, mesh = run.cfg, run.mesh
    mbs = [(t.to(run.device), lab.to(run.device)) for t, lab in
           microbatches(batch, mesh.dp.rank, mesh.dp.size, batch.shape[0] // (
               cfg.micro_batch_size * mesh.dp.size))]
    if mesh.cp.size > 1:  # Megatron's get_batch_on_this_cp_rank: chunks r and 2cp-1-r
        mbs = [get_batch_on_this_cp_rank(t, lab, mesh.cp.rank, mesh.cp.size) for t, lab in mbs]
    iters = [iter(mbs) for _ in run.chunks]
    schedule = _SCHEDULES[cfg.schedule]
    interleaved = cfg.schedule == "interleaved"
    kw = dict(mesh=mesh, hidden_size=cfg.model.hidden_size, dtype=run.dtype,
              sequence_parallel=cfg.parallel.sequence_parallel and mesh.tp.size > 1,
              overlap_p2p_comm=cfg.overlap_p2p_comm)
    if not forward_only:
        kw.update(no_sync_func=[d.no_sync for d in run.ddps],
                  finalize_model_grads_func=lambda _: finalize_model_grads(run.ddps, mesh))
    for chunk in run.chunks:
        chunk.train(not forward_only)
    if cfg.model.num_experts:  # the aux loss's gradient is scaled as the schedule scales the loss
        MoEAuxLossAutoScaler.set_loss_scale(1.0 / len(mbs))
    return schedule(forward_step, iters if interleaved else iters[0],
                    run.chunks if interleaved else run.chunks[0], len(mbs),
                    cfg.model.seq_length // mesh.cp.size, cfg.micro_batch_size, forward_only,
                    **kw)


def train_step(run: Run, step: int) -> dict:
    """One optimizer step; returns ``{"loss", "grad_norm", "lr"}`` (the same on every rank).

    A non-finite loss or gradient norm skips the update (``"skipped": True``); the data of the
    step is consumed all the same, so a run that recovers stays on the same batches.
    """
    cfg, mesh = run.cfg, run.mesh
    batch = run.corpus.global_batch(step, cfg.global_batch_size)
    for opt in run.optimizers:
        opt.zero_grad()
    moe = cfg.model.num_experts
    if moe:
        reset_moe_stats(run.chunks)
    losses = _run_schedule(run, batch, forward_only=False)
    zero = torch.zeros((), dtype=torch.float64)
    loss_sum = torch.stack(losses).double().sum() if losses else zero
    # this rank's loss counts once per (dp replica, cp rank): last stage, tp rank 0; every cp
    # rank holds the mean over the same number of tokens, so their mean is the sequence's
    weight = 1.0 if (mesh.is_last_stage and mesh.tp.rank == 0) else 0.0
    scalars = torch.stack([run.grad_norm.local_sq_norm(run.device),
                           loss_sum.to(run.device) * weight])
    if moe:  # aux/z loss, dropped assignments, tokens per expert: one all-reduce with the rest
        stats = moe_step_stats(run.chunks, cfg.model.num_layers, moe, run.device)
        scalars = torch.cat([scalars, stats])
    comm.all_reduce(scalars, mesh.world, phase="optimizer", kind="loss",
                    site="train_step:grad_norm_and_loss", split="per-rank partial sums")
    grad_norm = math.sqrt(scalars[0].item())
    loss = scalars[1].item() / (mesh.dp_cp.size * run.cfg.num_microbatches)
    extra = _moe_metrics(cfg, scalars[2:], mesh.dp_cp.size * cfg.num_microbatches) if moe else {}
    o = cfg.optim
    lr = learning_rate(step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps,
                       total_steps=cfg.steps)
    # One all-reduce carried both numbers, so every rank sees the same NaN/Inf and decides alike.
    if not (math.isfinite(grad_norm) and math.isfinite(loss)):
        run.step, run.tokens = step + 1, run.tokens + cfg.tokens_per_step
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr, **extra, "skipped": True}
    run.grad_norm.clip(grad_norm, o.clip_grad)
    for opt in run.optimizers:
        opt.lr = lr
        opt.step()
    run.step = step + 1
    run.tokens += cfg.tokens_per_step
    return {"loss": loss, "grad_norm": grad_norm, "lr": lr, **extra}


def _moe_metrics(cfg: TrainConfig, stats: torch.Tensor, microbatches: int) -> dict:
    """``aux_loss`` (mean over the step's microbatches of the sum over MoE layers, coefficient
    included), ``z_loss`` when on, ``tokens_per_expert`` per MoE layer (the step's routed
    assignments after any drops) and ``dropped_tokens`` with a capacity factor."""
    m = cfg.model
    table = stats[3:].view(m.num_layers, m.num_experts)
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
    """Mean loss over ``batches`` (each ``[b, s]``, every rank given the same), forward only."""
    cfg, mesh = run.cfg, run.mesh
    total = torch.zeros((), dtype=torch.float64, device=run.device)
    for tokens, labels in batches:
        batch = torch.cat([tokens, labels[:, -1:]], dim=1)  # back to [b, s + 1] windows
        losses = _run_schedule(run, batch, forward_only=True)
        if losses and mesh.tp.rank == 0:
            total += torch.stack(losses).double().sum()
    comm.all_reduce(total, mesh.world, phase="forward", kind="loss", site="evaluate:loss")
    per_batch = cfg.global_batch_size // (cfg.micro_batch_size * mesh.dp.size)
    return total.item() / (len(batches) * mesh.dp_cp.size * per_batch)
