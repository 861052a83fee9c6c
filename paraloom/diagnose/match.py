"""Match the ranks' communication: per process group, the members' sequences side by side.

A collective is identified across ranks by its group and its position in that group's sequence
(``gseq``), a message by its sender, receiver and position among their messages (``pseq``) --
never by time or guesswork. What must agree at one position is the collective's *signature*: op,
dtype, shape, root; the split sizes of an all-to-all must fit together (rank ``i`` sends
``input_splits[j]`` rows to rank ``j``, which expects ``output_splits[i]``), and an uneven
all-gather or reduce-scatter (Megatron's dispatcher over tp) needs the same splits everywhere,
each rank its own rows. Phase and module
(what a record knows) are *soft*: they tell which collective a rank meant, e.g. FSDP all-gathers
of two layers with the same sizes, but are not a mismatch on their own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from difflib import SequenceMatcher

__all__ = ["Group", "groups", "signature", "describe", "Mismatch", "first_mismatch",
           "align", "pairs"]

P2P = ("send", "recv")


@dataclass
class Group:
    """One process group: ``key`` = (pg name, ranks), ``kind``, and each member's collectives
    in ``gseq`` order (``seqs[rank]``)."""

    key: tuple
    kind: str
    seqs: dict[int, list[dict]]

    @property
    def ranks(self) -> list[int]:
        return list(self.key[1])

    def at(self, n: int) -> dict[int, dict]:
        return {r: s[n] for r, s in self.seqs.items() if n < len(s)}


def groups(ranks: dict) -> list[Group]:
    """Every group of two or more ranks in ``ranks`` (``{rank: RankEvidence}``), members that
    never used it included (with an empty sequence)."""
    found: dict[tuple, Group] = {}
    for rank, ev in ranks.items():
        for e in ev.events:
            members = tuple(e.get("group") or ())
            if e["op"] in P2P or "gseq" not in e or len(members) < 2:
                continue
            key = (e.get("pg") or "", members)
            g = found.get(key)
            if g is None:
                g = found[key] = Group(key, e.get("kind") or "", {r: [] for r in members})
            g.seqs.setdefault(rank, []).append(e)
    for g in found.values():
        for seq in g.seqs.values():
            seq.sort(key=lambda e: e["gseq"])
    return sorted(found.values(), key=lambda g: g.key)


def signature(e: dict) -> tuple:
    """What every member must agree on at one position (split sizes: see :func:`splits_fit`)."""
    shape = e.get("shape")
    uneven = e.get("output_splits") or e.get("input_splits")
    if e["op"] == "all_to_all" and shape:
        shape = shape[1:]  # rows may differ by rank; the row shape may not
    elif e["op"] in ("all_gather", "reduce_scatter") and shape and uneven:
        shape = [tuple(uneven), *shape[1:]]  # an uneven gather: each rank its rows, same splits
    return (e["op"], e.get("dtype"), tuple(shape) if shape is not None else e.get("bytes"),
            e.get("root", e.get("src")))


def soft(e: dict) -> tuple:
    return e.get("phase"), e.get("module")


def describe(e: dict | None) -> str:
    """``all_reduce float32 [100]`` (what a person compares)."""
    if e is None:
        return "nothing"
    shape = e.get("shape")
    text = f"{e['op']} {e.get('dtype') or ''} {list(shape) if shape is not None else ''}"
    text = " ".join(text.split())
    if e.get("root", e.get("src")) is not None:
        text += f" root {e.get('root', e.get('src'))}"
    if e["op"] == "all_to_all" and e.get("input_splits"):
        text += f" splits {e['input_splits']}/{e.get('output_splits')}"
    return text.strip()


def splits_fit(events: dict[int, dict], members: list[int]) -> list[int]:
    """Ranks whose all-to-all split sizes disagree with a peer's (empty: they fit)."""
    bad: Counter = Counter()
    for i, ei in events.items():
        for j, ej in events.items():
            si, sj = ei.get("input_splits"), ej.get("output_splits")
            if si and sj and i in members and j in members:
                if si[members.index(j)] != sj[members.index(i)]:
                    bad[i] += 1
                    bad[j] += 1
    top = max(bad.values(), default=0)
    return sorted(r for r, v in bad.items() if v == top)


@dataclass
class Mismatch:
    """Members of ``group`` launched different collectives at position ``n``: ``majority``
    (the ranks that agree, when most do) and ``culprits`` (the others, or every candidate)."""

    group: Group
    n: int
    culprits: list[int]
    majority: list[int]
    decided: bool
    soft: bool = False


def _split(events: dict[int, dict], key) -> tuple[list[int], list[int], bool]:
    counts = Counter(key(e) for e in events.values())
    if len(counts) < 2:
        return [], [], True
    (top, a), *rest = counts.most_common()
    decided = not rest or rest[0][1] < a
    if not decided:
        return sorted(events), [], False
    majority = sorted(r for r, e in events.items() if key(e) == top)
    return sorted(r for r in events if r not in majority), majority, True


def first_mismatch(gs: list[Group], *, use_soft: bool = False) -> Mismatch | None:
    """The earliest position (by launch time) where a group's members disagree."""
    found = []
    for g in gs:
        length = max((len(s) for s in g.seqs.values()), default=0)
        for n in range(length):
            events = g.at(n)
            if len(events) < 2:
                break
            culprits, majority, decided = _split(events, signature)
            if not culprits and events and next(iter(events.values()))["op"] == "all_to_all":
                bad = splits_fit(events, g.ranks)
                culprits, majority = bad, sorted(r for r in events if r not in bad)
                decided = len(bad) == 1
            is_soft = False
            if not culprits and use_soft:
                culprits, majority, decided = _split(events, soft)
                is_soft = bool(culprits)
            if culprits:
                t = min(e.get("t_start") or 0 for e in events.values())
                found.append((t, Mismatch(g, n, culprits, majority, decided, is_soft)))
                break
    return min(found, key=lambda x: x[0])[1] if found else None


def _token(e: dict) -> tuple:
    return signature(e) + soft(e) + ((e.get("site") or "").split(" ")[0],)


def align(reference: list[dict], other: list[dict]) -> tuple[str, int, int] | None:
    """Where ``other`` first departs from ``reference``: ``(how, i, j)`` with ``how`` one of
    ``skipped`` (``other`` lacks ``reference[i]``), ``extra`` (``other[j]`` is not in
    ``reference``), ``another`` (``other[j]`` stands where ``reference[i]`` does), or ``None``
    when one is a prefix of the other."""
    a, b = [_token(e) for e in reference], [_token(e) for e in other]
    for tag, i1, i2, j1, j2 in SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if tag == "delete":
            return ("skipped", i1, j1) if j1 < len(b) or i2 < len(a) else None
        if tag == "insert":
            return ("extra", i1, j1) if i1 < len(a) or j2 < len(b) else None
        return "another", i1, j1
    return None


def pairs(ranks: dict) -> dict[tuple, dict[str, list[dict]]]:
    """Point-to-point messages per (pg, sender, receiver): ``{"send": [...], "recv": [...]}``
    in ``pseq`` order (receives from any source are left out: no pair to match)."""
    found: dict[tuple, dict[str, list[dict]]] = {}
    for rank, ev in ranks.items():
        for e in ev.events:
            if e["op"] not in P2P or e.get("peer") in (None, -1) or "pseq" not in e:
                continue
            pair = (e.get("pg") or "", rank, e["peer"]) if e["op"] == "send" \
                else (e.get("pg") or "", e["peer"], rank)
            found.setdefault(pair, {"send": [], "recv": []})[e["op"]].append(e)
    for sides in found.values():
        for side in sides.values():
            side.sort(key=lambda e: e["pseq"])
    return found
