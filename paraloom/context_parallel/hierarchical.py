"""Hierarchical context-parallel attention (Megatron/Transformer Engine's ``--cp-comm-type
a2a+p2p`` with ``--hierarchical-context-parallel-sizes A B``).

The ``cp = A x B`` ranks of a sequence form two levels (:func:`paraloom.grid.hierarchical_cp_rank_
groups`): groups of ``A`` consecutive cp ranks (``cp_a2a``, meant for the fast links inside a node)
and the ranks ``A`` apart (``cp_p2p``, across nodes). Attention runs in three moves:

1. Ulysses inside the group (:mod:`.ulysses`): Q, K and V all-to-all'd from sequence to head
   shards (kind ``cp``); a rank then holds ``1/A`` of its tp rank's heads over the ``2A`` chunks
   of its group. With Megatron's load-balanced split those chunks are, in position order, two
   contiguous pieces: chunks ``gA .. gA+A-1`` and their mirror ``2cp-gA-A .. 2cp-1-gA`` (``g``:
   the group's index), which are exactly the two chunks that rank ``g`` of a load-balanced split
   into ``2B`` chunks holds. Put in that order,
2. the ring (:mod:`.ring`) runs over the ``B`` groups as it would at ``cp = B`` (kind ``cp``, its
   ``B - 1`` K/V exchanges forward, ``2B - 1`` backward), on the group's head share;
3. the output is put back in arrival order and all-to-all'd back to sequence shards.

Backward mirrors it: the output's gradient to head shards, the ring's backward, dQ, dK and dV back
to sequence shards. Each all-to-all moves a rank's whole tensor, as in Ulysses; each ring step
moves ``A`` times the K/V chunk of a plain ring over ``cp`` with ``1/A`` of the heads, the same
bytes. It needs the heads of a tp rank divisible by ``A``.
"""

from __future__ import annotations

import torch

from ..mesh import Axis
from .ring import ring_attention
from .split import position_ids
from .ulysses import _OutToSequence, _QKVToHeads

__all__ = ["hierarchical_attention"]


def _group_order(inner: Axis, outer: Axis, length: int, device) -> torch.Tensor:
    """The permutation putting the ``length`` positions that arrive from the group (each inner
    rank's two chunks, in inner-rank order) in position order."""
    cp = inner.size * outer.size
    first = outer.rank * inner.size  # the group's first cp rank
    arrived = torch.cat([position_ids(length * outer.size, first + j, cp, device)
                         for j in range(inner.size)])
    return torch.argsort(arrived)


def hierarchical_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inner: Axis,
                           outer: Axis, *, module: str | None = None) -> torch.Tensor:
    """Causal attention of this cp rank's positions: ``q [b, a, s/cp, d]``, ``k, v
    [b, g, s/cp, d]`` (``a`` and ``g`` divisible by ``inner.size``) -> ``[b, a, s/cp, d]``;
    all-to-all over ``inner`` (level 0), the ring over ``outer`` (level 1)."""
    a2a = inner.size
    if q.shape[1] % a2a or k.shape[1] % a2a:
        raise ValueError(f"cp_comm_type a2a+p2p: the heads of a rank ({q.shape[1]} query, "
                         f"{k.shape[1]} key/value) must be divisible by the inner hierarchical "
                         f"cp size {a2a}")
    qh, kh, vh = _QKVToHeads.apply(q, k, v, inner, module)       # [b, heads/A, A s/cp, d]
    order = _group_order(inner, outer, qh.shape[2], q.device)
    out = ring_attention(*(t.index_select(2, order) for t in (qh, kh, vh)), outer, module=module)
    return _OutToSequence.apply(out.index_select(2, torch.argsort(order)), inner, module)
