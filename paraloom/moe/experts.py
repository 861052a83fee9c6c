"""The experts of one MoE layer: GeLU MLPs, divided over ep and each split over tp.

Expert ``g`` (global index) is the MLP of ``models/gpt.py`` with its own weights
``layers.<i>.mlp.experts.<g>.fc1.weight`` etc.; the counter-based initializer keys every element
on that global name, so expert ``g`` starts the same on whichever ep rank holds it, and a
checkpoint stores it under that name whatever the layout. Rank ``r`` of the ep group holds the
contiguous experts ``[r * E / ep, (r + 1) * E / ep)``.

Within an expert, tensor parallelism splits as Megatron's experts: fc1 by output rows
(``ffn/tp`` per rank, ``partition_dim=0``), fc2 by input columns (``partition_dim=1``), so an
expert's output on a rank is a *partial sum* over tp. The experts themselves never communicate:
the token dispatcher gathers their input over tp and reduces their output (Megatron's
``explicit_expert_comm``). fc2's bias is added by tp rank 0 only (the partial sums then count
it once); its gradient is summed over tp when gradients are finalised. Every expert parameter
carries ``allreduce=False`` (Megatron's mark): its gradient is reduced over the
expert-data-parallel group, not over dp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ledger import span
from ..tensor_parallel.linear import set_tensor_model_parallel_attributes
from ..utils import divide

__all__ = ["Expert", "local_expert_ids"]


def local_expert_ids(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """Global indices of the experts ep rank ``ep_rank`` holds (contiguous)."""
    per = divide(num_experts, ep_size, "num_experts")
    return range(ep_rank * per, (ep_rank + 1) * per)


def _param(init, name, shape, ranges, dtype, dim: int | None, tp: int) -> nn.Parameter:
    """A weight from the counter-based ``init`` (``None``: a bias, zeros as in the dense MLP)."""
    if init is None:
        local = [b - a for a, b in ranges] if ranges else list(shape)
        p = nn.Parameter(torch.zeros(local, dtype=dtype))
    else:
        p = nn.Parameter(init(name, shape, ranges, dtype=dtype))
    set_tensor_model_parallel_attributes(p, dim is not None and tp > 1, dim or 0)
    p.allreduce = False
    return p


class Expert(nn.Module):
    """One expert's tp shard: ``[n, h] -> [n, h]`` partial sum over tp (fc2 bias on tp rank 0)."""

    def __init__(self, hidden: int, ffn: int, mesh, name: str, init, out_init, dtype) -> None:
        super().__init__()
        tp, r = mesh.tp.size, mesh.tp.rank
        f = divide(ffn, tp, "ffn_hidden_size")
        rows, cols = (r * f, (r + 1) * f), (0, hidden)
        self.name, self.first = name, r == 0
        self.fc1, self.fc2 = nn.Module(), nn.Module()  # names as the dense MLP's: fc1.weight
        self.fc1.weight = _param(init, f"{name}.fc1.weight", (ffn, hidden), (rows, cols), dtype,
                                 0, tp)
        self.fc1.bias = _param(None, f"{name}.fc1.bias", (ffn,), (rows,), dtype, 0, tp)
        self.fc2.weight = _param(out_init, f"{name}.fc2.weight", (hidden, ffn), (cols, rows),
                                 dtype, 1, tp)
        self.fc2.bias = _param(None, f"{name}.fc2.bias", (hidden,), None, dtype, None, tp)
        self.fc2.bias.sequence_parallel = tp > 1  # partial (rank 0 only): summed over tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # [n, h]
        with span("Expert.forward:fc1_gelu_fc2", phase="forward", module=self.name,
                  rows=x.shape[0]):
            h = F.gelu(F.linear(x, self.fc1.weight, self.fc1.bias), approximate="tanh")
            out = F.linear(h, self.fc2.weight)              # [n, h] partial over tp
        bias = self.fc2.bias
        return out + bias if self.first else out + 0 * bias
