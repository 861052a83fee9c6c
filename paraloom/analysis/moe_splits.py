"""The token dispatcher's row exchanges in ``paraloom check``: bytes from their split sizes.

The rows an expert-parallel exchange moves depend on the routing, so the analytical model
(:func:`~paraloom.analysis.moe_formulas.moe_comm`) counts these events and leaves their bytes
to the recorded split sizes: an all-to-all's or a reduce-scatter's input rows, an all-gather's
own share, each ``h x B`` bytes (a routing probability's row: 4 bytes, fp32).
:func:`check_all_to_all` then verifies what the per-key totals cannot see: the split sizes
agree between the peers of every exchange, and without drops the dispatch sends ``tokens x
topk`` rows.
"""

from __future__ import annotations

from collections import defaultdict

from .moe_formulas import local_tokens, split_tp

__all__ = ["split_bytes", "check_all_to_all"]


def _rows(e: dict) -> bool:
    """A dispatcher exchange of rows (not of counts): the bytes follow its split sizes."""
    return e["kind"] == "ep" and e.get("dtype") != "int64" and (
        e["op"] == "all_to_all" or "input_splits" in e or "output_splits" in e)


def _row_bytes(c, e: dict) -> int:
    return 4 if ":probs" in e["site"] else c.hidden * c.dtype_bytes  # fp32 probabilities


def _sent_rows(e: dict, rank: int) -> int:
    """Rows of this rank's input: an all-to-all's or reduce-scatter's whole input, an
    all-gather's own share."""
    if e["op"] == "all_gather":
        return e["output_splits"][e["group"].index(rank)]
    return sum(e["input_splits"])


def split_bytes(c, events: list[dict], rank: int, step: int | None) -> dict:
    """``{(kind, op, phase): {"count": 0, "bytes"}}``: the dispatcher's row exchanges' bytes as
    their recorded split sizes say, for this rank and step."""
    out: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
    for e in events:
        if _rows(e) and e["rank"] == rank and (step is None or e["step"] == step):
            phase = "recompute" if e.get("recompute") else e["phase"]
            out["ep", e["op"], phase]["bytes"] += _sent_rows(e, rank) * _row_bytes(c, e)
    return out


def check_all_to_all(c, events: list[dict], *, step: int | None = None) -> list[dict]:
    """Rows (the check's format) for what the per-key totals cannot see: for every rank, that
    each row exchange's split sizes match its peers' (``phase`` ``splits``: rank ``i``'s
    ``input_splits[j]`` is rank ``j``'s ``output_splits[i]`` in an all-to-all; every rank passes
    the same sizes to an all-gather or reduce-scatter), and without drops that the dispatch
    sends ``tokens x topk`` rows (``phase`` ``tokens x topk``)."""
    if c.moe is None or c.moe.ep * (c.tp if split_tp(c) else 1) == 1:
        return []
    chosen = [e for e in events if _rows(e) and (step is None or e["step"] == step)]
    key = lambda e: (e["step"], e["microbatch"], e["module"], e["site"], e["phase"],  # noqa
                     bool(e.get("recompute")))
    by_rank = {(e["rank"], key(e)): e for e in chosen}
    rows = []
    row_bytes = c.hidden * c.dtype_bytes
    per_mb = local_tokens(c) // (c.tp if split_tp(c) else 1) * c.moe.topk
    for rank in sorted({e["rank"] for e in chosen}):
        mine = [e for e in chosen if e["rank"] == rank]
        good = sum(_agrees(e, rank, [by_rank.get((r, key(e))) for r in e["group"]])
                   for e in mine)
        rows.append(_row(rank, "splits", len(mine), good, 0, 0))
        if not c.moe.capacity or c.moe.padded_rows:
            sent = [e for e in mine if e["phase"] == "forward" and e["op"] == "all_to_all"
                    and e["site"].endswith(".token_permutation.forward:tokens")]
            rows_per_mb = c.moe.padded_rows or per_mb
            want = [rows_per_mb * row_bytes] * len(sent)
            rows.append(_row(rank, "E x capacity" if c.moe.padded_rows else "tokens x topk",
                             len(sent), len(sent), sum(want), sum(e["bytes"] for e in sent)))
    return rows


def _agrees(e: dict, rank: int, peers: list) -> bool:
    if any(p is None for p in peers):
        return False
    if e["op"] != "all_to_all":
        name = "output_splits" if e["op"] == "all_gather" else "input_splits"
        return all(p[name] == e[name] for p in peers)
    i = e["group"].index(rank)
    return all(p["output_splits"][i] == e["input_splits"][j] for j, p in enumerate(peers))


def _row(rank, phase, exp_n, rec_n, exp_b, rec_b) -> dict:
    return {"rank": rank, "kind": "ep", "op": "all_to_all", "phase": phase,
            "expected_count": exp_n, "recorded_count": rec_n, "expected_bytes": exp_b,
            "recorded_bytes": rec_b, "ok": exp_n == rec_n and exp_b == rec_b}
