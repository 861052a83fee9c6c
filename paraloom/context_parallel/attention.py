"""The core-attention module used in place of ``CoreAttention`` when ``cp > 1``."""

from __future__ import annotations

from torch import nn

from ..mesh import Axis
from .all_gather import all_gather_attention
from .hierarchical import hierarchical_attention
from .ring import ring_attention
from .ulysses import ulysses_attention

__all__ = ["ContextParallelAttention"]

_KINDS = {"p2p": ring_attention, "all_gather": all_gather_attention, "a2a": ulysses_attention}


class ContextParallelAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v over the whole sequence, for the queries of this
    cp rank's chunks (``[b, a/tp, s/cp, d]`` in and out); ``comm_type`` ``p2p`` (ring),
    ``all_gather``, ``a2a`` (Ulysses, with ``core``: the model's local attention kernel, run
    on the whole sequence of the heads this rank gets) or ``a2a+p2p`` (``levels``: the two
    hierarchical cp axes, all-to-all over the first, the ring over the second)."""

    def __init__(self, axis: Axis, comm_type: str = "p2p", name: str | None = None,
                 core: nn.Module | None = None, levels: tuple[Axis, Axis] | None = None
                 ) -> None:
        super().__init__()
        if comm_type not in (*_KINDS, "a2a+p2p"):
            raise ValueError(f"cp comm type must be p2p, all_gather, a2a or a2a+p2p, got "
                             f"{comm_type!r}")
        if comm_type == "a2a+p2p" and levels is None:
            raise ValueError("cp comm type a2a+p2p needs levels=(cp_a2a axis, cp_p2p axis)")
        self.axis, self.comm_type, self.name, self.levels = axis, comm_type, name, levels
        self.local = core if comm_type == "a2a" else None  # the kernel on re-sharded heads

    def forward(self, q, k, v):
        if self.comm_type == "a2a+p2p":
            return hierarchical_attention(q, k, v, *self.levels, module=self.name)
        if self.comm_type == "a2a":
            return ulysses_attention(q, k, v, self.axis, module=self.name, core=self.local)
        return _KINDS[self.comm_type](q, k, v, self.axis, module=self.name)
