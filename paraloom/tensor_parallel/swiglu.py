"""SwiGLU's tensor-parallel layout: fc1 of a SwiGLU MLP holds ``[gate; up]`` globally and
``[gate_r; up_r]`` on tp rank ``r`` (Megatron's layout, ``partition_stride = 2``).

* :class:`SwiGLUInit` evaluates each rank's rows at their *global* indices, so every layout starts
  from the same weights;
* :func:`swiglu` is the activation on a rank's fc1 output.

Used by the dense MLP (:mod:`paraloom.models.gpt`) and the MoE experts (:mod:`paraloom.moe`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["SwiGLUInit", "swiglu"]


class SwiGLUInit:
    """Initializer for a SwiGLU fc1 ``[2f, h]``: rank ``r`` of ``t`` gets global rows
    ``[r f/t, (r+1) f/t)`` (gate) and ``f + [r f/t, (r+1) f/t)`` (up), each at its global index."""

    def __init__(self, base) -> None:
        self.base = base

    def __call__(self, name: str, global_shape, ranges, *, dtype=torch.float32, device=None):
        if ranges is None:
            return self.base(name, global_shape, ranges, dtype=dtype, device=device)
        (lo, hi), rest = ranges[0], tuple(ranges[1:])
        half, f = (hi - lo) // 2, global_shape[0] // 2
        rank = lo // (hi - lo)
        parts = [self.base(name, global_shape, ((start, start + half),) + rest, dtype=dtype,
                           device=device)
                 for start in (rank * half, f + rank * half)]
        return torch.cat(parts, 0)


def swiglu(x):
    """``silu(gate) * up`` for fc1's output ``[..., 2f/tp]`` = ``[gate_r | up_r]``."""
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up
