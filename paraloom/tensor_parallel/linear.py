"""The linear GEMM of the tensor-parallel layers, with the column layer's backward communication
placed for overlap (:class:`LinearWithGradAccumulationAndAsyncCommunication`), and the helpers
the layers share: the default mesh, Megatron's parameter attributes, shard-local parameters.

At tp = 1 (:func:`local_linear`) the layers use ``F.linear`` unless something needs the
function's own backward, which the layer knows from how it was built or from the ledger:
gradient-accumulation fusion (the GEMM into ``main_grad``), ``own_backward`` (a model whose
backward a zero-bubble schedule splits), or an active ledger (its fprop/dgrad/wgrad spans).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from .. import ledger as _ledger
from ..mesh import ParallelMesh
from ..parallel_state import get_mesh, model_parallel_is_initialized
from .init import shard_range
from .weight_grad import defer, is_deferring, weight_grad

__all__ = ["LinearWithGradAccumulationAndAsyncCommunication",
           "linear_with_grad_accumulation_and_async_allreduce", "local_linear",
           "set_tensor_model_parallel_attributes", "shard_param", "default_mesh"]


def default_mesh(mesh: ParallelMesh | None) -> ParallelMesh:
    """``mesh``, or the one from ``initialize_model_parallel``, else a one-rank mesh."""
    if mesh is not None:
        return mesh
    return get_mesh() if model_parallel_is_initialized() else ParallelMesh()


def set_tensor_model_parallel_attributes(param: nn.Parameter, is_parallel: bool, dim: int,
                                         stride: int = 1) -> None:
    """Megatron's parameter attributes (contract): ``tensor_model_parallel``, ``partition_dim``,
    ``partition_stride``."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def shard_param(init_method, name: str, global_shape, dim: int, mesh: ParallelMesh, dtype, device):
    """This rank's shard of a parameter split on ``dim`` (``dim < 0``: the whole tensor), made
    by ``init_method`` on its own index range only."""
    ranges = shard_range(global_shape, dim, mesh.tp.rank, mesh.tp.size) if dim >= 0 else None
    return nn.Parameter(init_method(name, global_shape, ranges, dtype=dtype, device=device))


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """``y = x W^T + b`` with the column layer's backward communication placed for overlap.

    Backward order (``where`` is None for the row layer, which communicates nothing here):

    1. sequence parallel: launch the re-gather of the saved ``[s/tp, b, h]`` input shard (async);
    2. dgrad GEMM ``grad_x = grad_y W``;
    3. sequence parallel: wait for the gather, launch the reduce-scatter of ``grad_x`` (async);
       async_grad_allreduce: launch the all-reduce of ``grad_x`` (async);
    4. wgrad GEMM ``grad_W = grad_y^T x``, routed by :func:`.weight_grad.weight_grad` (``.grad``,
       straight into fp32 ``weight.main_grad``, or queued for a zero-bubble W step);
    5. wait for the step-3 communication, which overlapped the wgrad GEMM.

    With no communication (tp = 1) it costs what ``F.linear``'s own backward costs: the same two
    GEMMs and bias sum, the weight gradient taken by autograd without a copy, or written into
    ``main_grad`` where a data-parallel wrapper would otherwise copy it there.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, where, sequence_parallel, async_grad_allreduce,
                gradient_accumulation_fusion):
        ctx.where, ctx.sp, ctx.async_ar = where, sequence_parallel, async_grad_allreduce
        ctx.fusion, ctx.has_bias = gradient_accumulation_fusion, bias is not None
        ctx.save_for_backward(x, weight)  # with sp, x is the local shard: tp times less memory
        # main_grad and the data-parallel marks live on the Parameter object itself; under
        # activation recomputation the saved ``weight`` comes back as another tensor object
        ctx.param = weight
        if sequence_parallel:
            x = comm.all_gather(x, where.axis, dim=0, **where.args("forward", "sp"))  # [s, b, h]
        if _ledger.active() is None:
            return F.linear(x, weight, bias)
        with _ledger.span(f"{where.site if where else 'linear'}.forward:fprop", phase="forward",
                          module=where.module if where else None):
            return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        w = ctx.where
        name, module = (w.site, w.module) if w else ("linear", None)
        gather = pending = None
        if ctx.sp:  # re-gather the saved shard while the dgrad GEMM runs
            gather = comm.all_gather(x, w.axis, dim=0, async_op=True,
                                     **w.args("backward", "sp", "input (re-gather)"))
        grad_x = None
        if ctx.needs_input_grad[0]:  # not for a first stage's data, say: no dgrad GEMM then
            with _ledger.span(f"{name}.backward:dgrad", phase="backward", module=module):
                grad_x = grad_out.matmul(weight)
        if gather is not None:
            x = gather.wait()
        if grad_x is None:
            pass
        elif ctx.sp:
            pending = comm.reduce_scatter(grad_x, w.axis, dim=0, async_op=True,
                                          **w.args("backward", "sp"))
        elif ctx.async_ar:
            pending = comm.all_reduce(grad_x, w.axis, async_op=True, **w.args("backward", "tp"))
        go = grad_out.reshape(-1, grad_out.shape[-1])
        xf = x.reshape(-1, x.shape[-1])
        grad_b = go.sum(0) if ctx.has_bias else None
        if is_deferring():  # zero-bubble B step: the weight gradient waits for its W step
            defer(ctx.param, go, xf, ctx.fusion, name, module)
            grad_w = None
        else:
            with _ledger.span(f"{name}.backward:wgrad", phase="backward", module=module):
                grad_w = weight_grad(ctx.param, go, xf, ctx.fusion)
        if pending is not None:
            grad_x = pending.wait()
        return grad_x, grad_w, grad_b, None, None, None, None


def linear_with_grad_accumulation_and_async_allreduce(x, weight, bias=None, where=None,
                                                      sequence_parallel=False,
                                                      async_grad_allreduce=False,
                                                      gradient_accumulation_fusion=False):
    """Functional form of :class:`LinearWithGradAccumulationAndAsyncCommunication`."""
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        x, weight, bias, where, sequence_parallel, async_grad_allreduce,
        gradient_accumulation_fusion)


def local_linear(x, weight, bias, fusion: bool, own_backward: bool):
    """A linear layer at tp = 1. The autograd function above is needed only for what it adds
    there: the GEMM into ``main_grad`` (``fusion``), the split backward of a zero-bubble ``B``
    step (``own_backward``), and the ledger's fprop/dgrad/wgrad spans while recording.
    Recomputation re-runs the whole layer either way (its checkpoint has torch's early stop off,
    as Megatron's re-runs everything). Otherwise ``F.linear``,
    whose backward runs in C++ and computes the same GEMMs (bitwise the same gradients), saves
    the Python function's ~30-50 us a call (1-3 % of a one-rank step, ``benchmarks/single.py``).
    """
    if fusion or own_backward or _ledger.active() is not None:
        return linear_with_grad_accumulation_and_async_allreduce(x, weight, bias, None, False,
                                                                 False, fusion)
    return F.linear(x, weight, bias)
