"""Region mappings: the autograd functions that move activations in and out of tp regions.

Each is "forward: X / backward: Y", with Megatron's names. ``axis`` is the tensor-parallel
:class:`~paraloom.mesh.Axis`; ``site`` names the caller (``"RowParallelLinear"``) and ``tag`` the
tensor (``"output"``), so the ledger reads ``RowParallelLinear.forward:output``. Activations are
sequence-first ``[s, b, h]``: tensor-parallel splits act on the last dim, sequence-parallel ones
on dim 0. Over a size-1 axis every mapping is the identity and returns its input (no autograd
node). All-reduces work in place on the tensor they are given (as Megatron's do): the partial
output in forward, the incoming gradient in backward; nothing else holds those tensors.

==========================================  ==========================  ==========================
function                                     forward                     backward
==========================================  ==========================  ==========================
copy_to_tensor_model_parallel_region         identity                    all-reduce
reduce_from_tensor_model_parallel_region     all-reduce                  identity
scatter_to_tensor_model_parallel_region      split last dim              all-gather last dim
gather_from_tensor_model_parallel_region     all-gather last dim         split last dim
scatter_to_sequence_parallel_region          split dim 0                 all-gather dim 0
gather_from_sequence_parallel_region         all-gather dim 0            reduce-scatter dim 0
reduce_scatter_to_sequence_parallel_region   reduce-scatter dim 0        all-gather dim 0
==========================================  ==========================  ==========================
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import comm
from ..mesh import Axis
from ..parallel_state import get_mesh

__all__ = [
    "Where", "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "split_along_dim",
]


class Where(NamedTuple):
    """Who communicates: the axis, the calling site and tensor, the module path, the split."""

    axis: Axis
    site: str
    tag: str = "input"
    module: str | None = None
    split: str | None = None

    def args(self, phase: str, kind: str, tag: str | None = None) -> dict:
        """Keyword arguments for a ``comm`` call; the site is ``{site}.{phase}:{tag}`` (``tag`` +
        ``_grad`` in backward unless ``tag`` is given here)."""
        suffix = tag or (self.tag if phase == "forward" else f"{self.tag}_grad")
        return dict(phase=phase, kind=kind, site=f"{self.site}.{phase}:{suffix}",
                    module=self.module, split=self.split)


def split_along_dim(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (data movement only, no
    communication)."""
    if axis.size == 1:
        return x
    if x.shape[dim] % axis.size:
        raise ValueError(f"cannot split dim {dim} of shape {list(x.shape)} over {axis.size} ranks")
    return x.chunk(axis.size, dim)[axis.rank].contiguous()


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, where):
        ctx.where = where
        return x

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.contiguous(), ctx.where.axis,
                               **ctx.where.args("backward", "tp")), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, where):
        return comm.all_reduce(x.contiguous(), where.axis, **where.args("forward", "tp"))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, where):
        ctx.where = where
        return split_along_dim(x, where.axis, -1)

    @staticmethod
    def backward(ctx, grad):
        w = ctx.where
        return comm.all_gather(grad, w.axis, dim=-1, **w.args("backward", "tp")), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, where):
        ctx.where = where
        return comm.all_gather(x, where.axis, dim=-1, **where.args("forward", "tp"))

    @staticmethod
    def backward(ctx, grad):
        return split_along_dim(grad, ctx.where.axis, -1), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, where):
        ctx.where = where
        return split_along_dim(x, where.axis, 0)

    @staticmethod
    def backward(ctx, grad):
        w = ctx.where
        return comm.all_gather(grad, w.axis, dim=0, **w.args("backward", "sp")), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, where, tensor_parallel_output_grad):
        ctx.where, ctx.reduce = where, tensor_parallel_output_grad
        return comm.all_gather(x, where.axis, dim=0, **where.args("forward", "sp"))

    @staticmethod
    def backward(ctx, grad):
        w = ctx.where
        if ctx.reduce:  # the consumer was tensor-parallel: each rank holds a partial sum
            return comm.reduce_scatter(grad, w.axis, dim=0, **w.args("backward", "sp")), None, None
        return split_along_dim(grad, w.axis, 0), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, where):
        ctx.where = where
        return comm.reduce_scatter(x, where.axis, dim=0, **where.args("forward", "sp"))

    @staticmethod
    def backward(ctx, grad):
        w = ctx.where
        return comm.all_gather(grad, w.axis, dim=0, **w.args("backward", "sp")), None


def _where(axis: Axis | None, site: str, tag: str, module, split) -> Where:
    if axis is None:
        axis = get_mesh().tp
    return Where(axis, site, tag, module, split)


def copy_to_tensor_model_parallel_region(x, axis=None, *,
                                         site="copy_to_tensor_model_parallel_region",
                                         tag="input", module=None, split=None):
    """Forward: identity. Backward: all-reduce the gradient over tp (each rank's is partial)."""
    where = _where(axis, site, tag, module, split)
    return x if where.axis.size == 1 else _CopyToModelParallelRegion.apply(x, where)


def reduce_from_tensor_model_parallel_region(x, axis=None, *,
                                             site="reduce_from_tensor_model_parallel_region",
                                             tag="output", module=None, split=None):
    """Forward: all-reduce the partial sums over tp. Backward: identity."""
    where = _where(axis, site, tag, module, split)
    return x if where.axis.size == 1 else _ReduceFromModelParallelRegion.apply(x, where)


def scatter_to_tensor_model_parallel_region(x, axis=None, *,
                                            site="scatter_to_tensor_model_parallel_region",
                                            tag="input", module=None, split=None):
    """Forward: keep this rank's slice of the last dim. Backward: all-gather the last dim."""
    where = _where(axis, site, tag, module, split)
    return x if where.axis.size == 1 else _ScatterToModelParallelRegion.apply(x, where)


def gather_from_tensor_model_parallel_region(x, axis=None, *,
                                             site="gather_from_tensor_model_parallel_region",
                                             tag="output", module=None, split=None):
    """Forward: all-gather the last dim. Backward: keep this rank's slice of the gradient."""
    where = _where(axis, site, tag, module, split)
    return x if where.axis.size == 1 else _GatherFromModelParallelRegion.apply(x, where)


def scatter_to_sequence_parallel_region(x, axis=None, *,
                                        site="scatter_to_sequence_parallel_region",
                                        tag="input", module=None, split=None):
    """Forward: keep this rank's slice of the sequence (dim 0). Backward: all-gather dim 0."""
    where = _where(axis, site, tag, module, split)
    return x if where.axis.size == 1 else _ScatterToSequenceParallelRegion.apply(x, where)


def gather_from_sequence_parallel_region(x, axis=None, tensor_parallel_output_grad=True, *,
                                         site="gather_from_sequence_parallel_region",
                                         tag="input", module=None, split=None):
    """Forward: all-gather the sequence (dim 0). Backward: reduce-scatter dim 0 when the consumer
    was tensor-parallel (``tensor_parallel_output_grad``), else keep this rank's slice."""
    where = _where(axis, site, tag, module, split)
    if where.axis.size == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, where, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x, axis=None, *,
                                               site="reduce_scatter_to_sequence_parallel_region",
                                               tag="output", module=None, split=None):
    """Forward: reduce-scatter dim 0 (sum partial outputs, keep my sequence slice).
    Backward: all-gather dim 0."""
    where = _where(axis, site, tag, module, split)
    return x if where.axis.size == 1 else _ReduceScatterToSequenceParallelRegion.apply(x, where)
