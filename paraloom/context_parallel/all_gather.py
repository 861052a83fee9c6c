"""All-gather context-parallel attention (Llama 3's CP; ``--cp-comm-type all_gather``).

One all-gather of this rank's K and V over the cp group per layer (kind ``cp``, phase
``forward``) gives every rank the whole sequence's keys and values; its queries attend to them
under the causal mask of their global positions. Backward: one reduce-scatter of dK/dV, each rank
keeping the sum for its own chunks. Simpler than the ring and with fewer messages, but nothing
overlaps the exchange and every rank holds the full K/V for the layer.
"""

from __future__ import annotations

import math

import torch

from .. import comm
from ..mesh import Axis
from .split import position_ids

__all__ = ["all_gather_attention"]


class _GatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, axis: Axis, module: str | None):
        ctx.axis, ctx.module = axis, module
        return comm.all_gather(kv, axis, dim=3, phase="forward", kind="cp",
                               site="all_gather_attention:kv", module=module)

    @staticmethod
    def backward(ctx, grad):
        return comm.reduce_scatter(grad.contiguous(), ctx.axis, dim=3, phase="backward",
                                   kind="cp", site="all_gather_attention:dkv",
                                   module=ctx.module), None, None


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: Axis, *,
                         module: str | None = None) -> torch.Tensor:
    """Causal attention of this cp rank's queries ``[b, a, s/cp, d]`` over the all-gathered K/V
    of the sequence; returns ``[b, a, s/cp, d]``."""
    cp, local = axis.size, q.shape[2]
    kv = _GatherKV.apply(torch.stack([k, v]), axis, module)   # [2, b, a, s, d], rank order
    s = cp * local
    q_pos = position_ids(s, axis.rank, cp, q.device)
    k_pos = torch.cat([position_ids(s, r, cp, q.device) for r in range(cp)])
    if kv.shape[2] != q.shape[1]:  # grouped-query attention: each K/V head serves a/g queries
        kv = kv.repeat_interleave(q.shape[1] // kv.shape[2], dim=2)
    scores = q @ kv[0].transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return scores.softmax(-1) @ kv[1]
