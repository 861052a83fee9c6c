"""An uneven all-gather on gloo, for ``paraloom record --megatron-on-cpu``.

Megatron-Core's alltoall token dispatcher with tensor parallelism all-gathers the rows each tp
rank received, and their counts differ (``gather_from_sequence_parallel_region`` with
``output_split_sizes``: ``torch.distributed.all_gather`` into a list of differently sized
tensors). NCCL does that; gloo refuses it (``ProcessGroupGloo::allgather: invalid tensor size``).
:func:`install` wraps ``torch.distributed.all_gather`` so that exactly this case, on a gloo
group, runs as one all-gather of shards padded to the largest, trimmed after, the way
``paraloom.comm`` gathers uneven rows on gloo; every other call goes straight to torch. The
recorder still records the collective Megatron asked for: this rank's rows (shape and bytes)
and the ``output_splits`` (:func:`paraloom.record.intercept.logical`), as ``paraloom train``
records its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import intercept

__all__ = ["install"]

_ORIGINAL = None


def _uneven(tensor_list, tensor) -> bool:
    shapes = {tuple(t.shape) for t in tensor_list}
    return len(shapes) > 1 and all(s[1:] == tuple(tensor.shape[1:]) for s in shapes)


def _all_gather(tensor_list, tensor, group=None, async_op=False):
    if not _uneven(tensor_list, tensor) or dist.get_backend(group) != "gloo":
        return _ORIGINAL(tensor_list, tensor, group=group, async_op=async_op)
    sizes = [t.shape[0] for t in tensor_list]
    padded = tensor.new_zeros((max(sizes), *tensor.shape[1:]))
    padded[:tensor.shape[0]] = tensor
    full = [torch.empty_like(padded) for _ in tensor_list]
    with intercept.logical([tensor], {"output_splits": sizes}):
        work = _ORIGINAL(full, padded, group=group, async_op=async_op)
    if work is not None:  # the copy below needs the data: asked-for asynchrony ends here
        work.wait()
    for out, got in zip(tensor_list, full, strict=True):
        out.copy_(got[:out.shape[0]])
    return work


def install() -> None:
    """Wrap ``torch.distributed.all_gather`` (once per process)."""
    global _ORIGINAL
    if _ORIGINAL is None:
        _ORIGINAL = dist.all_gather
        dist.all_gather = _all_gather
