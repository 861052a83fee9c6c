"""Recorded ledger vs the analytical model: per ``(kind, op, phase)`` counts and bytes, exactly.

:func:`compare` tallies one rank's events the way :func:`~paraloom.analysis.formulas.expected_comm`
keys its numbers (compute spans and ``setup`` operations are not part of a step; an event with
``recompute: true`` is keyed with phase ``recompute``) and returns one diff row per key present
on either side. :func:`check_run` does it for every rank of a run, each against the expectation
of its own pipeline stage. :func:`render_diff` prints the rows as a Markdown table; ``paraloom
check RUN_DIR`` exits 0 only if every row agrees.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from .formulas import CommConfig, expected_comm

__all__ = ["tally", "compare", "check_run", "render_diff", "all_ok"]


def _phase(event: dict) -> str:
    return "recompute" if event.get("recompute") else event["phase"]


def tally(events: Iterable[dict], *, rank: int | None = None,
          step: int | None = None) -> dict[tuple[str, str, str], dict]:
    """``{(kind, op, phase): {"count", "bytes"}}`` of the communications in ``events`` (of
    ``rank`` and ``step`` when given)."""
    out: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
    for e in events:
        if e["op"] == "compute" or e["phase"] == "setup":
            continue
        if (rank is not None and e["rank"] != rank) or (step is not None and e["step"] != step):
            continue
        cell = out[e["kind"], e["op"], _phase(e)]
        cell["count"] += 1
        cell["bytes"] += e["bytes"]
    return dict(out)


def compare(expected: dict, events: Iterable[dict], *, rank: int = 0,
            step: int | None = None) -> list[dict]:
    """One row per key in the expectation or the record: expected and recorded count and bytes,
    and ``ok`` when both agree exactly. Rows are sorted by kind, phase, op."""
    recorded = tally(events, rank=rank, step=step)
    rows = []
    zero = {"count": 0, "bytes": 0}
    for key in sorted(set(expected) | set(recorded), key=lambda k: (k[0], k[2], k[1])):
        exp, rec = expected.get(key, zero), recorded.get(key, zero)
        rows.append({"rank": rank, "kind": key[0], "op": key[1], "phase": key[2],
                     "expected_count": exp["count"], "recorded_count": rec["count"],
                     "expected_bytes": exp["bytes"], "recorded_bytes": rec["bytes"],
                     "ok": exp["count"] == rec["count"] and exp["bytes"] == rec["bytes"]})
    return rows


def check_run(config: CommConfig, events: list[dict], *, step: int | None = None) -> list[dict]:
    """:func:`compare` for every rank in ``events``, each against its own pipeline stage
    (rank order tp fastest, then dp, then pp: ``pp_rank = rank // (tp * dp)``)."""
    rows = []
    for rank in sorted({e["rank"] for e in events}):
        pp_rank = rank // (config.tp * config.dp)
        rows += compare(expected_comm(config, pp_rank), events, rank=rank, step=step)
    return rows


def all_ok(rows: list[dict]) -> bool:
    """True when every row agrees (an empty comparison agrees)."""
    return all(r["ok"] for r in rows)


def render_diff(rows: list[dict], *, only_diff: bool = False) -> str:
    """Markdown diff table (``only_diff`` keeps the disagreeing rows) and a verdict line."""
    head = ("| rank | kind | op | phase | expected count | recorded count | expected bytes "
            "| recorded bytes | |")
    lines = [head, "|" + "---|" * 9]
    bad = [r for r in rows if not r["ok"]]
    for r in (bad if only_diff else rows):
        mark = "ok" if r["ok"] else "DIFF"
        lines.append(f"| {r['rank']} | {r['kind']} | {r['op']} | {r['phase']} | "
                     f"{r['expected_count']} | {r['recorded_count']} | {r['expected_bytes']} | "
                     f"{r['recorded_bytes']} | {mark} |")
    verdict = (f"all {len(rows)} rows agree" if not bad else
               f"{len(bad)} of {len(rows)} rows differ: " + "; ".join(
                   f"rank {r['rank']} {r['kind']} {r['op']} {r['phase']}: expected "
                   f"{r['expected_count']} ops / {r['expected_bytes']} B, recorded "
                   f"{r['recorded_count']} / {r['recorded_bytes']} B" for r in bad[:5]))
    return "\n".join(lines) + "\n\n" + verdict + "\n"
