"""The core-attention module used in place of ``CoreAttention`` when ``cp > 1``."""

from __future__ import annotations

from torch import nn

from ..mesh import Axis
from .all_gather import all_gather_attention
from .ring import ring_attention

__all__ = ["ContextParallelAttention"]

_KINDS = {"p2p": ring_attention, "all_gather": all_gather_attention}


class ContextParallelAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v over the whole sequence, for the queries of this
    cp rank's chunks (``[b, a/tp, s/cp, d]`` in and out); ``comm_type`` ``p2p`` (ring) or
    ``all_gather``."""

    def __init__(self, axis: Axis, comm_type: str = "p2p", name: str | None = None) -> None:
        super().__init__()
        if comm_type not in _KINDS:
            raise ValueError(f"cp comm type must be p2p or all_gather, got {comm_type!r}")
        self.axis, self.comm_type, self.name = axis, comm_type, name

    def forward(self, q, k, v):
        return _KINDS[self.comm_type](q, k, v, self.axis, module=self.name)
