"""Ring attention (Megatron/TransformerEngine's ``p2p`` context-parallel communication).

Each cp rank holds the queries, keys and values of its two sequence chunks (see :mod:`.split`).
Attention runs in ``cp`` steps: at step ``i`` rank ``r`` holds the K/V of rank ``r - i`` and
computes its queries against them while it already sends that K/V block on to rank ``r + 1`` and
receives the next one from rank ``r - 1`` (kind ``cp``, phase ``forward``, ``cp - 1`` exchanges).
Every (query chunk, key chunk) pair is full, causal (its own chunk) or fully masked and skipped;
with the load-balanced split each rank computes the same number of blocks. Partial outputs are
merged with their log-sum-exp.

Each step's blocks are a ledger compute span (``ring_attention.<phase>:blocks``): what the
exchange in flight overlaps. Backward goes around the ring again: K/V travel as in forward
(``cp - 1`` exchanges) and with them an accumulator of dK/dV for the block, to which each rank
adds its queries' contribution before passing it on (``cp`` exchanges; after the last, each rank
holds its own dK/dV).
"""

from __future__ import annotations

import torch

from .. import comm, ledger
from ..mesh import Axis
from .blocks import block_backward, block_forward, block_kind, merge
from .split import chunk_ids

__all__ = ["ring_attention"]


def _blocks(axis: Axis, step: int):
    """``(q_half, k_half, causal)`` of the blocks rank ``axis.rank`` computes at ``step``."""
    mine = chunk_ids(axis.rank, axis.size)
    theirs = chunk_ids((axis.rank - step) % axis.size, axis.size)
    for a in range(2):
        for c in range(2):
            kind = block_kind(mine[a], theirs[c])
            if kind is not None:
                yield a, c, kind == "causal"


def _exchange(tensor: torch.Tensor, axis: Axis, phase: str, site: str, module: str | None):
    """Send ``tensor`` to the next ring rank, receive the previous rank's (async handle)."""
    nxt = axis.ranks[(axis.rank + 1) % axis.size]
    prv = axis.ranks[(axis.rank - 1) % axis.size]
    recv = torch.empty_like(tensor)
    return comm.batch_p2p([("send", tensor, nxt), ("recv", recv, prv)], axis, phase=phase,
                          kind="cp", site=site, module=module, async_op=True)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, axis: Axis, module: str | None):
        cp = axis.size
        kv = torch.stack([k, v])                             # [2, b, a, s/cp, d]
        qs = q.chunk(2, 2)
        outs, lses = [None, None], [None, None]
        for step in range(cp):
            handle = _exchange(kv, axis, "forward", "ring_attention:kv", module) \
                if step < cp - 1 else None
            ks, vs = kv[0].chunk(2, 2), kv[1].chunk(2, 2)
            with ledger.span("ring_attention.forward:blocks", phase="forward", module=module):
                for a, c, causal in _blocks(axis, step):
                    o, lse = block_forward(qs[a], ks[c], vs[c], causal)
                    outs[a], lses[a] = merge(outs[a], lses[a], o, lse)
            if handle is not None:
                kv = handle.wait()[1]
        out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.axis, ctx.module = axis, module
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        axis, module, cp = ctx.axis, ctx.module, ctx.axis.size
        dout = dout.float()
        delta = (dout * out).sum(-1)                          # [b, a, s/cp]
        qs, douts, lses, deltas = (t.chunk(2, 2) for t in (q, dout, lse, delta))
        dq = torch.zeros_like(q, dtype=torch.float32)
        dqs = dq.chunk(2, 2)
        kv, pending = torch.stack([k, v]), None
        for step in range(cp):
            handle = _exchange(kv, axis, "backward", "ring_attention:kv", module) \
                if step < cp - 1 else None
            ks, vs = kv[0].chunk(2, 2), kv[1].chunk(2, 2)
            dkv = torch.zeros_like(kv, dtype=torch.float32)
            dks, dvs = dkv[0].chunk(2, 2), dkv[1].chunk(2, 2)
            with ledger.span("ring_attention.backward:blocks", phase="backward", module=module):
                for a, c, causal in _blocks(axis, step):
                    g = block_backward(qs[a], ks[c], vs[c], douts[a], lses[a], deltas[a],
                                       causal)
                    dqs[a].add_(g[0])
                    dks[c].add_(g[1])
                    dvs[c].add_(g[2])
            if pending is not None:  # the accumulator of this K/V block from the ranks before
                dkv += pending.wait()[1].float()
            pending = _exchange(dkv.to(k.dtype), axis, "backward", "ring_attention:dkv", module)
            if handle is not None:
                kv = handle.wait()[1]
        dkv = pending.wait()[1]                               # this rank's own dK/dV, complete
        return dq.to(q.dtype), dkv[0], dkv[1], None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: Axis, *,
                   module: str | None = None) -> torch.Tensor:
    """Causal attention of this cp rank's queries ``[b, a, s/cp, d]`` (its two chunks) over the
    whole sequence, K/V passed around the ring of ``axis``; returns ``[b, a, s/cp, d]``."""
    return _RingAttention.apply(q, k, v, axis, module)
