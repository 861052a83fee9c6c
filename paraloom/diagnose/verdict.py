"""The diagnosis: verdict, culprits, the divergence, and one paragraph saying what happened.

The culprit is the rank whose *program* diverged, not the rank where an error surfaced (gloo
raises a size mismatch on whichever rank reads the bad message first). In order:

1. ``mismatch`` -- at the earliest position where the members of a group launched different
   collectives (op, dtype, shape, root, all-to-all splits) the minority is the culprit; a tie
   names every candidate. Aligning the culprit's sequence with a majority member's says whether
   it ran an extra collective, skipped one, or ran another one there.
2. ``hang`` -- members of a group wait in a collective that some member never launched: that
   member is the culprit (it finished, moved on, raised, or waits in another group; when ranks
   wait in different groups, the fewer are the culprits: they entered the groups in another
   order); for point-to-point, the rank in every pair whose sends and receives do not match.
   Where the culprit's sequence departs from the others' (module and site included) is the
   divergent line.
3. ``failed`` -- a rank raised or died first and no disagreement explains it: that rank.
4. ``ok`` -- every group's sequences agree and everything launched completed.
"""

from __future__ import annotations

from collections import Counter

from . import match
from .diagnosis import PEER_GONE_WORDS, Diagnosis
from .diagnosis import ended as _ended
from .diagnosis import failed as _failed
from .diagnosis import row as _row
from .diagnosis import secondary as _secondary
from .diagnosis import who as _who
from .evidence import Evidence, RankEvidence
from .source import condition_of

__all__ = ["Diagnosis", "diagnose", "PEER_GONE_WORDS"]

def _divergence(evidence: Evidence, g: match.Group, n: int, picks: dict | None = None) -> dict:
    picks = picks or {}
    per_rank = {}
    for r in g.ranks:
        seq = g.seqs.get(r, [])
        e = picks.get(r, seq[n] if n < len(seq) else None)
        per_rank[str(r)] = _row(evidence.ranks.get(r, RankEvidence(r)), e,
                                evidence.completion_known)
    return {"group": {"ranks": g.ranks, "kind": g.kind, "pg": g.key[0]}, "position": n,
            "ranks": per_rank}


def _where(ev: RankEvidence, known: bool) -> str:
    """Where a rank is now: its exit, or what it waits in."""
    if ev.missing and not ev.events:
        return f"it left {ev.missing}"
    pending = [e for e in ev.events if e.get("pending")
               or (not known and e is ev.events[-1])]
    if ev.exit not in (None, 0) and not ev.stopped:
        return "it failed: " + _ended(ev).removeprefix(f"rank {ev.rank} ")
    if pending:
        e = pending[0]
        num = f"#{e['gseq']}" if "gseq" in e else f"message #{e.get('pseq')}"
        return f"it waits in {match.describe(e)} {num} of group {e.get('group')} at " \
               f"{e.get('site')}"
    if ev.exit == 0:
        return "it finished (exit 0)"
    last = ev.events[-1] if ev.events else None
    return f"its last collective was {match.describe(last)} at {last.get('site')}" if last \
        else "it launched nothing"


def _located(reference: list[dict], other: list[dict], culprit: int) -> tuple[str, dict | None]:
    found = match.align(reference, other)
    if found is None:
        return "", None
    how, i, j = found
    if how == "extra":
        e = other[j]
        return f"rank {culprit} ran an extra {match.describe(e)} at {e.get('site')} " \
               f"(#{e.get('gseq')}) that the others did not{condition_of(e)}", e
    if how == "skipped":
        e = reference[i]
        return f"rank {culprit} skipped the {match.describe(e)} the others ran at " \
               f"{e.get('site')}{_module(e)} (their #{e.get('gseq')}){condition_of(e)}", e
    e, r = other[j], reference[i]
    theirs = condition_of(r)
    theirs = f" (theirs:{theirs.removeprefix(',')})" if theirs else ""
    return f"rank {culprit} ran {match.describe(e)} at {e.get('site')}{_module(e)}" \
           f"{condition_of(e)} where the others ran {match.describe(r)} at {r.get('site')}" \
           f"{_module(r)}{theirs}", e


def _module(e: dict) -> str:
    return f" in {e['module']}" if e.get("module") else ""


def _mismatch(evidence: Evidence, m: match.Mismatch) -> Diagnosis:
    g, n = m.group, m.n
    events = g.at(n)
    if not m.decided:
        rows = "; ".join(f"rank {r}: {match.describe(events.get(r))} at "
                         f"{(events.get(r) or {}).get('site')}" for r in m.culprits)
        return Diagnosis("mismatch", m.culprits, _divergence(evidence, g, n),
                         f"The members of group {g.ranks} launched different collectives as "
                         f"its #{n} and no majority decides who diverged: {rows}. Make them "
                         f"call the same operation with the same sizes and dtype.", False)
    ref = g.seqs[m.majority[0]]
    maj = events[m.majority[0]]
    parts = []
    for r in m.culprits:
        text, _ = _located(ref, g.seqs[r], r)
        parts.append(text or f"rank {r} launched {match.describe(events[r])} at "
                     f"{events[r].get('site')}{_module(events[r])}{condition_of(events[r])} "
                     f"where {_who(m.majority)} launched {match.describe(maj)} at "
                     f"{maj.get('site')}{_module(maj)}")
    what = "module/phase" if m.soft else "collective"
    text = (f"{'; '.join(parts)}: the {what} #{n} of group {g.ranks} ({g.kind or 'group'}) "
            f"differs on {_who(m.culprits)}. The members of a group must issue the same "
            f"collectives in the same order with the same sizes: look for a rank-local "
            f"condition or size on the path to {events[m.culprits[0]].get('site')}.")
    return Diagnosis("mismatch", m.culprits, _divergence(evidence, g, n), text + _failed(evidence))


def _hangs(gs: list[match.Group], known: bool) -> list[tuple[match.Group, int, list, list]]:
    """Groups whose last position some members wait in and others never reached."""
    out = []
    for g in gs:
        length = max(len(s) for s in g.seqs.values())
        waiting = [r for r, s in g.seqs.items() if len(s) == length
                   and (s[-1].get("pending") or s[-1].get("failed") or (not known))]
        absent = [r for r, s in g.seqs.items() if len(s) < length]
        if waiting and absent:
            out.append((g, length - 1, waiting, absent))
    return out


def _hang(evidence: Evidence, hung: list) -> Diagnosis:
    known = evidence.completion_known
    votes = Counter(r for _, _, _, absent in hung for r in absent)
    if len(hung) > 1:  # ranks wait in different groups: the fewer are out of order
        culprits = min((sorted(absent) for _, _, _, absent in hung), key=len)
    else:
        culprits = sorted(votes)
    g, n, waiting, absent = next(h for h in hung if set(culprits) <= set(h[3]))
    ref = g.seqs[waiting[0]]
    e = ref[n]
    lines = []
    for r in culprits:
        text, _ = _located(ref, g.seqs.get(r, []), r)
        ev = evidence.ranks.get(r, RankEvidence(r))
        count = len(g.seqs.get(r, []))
        lines.append((text + "; " if text else "") +
                     f"rank {r} launched {count} collective{'s' if count != 1 else ''} on this "
                     f"group, and {_where(ev, known)}")
    order = " The ranks entered the groups in another order." if len(hung) > 1 else ""
    text = (f"{_who(waiting)} wait{'s' if len(waiting) == 1 else ''} in {match.describe(e)} "
            f"#{n} of group {g.ranks} ({g.kind or 'group'}) at {e.get('site')}{_module(e)}, "
            f"which {_who(culprits)} never launched: {'; '.join(lines)}.{order}"
            f"{_failed(evidence)}")
    verdict = "failed" if all(evidence.ranks[r].exit not in (None, 0)
                              and not evidence.ranks[r].stopped and not _secondary(
                                  evidence.ranks[r]) for r in culprits) else "hang"
    return Diagnosis(verdict, culprits, _divergence(evidence, g, n), text)


def _odd_sides(evidence: Evidence, bad: list) -> list[int]:
    """The ranks whose message counts differ from what most pairs show: in a pair whose
    counts disagree, the side whose count is not the common one."""
    allp = match.pairs(evidence.ranks)
    counts = Counter(n for sides in allp.values() for n in (len(sides["send"]),
                                                           len(sides["recv"])))
    usual = counts.most_common(1)[0][0]
    votes: Counter = Counter()
    for (_, s, d), sides in bad:
        for rank, side in ((s, "send"), (d, "recv")):
            if len(sides[side]) != usual:
                votes[rank] += 1
    if not votes:
        return []
    top = max(votes.values())
    return sorted(r for r, v in votes.items() if v == top)


def _own_loop(evidence: Evidence, culprits: list[int], bad: list) -> str:
    """Where the culprit's own messages of a mismatched pair are issued (its loop)."""
    if len(culprits) != 1:
        return ""
    r = culprits[0]
    for (_, s, d), sides in bad:
        own = sides["send"] if r == s else sides["recv"] if r == d else []
        if own:
            where = condition_of(own[-1], loops=True)
            return f": rank {r} issues them at {own[-1].get('site')}{where}" if where else ""
    return ""


def _p2p(evidence: Evidence, bad: list) -> Diagnosis:
    culprits = _odd_sides(evidence, bad)
    decided = len(culprits) == 1
    if not culprits:
        culprits = sorted({r for (_, s, d), _ in bad for r in (s, d)})
    parts = []
    for (_, s, d), sides in bad:
        parts.append(f"rank {s} sent {len(sides['send'])} message(s) to rank {d}, which "
                     f"posted {len(sides['recv'])} receive(s)")
    (_, s, d), sides = bad[0]
    longer = sides["send"] if len(sides["send"]) > len(sides["recv"]) else sides["recv"]
    e = longer[min(len(sides["send"]), len(sides["recv"]))]
    div = {"group": {"ranks": [s, d], "kind": e.get("kind"), "pg": e.get("pg") or ""},
           "position": e.get("pseq"),
           "ranks": {str(r): _row(evidence.ranks[r], e if e["rank"] == r else None,
                                  evidence.completion_known) for r in (s, d)}}
    text = (f"Point-to-point counts disagree: {'; '.join(parts)}. "
            f"{'The count that differs from the other pairs is ' if decided else 'Candidates: '}"
            f"{_who(culprits)}'s (a stage running another number of microbatches, or a skipped "
            f"send/recv){_own_loop(evidence, culprits, bad)}; the first unmatched: "
            f"{match.describe(e)} at {e.get('site')} on rank {e['rank']}."
            f"{_failed(evidence)}")
    return Diagnosis("hang", culprits, div, text, decided)


def _first_failure(evidence: Evidence) -> Diagnosis | None:
    bad = [ev for ev in evidence.ranks.values() if ev.exit not in (None, 0) and not ev.stopped]
    if not bad:
        return None
    own = [ev for ev in bad if not _secondary(ev)] or bad
    first = min(own, key=lambda ev: (ev.time or float("inf"), ev.rank))
    why = f" ({first.error})" if first.error else ""
    last = first.events[-1] if first.events else None
    where = f"; its last communication was {match.describe(last)} at {last.get('site')}" \
        if last else ""
    return Diagnosis("failed", [first.rank], None,
                     f"rank {first.rank} failed first with exit {first.exit}{why}{where}. "
                     f"Every group's sequences agree up to there: the failure is the rank's own, "
                     f"not a disagreement between ranks.")


def diagnose(evidence: Evidence) -> Diagnosis:
    """The diagnosis of ``evidence`` (see the module docstring for the rules)."""
    gs = match.groups(evidence.ranks)
    known = evidence.completion_known
    m = match.first_mismatch(gs)
    if m is not None:
        d = _mismatch(evidence, m)
    else:
        hung = _hangs(gs, known)
        bad = [(k, sides) for k, sides in match.pairs(evidence.ranks).items()
               if len(sides["send"]) != len(sides["recv"])]
        if bad:
            d = _p2p(evidence, bad)
        elif hung:
            d = _hang(evidence, hung)
        else:
            d = _first_failure(evidence)
            if d is None:
                soft = match.first_mismatch(gs, use_soft=True)
                pending = [ev.rank for ev in evidence.ranks.values()
                           if any(e.get("pending") for e in ev.events)]
                if soft is not None and pending:
                    d = _mismatch(evidence, soft)
                elif missing := [ev.rank for ev in evidence.ranks.values()
                                 if ev.missing and not ev.events]:
                    d = Diagnosis("failed", missing, None, f"{_who(missing)} left "
                                  f"{evidence.ranks[missing[0]].missing}; what the other ranks "
                                  f"left agrees, so the ones without evidence are the "
                                  f"candidates.", False)
                elif pending:
                    d = Diagnosis("hang", [], None, f"{_who(pending)} still wait in "
                                  f"communication every member launched: nothing diverged "
                                  f"(a slow or stopped peer, or the network).", False)
                else:
                    d = Diagnosis("ok", [], None, f"Every group's sequences agree across "
                                  f"{len(evidence.ranks)} ranks and every launched operation "
                                  f"completed.")
    d.notes = list(evidence.notes) + d.notes
    if not known:
        d.notes.append("completion is unknown (gloo Flight Recorder dumps say 'scheduled' for "
                       "everything): a rank's last entry in a group may be waiting or done")
    return d
