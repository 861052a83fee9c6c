"""Data parallelism's rows of ``paraloom plan --table`` (:mod:`.order`): a chunk's gradient
buckets as ``start_grad_sync`` / ``finish_grad_sync`` launch them, and the distributed
optimizer's parameter all-gathers in the optimizer step."""

from __future__ import annotations

__all__ = ["bucket_rows", "gather_site"]


def bucket_rows(cfg, groups: list[list[int]], cp: int, phase: str) -> list[dict]:
    """The events (kind, op, site, split, shape, bytes, async) of bucket groups (each the
    elements of its buckets; :func:`~.layout.chunk_groups`): one all-reduce each (reduce-scatter
    under the distributed optimizer, asynchronous), coalesced over a group's buckets (the first
    one's shape, all of their bytes); with ``--num-distributed-optimizer-instances N > 1`` the
    reduce-scatter covers a block of ``dp x cp / N`` ranks and this rank's shard is then
    all-reduced across the blocks (kind ``dp_inter``), both synchronous, as Megatron issues them
    then."""
    zero, n = cfg.distributed_optimizer, cfg.num_distributed_optimizer_instances
    block = cfg.parallel.dp * cp // n  # the ranks a bucket is sharded over
    rows = []
    for numels in groups:
        if block > 1:
            rows.append(dict(kind="dp", op="reduce_scatter" if zero else "all_reduce",
                             site=f"DistributedDataParallel.{phase}:bucket_grads",
                             shape=[numels[0]], bytes=4 * sum(numels),
                             split="gradient bucket, 1/dp contiguous shard"
                             if zero else "gradient bucket (replicated)", **{"async": n == 1}))
        if n > 1:
            rows.append(dict(kind="dp_inter", op="all_reduce",
                             site=f"DistributedDataParallel.{phase}:shard_across_instances",
                             shape=[numels[0] // block], bytes=4 * sum(numels) // block,
                             split="gradient shard, summed across optimizer instances",
                             **{"async": False}))
    return rows


def gather_site(with_step: bool) -> dict:
    """A parameter all-gather in the optimizer step: the synchronous one, or chunk 0's launched
    by its own step under ``--overlap-param-gather-with-optimizer-step`` (asynchronous)."""
    if with_step:
        return {"site": "DistributedDataParallel.start_param_sync:param_shards", "async": True}
    return {"site": "DistributedOptimizer.step:param_shards"}
