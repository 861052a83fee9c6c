"""The experts of one MoE layer: MLPs divided over ep, each split over tp.

Expert ``g`` (global index) is the MLP of ``models/gpt.py`` with its own weights
``layers.<i>.mlp.experts.<g>.fc1.weight`` etc.; the counter-based initializer keys every element
on that global name, so expert ``g`` starts the same on whichever ep rank holds it, and a
checkpoint stores it under that name whatever the layout. Rank ``r`` of the ep group holds the
contiguous experts ``[r * E / ep, (r + 1) * E / ep)``. An expert is the model's MLP: tanh-GeLU with
biases (GPT-2), or SwiGLU without biases (``--swiglu --disable-bias-linear``: Mixtral, DeepSeek,
Qwen-MoE; Megatron's ``gated_linear_unit`` experts), whose fc1 is ``2f`` rows, ``[gate_r; up_r]``
on tp rank ``r`` (``partition_stride = 2``, as the dense SwiGLU MLP).

Within an expert, tensor parallelism splits as Megatron's experts: fc1 by output rows
(``ffn/tp`` per rank, ``partition_dim=0``), fc2 by input columns (``partition_dim=1``), so an
expert's output on a rank is a *partial sum* over tp. The experts themselves never communicate:
the token dispatcher gathers their input over tp and reduces their output (Megatron's
``explicit_expert_comm``). fc2's bias is added by tp rank 0 only (the partial sums then count
it once); its gradient is summed over tp when gradients are finalised. Every expert parameter
carries ``allreduce=False`` (Megatron's mark): its gradient is reduced over the
expert-data-parallel group, not over dp.

With ``--moe-grouped-gemm`` the local experts are a :class:`GroupedExperts`: Megatron's
``TEGroupedMLP`` runs them as one grouped GEMM per linear and registers ``linear_fc1.weight<i>``
(``bias<i>``) of every local expert before ``linear_fc2``'s, so its parameters -- the gradient
buffer, the buckets and what each bucket holds -- come in that order. Here the same modules and
names are walked in that order; each expert still runs its own GEMMs (on CPU a grouped GEMM is
that loop: the same arithmetic, the same communication).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ledger import span
from ..tensor_parallel.linear import set_tensor_model_parallel_attributes
from ..tensor_parallel.swiglu import SwiGLUInit, swiglu
from ..utils import divide

__all__ = ["Expert", "GroupedExperts", "local_expert_ids"]


def local_expert_ids(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """Global indices of the experts ep rank ``ep_rank`` holds (contiguous)."""
    per = divide(num_experts, ep_size, "num_experts")
    return range(ep_rank * per, (ep_rank + 1) * per)


def _param(init, name, shape, ranges, dtype, dim: int | None, tp: int,
           stride: int = 1) -> nn.Parameter:
    """A weight from the counter-based ``init`` (``None``: a bias, zeros as in the dense MLP)."""
    if init is None:
        local = [b - a for a, b in ranges] if ranges else list(shape)
        p = nn.Parameter(torch.zeros(local, dtype=dtype))
    else:
        p = nn.Parameter(init(name, shape, ranges, dtype=dtype))
    # a strided split is marked at tp = 1 too (as the dense SwiGLU fc1): the checkpoint stores
    # it as [stride, n / stride, ...] whatever tp wrote it
    split = dim is not None and (tp > 1 or stride > 1)
    set_tensor_model_parallel_attributes(p, split, dim or 0, stride)
    p.allreduce = False
    return p


class Expert(nn.Module):
    """One expert's tp shard: ``[n, h] -> [n, h]`` partial sum over tp (fc2 bias on tp rank 0).

    ``swiglu``: fc1 is ``[gate_r; up_r]`` (``2f/tp`` rows) and the activation ``silu(gate) * up``;
    ``bias``: fc1 and fc2 biases (``add_bias_linear``)."""

    def __init__(self, hidden: int, ffn: int, mesh, name: str, init, out_init, dtype, *,
                 swiglu: bool = False, bias: bool = True) -> None:
        super().__init__()
        tp, r = mesh.tp.size, mesh.tp.rank
        f = divide(ffn, tp, "ffn_hidden_size")
        wide, stride = (2, 2) if swiglu else (1, 1)  # SwiGLU: gate and up rows
        rows, cols = (r * wide * f, (r + 1) * wide * f), (0, hidden)
        self.name, self.first, self.swiglu = name, r == 0, swiglu
        self.fc1, self.fc2 = nn.Module(), nn.Module()  # names as the dense MLP's: fc1.weight
        self.fc1.weight = _param(SwiGLUInit(init) if swiglu else init, f"{name}.fc1.weight",
                                 (wide * ffn, hidden), (rows, cols), dtype, 0, tp, stride)
        self.fc2.weight = _param(out_init, f"{name}.fc2.weight", (hidden, ffn),
                                 (cols, (r * f, (r + 1) * f)), dtype, 1, tp)
        if not bias:
            self.fc1.bias = self.fc2.bias = None
        else:
            self.fc1.bias = _param(None, f"{name}.fc1.bias", (wide * ffn,), (rows,), dtype, 0,
                                   tp, stride)
            self.fc2.bias = _param(None, f"{name}.fc2.bias", (hidden,), None, dtype, None, tp)
            self.fc2.bias.sequence_parallel = tp > 1  # partial (rank 0 only): summed over tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # [n, h]
        what = "fc1_swiglu_fc2" if self.swiglu else "fc1_gelu_fc2"
        with span(f"Expert.forward:{what}", phase="forward", module=self.name,
                  rows=x.shape[0]):
            h = F.linear(x, self.fc1.weight, self.fc1.bias)
            h = swiglu(h) if self.swiglu else F.gelu(h, approximate="tanh")
            out = F.linear(h, self.fc2.weight)              # [n, h] partial over tp
        bias = self.fc2.bias
        if bias is None:
            return out
        return out + bias if self.first else out + 0 * bias


class GroupedExperts(nn.ModuleDict):
    """The local experts (``{str(g): Expert}``) in Megatron's grouped-GEMM parameter order: the
    modules and names of a ``ModuleDict``, walked fc1 of every expert, then fc2 -- so
    ``parameters()``, and with it the gradient buffer's layout, follows ``TEGroupedMLP``."""

    def named_modules(self, memo: set | None = None, prefix: str = "",
                      remove_duplicate: bool = True):
        memo = set() if memo is None else memo
        if self in memo:
            return
        if remove_duplicate:
            memo.add(self)
        yield prefix, self
        dot = f"{prefix}." if prefix else ""
        for g, expert in self._modules.items():  # no parameters of their own
            if expert not in memo:
                if remove_duplicate:
                    memo.add(expert)
                yield f"{dot}{g}", expert
        for part in ("fc1", "fc2"):
            for g, expert in self._modules.items():
                yield from getattr(expert, part).named_modules(memo, f"{dot}{g}.{part}",
                                                               remove_duplicate)
