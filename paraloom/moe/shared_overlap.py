"""Megatron's ``--moe-shared-expert-overlap``: the shared expert computed in pieces inside the
alltoall token dispatcher, so that on a GPU its GEMMs run while the routed tokens travel.

Without it the shared expert (a dense tp MLP every token runs) goes first, before the router,
with its linears' own tensor-parallel communication. With it, as Megatron-Core's
``SharedExpertMLP`` with ``moe_shared_expert_overlap`` does, the linears communicate nothing
themselves and the dispatcher calls, in this order:

1. :meth:`SharedExpertOverlap.pre_forward_comm` once the token counts are exchanged: the gate's
   score, then the input all-gathered over tp under sequence parallelism (kind ``sp``; backward a
   reduce-scatter), or the tp "copy" (backward an all-reduce, kind ``tp``);
2. :meth:`SharedExpertOverlap.fc1` right after the tokens' all-to-all, before the
   probabilities': fc1 and the activation;
3. :meth:`SharedExpertOverlap.fc2` right after the combine all-to-all: fc2 (a partial sum over
   tp), then :meth:`SharedExpertOverlap.post_forward_comm`: reduce-scattered (sp) or all-reduced
   over tp;
4. :meth:`SharedExpertOverlap.output` (times the gate) is added to the routed experts' output.

Megatron also moves the pieces' backward: it raises the autograd priority (the grad function's
sequence number) of the gathered input and of the reduced output, so their backward
communication starts as soon as it can, and puts fc1's activation just behind the tokens'
all-to-all; the same is done here (``_set_sequence_nr``; autograd runs the ready function with
the highest number first). The numbers equal the shared expert computed first, up to the order
in which the router's and the shared expert's gradients are added to the layer's input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..tensor_parallel.linear import linear_with_grad_accumulation_and_async_allreduce
from ..tensor_parallel.mappings import (
    Where,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from ..tensor_parallel.swiglu import swiglu

__all__ = ["SharedExpertOverlap"]

_FIRST = 2 ** 31 - 1  # the highest priority autograd knows
_SITE = "SharedExpertMLP"


def _called(module, x: torch.Tensor) -> None:
    """What calling ``module`` would do first: its forward pre-hooks (the overlapped parameter
    gather's among them), as Megatron calls each linear module."""
    for hook in list(module._forward_pre_hooks.values()):
        hook(module, (x,))


def _priority(t: torch.Tensor | None, value: int) -> None:
    if t is not None and t.grad_fn is not None:
        t.grad_fn._set_sequence_nr(value)


class SharedExpertOverlap:
    """The pieces of one MoE layer's shared expert (an ``MLP`` of ``models/gpt.py``) for one
    forward; ``tp`` its tensor-parallel axis, ``sp`` whether its input is a sequence slice."""

    def __init__(self, mlp, tp, sp: bool, module: str) -> None:
        self.mlp, self.tp, self.sp, self.module = mlp, tp, sp, module
        self.x = self.h = self.out = self.gate = None

    def _linear(self, x: torch.Tensor, layer) -> torch.Tensor:
        _called(layer, x)
        where = Where(self.tp, f"{_SITE}.{layer.name.rsplit('.', 1)[-1]}", "input",
                      layer.name, None)
        return linear_with_grad_accumulation_and_async_allreduce(
            x, layer.weight, None, where, False, False, layer.gradient_accumulation_fusion)

    def start(self, x: torch.Tensor) -> None:
        """The layer's input (``[s(/tp), b, h]``), kept for :meth:`pre_forward_comm`."""
        self.x, self.h, self.out, self.gate = x, None, None, None

    def pre_forward_comm(self) -> None:
        x, kw = self.x, dict(site=f"{_SITE}.pre_forward_comm", module=self.module,
                             split="shared expert input, sequence")
        _called(self.mlp, x)
        if self.mlp.gate_weight is not None:
            self.gate = torch.sigmoid(F.linear(x, self.mlp.gate_weight))
        if self.sp:
            self.x = gather_from_sequence_parallel_region(x, self.tp, True, **kw)
        else:
            self.x = copy_to_tensor_model_parallel_region(x, self.tp, **kw)
        _priority(self.x, _FIRST)

    def fc1(self, overlapped: torch.Tensor | None = None) -> None:
        """fc1 and the activation; ``overlapped``: the tokens' all-to-all output, whose
        backward this one's follows."""
        h = self._linear(self.x, self.mlp.fc1)
        self.h = swiglu(h) if self.mlp.swiglu else F.gelu(h, approximate="tanh")
        self.x = None
        if overlapped is not None and overlapped.grad_fn is not None:
            _priority(self.h, overlapped.grad_fn._sequence_nr() - 1)

    def fc2(self, overlapped: torch.Tensor | None = None) -> None:
        """fc2 (partial over tp); ``overlapped``: the combine all-to-all's output, whose
        backward goes first."""
        _priority(overlapped, _FIRST)
        self.out, self.h = self._linear(self.h, self.mlp.fc2), None

    def post_forward_comm(self) -> None:
        kw = dict(site=f"{_SITE}.post_forward_comm", module=self.module,
                  split="shared expert output, partial sums over tp")
        if self.sp:
            self.out = reduce_scatter_to_sequence_parallel_region(self.out, self.tp, **kw)
        else:
            self.out = reduce_from_tensor_model_parallel_region(self.out, self.tp, **kw)
        _priority(self.out, _FIRST)

    def output(self) -> torch.Tensor:
        out = self.out if self.gate is None else self.out * self.gate
        self.out = self.gate = None
        return out
