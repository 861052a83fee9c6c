"""Context parallelism in the analytical model: the cp messages of one step, and what cp changes
in the others (hooked into :mod:`paraloom.analysis.formulas` with a few lines).

Per layer and microbatch, one rank's K and V of its two chunks are ``kv = 2 b (s/cp) (h/t)``
elements (``[2, b, a/t, s/cp, d]``) in the activation dtype:

* ``p2p`` (ring): forward ``cp - 1`` sends and receives of ``kv``; backward ``cp - 1`` again
  (K/V travel around once more) plus ``cp`` of the dK/dV accumulator (same size and dtype): ``2cp
  - 1`` sends and receives.
* ``all_gather``: forward one all-gather of ``kv`` (the local shard); backward one reduce-scatter
  of the gathered gradient, ``cp * kv``.
* ``a2a`` (Ulysses): forward four all-to-alls, Q (``b (s/cp) (a d/t)`` elements), K and V
  (``b (s/cp) (g d/t)`` each) to head shards and the output (Q's size) back; backward the same
  four sizes (the output's gradient, then dQ, dK, dV). Each moves its whole tensor.
* ``a2a+p2p`` (hierarchical, levels ``A x B``): Ulysses' four all-to-alls each way inside the
  ``A`` ranks (the same bytes as ``a2a``: a rank's whole tensor), and between them the ring over
  the ``B`` groups: ``B - 1`` exchanges forward, ``2B - 1`` backward, each of ``kv`` bytes (``A``
  chunks of ``1/A`` of the heads).

Recomputation (selective: the attention core; full: the layer, whose re-run includes the core)
repeats the forward messages, keyed with phase ``recompute``. Elsewhere cp shortens every
activation to ``s/cp`` tokens (tp/sp collectives, pipeline p2p, the cross-entropy's all-reduces)
and reduces gradients over ``dp x cp`` ranks (Megatron's data-parallel group with context
parallel): the bucket reductions are those of a ``dp * cp`` data-parallel layout.
"""

from __future__ import annotations

from dataclasses import replace

__all__ = ["local_seq", "grad_sync_view", "add_cp_comm", "cp_kv_bytes", "cp_q_bytes", "ring_size",
           "cp_activation_factor"]


def local_seq(c) -> int:
    """Tokens of a sequence held by one cp rank: ``s / cp``."""
    return c.seq_len // c.cp


def grad_sync_view(c):
    """The layout whose data-parallel gradient reduction equals ``c``'s over ``dp x cp``."""
    return replace(c, dp=c.dp * c.cp, cp=1) if c.cp > 1 else c


def cp_kv_bytes(c) -> int:
    """Bytes of one rank's K and V for one layer and microbatch: ``2 b (s/cp) (g d/t)`` elements
    (``g`` key/value heads of size ``d = h/a``; ``g = a`` without grouped-query attention)."""
    groups = getattr(c, "arch", None) and c.arch.num_query_groups or c.heads
    return 2 * c.micro_batch * local_seq(c) * (groups * (c.hidden // c.heads) // c.tp) \
        * c.dtype_bytes


def add_cp_comm(c, layer_passes: int, add) -> None:
    """Add the cp messages of ``layer_passes`` (microbatches x layers of this rank) to a
    :func:`~paraloom.analysis.formulas.expected_comm` tally."""
    if c.cp == 1:
        return
    kv, cp, n = cp_kv_bytes(c), c.cp, layer_passes
    phases = ["forward"] + (["recompute"] if c.recompute != "none" else [])
    if c.cp_comm_type in ("p2p", "a2a+p2p"):
        ring = ring_size(c)
        for op in ("send", "recv"):
            for phase in phases:
                add("cp", op, phase, (ring - 1) * n, kv)
            add("cp", op, "backward", (2 * ring - 1) * n, kv)
    if c.cp_comm_type in ("a2a", "a2a+p2p"):
        q = cp_q_bytes(c)  # Q and the output; K and V are kv / 2 each
        for phase in [*phases, "backward"]:
            add("cp", "all_to_all", phase, 2 * n, q)
            add("cp", "all_to_all", phase, 2 * n, kv // 2)
    if c.cp_comm_type == "all_gather":
        for phase in phases:
            add("cp", "all_gather", phase, n, kv)
        add("cp", "reduce_scatter", "backward", n, cp * kv)


def ring_size(c) -> int:
    """Ranks of the K/V ring: cp for ``p2p``, the outer level ``cp / A`` for ``a2a+p2p``."""
    return c.cp // c.cp_a2a if c.cp_comm_type == "a2a+p2p" else c.cp


def cp_q_bytes(c) -> int:
    """Bytes of one rank's queries (or attention output) for one layer and microbatch:
    ``b (s/cp) (a d / t)`` elements."""
    return c.micro_batch * local_seq(c) * (c.hidden // c.tp) * c.dtype_bytes


def cp_activation_factor(cp: int) -> float:
    """Activation memory per rank relative to cp = 1: every saved activation holds ``s/cp``
    tokens (attention's scores too: ``s/cp`` queries against one ``s/(2cp)`` key chunk at a
    time in the ring, so its share falls at least as fast)."""
    return 1.0 / cp
