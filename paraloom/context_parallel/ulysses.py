"""All-to-all context-parallel attention (DeepSpeed-Ulysses; Megatron's ``--cp-comm-type a2a``).

Attention needs every position of a head, not every head of a position: so instead of moving K/V
around (the ring, the all-gather), Ulysses re-shards Q, K and V from the sequence to the heads.
One all-to-all each (kind ``cp``, phase ``forward``) sends head group ``j`` of this rank's
``s/cp`` positions to cp rank ``j``; rank ``j`` then holds ``a/cp`` query heads (``g/cp``
key/value heads) over the whole sequence. The positions arrive in cp-rank order (each rank's two
load-balanced chunks) and are put back in sequence order for the model's own attention kernel
(written-out or fused, as at cp = 1); a fourth all-to-all sends the output back to sequence
shards. Backward mirrors it: an all-to-all of the output's gradient, the attention's backward,
then one of dQ, dK and dV each. Megatron (Transformer Engine) issues the same exchanges: Q, K, V
in one call before the core, the output after it.

Each all-to-all moves a rank's whole tensor (``(cp - 1)/cp`` of it leaves the rank), the same
bytes whatever the position in the sequence, and nothing overlaps them. It needs the heads of a
tp rank (``a/tp`` and ``g/tp``) divisible by cp: ``cp <= g/tp``.
"""

from __future__ import annotations

import math

import torch

from .. import comm
from ..mesh import Axis
from .split import position_ids

__all__ = ["ulysses_attention"]

_SITE = "ulysses_attention"


def _seq_to_head(x: torch.Tensor, axis: Axis, site: str, phase: str, module) -> torch.Tensor:
    """``[b, n, s/cp, d]`` (this rank's positions, all ``n`` heads) -> ``[b, n/cp, s, d]`` (head
    group ``axis.rank``, every rank's positions in rank order)."""
    b, n, s, d = x.shape
    cp = axis.size
    send = x.view(b, cp, n // cp, s, d).permute(1, 0, 2, 3, 4)   # [cp, b, n/cp, s/cp, d]
    got = comm.all_to_all(send, axis, phase=phase, kind="cp", site=f"{_SITE}:{site}",
                          module=module, split="heads to the cp rank of their group")
    return got.permute(1, 2, 0, 3, 4).reshape(b, n // cp, cp * s, d)


def _head_to_seq(x: torch.Tensor, axis: Axis, site: str, phase: str, module) -> torch.Tensor:
    """The inverse: ``[b, n/cp, s, d]`` -> ``[b, n, s/cp, d]``."""
    b, m, s, d = x.shape
    cp = axis.size
    send = x.view(b, m, cp, s // cp, d).permute(2, 0, 1, 3, 4)   # [cp, b, n/cp, s/cp, d]
    got = comm.all_to_all(send, axis, phase=phase, kind="cp", site=f"{_SITE}:{site}",
                          module=module, split="positions back to their cp rank")
    return got.permute(1, 0, 2, 3, 4).reshape(b, cp * m, s // cp, d)


class _QKVToHeads(torch.autograd.Function):
    """Q, K, V from sequence to head shards (three all-to-alls); backward dQ, dK, dV back."""

    @staticmethod
    def forward(ctx, q, k, v, axis: Axis, module):
        ctx.axis, ctx.module = axis, module
        return tuple(_seq_to_head(t, axis, name, "forward", module)
                     for t, name in ((q, "q"), (k, "k"), (v, "v")))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        return (*(_head_to_seq(t.contiguous(), ctx.axis, name, "backward", ctx.module)
                  for t, name in ((dq, "dq"), (dk, "dk"), (dv, "dv"))), None, None)


class _OutToSequence(torch.autograd.Function):
    """The attention output back to sequence shards; backward its gradient to head shards."""

    @staticmethod
    def forward(ctx, out, axis: Axis, module):
        ctx.axis, ctx.module = axis, module
        return _head_to_seq(out, axis, "out", "forward", module)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad.contiguous(), ctx.axis, "dout", "backward", ctx.module), \
            None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: Axis, *,
                      module: str | None = None, core=None) -> torch.Tensor:
    """Causal attention of this cp rank's positions: ``q [b, a, s/cp, d]``, ``k, v
    [b, g, s/cp, d]`` (``a`` and ``g`` divisible by cp) -> ``[b, a, s/cp, d]``. ``core``: the
    model's local attention (``CoreAttention`` or ``SDPAttention``, causal over ``[b, heads, s,
    d]`` in sequence order), run on the whole sequence put back in order; ``None``: written out
    here with the mask of the positions as they arrive."""
    cp = axis.size
    if q.shape[1] % cp or k.shape[1] % cp:
        raise ValueError(f"cp_comm_type a2a: the heads of a rank ({q.shape[1]} query, "
                         f"{k.shape[1]} key/value) must be divisible by cp = {cp}")
    qh, kh, vh = _QKVToHeads.apply(q, k, v, axis, module)         # [b, heads/cp, s, d]
    s = qh.shape[2]
    pos = torch.cat([position_ids(s, r, cp, q.device) for r in range(cp)])  # arrival order
    if core is not None:  # sequence order for the model's kernel, then back to arrival order
        order = torch.argsort(pos)
        out = core(*(t.index_select(2, order) for t in (qh, kh, vh))).index_select(2, pos)
        return _OutToSequence.apply(out, axis, module)
    if kh.shape[1] != qh.shape[1]:  # grouped-query attention: each K/V head serves a/g queries
        kh = kh.repeat_interleave(qh.shape[1] // kh.shape[1], dim=1)
        vh = vh.repeat_interleave(qh.shape[1] // vh.shape[1], dim=1)
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    return _OutToSequence.apply(scores.softmax(-1) @ vh, axis, module)
