"""``paraloom diff A B``: do two runs communicate identically, rank by rank?

    paraloom diff RUN_A RUN_B [--ignore-names] [--rank R] [--fields phase,op,bytes] [--kinds exact]

A and B are run or record folders (``ledger.jsonl``, or a recorder's partial
``ledger/rank_R.jsonl``) or ledger files (:func:`paraloom.run_folder.load_events`). Each rank's
*communication sequence* is its events in launch order (``seq``) without the compute spans;
two sequences are equal when every position agrees on the compared fields: phase, kind, op,
async, bytes, shape, peer — and site and module unless ``--ignore-names`` (two implementations
never share file names, so comparing Megatron-Core with paraloom needs it). The first divergence
of each rank is printed with a side-by-side table around it. Exit codes: 0 equal, 1 different,
2 bad input (the message names the value).

How ``kind`` is compared (``--kinds``):

* ``dimension`` (default): the parallel *dimension* is compared. ``sp`` counts as ``tp``:
  sequence parallelism runs on the tensor-parallel group (paraloom's layers label those calls
  ``sp``; a recorded Megatron-Core run, whose ``parallel_state`` has no sequence-parallel group,
  labels them ``tp``), so a Megatron and a paraloom block compare equal exactly when they move
  the same bytes in the same order on that group. A kind that names no dimension (a recorder's
  ``group[0,1]`` for a group nobody named) matches any kind: nothing is known to disagree. Every
  other pair (``tp`` vs ``dp``, ``pp`` vs ``cp``) must be equal.
* ``exact``: the strings must be equal (``sp`` differs from ``tp``).
"""

from __future__ import annotations

__all__ = ["DEFAULT_FIELDS", "NAME_FIELDS", "DIMENSIONS", "VALID_FIELDS", "DiffError",
           "sequences", "compare", "report", "fields_to_compare"]

DEFAULT_FIELDS = ("phase", "kind", "op", "async", "bytes", "shape", "peer")
"""Fields every position must agree on (``--fields`` replaces them)."""
NAME_FIELDS = ("site", "module")
"""Where the call came from; compared unless ``--ignore-names``."""
DIMENSIONS = {"tp": "tp", "sp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "ep": "ep",
              "emb": "emb", "loss": "loss"}
"""Known kinds and the parallel dimension (process group) each one runs on."""
VALID_FIELDS = ("rank", "step", "microbatch", "phase", "kind", "op", "site", "module", "split",
                 "async", "bytes", "shape", "dtype", "group", "peer")


class DiffError(ValueError):
    """Bad input to ``paraloom diff`` (exit code 2)."""




def sequences(events: list[dict]) -> dict[int, list[dict]]:
    """Each rank's communication events (no ``compute`` spans), in launch order."""
    out: dict[int, list[dict]] = {}
    for e in events:
        if e["op"] != "compute":
            out.setdefault(e["rank"], []).append(e)
    for seq in out.values():
        seq.sort(key=lambda e: e.get("seq", 0))
    return dict(sorted(out.items()))


def _same(field: str, a, b, kinds: str) -> bool:
    if field == "kind" and kinds == "dimension":
        da, db = DIMENSIONS.get(a), DIMENSIONS.get(b)
        return da is None or db is None or da == db
    return a == b


def compare(a: dict[int, list[dict]], b: dict[int, list[dict]], fields, *,
            kinds: str = "dimension") -> dict[int, dict | None]:
    """Per rank: ``None`` when equal, else the first divergence ``{"index", "fields", "why"}``
    (``index`` counts communications from 0; ``fields`` the disagreeing ones)."""
    out: dict[int, dict | None] = {}
    for rank in sorted(set(a) | set(b)):
        sa, sb = a.get(rank, []), b.get(rank, [])
        out[rank] = None
        for i, (ea, eb) in enumerate(zip(sa, sb, strict=False)):
            bad = [f for f in fields if not _same(f, ea.get(f), eb.get(f), kinds)]
            if bad:
                why = "; ".join(f"{f}: {_cell(ea.get(f))} vs {_cell(eb.get(f))}" for f in bad)
                out[rank] = {"index": i, "fields": bad, "why": why}
                break
        else:
            if len(sa) != len(sb):
                longer, n = ("A", len(sa)) if len(sa) > len(sb) else ("B", len(sb))
                out[rank] = {"index": min(len(sa), len(sb)), "fields": [],
                             "why": f"{longer} has {n - min(len(sa), len(sb))} more "
                                    f"communication(s) ({len(sa)} vs {len(sb)})"}
    return out


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "async" if value else "sync"
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


def _row(e: dict | None, fields) -> list[str]:
    return [_cell(e.get(f)) if e is not None else "" for f in fields]


def report(a: dict, b: dict, result: dict, fields, *, names=("A", "B"), context: int = 3,
           kinds: str = "dimension") -> str:
    """Plain text: per rank "equal (N communications)" or the first divergence and a
    side-by-side table of the positions around it (``context`` before and after; ``!`` marks
    disagreeing positions)."""
    out = []
    for rank, div in result.items():
        sa, sb = a.get(rank, []), b.get(rank, [])
        if div is None:
            out.append(f"rank {rank}: equal ({len(sa)} communications)")
            continue
        i = div["index"]
        out.append(f"rank {rank}: first divergence at communication #{i}: {div['why']}")
        lo, hi = max(0, i - context), min(max(len(sa), len(sb)), i + context + 1)
        window = sa[lo:hi] + sb[lo:hi]  # columns empty on both sides (e.g. peer) are left out
        shown = [f for f in fields if f in div["fields"]
                 or any(e.get(f) is not None for e in window)]
        head = ["#", *(f"{names[0]} {f}" for f in shown), *(f"{names[1]} {f}" for f in shown)]
        rows = [head]
        for k in range(lo, hi):
            ea = sa[k] if k < len(sa) else None
            eb = sb[k] if k < len(sb) else None
            mark = "!" if k >= i and (ea is None or eb is None or any(
                not _same(f, ea.get(f), eb.get(f), kinds) for f in shown)) else " "
            rows.append([f"{mark}{k}", *_row(ea, shown), *_row(eb, shown)])
        widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
        split = 1 + len(shown)
        for r in rows:
            left = "  ".join(c.ljust(w) for c, w in zip(r[:split], widths[:split], strict=True))
            right = "  ".join(c.ljust(w) for c, w in zip(r[split:], widths[split:], strict=True))
            out.append(f"  {left} | {right}".rstrip())
    return "\n".join(out) + "\n"


def fields_to_compare(text: str | None, ignore_names: bool) -> tuple[str, ...]:
    """The fields ``--fields`` names (default: :data:`DEFAULT_FIELDS`, and the names unless
    ``ignore_names``); :class:`DiffError` for an unknown one."""
    if text is None:
        return DEFAULT_FIELDS + (() if ignore_names else NAME_FIELDS)
    fields = tuple(f.strip() for f in text.replace(" ", ",").split(",") if f.strip())
    bad = [f for f in fields if f not in VALID_FIELDS]
    if bad or not fields:
        raise DiffError(f"--fields {text!r}: unknown field(s) {bad or '(none given)'}; valid: "
                        f"{', '.join(VALID_FIELDS)}")
    if ignore_names:
        fields = tuple(f for f in fields if f not in NAME_FIELDS)
    return fields
