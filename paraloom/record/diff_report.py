"""``paraloom diff``'s text: per rank the counts, then every divergence side by side.

(:mod:`.diff` chooses, aligns and compares; this module only renders its result.)
"""

from __future__ import annotations

from .diff import Options, field_value, named_groups

__all__ = ["report"]


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "async" if value else "sync"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(str, value)) + "]"
    text = str(value)
    return text if len(text) <= 48 else "…" + text[-47:]


def _shown(field: str, event: dict) -> str:
    """A cell as compared: a re-run's forward communication reads ``backward (re-run)``."""
    if field == "phase" and event.get("recompute"):
        return "backward (re-run)"
    return _cell(event.get(field))


def _table(rows: list[list[str]], split: int) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = []
    for r in rows:
        left = "  ".join(c.ljust(w) for c, w in zip(r[:split], widths[:split], strict=True))
        right = "  ".join(c.ljust(w) for c, w in zip(r[split:], widths[split:], strict=True))
        lines.append(f"    {left} | {right}".rstrip())
    return lines


def _hunk_rows(sa, sb, hunk, fields, options, named, context) -> tuple[list, list[str]]:
    """The rows of one hunk (with ``context`` equal events before it: the caller keeps it within
    the equal stretch since the previous hunk) and the fields shown: those that disagree, plus
    op, shape, kind and phase for orientation."""
    tag, i1, i2, j1, j2 = hunk
    pairs = []  # (mark, index A or None, index B or None)
    for k in range(context, 0, -1):
        if i1 - k >= 0 and j1 - k >= 0:
            pairs.append((" ", i1 - k, j1 - k))
    n = max(i2 - i1, j2 - j1)
    for k in range(n):
        ia = i1 + k if i1 + k < i2 else None
        ib = j1 + k if j1 + k < j2 else None
        pairs.append(("!", ia, ib))
    differing = set()
    for _, ia, ib in pairs:
        if ia is not None and ib is not None:
            for f in fields:
                if field_value(f, sa[ia], options, named) != field_value(f, sb[ib], options, named):
                    differing.add(f)
    shown = [f for f in fields if f in differing or f in ("op", "shape", "kind", "phase")]
    return pairs, shown


def report(a: dict, b: dict, result: dict, options: Options | None = None, *,
           names=("A", "B"), context: int = 1) -> str:
    """Plain text: per rank the counts, then every hunk of the alignment as a side-by-side
    table (``!`` marks the divergent rows; ``context`` equal rows before each hunk)."""
    options = options or Options()
    named = named_groups(a, b)
    out = []
    for rank, r in result.items():
        end_a = 0  # where the previous hunk ended in A: context rows stay after it
        sa, sb = a.get(rank, []), b.get(rank, [])
        counts = (f"{r['equal']} equal, {r['changed']} changed, {r['only_a']} only in "
                  f"{names[0]}, {r['only_b']} only in {names[1]}")
        if not r["hunks"]:
            out.append(f"rank {rank}: equal ({len(sa)} communications)")
            continue
        out.append(f"rank {rank}: different ({len(sa)} vs {len(sb)} communications: "
                   f"{counts})")
        for hunk in r["hunks"]:
            tag, i1, i2, j1, j2 = hunk
            what = {"replace": "changed", "delete": f"only in {names[0]}",
                    "insert": f"only in {names[1]}"}[tag]
            where = f"{names[0]} #{i1}" + (f"-{i2 - 1}" if i2 - i1 > 1 else "") \
                if i2 > i1 else f"{names[0]} after #{i1 - 1}"
            where += f", {names[1]} #{j1}" + (f"-{j2 - 1}" if j2 - j1 > 1 else "") \
                if j2 > j1 else f", {names[1]} after #{j1 - 1}"
            out.append(f"  {what}: {where}")
            pairs, shown = _hunk_rows(sa, sb, hunk, options.fields, options, named,
                                      min(context, i1 - end_a))
            end_a = i2
            head = ["#", *(f"{names[0]} {f}" for f in shown), "#",
                    *(f"{names[1]} {f}" for f in shown)]
            rows = [head]
            for mark, ia, ib in pairs:
                left = [f"{mark}{ia}" if ia is not None else "",
                        *[_shown(f, sa[ia]) if ia is not None else "" for f in shown]]
                right = [f"{ib}" if ib is not None else "",
                         *[_shown(f, sb[ib]) if ib is not None else "" for f in shown]]
                rows.append(left + right)
            out.extend(_table(rows, 1 + len(shown)))
    return "\n".join(out) + "\n"
