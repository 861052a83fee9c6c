"""The analytical model: what one training step communicates, stores and computes.

:func:`expected_comm` gives, for one rank, the number of operations and their logical bytes per
``(kind, op, phase)`` in one step, written from the same conventions ``comm.py`` records
(all-reduce and reduce-scatter: the local input; all-gather: the local shard; send/recv: the
tensor), so :mod:`paraloom.analysis.check` can demand exact equality with a recorded ledger.
Re-runs of forward communication under full recomputation are keyed with phase ``recompute``
(the ledger marks them ``recompute: true``; their recorded phase is ``forward``).

A train step (``grad_sync``) adds the data-parallel bucket reductions of the exact bucket
layout (:mod:`paraloom.analysis.layout`), ``finalize_model_grads``' sp and tied-embedding sums
and the loss + gradient-norm all-reduce; :func:`paraloom.analysis.check.check_run` compares all
of it with a ``paraloom train`` run folder.

Notation: ``s`` sequence, ``b`` microbatch, ``h`` hidden, ``a`` heads, ``L`` layers, ``V``
vocabulary, ``t``/``p``/``d`` tp/pp/dp sizes, ``v`` virtual stages, ``m`` microbatches. With
context parallelism (``cp``) activations hold ``s/cp`` tokens and gradients are reduced over
``dp * cp`` ranks; the cp messages themselves are in :mod:`paraloom.analysis.cp_formulas`.

Sources: Shoeybi et al. 2019 (Megatron-LM: 2 all-reduces forward + 2 backward per layer),
Korthikanti et al. 2022 (sequence parallelism, Table 2 activation memory), Narayanan et al. 2021
(pipeline p2p, bubble, FLOPs per iteration, parameter count).
"""

from __future__ import annotations

from collections import defaultdict

from .cp_formulas import add_cp_comm, grad_sync_view, local_seq
from .layout import rank_buckets, sp_elems, stage_layers
from .moe_formulas import moe_comm
from .spec import F32, CommConfig

__all__ = ["CommConfig", "expected_comm"]






def expected_comm(c: CommConfig, pp_rank: int = 0) -> dict[tuple[str, str, str], dict]:
    """``{(kind, op, phase): {"count": n, "bytes": total}}`` for one step on one rank of
    pipeline stage ``pp_rank`` (every tp/dp rank of a stage communicates the same)."""
    out: dict = defaultdict(lambda: {"count": 0, "bytes": 0})

    def add(kind, op, phase, count, nbytes):
        if count:
            out[kind, op, phase]["count"] += count
            out[kind, op, phase]["bytes"] += count * nbytes

    t, m, sp = c.tp, c.num_microbatches, c.sp
    first, last = pp_rank == 0, pp_rank == c.pp - 1
    act = local_seq(c) * c.micro_batch * c.hidden * c.dtype_bytes  # one [s(/cp), b, h] tensor
    shard = act // t                                              # one [s/t, b, h] tensor
    ml = m * stage_layers(c)                                       # layer passes per step
    if t > 1:
        if sp:  # per layer: QKV and fc1 gather the input, proj and fc2 reduce-scatter the output
            add("sp", "all_gather", "forward", 2 * ml, shard)
            add("sp", "reduce_scatter", "forward", 2 * ml, act)
            # backward: row layers gather the output grad, column layers re-gather the saved
            # input shard and reduce-scatter the input grad
            add("sp", "all_gather", "backward", 4 * ml, shard)
            add("sp", "reduce_scatter", "backward", 2 * ml, act)
            if c.recompute == "full":  # the re-run stops before fc2's reduction (see below)
                add("sp", "all_gather", "recompute", 2 * ml, shard)
                add("sp", "reduce_scatter", "recompute", ml, act)
        else:   # Shoeybi et al.: row outputs all-reduced forward, column input grads backward
            add("tp", "all_reduce", "forward", 2 * ml, act)
            add("tp", "all_reduce", "backward", 2 * ml, act)
            if c.recompute == "full":
                # torch's non-reentrant checkpoint stops the re-run once every tensor backward
                # needs is rebuilt: fc2's reduced output only joins the residual sum, so only
                # proj's reduction is repeated (Megatron's reentrant checkpoint repeats both)
                add("tp", "all_reduce", "recompute", ml, act)
        if first:  # vocabulary-parallel embedding: partial rows summed
            if sp:
                add("sp", "reduce_scatter", "forward", m, act)
                add("sp", "all_gather", "backward", m, shard)
            else:
                add("tp", "all_reduce", "forward", m, act)
        if last:  # output layer input (copy / sequence gather) and vocab-parallel cross-entropy
            if sp:
                add("sp", "all_gather", "forward", m, shard)
                add("sp", "reduce_scatter", "backward", m, act)
            else:
                add("tp", "all_reduce", "backward", m, act)
            tokens = local_seq(c) * c.micro_batch
            add("tp", "all_reduce", "forward", m, tokens * F32)                   # MAX
            add("tp", "all_reduce", "forward", m, (3 if c.label_smoothing else 2) * tokens * F32)
    add_cp_comm(c, ml, add)
    if c.pp > 1:
        _pipeline(c, pp_rank, add, shard if sp else act)
    if c.moe is not None:  # MoE layers' tp/sp traffic instead of the dense MLP's, and ep counts
        moe_comm(c, pp_rank, add)
    if c.grad_sync:
        _grad_sync(grad_sync_view(c), pp_rank, add)  # cp: gradients reduced over dp x cp
    return dict(out)


def _pipeline(c: CommConfig, r: int, add, nbytes: int) -> None:
    """p2p per microbatch: activations to the next virtual stage, gradients to the previous one
    (Narayanan et al.); with ``v`` chunks a rank sits at ``v`` virtual stages."""
    p, v, m = c.pp, c.v, c.num_microbatches
    stages = [k * p + r for k in range(v)]           # this rank's virtual stage indices
    sends = sum(1 for s in stages if s < v * p - 1)   # has a successor
    recvs = sum(1 for s in stages if s > 0)           # has a predecessor
    add("pp", "send", "forward", sends * m, nbytes)
    add("pp", "recv", "forward", recvs * m, nbytes)
    add("pp", "send", "backward", recvs * m, nbytes)
    add("pp", "recv", "backward", sends * m, nbytes)


def _grad_sync(c: CommConfig, r: int, add) -> None:
    """What a train step adds after the schedule: the data-parallel bucket reductions (launched
    from the gradient hooks, phase ``backward``, or at finish, phase ``optimizer``; under the
    distributed optimizer reduce-scattered, except a tied embedding's own bucket, and every
    bucket's parameter shard all-gathered), ``finalize_model_grads`` (one coalesced all-reduce
    over tp of the sequence-parallel grads, one over the embedding group of the tied word
    embedding) and the step's loss + gradient-norm reduction over all ranks (2 float64)."""
    if c.dp > 1:
        phase = "backward" if c.overlap_grad_reduce else "optimizer"
        buckets = [(b.numel, b.reduce_scatter) for b in rank_buckets(c, r)] \
            if c.buckets is None else [(n, c.distributed_optimizer) for n in c.buckets]
        edp = c.dp // c.moe.ep if c.moe is not None else c.dp
        if c.buckets is None:
            buckets = [(b.numel, b.reduce_scatter, edp if b.expert else c.dp)
                       for b in rank_buckets(c, r)]
        else:
            buckets = [(n, c.distributed_optimizer, c.dp) for n in c.buckets]
        for n, scatter, size in buckets:
            if size == 1:  # an expert bucket with ep = dp: no replica to reduce with
                continue
            add("dp", "reduce_scatter" if scatter else "all_reduce", phase, 1, n * c.grad_bytes)
            if c.distributed_optimizer and c.optimizer_step:
                add("dp", "all_gather", "optimizer", 1, n // size * c.dtype_bytes)
    if c.tp > 1 and sp_elems(c, r):  # LayerNorms etc. under sp; MoE: experts' fc2 biases
        add("sp", "all_reduce", "optimizer", 1, sp_elems(c, r) * c.grad_bytes)
    if c.pp > 1 and r in (0, c.pp - 1) and c.arch.tied:
        vocab = -(-c.vocab // c.tp) * c.tp
        add("emb", "all_reduce", "optimizer", 1, vocab * c.hidden // c.tp * c.grad_bytes)
    if c.tp * c.pp * c.dp > 1:
        stats = 3 + c.layers * c.moe.num_experts if c.moe is not None else 0
        add("loss", "all_reduce", "optimizer", 1, (2 + stats) * 8)
