"""Tensor-parallel layers: ColumnParallelLinear and RowParallelLinear (the embedding and the output
layer are in :mod:`.embedding`).

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
"""

from __future__ import annotations

import torch
from torch import nn

from ..mesh import ParallelMesh
from ..utils import divide
from .init import CounterInit
from .linear import (
    default_mesh,
    linear_with_grad_accumulation_and_async_allreduce,
    local_linear,
    set_tensor_model_parallel_attributes,
    shard_param,
)
from .mappings import (
    Where,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


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
            after it. ``None`` (default): Megatron-Core's rule, on when tp > 1 and not
            ``sequence_parallel``; an explicit ``True`` with ``sequence_parallel`` is an error.
        gradient_accumulation_fusion: accumulate the weight gradient in fp32 ``weight.main_grad``.
        own_backward: use the layer's own autograd function also at tp = 1, where it would use
            ``F.linear``: for a model whose backward a zero-bubble schedule splits into B and W
            (see :func:`.linear.local_linear`).
        skip_bias_add: return the bias instead of adding it.
        init_method: ``(name, global_shape, ranges, dtype=, device=) -> Tensor``; bias starts at 0.
        mesh: the layout (default: the one from ``initialize_model_parallel``, else 1 rank).
        name: the module's global path (``layers.0.mlp.fc1``): the init key and the ledger's
            ``module``.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 async_grad_allreduce: bool | None = None,
                 gradient_accumulation_fusion: bool = False,
                 own_backward: bool = False, skip_bias_add: bool = False, init_method=None,
                 mesh: ParallelMesh | None = None, name: str = "column",
                 params_dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        if sequence_parallel and async_grad_allreduce:
            raise ValueError("ColumnParallelLinear: sequence_parallel=True with "
                             "async_grad_allreduce=True is invalid (sequence parallelism has no "
                             "input-gradient all-reduce; its reduce-scatter already overlaps)")
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: sequence_parallel=True needs "
                             "gather_output=False (the output stays split for a RowParallelLinear)")
        self.mesh = default_mesh(mesh)
        tp = self.mesh.tp
        self.input_size, self.output_size, self.name = input_size, output_size, name
        self.output_size_per_partition = divide(output_size, tp.size, f"{name}: output_size")
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        if async_grad_allreduce is None:  # Megatron-Core's rule
            async_grad_allreduce = not sequence_parallel
        self.async_grad_allreduce = async_grad_allreduce and tp.size > 1
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.own_backward = own_backward
        self.skip_bias_add = skip_bias_add
        init_method = init_method or CounterInit()
        self.weight = shard_param(init_method, f"{name}.weight", (output_size, input_size), 0,
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
            out = local_linear(x, self.weight, bias, self.gradient_accumulation_fusion,
                               self.own_backward)
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
        bias, gradient_accumulation_fusion, own_backward, skip_bias_add, init_method, mesh,
            name: as for :class:`ColumnParallelLinear`. The bias is added after the reduction.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 input_is_parallel: bool = False, sequence_parallel: bool = False,
                 gradient_accumulation_fusion: bool = False, own_backward: bool = False,
                 skip_bias_add: bool = False, init_method=None, mesh: ParallelMesh | None = None,
                 name: str = "row", params_dtype: torch.dtype = torch.float32,
                 device=None) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        self.mesh = default_mesh(mesh)
        tp = self.mesh.tp
        self.input_size, self.output_size, self.name = input_size, output_size, name
        self.input_size_per_partition = divide(input_size, tp.size, f"{name}: input_size")
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.own_backward = own_backward
        self.skip_bias_add = skip_bias_add
        init_method = init_method or CounterInit()
        self.weight = shard_param(init_method, f"{name}.weight", (output_size, input_size), 1,
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
            out = local_linear(x, self.weight, bias, self.gradient_accumulation_fusion,
                               self.own_backward)
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
