"""Context parallelism's rows of ``paraloom plan --table`` (:mod:`.order`): what the core
attention of one layer exchanges over cp, forward or backward, as the runtime issues it."""

from __future__ import annotations

__all__ = ["cp_rows"]


def cp_rows(comm_type: str, r, *, backward: bool) -> list[dict]:
    """The events (op, site, split, shape) of one layer's core attention on rank ``r`` (an
    :mod:`.order` rank: ``cp``, ``b``, ``s``, ``local`` tokens, ``kv`` shape, ``heads``): the
    ring's ``cp - 1`` K/V exchanges (backward: K/V and their gradients each step, then the
    gradients home), one all-gather (backward: one reduce-scatter of the gradients), or
    Ulysses' four all-to-alls each way (Q, K, V to head shards, the output back; backward the
    output's gradient, then dQ, dK, dV)."""
    if comm_type == "a2a":  # [cp, b, heads/cp, s/cp, d] each
        q, g = (n // r.cp for n in r.heads)
        names = (("dout", q), ("dq", q), ("dk", g), ("dv", g)) if backward else \
            (("q", q), ("k", g), ("v", g), ("out", q))
        return [dict(op="all_to_all", site=f"ulysses_attention:{name}",
                     split="positions back to their cp rank" if name in ("out", "dq", "dk", "dv")
                     else "heads to the cp rank of their group",
                     shape=[r.cp, r.b, heads, r.local, r.kv[4]]) for name, heads in names]
    if comm_type == "all_gather":
        full = r.kv[:3] + [r.s] + r.kv[4:]
        return [dict(op="reduce_scatter" if backward else "all_gather",
                     site=f"all_gather_attention:{'dkv' if backward else 'kv'}",
                     shape=full if backward else r.kv)]
    steps = [["kv", "dkv"]] * (r.cp - 1) + [["dkv"]] if backward else [["kv"]] * (r.cp - 1)
    return [dict(op=op, site=f"ring_attention:{name}", shape=r.kv)
            for names in steps for name in names for op in ("send", "recv")]
