"""Contiguous fp32 gradient buffers split into buckets: what data parallelism communicates.

One :class:`GradBuffer` per parameter dtype holds the fp32 gradient of every trainable parameter of
that dtype in one flat tensor; ``param.main_grad`` is a view into it, so

* gradient accumulation over microbatches is an in-place add into the view (and the tensor-parallel
  layers' ``gradient_accumulation_fusion`` writes there directly), and
* a bucket is a contiguous slice of the buffer, reduced by ONE collective with no packing copy.

Parameters are laid out in *reverse* registration order: autograd produces gradients roughly from
the last layer to the first, so the first bucket fills first and its reduction can start while the
rest of backward still runs. (The order only affects how early a bucket is complete, never the
result: every parameter is counted ready by its own hook.)

Buckets close once they hold at least ``bucket_size`` elements; a parameter is never split across
buckets; the last buckets of backward halve in size (:func:`cut_buckets`), so that the reduction
left once backward ends is small. A parameter marked ``shared_embedding``
gets a bucket of its own, so that its bucket can be all-reduced in full even under the
distributed optimizer (its gradient is summed again over the embedding group afterwards, which
needs every element valid on every rank).

For the distributed optimizer (ZeRO-1), each bucket is padded to a multiple of ``pad_to`` (the
data-parallel size), so a reduce-scatter gives every rank an equal contiguous shard, and the
parameters' data is also moved into a flat buffer with the same layout (``param.data`` becomes a
view), so the updated shards are all-gathered straight back into the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Bucket", "GradBuffer", "default_bucket_size", "cut_buckets", "TAIL_SPLITS"]

TAIL_SPLITS = 4
"""The last buckets of backward halve in size, down to ``bucket_size / 2**TAIL_SPLITS``
(:func:`cut_buckets`)."""


def default_bucket_size(dp: int) -> int:
    """Megatron's default: ``max(40_000_000, 1_000_000 * dp)`` elements per bucket."""
    return max(40_000_000, 1_000_000 * dp)


def cut_buckets(params: list[tuple[int, bool]], bucket_size: int,
                tail_splits: int = TAIL_SPLITS) -> list[list[int]]:
    """Cut parameters, given in backward order as ``(numel, shared_embedding)``, into buckets:
    lists of their indices, in launch order. Pure; :mod:`paraloom.analysis.layout` replays it.

    * A bucket closes once it holds at least its limit; a parameter is never split.
    * A shared embedding gets a bucket of its own.
    * The limits, counted from the *end* of backward (the first parameters registered), are
      ``b/2**k, b/2**k, b/2**(k-1), ..., b/2`` for ``b = bucket_size`` and ``k = tail_splits``,
      then ``b`` for every earlier bucket (the first one launched takes what is left over).
      The end of backward is where no compute is left to hide a reduction behind: the last
      bucket's reduction is the part of the step nothing overlaps, so it is kept small, while
      the buckets before it stay large (few collectives).
    """
    limits = [max(1, bucket_size >> tail_splits)] + \
        [max(1, bucket_size >> k) for k in range(tail_splits, 0, -1)]
    out: list[list[int]] = []
    current: list[int] = []
    held = 0
    for i in reversed(range(len(params))):  # from the end of backward
        numel, shared = params[i]
        if shared and current:
            out.append(current)
            current, held = [], 0
        current.append(i)
        held += numel
        if shared or held >= (limits[len(out)] if len(out) < len(limits) else bucket_size):
            out.append(current)
            current, held = [], 0
    if current:
        out.append(current)
    return [group[::-1] for group in reversed(out)]  # launch order, backward order inside


@dataclass(eq=False)
class Bucket:
    """A contiguous slice ``[start, end)`` of a :class:`GradBuffer`, reduced by one collective."""

    index: int
    """Global bucket number inside the DDP wrapper (the ledger's ``bucket``); launch order."""
    buffer: GradBuffer
    start: int
    end: int
    """End of the padded slice (``end - start`` is a multiple of the buffer's ``pad_to``)."""
    params: list[torch.nn.Parameter]
    names: list[str]
    reduce_scatter: bool = False
    """Reduce-scatter this bucket (distributed optimizer) instead of all-reducing it."""
    ready: set = field(default_factory=set)
    """``id`` of each parameter whose gradient hook fired in the current synchronising backward."""
    pending: object = None
    """``(handle, sent_tensor)`` of the reduction in flight, or ``None``."""
    axis: object = None
    """The :class:`~paraloom.mesh.Axis` this bucket is reduced (and sharded) over: ``mesh.dp``,
    or ``mesh.edp`` for expert parameters (set by the DDP wrapper)."""

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def grad(self) -> torch.Tensor:
        """The bucket's fp32 gradients (a view of the buffer, padding included)."""
        return self.buffer.grad[self.start:self.end]

    @property
    def param_data(self) -> torch.Tensor | None:
        """The bucket's parameter values (a view), when the buffer holds them."""
        data = self.buffer.param_data
        return None if data is None else data[self.start:self.end]

    def shard(self, dp_rank: int, dp: int) -> tuple[int, int]:
        """Bucket-relative ``[lo, hi)`` that data-parallel rank ``dp_rank`` owns after a
        reduce-scatter (the ``dp_rank``-th of ``dp`` equal contiguous pieces)."""
        size = self.numel // dp
        return dp_rank * size, (dp_rank + 1) * size

    def is_complete(self) -> bool:
        return len(self.ready) == len(self.params)

    def missing(self) -> list[str]:
        """Names of the parameters whose hook has not fired."""
        return [n for n, p in zip(self.names, self.params, strict=True) if id(p) not in self.ready]


class GradBuffer:
    """Flat fp32 ``main_grad`` storage for the parameters of one dtype, and its buckets.

    Args:
        named_params: ``(name, parameter)`` pairs in registration (forward) order; all of one dtype.
        bucket_size: close a bucket once it holds at least this many elements.
        first_index: number of the first bucket (buckets are numbered across buffers).
        pad_to: pad each bucket to a multiple of this (the dp size for a reduce-scatter; else 1).
        hold_params: also move the parameters' data into a flat buffer of the same layout.
    """

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], *, bucket_size: int,
                 first_index: int = 0, pad_to: int = 1, hold_params: bool = False) -> None:
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"bucket_size must be a positive number of elements, got "
                             f"{bucket_size!r}")
        if not named_params:
            raise ValueError("GradBuffer needs at least one parameter")
        dtypes = {p.dtype for _, p in named_params}
        if len(dtypes) != 1:
            raise ValueError(f"one GradBuffer holds one parameter dtype, got "
                             f"{sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.pad_to = pad_to
        device = named_params[0][1].device
        self.offsets: dict[int, tuple[int, int]] = {}  # id(param) -> [start, end) in the buffer
        order = list(reversed(named_params))  # backward order: last layer first
        groups = cut_buckets([(p.numel(), getattr(p, "shared_embedding", False))
                              for _, p in order], bucket_size)
        layout: list[tuple[int, int, list]] = []  # (start, end, [(name, param)])
        offset = 0
        for group in groups:
            start = offset
            for i in group:
                self.offsets[id(order[i][1])] = (offset, offset + order[i][1].numel())
                offset += order[i][1].numel()
            offset += -(offset - start) % pad_to  # pad the bucket to a multiple of pad_to
            layout.append((start, offset, [order[i] for i in group]))
        self.numel = offset
        self.grad = torch.zeros(offset, dtype=torch.float32, device=device)
        self.param_data = torch.zeros(offset, dtype=self.dtype, device=device) if hold_params \
            else None
        self.buckets: list[Bucket] = []
        for i, (lo, hi, members) in enumerate(layout):
            names, params = [n for n, _ in members], [p for _, p in members]
            self.buckets.append(Bucket(first_index + i, self, lo, hi, params, names))
        for _, param in named_params:
            lo, hi = self.offsets[id(param)]
            param.main_grad = self.grad[lo:hi].view(param.shape)
            if self.param_data is not None:
                view = self.param_data[lo:hi].view(param.shape)
                view.copy_(param.data)
                param.data = view  # the all-gather of updated shards then lands in the params

    def param_range(self, param: torch.nn.Parameter) -> tuple[int, int]:
        """``[start, end)`` of ``param`` inside this buffer."""
        return self.offsets[id(param)]

    def zero_(self) -> None:
        self.grad.zero_()

    def __repr__(self) -> str:
        return (f"GradBuffer(dtype={self.dtype}, numel={self.numel}, "
                f"buckets={[b.numel for b in self.buckets]})")
