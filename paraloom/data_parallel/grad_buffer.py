"""Contiguous fp32 gradient buffers split into buckets: what data parallelism communicates.

One :class:`GradBuffer` per parameter dtype holds the fp32 gradient of every trainable parameter of
that dtype in one flat tensor; ``param.main_grad`` is a view into it, so

* gradient accumulation over microbatches is an in-place add into the view (and the tensor-parallel
  layers' ``gradient_accumulation_fusion`` writes there directly), and
* a bucket is a contiguous slice of the buffer, reduced by ONE collective with no packing copy.

The layout is Megatron-Core's (:func:`bucket_layout`, 0.19's ``param_and_grad_buffer`` and
``DistributedOptimizer._compute_per_buffer_param_layout``): parameters in *reverse* registration
order (autograd produces gradients roughly from the last layer to the first, so the first bucket
fills first and its reduction can start while the rest of backward still runs); a bucket closes
once it holds at least ``bucket_size`` elements (``None``: one bucket); a parameter is never split.
For the distributed optimizer (``shard_over`` = dp > 1 ranks reduce-scatter each bucket) a
parameter starts at a multiple of 64 elements, a bucket ends at a multiple of
``lcm(dp, 128)`` (so every rank gets an equal contiguous shard), and a parameter marked
``shared_embedding`` gets a bucket of its own. paraloom's own ``tail_splits`` (off by default)
halves the last buckets of backward (:func:`bucket_layout`), so that the reduction left once
backward ends is small.

For the distributed optimizer (ZeRO-1) the parameters' data is also moved into a flat buffer with
the same layout (``param.data`` becomes a view), so the updated shards are all-gathered straight
back into the parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .fsdp_layout import fsdp_layout

__all__ = ["Bucket", "GradBuffer", "accumulate_grad", "default_bucket_size", "bucket_layout",
           "PARAM_ALIGN",
           "bucket_divisor"]

PARAM_ALIGN = 64
"""Under the distributed optimizer a parameter starts at a multiple of this many elements."""


def default_bucket_size(dp: int) -> int:
    """Megatron's default: ``max(40_000_000, 1_000_000 * dp)`` elements per bucket."""
    return max(40_000_000, 1_000_000 * dp)


def bucket_divisor(shard_over: int) -> int:
    """A bucket's padded length is a multiple of this: ``lcm(dp, 128)`` when it is sharded over
    ``dp`` ranks (Megatron's ``pad_bucket_end``), else 1 (no padding)."""
    return math.lcm(shard_over, 128) if shard_over > 1 else 1


def bucket_layout(params: list[tuple[int, bool]], bucket_size: int | None, *,
                  shard_over: int = 1, sharded: bool = False,
                  tail_splits: int = 0) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """Cut parameters, given in backward order as ``(numel, shared_embedding)``, into buckets.

    Returns ``(start, end, members)`` per bucket in launch order, with buffer offsets (``end``
    padded) and ``members`` the ``(index, start, end)`` of each parameter. Pure; the analysis
    (:mod:`paraloom.analysis.layout`) replays it. ``sharded``: the distributed optimizer's
    layout (64-element parameter starts, buckets padded to ``lcm(shard_over, 128)``, a shared
    embedding alone in its bucket); else no padding at all. ``bucket_size=None``: no size limit
    (one bucket, unless a shared embedding splits it off). ``tail_splits = k > 0`` (paraloom's
    option): counted from the *end* of backward, the limits are ``b/2**k, b/2**k, b/2**(k-1),
    ..., b/2`` for ``b = bucket_size``, then ``b`` for every earlier bucket.
    """
    limits = []
    if tail_splits and bucket_size is not None:
        limits = [max(1, bucket_size >> tail_splits)] + \
            [max(1, bucket_size >> k) for k in range(tail_splits, 0, -1)]
    # the tail splits count from the end of backward: cut in forward order, then reverse
    n = len(params)
    if limits:
        cuts = _tail_cut(params, bucket_size, limits)
    else:
        cuts = None
    divisor = bucket_divisor(shard_over) if sharded else 1
    out: list[tuple[int, int, list]] = []
    members: list[tuple[int, int, int]] = []
    start = offset = 0

    def close(end: int) -> int:
        padded = -(-end // divisor) * divisor
        out.append((start, padded, members))
        return padded

    for i in range(n):
        numel, shared = params[i]
        if sharded:
            offset = -(-offset // PARAM_ALIGN) * PARAM_ALIGN
            if shared and members:
                start = offset = close(offset)
                members = []
        members.append((i, offset, offset + numel))
        offset += numel
        full = (cuts is not None and i in cuts) or (
            cuts is None and bucket_size is not None and offset - start >= bucket_size)
        if full or (sharded and shared):
            start = offset = close(offset)
            members = []
    if members:
        close(offset)
    return out


def _tail_cut(params, bucket_size: int, limits: list[int]) -> set[int]:
    """Indices (backward order) after which a bucket closes, with the limits counted from the
    end of backward."""
    cuts: set[int] = set()
    held, made = 0, 0
    for i in reversed(range(len(params))):
        held += params[i][0]
        if held >= (limits[made] if made < len(limits) else bucket_size):
            if i > 0:
                cuts.add(i - 1)
            held, made = 0, made + 1
    return cuts


def accumulate_grad(main: torch.Tensor, grad: torch.Tensor, scale: float,
                    overwrite: bool) -> None:
    """``main = scale * grad`` (``overwrite``) or ``main += scale * grad``, in fp32: one pass."""
    if not overwrite:
        main.add_(grad, alpha=scale)  # fp32 accumulation whatever .grad's dtype
    elif grad.dtype == main.dtype and scale != 1.0:
        torch.mul(grad, scale, out=main)
    elif grad.dtype == main.dtype:
        main.copy_(grad)
    else:  # widen first: a 16-bit product would be rounded before it reached main_grad
        main.copy_(grad)
        if scale != 1.0:
            main.mul_(scale)


@dataclass(eq=False)
class Bucket:
    """A contiguous slice ``[start, end)`` of a :class:`GradBuffer`, reduced by one collective."""

    index: int
    """Global bucket number inside the DDP wrapper (the ledger's ``bucket``); launch order."""
    buffer: GradBuffer
    start: int
    end: int
    """End of the padded slice (under the distributed optimizer ``end - start`` is a multiple of
    ``lcm(dp, 128)``)."""
    params: list[torch.nn.Parameter]
    names: list[str]
    reduce_scatter: bool = False
    """Reduce-scatter this bucket (distributed optimizer) instead of all-reducing it."""
    ready: set = field(default_factory=set)
    """``id`` of each parameter whose gradient hook fired in the current synchronising backward."""
    group: object = None
    """The :class:`~paraloom.data_parallel.bucket_group.BucketGroup` launched with it."""
    axis: object = None
    """The :class:`~paraloom.mesh.Axis` this bucket is reduced (and sharded) over: ``mesh.dp_cp``,
    or ``mesh.edp`` for expert parameters; with several distributed-optimizer instances their
    block of it (set by the DDP wrapper)."""
    inter: object = None
    """With several distributed-optimizer instances, the axis across the blocks over which the
    shard is then all-reduced (size 1 otherwise)."""
    expert: bool = False
    """Whether the bucket holds expert parameters (reduced over edp)."""
    full: torch.Tensor | None = None
    """Megatron-FSDP's ZeRO-3: the bucket's own parameter storage (the parameters are views),
    released between uses (:mod:`.megatron_fsdp_unshard`)."""
    kept: torch.Tensor | None = None
    """ZeRO-3: this rank's ``1/dp`` piece of the parameters, kept while ``full`` is released."""

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
        if self.full is not None:
            return self.full
        data = self.buffer.param_data
        return None if data is None else data[self.start:self.end]

    def param_shard(self) -> torch.Tensor:
        """This rank's ``1/dp`` piece of the parameters: what the optimizer updates and the
        all-gathers send."""
        if self.kept is not None:
            return self.kept
        return self.param_data[slice(*self.shard(self.axis.rank, self.axis.size))]

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
        bucket_size: close a bucket once it holds at least this many elements (``None``: one).
        first_index: number of the first bucket (buckets are numbered across buffers).
        shard_over: ranks each bucket is reduce-scattered over (the distributed optimizer's dp;
            then Megatron's padded layout), else 1.
        hold_params: also move the parameters' data into a flat buffer of the same layout.
        tail_splits: paraloom's halving of the last buckets (:func:`bucket_layout`).
        fsdp: Megatron-FSDP's layout instead (:func:`~.fsdp_layout.fsdp_layout`: registration
            order, ordered by row size inside a bucket, padded to ``shard_over x chunk``).
        units: with ``fsdp``, ``id(param) -> `` its FSDP unit's number (ZeRO-3): buckets by unit,
            and each bucket's parameters in storage of their own (``Bucket.full``).
    """

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], *,
                 bucket_size: int | None, first_index: int = 0, shard_over: int = 1,
                 hold_params: bool = False, tail_splits: int = 0, fsdp: bool = False,
                 units: dict | None = None) -> None:
        if bucket_size is not None and (isinstance(bucket_size, bool)
                                        or not isinstance(bucket_size, int) or bucket_size < 1):
            raise ValueError(f"bucket_size must be a positive number of elements or None, got "
                             f"{bucket_size!r}")
        if not named_params:
            raise ValueError("GradBuffer needs at least one parameter")
        dtypes = {p.dtype for _, p in named_params}
        if len(dtypes) != 1:
            raise ValueError(f"one GradBuffer holds one parameter dtype, got "
                             f"{sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.shard_over = shard_over
        device = named_params[0][1].device
        if fsdp:
            order = list(named_params)
            layout = fsdp_layout([(p.numel(), p[0].numel() if p.dim() > 1 else 1,
                                   getattr(p, "shared_embedding", False), (units or {}).get(id(p)))
                                  for _, p in order], bucket_size, shard_over=shard_over,
                                 sharded=hold_params)
        else:
            order = list(reversed(named_params))  # backward order: last layer first
            layout = bucket_layout([(p.numel(), getattr(p, "shared_embedding", False))
                                    for _, p in order], bucket_size, shard_over=shard_over,
                                   sharded=hold_params, tail_splits=tail_splits)
        self.offsets: dict[int, tuple[int, int]] = {}  # id(param) -> [start, end) in the buffer
        for _, _, members in layout:
            for i, lo, hi in members:
                self.offsets[id(order[i][1])] = (lo, hi)
        self.numel = layout[-1][1]
        self.grad = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.param_data = torch.zeros(self.numel, dtype=self.dtype, device=device) \
            if hold_params and units is None else None
        self.buckets: list[Bucket] = []
        for k, (lo, hi, members) in enumerate(layout):
            names = [order[i][0] for i, _, _ in members]
            params = [order[i][1] for i, _, _ in members]
            self.buckets.append(Bucket(first_index + k, self, lo, hi, params, names))
            if hold_params and units is not None:  # ZeRO-3: storage of its own
                self.buckets[-1].full = torch.zeros(hi - lo, dtype=self.dtype, device=device)
        of = {id(p): b for b in self.buckets for p in b.params}
        for _, param in named_params:
            lo, hi = self.offsets[id(param)]
            param.main_grad = self.grad[lo:hi].view(param.shape)
            if hold_params:
                bucket = of[id(param)]
                view = bucket.param_data[lo - bucket.start:hi - bucket.start].view(param.shape)
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
