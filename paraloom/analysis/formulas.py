"""The analytical model: what one training step communicates, stores and computes.

:func:`expected_comm` gives, for one rank, the number of operations and their logical bytes per
``(kind, op, phase)`` in one step, written from the same conventions ``comm.py`` records
(all-reduce and reduce-scatter: the local input; all-gather: the local shard; send/recv: the
tensor), so :mod:`paraloom.verify.check` can demand exact equality with a recorded ledger.
Re-runs of forward communication under full recomputation are keyed with phase ``recompute``
(the ledger marks them ``recompute: true``; their recorded phase is ``forward``).

A train step (``grad_sync``) adds the data-parallel bucket reductions of the exact bucket
layout (:mod:`paraloom.analysis.layout`), ``finalize_model_grads``' sp and tied-embedding sums,
the gradient norm and the step's agreements and loss (:func:`_grad_sync`);
:func:`paraloom.verify.check.check_run` compares all of it with a ``paraloom train`` run
folder.

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
from .fsdp_formulas import zero3_gather_events
from .layout import chunk_groups, layers_per_stage, sp_elems
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
    ml = m * layers_per_stage(c)                                   # layer passes per step
    if t > 1:
        if sp:  # per layer: QKV and fc1 gather the input, proj and fc2 reduce-scatter the output
            add("sp", "all_gather", "forward", 2 * ml, shard)
            add("sp", "reduce_scatter", "forward", 2 * ml, act)
            # backward: row layers gather the output grad, column layers re-gather the saved
            # input shard and reduce-scatter the input grad
            add("sp", "all_gather", "backward", 4 * ml, shard)
            add("sp", "reduce_scatter", "backward", 2 * ml, act)
            if c.recompute == "full":  # the whole layer's forward again (Megatron's re-run)
                add("sp", "all_gather", "recompute", 2 * ml, shard)
                add("sp", "reduce_scatter", "recompute", 2 * ml, act)
        else:   # Shoeybi et al.: row outputs all-reduced forward, column input grads backward
            add("tp", "all_reduce", "forward", 2 * ml, act)
            add("tp", "all_reduce", "backward", 2 * ml, act)
            if c.recompute == "full":  # both row reductions again, as Megatron's re-run
                add("tp", "all_reduce", "recompute", 2 * ml, act)
        if first:  # vocabulary-parallel embedding: partial rows summed [b, s, h]
            if sp and c.arch.position_embedding_type != "learned_absolute":
                add("sp", "reduce_scatter", "forward", m, act)  # rotary: reduce-scattered
            else:
                add("tp", "all_reduce", "forward", m, act)  # (sp: then split locally)
            if sp:  # the backward of the sequence split: the gradient all-gathered
                add("sp", "all_gather", "backward", m, shard)
        if last:  # output layer input (copy / sequence gather) and vocab-parallel cross-entropy
            if sp:  # as a column-parallel linear: gather; backward re-gather + reduce-scatter
                add("sp", "all_gather", "forward", m, shard)
                add("sp", "all_gather", "backward", m, shard)
                add("sp", "reduce_scatter", "backward", m, act)
            else:
                add("tp", "all_reduce", "backward", m, act)
            tokens = local_seq(c) * c.micro_batch  # MAX, target logit, exp sum (+ logit sum)
            if c.cross_entropy_fusion:  # MAX, then target logits and exp sums in one
                add("tp", "all_reduce", "forward", m, tokens * F32)
                add("tp", "all_reduce", "forward", m, 2 * tokens * F32)
            else:
                add("tp", "all_reduce", "forward", (4 if c.label_smoothing else 3) * m,
                    tokens * F32)
    add_cp_comm(c, ml, add)
    if c.pp > 1:
        _pipeline(c, pp_rank, add, shard if sp else act)
    if c.moe is not None:  # MoE layers' tp/sp traffic instead of the dense MLP's, and ep counts
        moe_comm(c, pp_rank, add)
    if c.grad_sync:
        _grad_sync(grad_sync_view(c), pp_rank, add)  # cp: gradients reduced over dp x cp
        if c.megatron_lm_loop:
            _megatron_lm_loop(c, first, last, add)
        if c.exit_vote and c.tp * c.cp * c.pp * c.dp > 1:  # --exit-duration-in-mins
            add("world", "all_reduce", "optimizer", 1, 4)
        if c.per_token_loss:  # the step's token count (int32) in finalize_model_grads
            add("pp", "broadcast", "optimizer", int(c.pp > 1), 4)
            add("dp", "all_reduce", "optimizer", int(c.dp * c.cp > 1), 4)
    return dict(out)


def _megatron_lm_loop(c: CommConfig, first: bool, last: bool, add) -> None:
    """Megatron-LM's loop around the step (:mod:`paraloom.training.megatron_lm_loop`): per
    microbatch, on a stage that reads data, one broadcast over tp per batch tensor (int64 tokens,
    labels, positions ``[b, s]``, fp32 loss mask ``[b, s]``, bool mask ``[b, 1, s, s]``; the
    whole sequence, before a cp split); the rerun vote (int32 over the world); the log's
    learning rate (fp32 over tp x pp); barriers over the world in a logged and the last step."""
    bs, world, mp = c.micro_batch * c.seq_len, c.tp * c.cp * c.pp * c.dp, c.tp * c.pp
    if c.tp > 1 and (first or last):
        tensors = [8, 8, 4, 8] if first and last else [8, 8] if first else [8, 4]
        for size in tensors + [c.seq_len]:  # ... and the attention mask, s bytes per token
            add("tp", "broadcast", "data", c.num_microbatches, size * bs)
    if world > 1:
        add("world", "all_reduce", "optimizer", int(c.rerun_vote), 4)
        add("world", "barrier", "optimizer", 2 * c.timer_barriers + c.last_step, 0)
    if mp > 1:
        add("mp", "all_reduce", "optimizer", 1, F32)


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


def _bucket_phase(c: CommConfig, r: int) -> str:
    """Where a step's bucket reductions are launched: from the gradient hooks or the schedule's
    ``grad_sync_func`` (phase ``backward``), or in ``finish_grad_sync`` (``optimizer``): always
    without overlap; in the first step unless the schedule launches them (Megatron's DDP launches
    nothing from its hooks before it has seen one step)."""
    if not c.overlap_grad_reduce:
        return "optimizer"
    schedule = c.schedule or ("none" if c.pp == 1 else "interleaved" if c.v > 1 else "1f1b")
    by_schedule = c.align_grad_reduce and (schedule == "interleaved"
                                           or (schedule == "1f1b" and r > 0))
    return "backward" if by_schedule or not c.first_step else "optimizer"


def _grad_sync(c: CommConfig, r: int, add) -> None:
    """What a train step adds after the schedule, in Megatron-Core's and Megatron-LM's terms:

    * the data-parallel bucket reductions (:func:`_bucket_phase`; Megatron-FSDP's in backward,
      under ``optim_grads`` after every microbatch, and in the first step its unsharding
      all-gather of every bucket in forward; under the distributed
      optimizer every bucket reduce-scattered, and after the update every bucket's parameter
      shard all-gathered — with ``overlap_param_gather`` in the forward of the next step
      instead, when ``param_gather_forward``; chunk 0's in the optimizer step again with
      ``param_gather_with_optimizer_step``),
    * ``finalize_model_grads``: one coalesced all-reduce over tp of the sequence-parallel
      grads, one over the embedding group of the tied word embedding,
    * the optimizer's gradient norm: one fp32 ``[1]`` over its grad-stats group (``mp`` = tp x
      pp; ``distopt`` = every rank with the distributed optimizer; MoE: a second over the
      experts' group, except under Megatron-FSDP, whose one optimizer holds them), in the
      first step once more (an int32 flag per group),
    * Megatron-LM's ``train_step``: the update flag and the norm agreed over ``mp`` (two
      ``[1]``), and on the last stage the loss ``[sum, tokens]`` over dp (x cp),
    * with MoE, paraloom's statistics over every rank (float64)."""
    if c.dp > 1:
        _dp_buckets(c, r, add)
    if c.tp > 1 and sp_elems(c, r):  # LayerNorms etc. under sp; MoE: experts' fc2 biases
        add("sp", "all_reduce", "optimizer", 1, sp_elems(c, r) * c.grad_bytes)
    if c.pp > 1 and r in (0, c.pp - 1) and c.arch.tied:
        vocab = -(-c.vocab // c.tp) * c.tp
        add("emb", "all_reduce", "optimizer", 1, vocab * c.hidden // c.tp * c.grad_bytes)
    mp, world = c.tp * c.pp, c.tp * c.pp * c.dp
    instance = world // c.instances  # the distributed optimizer's grad-stats group
    groups = [("distopt", instance)] if c.distributed_optimizer else [("mp", mp)]
    if c.moe is not None and not c.megatron_fsdp:  # Megatron's expert optimizer: tp x ep x pp
        # (distributed: the world); Megatron-FSDP's one optimizer holds the experts too
        groups.append(("distopt", instance) if c.distributed_optimizer
                      else ("tp_ep_pp", mp * c.moe.ep))
    chained = 2 if c.param_gather_with_optimizer_step else 1  # Megatron's dense optimizers
    for i, (kind, size) in enumerate(groups):
        if size > 1:  # the norm, and in the first step each optimizer's has_grad_norm_group
            add(kind, "all_reduce", "optimizer", 1 + (chained if i == 0 else 1) *
                c.first_step, F32)
    if c.num_zeros:  # Megatron's count_zeros_fp32: int64, once when the groups are shared
        for kind, size in groups[:1] if c.distributed_optimizer else groups:
            add(kind, "all_reduce", "optimizer", int(size > 1), 8)
    if mp > 1:  # update flag (int32), norm (fp32) and with --log-num-zeros-in-grad the zeros
        add("mp", "all_reduce", "optimizer", 2 + c.num_zeros, F32)
    if c.params_norm:  # Megatron-LM's calc_params_l2_norm (paraloom.training.step_stats)
        ep = c.moe.ep if c.moe is not None else 1
        add("dp", "all_reduce", "optimizer", 2 * (c.dp * c.cp > 1), F32)
        add("edp", "all_reduce", "optimizer", 2 * (c.dp * c.cp // ep > 1), F32)
        add("mp", "all_reduce", "optimizer", int(mp > 1), F32)
        add("tp_ep_pp", "all_reduce", "optimizer", int(ep > 1), F32)
    if r == c.pp - 1 and c.dp > 1:
        add("dp", "all_reduce", "optimizer", 1, 2 * F32)  # [loss sum, tokens]
    if c.moe is not None and world > 1:
        add("world", "all_reduce", "optimizer", 1, (3 + c.layers * c.moe.num_experts) * 8)


def _dp_buckets(c: CommConfig, r: int, add) -> None:
    """The data-parallel bucket reductions and parameter gathers of a train step (dp > 1)."""
    phase = "backward" if c.megatron_fsdp else _bucket_phase(c, r)
    zero3 = c.megatron_fsdp == "optim_grads_params"
    times = c.num_microbatches if c.megatron_fsdp in ("optim_grads", "optim_grads_params") \
        else 1  # ZeRO-2 and 3 reduce after every microbatch
    for phase_, _, _, nbytes, _ in zero3_gather_events(c, r) if zero3 else ():
        if phase_ != "optimizer" or c.optimizer_step:  # ZeRO-3's: before each use, after
            add("dp", "all_gather", phase_, 1, nbytes)  # the update (a step that ran)
    edp = c.dp // c.moe.ep if c.moe is not None else c.dp
    if c.buckets is None:
        buckets = [(sum(b.numel for b in g), g[0].reduce_scatter,  # one op per group
                    edp if g[0].expert else c.dp, chunk)
                   for chunk in range(c.v) for g in chunk_groups(c, r, chunk)]
    else:
        buckets = [(n, c.distributed_optimizer, c.dp, 0) for n in c.buckets]
    for n, scatter, size, chunk in buckets:
        if size == 1:  # an expert bucket with ep = dp: no replica to reduce with
            continue
        size //= c.instances  # the block a bucket is sharded over (instances: see spec)
        if size > 1:
            add("dp", "reduce_scatter" if scatter else "all_reduce", phase, times,
                n * (c.dp_grad_bytes or c.grad_bytes))
        if c.instances > 1:  # this rank's shard summed across the instances (Megatron-FSDP's
            whole = c.megatron_fsdp == "optim"  # ZeRO-1: its whole, unsharded buckets)
            add("dp_inter", "all_reduce", phase, 1,
                n // (1 if whole else size) * (c.dp_grad_bytes or c.grad_bytes))
        if not c.distributed_optimizer or size == 1 or zero3:
            continue
        if c.megatron_fsdp and c.first_step:  # the first forward unshards the model
            add("dp", "all_gather", "forward", 1, n // size * c.dtype_bytes)
        if c.param_gather_with_optimizer_step and chunk == 0:
            if c.optimizer_step:  # right after chunk 0's update, every step
                add("dp", "all_gather", "optimizer", 1, n // size * c.dtype_bytes)
        elif c.overlap_param_gather and c.param_gather_forward:  # ahead of first use
            add("dp", "all_gather", "forward", 1, n // size * c.dtype_bytes)
        elif not c.overlap_param_gather and c.optimizer_step:  # after the update
            add("dp", "all_gather", "optimizer", 1, n // size * c.dtype_bytes)
