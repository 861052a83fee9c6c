"""Attention on one block (a query chunk against a key chunk) and its backward, by hand.

Context-parallel attention sees the keys of a sequence a block at a time, so it needs what a
fused flash-attention kernel keeps inside: each block's output with its row-wise log-sum-exp
(``lse``), a stable merge of blocks, and a backward that recomputes a block's probabilities from
the *merged* ``lse``. Blocks are ``full`` (every key precedes every query), ``causal`` (the same
chunk: a lower-triangular mask) or skipped (every key follows every query). Statistics are kept in
fp32 whatever the input dtype.
"""

from __future__ import annotations

import math

import torch

__all__ = ["block_kind", "block_forward", "merge", "block_backward"]


def block_kind(q_chunk: int, k_chunk: int) -> str | None:
    """``"full"``, ``"causal"`` or ``None`` (fully masked: skipped) for global chunk indices."""
    if k_chunk < q_chunk:
        return "full"
    return "causal" if k_chunk == q_chunk else None


def _scores(q, k, causal: bool) -> torch.Tensor:
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        n = s.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _grouped(q, k, v, *rows):
    """Grouped-query attention without copying K/V: ``q [b, a, s, d]`` (and per-row tensors
    ``[b, a, s(, d)]``) viewed as ``[b, g, a/g, ...]``, ``k``/``v`` ``[b, g, s, d]`` as
    ``[b, g, 1, s, d]``; query head ``i`` uses key/value head ``i // (a/g)``."""
    g = k.shape[1]
    if q.shape[1] == g:
        return (q, k, v, *rows)
    return (q.unflatten(1, (g, -1)), k.unsqueeze(2), v.unsqueeze(2),
            *(t.unflatten(1, (g, -1)) for t in rows))


def block_forward(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, a, sq, d] fp32, lse [b, a, sq] fp32)`` of softmax(q k^T / sqrt(d)) v; ``k``,
    ``v`` may have fewer heads (grouped-query attention)."""
    q, k, v = _grouped(q, k, v)
    s = _scores(q, k, causal)
    lse = torch.logsumexp(s, -1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ v.float()
    if out.dim() == 5:
        out, lse = out.flatten(1, 2), lse.flatten(1, 2)
    return out, lse


def merge(out, lse, block_out, block_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmaxes over disjoint keys: the result is the softmax over both."""
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(block_lse - new) \
        .unsqueeze(-1)
    return out, new


def block_backward(q, k, v, dout, lse, delta, causal: bool):
    """``(dq, dk, dv)`` (fp32) of one block, from the merged ``lse`` and
    ``delta = rowsum(dout * out)`` of the merged output."""
    grouped = q.shape[1] != k.shape[1]
    q, k, v, dout, lse, delta = _grouped(q, k, v, dout, lse, delta)
    p = torch.exp(_scores(q, k, causal) - lse.unsqueeze(-1))      # [b, a, sq, sk]
    dv = p.transpose(-1, -2) @ dout
    dp = dout @ v.float().transpose(-1, -2)
    ds = p * (dp - delta.unsqueeze(-1)) / math.sqrt(q.shape[-1])
    dq, dk = ds @ k.float(), ds.transpose(-1, -2) @ q.float()
    if grouped:  # a key/value head's gradient sums over the query heads of its group
        return dq.flatten(1, 2), dk.sum(2), dv.sum(2)
    return dq, dk, dv
