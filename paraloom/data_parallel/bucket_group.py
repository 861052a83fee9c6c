"""Bucket groups (Megatron-Core's ``_ParamAndGradBucketGroup``): the buckets whose gradients are
reduced, and whose parameters are gathered, by one collective each way.

Megatron-LM builds a model chunk's DDP with ``disable_bucketing`` for every chunk but the first
(for all of them under ``--overlap-param-gather-with-optimizer-step``), and Megatron-Core then
puts every bucket of a buffer in one group (``partition_buckets(force_single_bucket_group=
True)``): the group is launched once all its buckets are complete, its reduce-scatters go out as
one coalesced collective (torch's ``_coalescing_manager``) and its parameter all-gathers too.
Without bucketing a buffer has more than one bucket only under the distributed optimizer, where
the tied word embedding gets a bucket of its own; everywhere else a group is one bucket and its
collectives are the plain ones. A group's event is the coalesced call: its shape the first
bucket's, its bytes all of theirs, ``tensors`` how many (as the recorder sees Megatron's).

Here :meth:`BucketGroup.launch_grads` / :meth:`BucketGroup.finish_grads` are the gradient side
(with several distributed-optimizer instances the shards then go across the blocks, coalesced
as well), :func:`gather_params` / :func:`land_params` the parameter side.
"""

from __future__ import annotations

import torch

from .. import comm

__all__ = ["BucketGroup", "gather_params", "land_params", "group_buckets"]

_SITE = "{owner}.{phase}:bucket_grads"
_INTER = "{owner}.{phase}:shard_across_instances"
_SHARD = "gradient bucket, 1/dp contiguous shard"
_ACROSS = "gradient shard, summed across optimizer instances"
_PARAMS = "parameter bucket, 1/dp contiguous shard"


_PLAIN = {"all_reduce": comm.all_reduce, "reduce_scatter": comm.reduce_scatter,
          "all_gather": comm.all_gather}


def _op(op: str, tensors: list[torch.Tensor], axis, **kwargs):
    """One bucket's plain collective, or a group's coalesced one."""
    if len(tensors) > 1:
        return comm.coalesced(op, tensors, axis, **kwargs)
    return _PLAIN[op](tensors[0], axis, **kwargs)


def _results(value) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


class BucketGroup:
    """Buckets launched together (``buckets[0]`` names the group in the ledger)."""

    def __init__(self, buckets: list) -> None:
        self.buckets = buckets
        self.pending = None
        """``(handle, sent tensors)`` of the gradient reduction in flight, or ``None``."""
        for bucket in buckets:
            bucket.group = self

    @property
    def lead(self):
        return self.buckets[0]

    def is_complete(self) -> bool:
        return all(b.is_complete() for b in self.buckets)

    def fields(self, **event) -> dict:
        """``event``'s ledger fields plus the group's: its lead bucket, every parameter name,
        and ``expert`` for a group reduced over mesh.edp."""
        event.update(kind="dp", bucket=self.lead.index,
                     params=[n for b in self.buckets for n in b.names])
        if self.lead.expert:
            event["expert"] = True
        return event

    def launch_grads(self, phase: str, async_op: bool, fp32: bool,
                     owner: str = "DistributedDataParallel", across: bool = True) -> None:
        """Reduce the group's gradients (reduce-scatter under the distributed optimizer; with
        several instances then, unless not ``across``, the shards all-reduced across, both
        synchronous); ``owner``: the wrapper named in the site."""
        lead = self.lead
        sends = [b.grad if fp32 else b.grad.to(torch.bfloat16) for b in self.buckets]
        args = self.fields(phase=phase, site=_SITE.format(owner=owner, phase=phase),
                           async_op=async_op)
        if lead.inter.size > 1 and across:  # partial distributed optimizer: block, then across
            args["async_op"] = async_op = False
            shards = _results(_op("reduce_scatter", sends, lead.axis, split=_SHARD, **args))
            args.update(kind="dp_inter", site=_INTER.format(owner=owner, phase=phase))
            handle = _op("all_reduce", shards, lead.inter, split=_ACROSS, **args)
        elif lead.reduce_scatter:
            handle = _op("reduce_scatter", sends, lead.axis, split=_SHARD, **args)
        else:
            handle = _op("all_reduce", sends, lead.axis, split="gradient bucket (replicated)",
                         **args)
        if not async_op:  # without overlap Megatron reduces synchronously: done already
            handle = comm.Handle([], handle)
        self.pending = (handle, sends)

    @torch.no_grad()
    def reduce_across(self, grads: list[torch.Tensor], phase: str, owner: str,
                      fp32: bool = True) -> None:
        """``grads`` (the buckets' summed shards, or whole buckets) all-reduced across the
        optimizer instances, in place (kind ``dp_inter``, synchronous: Megatron-FSDP's outer
        reduction; a bf16 copy without ``fp32``)."""
        args = self.fields(phase=phase, site=_INTER.format(owner=owner, phase=phase),
                           async_op=False)
        args["kind"] = "dp_inter"
        sends = [g if fp32 else g.to(torch.bfloat16) for g in grads]
        outs = _results(_op("all_reduce", sends, self.lead.inter, split=_ACROSS, **args))
        for grad, out in zip(grads, outs, strict=True):
            if out.data_ptr() != grad.data_ptr():
                grad.copy_(out)

    def finish_grads(self) -> None:
        """Wait for the reduction in flight and put each result where its bucket keeps it."""
        handle, _ = self.pending
        for bucket, result in zip(self.buckets, _results(handle.wait()), strict=True):
            target = bucket.grad
            if bucket.reduce_scatter:
                lo, hi = bucket.shard(bucket.axis.rank, bucket.axis.size)
                target = target[lo:hi]
            if result.data_ptr() != target.data_ptr():
                target.copy_(result)
        self.pending = None


def group_buckets(buckets: list, single: bool) -> list[BucketGroup]:
    """The groups of a wrapper's buckets: one per bucket, or with ``single`` (Megatron-LM's
    ``disable_bucketing``) one for the non-expert buckets and one for the expert buckets."""
    if not single:
        return [BucketGroup([b]) for b in buckets]
    kinds = [[b for b in buckets if not b.expert], [b for b in buckets if b.expert]]
    return [BucketGroup(kind) for kind in kinds if kind]


@torch.no_grad()
def gather_params(group: BucketGroup, *, phase: str, site: str, async_op: bool = False,
                  module: str | None = None):
    """All-gather the group's parameters from every rank's ``1/dp`` shard of each bucket (kind
    ``dp``, over the buckets' axis): the full flat buckets (one, or a list), or a Handle."""
    shards = [b.param_shard() for b in group.buckets]
    return _op("all_gather", shards, group.lead.axis, split=_PARAMS,
               **group.fields(phase=phase, site=site, module=module, async_op=async_op))


@torch.no_grad()
def land_params(group: BucketGroup, gathered) -> None:
    """Gathered buckets into the parameters' flat buffer (nothing where it is the buffer)."""
    for bucket, full in zip(group.buckets, _results(gathered), strict=True):
        if full.data_ptr() != bucket.param_data.data_ptr():
            bucket.param_data.copy_(full)
