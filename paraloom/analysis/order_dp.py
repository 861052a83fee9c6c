"""Data parallelism's rows of ``paraloom plan --table`` (:mod:`.order`): a chunk's gradient
buckets as ``start_grad_sync`` / ``finish_grad_sync`` launch them, and the distributed
optimizer's parameter all-gathers in the optimizer step."""

from __future__ import annotations

from ..config.megatron_fsdp_checks import fsdp_reduces_in_bf16

__all__ = ["bucket_rows", "gather_site", "grad_norm_rows", "num_tokens_rows", "unshard_rows"]


def bucket_rows(cfg, groups: list[tuple[list[int], bool]], cp: int, phase: str,
                across: bool = True) -> list[dict]:
    """The events (kind, op, site, split, shape, bytes, async) of bucket groups (each the
    elements of its buckets and whether they are experts', reduced over the ``dp x cp / ep``
    expert-data-parallel ranks; :func:`~.layout.chunk_groups`): one all-reduce each (reduce-scatter
    under the distributed optimizer, asynchronous), coalesced over a group's buckets (the first
    one's shape, all of their bytes); with ``--num-distributed-optimizer-instances N > 1`` the
    reduce-scatter covers a block of ``dp x cp / N`` ranks and this rank's shard is then
    all-reduced across the blocks (kind ``dp_inter``; not without ``across``: a Megatron-FSDP
    microbatch before the last), both synchronous, as Megatron issues them then."""
    zero, n = cfg.distributed_optimizer, cfg.num_distributed_optimizer_instances
    fsdp = cfg.use_megatron_fsdp  # Megatron-FSDP: synchronous, on a side stream
    owner = "FullyShardedDataParallel" if fsdp else "DistributedDataParallel"
    item = 2 if fsdp_reduces_in_bf16(cfg) else 4
    rows = []
    for numels, expert in groups:
        # the ranks a bucket is reduced (sharded) over
        block = cfg.parallel.dp * cp // (cfg.parallel.ep if expert else 1) // n
        if block > 1:
            rows.append(dict(kind="dp", op="reduce_scatter" if zero else "all_reduce",
                             site=f"{owner}.{phase}:bucket_grads",
                             shape=[numels[0]], bytes=item * sum(numels),
                             split="gradient bucket, 1/dp contiguous shard"
                             if zero else "gradient bucket (replicated)",
                             **{"async": n == 1 and not fsdp}))
        if n > 1 and across:  # Megatron-FSDP's ZeRO-1: its whole (unsharded) buckets
            per = 1 if cfg.use_megatron_fsdp and cfg.data_parallel_sharding_strategy == "optim" \
                else block
            rows.append(dict(kind="dp_inter", op="all_reduce",
                             site=f"{owner}.{phase}:shard_across_instances",
                             shape=[numels[0] // per], bytes=item * sum(numels) // per,
                             split="gradient shard, summed across optimizer instances",
                             **{"async": False}))
    return rows


def unshard_rows(cfg, groups: list[tuple[list[int], bool]], cp: int, itemsize: int) -> list:
    """Megatron-FSDP's first forward under a sharding strategy: every bucket's parameters
    all-gathered from the shards, asynchronously (kind, op, site, split, shape, bytes, async)."""
    if not (cfg.use_megatron_fsdp and cfg.distributed_optimizer):
        return []
    rows = []
    for numels, expert in groups:
        block = cfg.parallel.dp * cp // (cfg.parallel.ep if expert else 1)
        if block > 1:
            rows.append(dict(kind="dp", op="all_gather", site="FullyShardedDataParallel.forward:"
                             "unshard", split="parameter bucket, 1/dp contiguous shard",
                             shape=[numels[0] // block], bytes=sum(numels) // block * itemsize,
                             **{"async": True}))
    return rows


def gather_site(with_step: bool, fsdp: bool = False) -> dict:
    """A parameter all-gather in the optimizer step: the synchronous one, or chunk 0's launched
    by its own step under ``--overlap-param-gather-with-optimizer-step`` (asynchronous), or
    Megatron-FSDP's (launched asynchronously, waited at once)."""
    if fsdp:
        return {"site": "DistributedOptimizer.step:param_shards", "async": True}
    if with_step:
        return {"site": "DistributedDataParallel.start_param_sync:param_shards", "async": True}
    return {"site": "DistributedOptimizer.step:param_shards"}


def grad_norm_rows(cfg) -> list[dict]:
    """The gradient norm's all-reduces (kind, op, site, split): each optimizer's squared norm
    over its grad-stats group (the model-parallel ranks, the experts' tp x ep x pp ranks; under
    the distributed optimizer both the instance's ranks; Megatron-FSDP's one optimizer holds
    the experts too), then, on the first step, Megatron
    0.19's has-grad-norm-group flag per optimizer of the chain (the dense one per optimizer:
    two under ``--overlap-param-gather-with-optimizer-step``), and with
    ``--log-num-zeros-in-grad`` the zero count (int64; once when the groups are shared, under
    the distributed optimizer). Groups of one rank: no row."""
    p, n = cfg.parallel, cfg.num_distributed_optimizer_instances
    dense = ("distopt", p.tp * p.pp * p.dp * p.cp // n) if cfg.distributed_optimizer else \
        ("mp", p.tp * p.pp)
    groups = [dense]
    if cfg.model.num_experts is not None and not cfg.use_megatron_fsdp:  # FSDP: one optimizer
        groups.append(dense if cfg.distributed_optimizer else ("tp_ep_pp", p.tp * p.ep * p.pp))
    flags = [dense] * (2 if cfg.overlap_param_gather_with_optimizer_step else 1) + groups[1:]
    norm = dict(op="all_reduce", site="get_grad_norm_fp32:squared_norm",
                split="this rank's squared gradient norm")
    flag = dict(op="all_reduce", site="has_grad_norm_group:flag",
                split="whether any rank has separately-normed parameters")
    zeros = dict(op="all_reduce", site="count_zeros_fp32:num_zeros", itemsize=8,
                 split="this rank's count of zero gradients")  # --log-num-zeros-in-grad
    counted = (groups[:1] if cfg.distributed_optimizer else groups) \
        if cfg.run.log_num_zeros_in_grad else []
    return [dict(kind=k, **norm) for k, size in groups if size > 1] + \
        [dict(kind=k, **flag) for k, size in flags if size > 1] + \
        [dict(kind=k, **zeros) for k, size in counted if size > 1]


def num_tokens_rows(cfg) -> list[dict]:
    """``--calculate-per-token-loss``: at the end of ``finalize_model_grads`` the step's token
    count (int32 ``[]``) broadcast from the last pipeline stage, then summed over dp x cp (kind,
    op, site, split, shape, bytes). Groups of one rank: no row."""
    p = cfg.parallel
    if not cfg.calculate_per_token_loss:
        return []
    row = dict(site="finalize_model_grads:num_tokens", split="the step's token count", shape=[],
               bytes=4)
    return [dict(kind=kind, op=op, **row) for kind, op, size in (
        ("pp", "broadcast", p.pp), ("dp", "all_reduce", p.dp * p.cp)) if size > 1]
