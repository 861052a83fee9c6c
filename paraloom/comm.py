"""Every collective and point-to-point operation in paraloom goes through this module.

It is the only caller of ``torch.distributed`` communication, so one file shows all of it. Each
function takes the :class:`~paraloom.mesh.Axis` to communicate over and states, explicitly, the
``phase`` (forward / backward / optimizer / setup), the ``kind`` (tp, sp, pp, dp, emb) and the
``site`` of the call; while a ledger is active (:mod:`paraloom.ledger`) each call is recorded with
its shape, dtype, logical bytes, group, and launch / wait / completion times.

Conventions:

* Size-1 axes bypass everything: no call, no record (nothing is communicated).
* ``bytes`` is the logical size of the local tensor sent or reduced: the input of an all-reduce or a
  reduce-scatter, the local shard of an all-gather, the tensor of a send/recv.
* ``async_op=True`` returns a :class:`Handle`; ``handle.wait()`` returns the result. Every wait has
  a timeout (:func:`set_timeout`), after which :class:`CommTimeout` names the operation and the
  group instead of hanging (:mod:`paraloom.comm_wait`: handles, timeout, flight recorder).
* Reductions are SUM (averages divide afterwards), except where an algorithm needs MAX.
* ``all_to_all`` moves rows of dim 0 with per-rank split sizes (Megatron's expert dispatch); its
  event carries ``input_splits`` / ``output_splits`` (rows) and ``row_bytes``, and ``bytes`` is the
  whole local input (the rows kept on this rank included), ``recv_bytes`` the whole output.
* ``coalesced`` issues several all-reduces, reduce-scatters or all-gathers as one call (a
  Megatron bucket group): one event, the first tensor's shape, every tensor's bytes, ``tensors``.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from . import ledger as _ledger
from .comm_wait import (
    RECENT,
    CommTimeout,
    Handle,
    P2PHandle,
    flight_recorder,
    get_timeout,
    set_timeout,
)
from .mesh import Axis

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "coalesced", "all_to_all", "broadcast",
           "batch_p2p", "barrier",
           "gather_objects", "Handle", "CommTimeout", "set_timeout", "get_timeout",
           "flight_recorder"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# torch 2.13 renames the tensor-level collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _run(launch, result, axis: Axis, async_op: bool, finish=None, record=None, what: str = ""):
    """Launch ``launch()`` (returns a Work), record it, and either wait or return a Handle."""
    led = _ledger.active()
    event = led.record(async_op=async_op, group=axis.ranks, pg=axis.name, **record) \
        if led else None
    work = launch()
    desc = f"{what} over {axis.name} group {list(axis.ranks)}"
    RECENT.append((time.time(), desc))
    handle = Handle([work], result, event, finish, desc)
    return handle if async_op else handle.wait()


def _done(result, async_op: bool):
    return Handle([], result) if async_op else result


def all_reduce(tensor: torch.Tensor, axis: Axis, *, phase: str, kind: str, site: str,
               module: str | None = None, split: str | None = None, op: str = "sum",
               async_op: bool = False, **extra):
    """In-place reduction of ``tensor`` over ``axis``; returns it (or a Handle if ``async_op``)."""
    if axis.size == 1:
        return _done(tensor, async_op)
    record = dict(op="all_reduce", phase=phase, kind=kind, site=site, module=module, split=split,
                  tensor=tensor, **extra)
    return _run(lambda: dist.all_reduce(tensor, _OPS[op], group=axis.group, async_op=True),
                tensor, axis, async_op, record=record, what=f"all_reduce at {site}")


def all_gather(tensor: torch.Tensor, axis: Axis, *, dim: int = 0, phase: str, kind: str,
               site: str, module: str | None = None, split: str | None = None,
               async_op: bool = False, output_splits: list[int] | None = None, **extra):
    """Concatenate every rank's ``tensor`` along ``dim`` (rank order); a new tensor is returned.
    ``output_splits``: the ranks' dim-0 sizes differ (Megatron's all-gather with
    ``output_split_sizes``); every rank passes the same list. It runs as one all-gather of
    shards padded to the largest (gloo gathers equal sizes only), trimmed after; its event
    records the splits, and its bytes stay this rank's own rows."""
    if axis.size == 1:
        return _done(tensor, async_op)
    local = tensor.contiguous()
    if output_splits is not None:
        if dim % local.dim() != 0:
            raise ValueError(f"all_gather at {site}: output_splits gathers along dim 0, not "
                             f"dim {dim}")
        return _all_gather_v(local, axis, list(output_splits), async_op,
                             dict(op="all_gather", phase=phase, kind=kind, site=site,
                                  module=module, split=split, tensor=local,
                                  output_splits=list(output_splits), **extra))
    out = torch.empty((axis.size * local.shape[0], *local.shape[1:]), dtype=local.dtype,
                      device=local.device)
    finish = None
    if dim % local.dim() != 0:
        finish = lambda full: torch.cat(full.chunk(axis.size, 0), dim=dim)  # noqa: E731
    record = dict(op="all_gather", phase=phase, kind=kind, site=site, module=module, split=split,
                  tensor=local, **extra)
    return _run(lambda: _all_gather_single(out, local, group=axis.group, async_op=True), out,
                axis, async_op, finish, record, f"all_gather at {site}")


def _all_gather_v(local: torch.Tensor, axis: Axis, splits: list[int], async_op: bool, record):
    if len(splits) != axis.size or splits[axis.rank] != local.shape[0]:
        raise ValueError(f"all_gather at {record['site']}: output_splits {splits} must have "
                         f"{axis.size} entries with this rank's ({axis.rank}) equal to dim 0 of "
                         f"shape {list(local.shape)}")
    most = max(splits)
    padded = local.new_zeros((most, *local.shape[1:]))
    padded[:local.shape[0]] = local
    out = local.new_empty((axis.size * most, *local.shape[1:]))
    finish = lambda full: torch.cat([c[:n] for c, n in  # noqa: E731
                                     zip(full.chunk(axis.size, 0), splits, strict=True)])
    return _run(lambda: _all_gather_single(out, padded, group=axis.group, async_op=True), out,
                axis, async_op, finish, record, f"all_gather at {record['site']}")


def reduce_scatter(tensor: torch.Tensor, axis: Axis, *, dim: int = 0, phase: str, kind: str,
                   site: str, module: str | None = None, split: str | None = None,
                   async_op: bool = False, input_splits: list[int] | None = None, **extra):
    """Sum ``tensor`` over ``axis`` and keep this rank's slice along ``dim`` (a new tensor).
    ``input_splits``: uneven dim-0 slices, rank ``j`` keeps ``input_splits[j]`` rows (Megatron's
    reduce-scatter with ``input_split_sizes``; recorded on the event)."""
    if axis.size == 1:
        return _done(tensor, async_op)
    if input_splits is not None:
        ins = list(input_splits)
        if len(ins) != axis.size or sum(ins) != tensor.shape[0]:
            raise ValueError(f"reduce_scatter at {site}: input_splits {ins} must have "
                             f"{axis.size} entries summing to dim 0 of {list(tensor.shape)}")
        parts = [p.contiguous() for p in tensor.split(ins)]
        out = torch.empty_like(parts[axis.rank])
        record = dict(op="reduce_scatter", phase=phase, kind=kind, site=site, module=module,
                      split=split, tensor=tensor, input_splits=ins, **extra)
        return _run(lambda: dist.reduce_scatter(out, parts, group=axis.group, async_op=True),
                    out, axis, async_op, None, record, f"reduce_scatter at {site}")
    if tensor.shape[dim] % axis.size:
        raise ValueError(f"reduce_scatter at {site}: dim {dim} of shape {list(tensor.shape)} is "
                         f"not divisible by the group size {axis.size}")
    # Chunks along ``dim`` stacked on dim 0: this rank's output is then exactly one chunk.
    full = tensor.contiguous() if dim % tensor.dim() == 0 else \
        torch.cat(tensor.chunk(axis.size, dim), 0)
    out = torch.empty_like(tensor.chunk(axis.size, dim)[0], memory_format=torch.contiguous_format)
    record = dict(op="reduce_scatter", phase=phase, kind=kind, site=site, module=module,
                  split=split, tensor=tensor, **extra)
    return _run(lambda: _reduce_scatter_single(out, full, group=axis.group, async_op=True), out,
                axis, async_op, None, record, f"reduce_scatter at {site}")


def coalesced(op: str, tensors: list[torch.Tensor], axis: Axis, *, phase: str, kind: str,
              site: str, split: str | None = None, async_op: bool = False, **extra):
    """Several ``op`` s (``all_reduce`` in place, ``reduce_scatter`` or ``all_gather`` of flat
    tensors) as one coalesced collective, as Megatron issues a bucket group's buckets (torch's
    ``_coalescing_manager``): one event, its shape the first tensor's, its bytes all of theirs,
    ``tensors`` how many. Returns the results in order (or a Handle with ``async_op``)."""
    if axis.size == 1:
        return _done(list(tensors), async_op)
    n = axis.size
    outs = [t if op == "all_reduce" else
            t.new_empty(t.numel() // n if op == "reduce_scatter" else t.numel() * n)
            for t in tensors]
    record = dict(op=op, phase=phase, kind=kind, site=site, split=split, tensor=tensors[0],
                  nbytes=sum(t.numel() * t.element_size() for t in tensors),
                  tensors=len(tensors), **extra)

    def launch():
        with dist._coalescing_manager(group=axis.group, async_ops=True) as cm:
            for t, out in zip(tensors, outs, strict=True):
                if op == "all_reduce":
                    dist.all_reduce(t, group=axis.group, async_op=True)
                elif op == "reduce_scatter":
                    _reduce_scatter_single(out, t, group=axis.group, async_op=True)
                else:
                    _all_gather_single(out, t, group=axis.group, async_op=True)
        return cm.works[0]  # the one Work of the coalesced call
    return _run(launch, outs, axis, async_op, record=record, what=f"coalesced {op} at {site}")


def all_to_all(tensor: torch.Tensor, axis: Axis, *, input_splits: list[int] | None = None,
               output_splits: list[int] | None = None, phase: str, kind: str, site: str,
               module: str | None = None, split: str | None = None, async_op: bool = False,
               **extra):
    """Send rows ``[sum(input_splits[:j]), ...)`` of ``tensor`` (dim 0) to the ``j``-th rank of
    ``axis`` and receive ``output_splits[j]`` rows from it, concatenated in rank order (a new
    tensor). ``None`` splits mean equal parts. Every rank must pass matching sizes (rank ``i``'s
    ``input_splits[j]`` is rank ``j``'s ``output_splits[i]``)."""
    if axis.size == 1:
        return _done(tensor, async_op)
    local = tensor.contiguous()
    n = axis.size
    ins = list(input_splits) if input_splits is not None else [local.shape[0] // n] * n
    outs = list(output_splits) if output_splits is not None else ins
    if len(ins) != n or len(outs) != n or sum(ins) != local.shape[0]:
        raise ValueError(f"all_to_all at {site}: input_splits {ins} / output_splits {outs} must "
                         f"have {n} entries (the group size) and input_splits must sum to "
                         f"dim 0 of shape {list(local.shape)}")
    out = torch.empty((sum(outs), *local.shape[1:]), dtype=local.dtype, device=local.device)
    row = math.prod(local.shape[1:]) * local.element_size()  # also when this rank sends nothing
    record = dict(op="all_to_all", phase=phase, kind=kind, site=site, module=module, split=split,
                  tensor=local, input_splits=ins, output_splits=outs, row_bytes=row,
                  recv_bytes=sum(outs) * row, **extra)
    return _run(lambda: dist.all_to_all_single(out, local, outs, ins, group=axis.group,
                                               async_op=True),
                out, axis, async_op, None, record, f"all_to_all at {site}")


def broadcast(tensor: torch.Tensor, axis: Axis, *, src: int, phase: str, kind: str, site: str,
              module: str | None = None, **extra) -> torch.Tensor:
    """Copy ``tensor`` from global rank ``src`` to every rank of ``axis`` (in place)."""
    if axis.size == 1:
        return tensor
    record = dict(op="broadcast", phase=phase, kind=kind, site=site, module=module,
                  tensor=tensor, src=src, **extra)
    return _run(lambda: dist.broadcast(tensor, src, group=axis.group, async_op=True), tensor,
                axis, False, record=record, what=f"broadcast at {site}")


def batch_p2p(ops: list[tuple[str, torch.Tensor, int]], axis: Axis, *, phase: str, kind: str,
              site: str, module: str | None = None, async_op: bool = False, **extra):
    """Post sends and receives together (``P2POp`` + ``batch_isend_irecv``), so no pair deadlocks.

    ``ops`` are ``("send" | "recv", tensor, peer_global_rank)``; the received tensors are filled in
    place. Each op is one ledger event (with its ``peer``), asynchronous (an ``isend`` /
    ``irecv``, as Megatron's batched p2p; without ``async_op`` it is waited for at once); returns
    the list of tensors, or a Handle when ``async_op``. An op may carry a fourth element, a
    dict of ledger fields for its own event only (``{"phase": "backward", "microbatch": 3}``):
    one batch can mix a forward activation and a backward gradient of different microbatches.
    """
    if not ops:
        return _done([], async_op)
    led = _ledger.active()
    events, p2p = [], []
    for name, tensor, peer, *own in ops:
        if name not in ("send", "recv"):
            raise ValueError(f"p2p op must be 'send' or 'recv', got {name!r}")
        fn = dist.isend if name == "send" else dist.irecv
        p2p.append(dist.P2POp(fn, tensor, peer, group=axis.group))
        if led:
            fields = dict(phase=phase, kind=kind, site=site, module=module, **extra)
            fields.update(*own)
            events.append(led.record(op=name, async_op=True, tensor=tensor,
                                     group=axis.ranks, pg=axis.name, peer=peer, **fields))
    works = dist.batch_isend_irecv(p2p)
    peers = ", ".join(f"{op[0]} {op[2]}" for op in ops)
    desc = f"p2p ({peers}) at {site}"
    RECENT.append((time.time(), desc))
    handle = P2PHandle(works, [op[1] for op in ops], events, desc)
    return handle if async_op else handle.wait()


def barrier(axis: Axis, *, phase: str = "setup", site: str = "barrier") -> None:
    """Wait until every rank of ``axis`` arrives (recorded as op ``barrier``)."""
    if axis.size == 1:
        return
    record = dict(op="barrier", phase=phase, kind=axis.name, site=site)
    _run(lambda: dist.barrier(group=axis.group, async_op=True), None, axis, False,
         record=record, what=f"barrier at {site}")


def gather_objects(obj, axis: Axis, *, dst: int = 0) -> list | None:
    """Every rank's picklable ``obj`` on global rank ``dst`` (others get ``None``).

    For reports only (the ledger's events and metrics after a run), never inside a step, and not
    recorded: it moves the record itself.
    """
    if axis.size == 1:
        return [obj]
    out = [None] * axis.size if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=axis.group)
    return out
