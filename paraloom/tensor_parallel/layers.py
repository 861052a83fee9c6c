"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Megatron's names and keyword arguments; ``forward`` returns ``(output, bias)`` where ``bias`` is
``None`` unless ``skip_bias_add`` (then the caller adds it, e.g. fused into a later op). Weights are
``[out, in]`` like ``nn.Linear``; each rank creates only its shard with the counter-based
initializer, so every layout starts from the same function.

Where each layer communicates (tp = tensor-parallel group, activations ``[s, b, h]``):

* Column (weight split on the output dim): forward nothing (all-gather of the output only if
  ``gather_output``; with ``sequence_parallel`` an all-gather of the ``[s/tp, b, h]`` input);
  backward all-reduces the input gradient (sequence parallel: reduce-scatters it).
* Row (weight split on the input dim): forward all-reduces the partial outputs (sequence
  parallel: reduce-scatters them), then adds the bias; backward communicates nothing itself.
* VocabParallelEmbedding (rows split by vocabulary range): forward all-reduces the looked-up
  rows (or reduce-scatters them along the sequence with ``reduce_scatter_embeddings``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from .. import ledger as _ledger
from ..mesh import ParallelMesh
from ..utils import divide
from .init import CounterInit, shard_range
from .mappings import (
    Where,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .weight_grad import defer, defer_weight_grads, is_deferring, layer_function_needed, weight_grad

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "LinearWithGradAccumulationAndAsyncCommunication", "defer_weight_grads",
           "linear_with_grad_accumulation_and_async_allreduce",
           "set_tensor_model_parallel_attributes"]


def _mesh(mesh: ParallelMesh | None) -> ParallelMesh:
    if mesh is not None:
        return mesh
    from ..parallel_state import get_mesh, model_parallel_is_initialized
    return get_mesh() if model_parallel_is_initialized() else ParallelMesh()


def set_tensor_model_parallel_attributes(param: nn.Parameter, is_parallel: bool, dim: int,
                                         stride: int = 1) -> None:
    """Megatron's parameter attributes (contract): ``tensor_model_parallel``, ``partition_dim``,
    ``partition_stride``."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def _shard_param(init_method, name: str, global_shape, dim: int, mesh: ParallelMesh, dtype, device):
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


def _local_linear(x, weight, bias, fusion: bool):
    """A linear layer at tp = 1. The autograd function above is needed only for what it adds
    there -- the ledger's fprop/dgrad/wgrad spans while recording, the GEMM into ``main_grad``
    (fusion), the split backward of a zero-bubble ``B`` step, a whole re-run under recomputation
    (:func:`.weight_grad.need_layer_function`); otherwise ``F.linear``, whose
    backward runs in C++ and computes the same GEMMs (bitwise the same gradients), saves the
    Python function's ~30-50 us a call (1-3 % of a one-rank step, ``benchmarks/single.py``)."""
    if fusion or layer_function_needed() or _ledger.active() is not None:
        return linear_with_grad_accumulation_and_async_allreduce(x, weight, bias, None, False,
                                                                 False, fusion)
    return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by columns (output dim): rank ``i`` holds ``A_i``,
    ``[out/tp, in]``.

    Args:
        input_size, output_size: global sizes; ``output_size`` must divide by tp.
        bias: create a bias (split like the output).
        gather_output: all-gather the output so every rank has ``[.., out]``; else ``[.., out/tp]``.
        sequence_parallel: the input is ``[s/tp, b, h]``; all-gathered in forward, and the input
            gradient reduce-scattered (overlapping the wgrad GEMM) in backward.
        async_grad_allreduce: launch the input-gradient all-reduce before the wgrad GEMM and wait
            after it. Not with ``sequence_parallel``.
        gradient_accumulation_fusion: accumulate the weight gradient in fp32 ``weight.main_grad``.
        skip_bias_add: return the bias instead of adding it.
        init_method: ``(name, global_shape, ranges, dtype=, device=) -> Tensor``; bias starts at 0.
        mesh: the layout (default: the one from ``initialize_model_parallel``, else 1 rank).
        name: the module's global path (``layers.0.mlp.fc1``): the init key and the ledger's
            ``module``.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 async_grad_allreduce: bool = False, gradient_accumulation_fusion: bool = False,
                 skip_bias_add: bool = False, init_method=None, mesh: ParallelMesh | None = None,
                 name: str = "column", params_dtype: torch.dtype = torch.float32,
                 device=None) -> None:
        super().__init__()
        if sequence_parallel and async_grad_allreduce:
            raise ValueError("ColumnParallelLinear: sequence_parallel=True with "
                             "async_grad_allreduce=True is invalid (sequence parallelism has no "
                             "input-gradient all-reduce; its reduce-scatter already overlaps)")
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: sequence_parallel=True needs "
                             "gather_output=False (the output stays split for a RowParallelLinear)")
        self.mesh = _mesh(mesh)
        tp = self.mesh.tp
        self.input_size, self.output_size, self.name = input_size, output_size, name
        self.output_size_per_partition = divide(output_size, tp.size, f"{name}: output_size")
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.async_grad_allreduce = async_grad_allreduce and tp.size > 1
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.skip_bias_add = skip_bias_add
        init_method = init_method or CounterInit()
        self.weight = _shard_param(init_method, f"{name}.weight", (output_size, input_size), 0,
                                   self.mesh, params_dtype, device)
        set_tensor_model_parallel_attributes(self.weight, True, 0)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition,
                                                 dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, True, 0)
        else:
            self.register_parameter("bias", None)
        self._where = Where(tp, "ColumnParallelLinear", "input", name,
                            "ColumnParallelLinear weight, output dim")

    def forward(self, x: torch.Tensor):
        """``x``: ``[s, b, in]`` (``[s/tp, b, in]`` with sequence parallel). Returns
        ``([s, b, out/tp] or [s, b, out] if gather_output, bias or None)``."""
        w, tp = self._where, self.mesh.tp.size
        bias = None if self.skip_bias_add else self.bias
        if tp == 1:
            out = _local_linear(x, self.weight, bias, self.gradient_accumulation_fusion)
            return out, (self.bias if self.skip_bias_add else None)
        if not (self.async_grad_allreduce or self.sequence_parallel):
            x = copy_to_tensor_model_parallel_region(x, w.axis, site=w.site, module=w.module,
                                                     split=w.split)
        out = linear_with_grad_accumulation_and_async_allreduce(
            x, self.weight, bias, w, self.sequence_parallel, self.async_grad_allreduce,
            self.gradient_accumulation_fusion)
        if self.gather_output:
            out = gather_from_tensor_model_parallel_region(out, w.axis, site=w.site,
                                                           module=w.module, split=w.split)
        return out, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size} (per rank "
                f"{self.output_size_per_partition}), gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by rows (input dim): rank ``i`` holds ``A_i``,
    ``[out, in/tp]``.

    Args:
        input_is_parallel: the input is already split on its last dim (the output of a
            ColumnParallelLinear); otherwise it is scattered here (a split, no communication).
        sequence_parallel: reduce-scatter the output along the sequence (``[s/tp, b, out]``)
            instead of all-reducing it. Needs ``input_is_parallel``. The bias is then replicated
            and marked ``sequence_parallel`` (its gradient is all-reduced over tp when grads are
            finalised).
        bias, gradient_accumulation_fusion, skip_bias_add, init_method, mesh, name: as for
            :class:`ColumnParallelLinear`. The bias is added after the reduction.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 input_is_parallel: bool = False, sequence_parallel: bool = False,
                 gradient_accumulation_fusion: bool = False, skip_bias_add: bool = False,
                 init_method=None, mesh: ParallelMesh | None = None, name: str = "row",
                 params_dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        self.mesh = _mesh(mesh)
        tp = self.mesh.tp
        self.input_size, self.output_size, self.name = input_size, output_size, name
        self.input_size_per_partition = divide(input_size, tp.size, f"{name}: input_size")
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.skip_bias_add = skip_bias_add
        init_method = init_method or CounterInit()
        self.weight = _shard_param(init_method, f"{name}.weight", (output_size, input_size), 1,
                                   self.mesh, params_dtype, device)
        set_tensor_model_parallel_attributes(self.weight, True, 1)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            self.bias.sequence_parallel = sequence_parallel and tp.size > 1
        else:
            self.register_parameter("bias", None)
        self._where = Where(tp, "RowParallelLinear", "output", name,
                            "RowParallelLinear weight, input dim")

    def forward(self, x: torch.Tensor):
        """``x``: ``[s, b, in/tp]`` (or ``[s, b, in]`` if not ``input_is_parallel``). Returns
        ``([s, b, out] or [s/tp, b, out] with sequence parallel, bias or None)``."""
        w = self._where
        if self.mesh.tp.size == 1:  # nothing to reduce: the bias goes into the GEMM (addmm)
            bias = None if self.skip_bias_add else self.bias
            out = _local_linear(x, self.weight, bias, self.gradient_accumulation_fusion)
            return out, self.bias if self.skip_bias_add else None
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, w.axis, site=w.site, tag="input",
                                                        module=w.module, split=w.split)
        partial = linear_with_grad_accumulation_and_async_allreduce(
            x, self.weight, None, w._replace(tag="output"), False, False,
            self.gradient_accumulation_fusion)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, w.axis, site=w.site,
                                                             module=w.module, split=w.split)
        else:
            out = reduce_from_tensor_model_parallel_region(partial, w.axis, site=w.site,
                                                           module=w.module, split=w.split)
        if self.skip_bias_add or self.bias is None:
            return out, self.bias if self.skip_bias_add else None
        return out + self.bias, None

    def extra_repr(self) -> str:
        return (f"in={self.input_size} (per rank {self.input_size_per_partition}), "
                f"out={self.output_size}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary range: rank ``i`` holds rows ``[i V/tp, (i+1) V/tp)``.

    Each rank looks up the tokens in its range (zeros elsewhere); the partial results are
    all-reduced over tp, or, with ``reduce_scatter_embeddings`` (sequence parallel), reduce-
    scattered along the sequence so each rank keeps ``[s/tp, b, h]`` (input ids ``[s, b]``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method=None,
                 reduce_scatter_embeddings: bool = False, mesh: ParallelMesh | None = None,
                 name: str = "embedding", params_dtype: torch.dtype = torch.float32,
                 device=None) -> None:
        super().__init__()
        self.mesh = _mesh(mesh)
        tp = self.mesh.tp
        self.num_embeddings, self.embedding_dim, self.name = num_embeddings, embedding_dim, name
        self.num_embeddings_per_partition = divide(num_embeddings, tp.size,
                                                   f"{name}: num_embeddings (vocabulary)")
        self.vocab_start_index = tp.rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        init_method = init_method or CounterInit()
        self.weight = _shard_param(init_method, f"{name}.weight", (num_embeddings, embedding_dim),
                                   0, self.mesh, params_dtype, device)
        set_tensor_model_parallel_attributes(self.weight, True, 0)
        self._where = Where(tp, "VocabParallelEmbedding", "output", name,
                            "embedding rows, vocabulary range")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.mesh.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local = (ids - self.vocab_start_index).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        w = self._where
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(partial, w.axis, site=w.site,
                                                              module=w.module, split=w.split)
        return reduce_from_tensor_model_parallel_region(partial, w.axis, site=w.site,
                                                        module=w.module, split=w.split)
