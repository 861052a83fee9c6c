"""Context parallelism's rows of ``paraloom plan --table`` (:mod:`.order`): what the core
attention of one layer exchanges over cp, forward or backward, as the runtime issues it."""

from __future__ import annotations

__all__ = ["cp_rows"]

_TO_HEADS, _TO_SEQ = "heads to the cp rank of their group", "positions back to their cp rank"


def _a2a(r, size: int, names) -> list[dict]:
    """Ulysses' all-to-alls over ``size`` ranks, ``[size, b, heads/size, s/cp, d]`` each."""
    q, g = (n // size for n in r.heads)
    return [dict(op="all_to_all", site=f"ulysses_attention:{name}",
                 split=_TO_SEQ if name in ("out", "dq", "dk", "dv") else _TO_HEADS,
                 shape=[size, r.b, g if name in ("k", "v", "dk", "dv") else q, r.local,
                        r.kv[4]])
            for name in names]


def _ring(ring: int, kv: list, backward: bool) -> list[dict]:
    """The ring over ``ring`` ranks: ``ring - 1`` K/V exchanges (backward: K/V and their
    gradients each step, then the gradients home)."""
    steps = [["kv", "dkv"]] * (ring - 1) + [["dkv"]] if backward else [["kv"]] * (ring - 1)
    return [dict(op=op, site=f"ring_attention:{name}", shape=kv)
            for names in steps for name in names for op in ("send", "recv")]


def cp_rows(comm_type: str, r, *, backward: bool) -> list[dict]:
    """The events (op, site, split, shape) of one layer's core attention on rank ``r`` (an
    :mod:`.order` rank: ``cp``, ``b``, ``s``, ``local`` tokens, ``kv`` shape, ``heads``): the
    ring's ``cp - 1`` K/V exchanges, one all-gather (backward: one reduce-scatter of the
    gradients), Ulysses' four all-to-alls each way (Q, K, V to head shards, the output back;
    backward the output's gradient, then dQ, dK, dV), or with ``a2a+p2p`` Ulysses inside the
    inner level around the ring over the outer one (K/V of the group's ``2A`` chunks, ``1/A`` of
    the heads)."""
    ahead, after = (("dout",), ("dq", "dk", "dv")) if backward else (("q", "k", "v"), ("out",))
    if comm_type == "a2a":
        return _a2a(r, r.cp, ahead + after)
    if comm_type == "a2a+p2p":
        inner = r.cfg.parallel.cp_sizes[0]
        kv = [2, r.b, r.kv[2] // inner, inner * r.local, r.kv[4]]
        return _a2a(r, inner, ahead) + _ring(r.cp // inner, kv, backward) + _a2a(r, inner, after)
    if comm_type == "all_gather":
        full = r.kv[:3] + [r.s] + r.kv[4:]
        return [dict(op="reduce_scatter" if backward else "all_gather",
                     site=f"all_gather_attention:{'dkv' if backward else 'kv'}",
                     shape=full if backward else r.kv)]
    return _ring(r.cp, r.kv, backward)
