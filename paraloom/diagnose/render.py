"""The text form of a diagnosis: verdict, culprits, the explanation, and the divergent
collective side by side over the group's ranks (with each rank's events just before it)."""

from __future__ import annotations

import textwrap

from .evidence import Evidence
from .match import describe
from .verdict import Diagnosis

__all__ = ["render"]

_COLUMNS = ("rank", "state", "#", "op", "dtype", "shape", "site", "phase", "module")


def _cells(rank: str, row: dict) -> list[str]:
    number = row.get("gseq", row.get("pseq"))
    return [rank, row["state"], "" if number is None else str(number), row.get("op") or "-",
            row.get("dtype") or "", "" if row.get("shape") is None else str(row["shape"]),
            row.get("site") or "", row.get("phase") or "", row.get("module") or ""]


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]


def render(d: Diagnosis, evidence: Evidence | None = None, before: int = 2) -> str:
    """The diagnosis as text (``before``: how many earlier events of the group to show)."""
    culprits = ", ".join(map(str, d.culprits)) or "none"
    head = f"verdict: {d.verdict}\nculprits: {culprits}" + \
        ("" if d.decided else " (undecided: candidates)")
    lines = [head, "", *textwrap.wrap(d.explanation, 100)]
    div = d.divergence
    if div is not None:
        g = div["group"]
        lines += ["", f"divergence: group {g['ranks']} ({g['kind'] or 'group'}), position "
                      f"{div['position']}"]
        rows = [list(_COLUMNS)]
        for rank, row in div["ranks"].items():
            if evidence is not None and "gseq" in row:
                rows += _earlier(evidence, int(rank), g, row["gseq"], before)
            rows.append(_cells(rank, row))
        lines += _table(rows)
    for note in d.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _earlier(evidence: Evidence, rank: int, g: dict, n: int, before: int) -> list[list[str]]:
    ev = evidence.ranks.get(rank)
    if ev is None:
        return []
    seq = [e for e in ev.events if tuple(e.get("group") or ()) == tuple(g["ranks"])
           and (e.get("pg") or "") == g["pg"] and "gseq" in e and n - before <= e["gseq"] < n]
    return [_cells(str(rank), {"state": "done" if not e.get("pending") else "waiting", **e})
            for e in seq]


def summary(d: Diagnosis) -> str:
    """One line: ``hang: rank 3 (all_reduce float32 [4] ...)``."""
    if d.divergence is None:
        return f"{d.verdict}: {', '.join(map(str, d.culprits)) or 'no culprit'}"
    rows = d.divergence["ranks"]
    culprit = rows.get(str(d.culprits[0])) if d.culprits else None
    return f"{d.verdict}: culprit {', '.join(map(str, d.culprits))}" + \
        (f" ({describe(culprit) if culprit and culprit.get('op') else 'absent'})"
         if culprit else "")
