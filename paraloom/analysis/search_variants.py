"""What ``plan --search`` tries beyond the plain layouts (:mod:`.search`): memory fit, and the
fastest distributed-optimizer layouts again with several optimizer instances and under
Megatron-FSDP's sharding strategies."""

from __future__ import annotations

from dataclasses import replace

from .costs import Options, spans_nodes
from .hardware import Hardware
from .memory_formulas import activation_bytes_per_layer, memory_per_gpu
from .spec import CommConfig
from .steptime import step_time

__all__ = ["FIT_FRACTION", "INSTANCE_TRIES", "instance_counts", "transient_bytes", "memory_fit",
           "with_instances", "with_megatron_fsdp"]

FIT_FRACTION = 0.9
"""The share of a GPU's memory a layout may plan to use (the rest: CUDA context, allocator
slack, the logits' transients)."""


def instance_counts(dp_cp: int, edp: int, tp: int, gpus_per_node: int) -> tuple[int, ...]:
    """The distributed-optimizer instance counts worth trying: 1, and, when the dp x cp ranks
    span nodes, the fewest instances whose block of them fits in one node (Megatron's partial
    distributed optimizer: reduce-scatter inside the node, the shard all-reduced across)."""
    for n in range(2, dp_cp + 1):
        if spans_nodes(tp, dp_cp, gpus_per_node) and dp_cp % n == 0 and edp % n == 0 \
                and not spans_nodes(tp, dp_cp // n, gpus_per_node):
            return (1, n)
    return (1,)


def transient_bytes(c: CommConfig) -> float:
    """Bytes one layer needs on top of what ``memory_per_gpu`` keeps for backward: under full
    recomputation the re-run layer's whole activations, under selective the re-run attention
    scores (written-out attention), each for ``s/cp`` tokens (the cp ring computes ``s/cp``
    queries against ``s/cp`` keys at a time). This is what makes a long sequence need cp."""
    if c.recompute == "none":
        return 0.0
    s = c.seq_len // c.cp
    kw = dict(sequence_parallel=c.sp, attention=c.arch.attention)
    full = activation_bytes_per_layer(s, c.micro_batch, c.hidden, c.heads, c.tp, **kw)
    kept = activation_bytes_per_layer(s, c.micro_batch, c.hidden, c.heads, c.tp,
                                      recompute=c.recompute, **kw)
    return (full - kept) * c.dtype_bytes / 2


def memory_fit(c: CommConfig, hw: Hardware, fit_fraction: float = FIT_FRACTION) -> dict:
    """Whether ``c`` fits ``hw``: ``need_bytes`` (the busiest stage's memory plus the layer
    being recomputed), ``budget_bytes`` (``fit_fraction`` of the GPU's memory), ``fits`` and,
    when it does not, ``advice``: the settings that would cut memory, most effective first."""
    need = memory_per_gpu(c)["total"] + transient_bytes(c)
    budget = fit_fraction * hw.hbm_bytes
    advice = []
    if need > budget:
        if not c.distributed_optimizer and c.dp > 1:
            advice.append("--distributed-optimizer (optimizer state sharded over dp)")
        if c.recompute != "full":
            advice.append("--recompute full" if c.recompute == "selective"
                          else "--recompute selective or full")
        if not c.sp and c.tp > 1:
            advice.append("--sequence-parallel")
        advice.append("a larger --tp or --pp (fewer layers and weights per GPU)")
        advice.append("paraloom plan --search --gpus N (every layout that fits)")
    return {"need_bytes": need, "budget_bytes": budget, "fits": need <= budget,
            "advice": advice}


INSTANCE_TRIES = 64
"""How many of the fastest distributed-optimizer layouts the search also tries with several
optimizer instances (a change of the data-parallel reduction only: the rest ranks the same)."""


def _variants(fits: list, zeros: list, hw: Hardware, o: Options, fit_fraction: float,
              changes) -> int:
    """Add to ``fits`` the fastest distributed-optimizer layouts again under each
    ``(config changes, candidate changes)`` that ``changes(config)`` yields; returns how many of
    those did not fit."""
    too_big = 0
    for x, c in sorted(zeros, key=lambda xc: xc[0].step_time_s)[:INSTANCE_TRIES]:
        for config, candidate in changes(c):
            more = replace(c, **config)
            mem = memory_fit(more, hw, fit_fraction)["need_bytes"]
            if mem > fit_fraction * hw.hbm_bytes:
                too_big += 1
                continue
            r = step_time(more, hw, o)
            fits.append(replace(x, step_time_s=r["step_time_s"], memory_bytes=mem,
                                prediction=r, **candidate))
    return too_big


def with_instances(fits: list, zeros: list, hw: Hardware, o: Options,
                   fit_fraction: float) -> int:
    """Add to ``fits`` the fastest distributed-optimizer layouts again with each instance count
    of :func:`instance_counts` above 1; returns how many of those did not fit."""
    def changes(c):
        edp = c.dp * c.cp // (c.moe.ep if c.moe is not None else 1)
        return [({"instances": n}, {"instances": n})
                for n in instance_counts(c.dp * c.cp, edp, c.tp, hw.gpus_per_node)[1:]]
    return _variants(fits, zeros, hw, o, fit_fraction, changes)


FSDP_STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
"""Megatron-FSDP's sharding strategies the search tries (``no_shard`` is DDP's pattern)."""


def with_megatron_fsdp(fits: list, zeros: list, hw: Hardware, o: Options,
                       fit_fraction: float) -> int:
    """Add to ``fits`` the fastest distributed-optimizer layouts without pipeline parallelism
    (megatron-core's Megatron-FSDP cannot wrap a stage) again under each of
    :data:`FSDP_STRATEGIES`; returns how many of those did not fit."""
    def changes(c):
        if c.pp > 1:
            return []
        return [({"megatron_fsdp": s, "buckets": None, "bucket_size": None}, {"fsdp": s})
                for s in FSDP_STRATEGIES]
    return _variants(fits, zeros, hw, o, fit_fraction, changes)
