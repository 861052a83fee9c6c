"""Prove a set of per-stage p2p plans matches message for message and cannot deadlock.

A plan (:func:`.plans.p2p_plan`) is a list of compute steps ``(kind, mb, chunk)`` and
communication entries whose ops are ``("send" | "recv", side, message)``:

* ``("comm", ops)`` — post the ops and wait for all of them (a blocking batch);
* ``("post", ops)`` — post the ops and go on (``isend`` / ``irecv``);
* ``("wait", ops)`` — block until those previously posted ops completed.

The simulation uses the strictest model: a send completes only once its receiver has posted the
matching receive (no buffering), a receive once its sender has posted the send; matching is
first-in-first-out per (sender, receiver) pair, as in gloo and NCCL. Compute steps take no time.
"""

from __future__ import annotations

__all__ = ["check_plans"]

_DEST = {"next": 1, "prev": -1}


def check_plans(plans: list[list[tuple]]) -> None:
    """Raise ``RuntimeError`` if a message mismatches, hangs, or a posted op is never waited."""
    p = len(plans)
    posted: dict[tuple[str, int, int], list] = {}  # (send|recv, src, dst) -> messages posted
    mine: list[dict] = [{} for _ in range(p)]  # per rank: op -> (key, index in posted[key])
    waited: list[set] = [set() for _ in range(p)]
    pos, blocked = [0] * p, [None] * p

    def post(r, ops):
        for op in ops:
            what, side, msg = op
            if op in mine[r]:
                raise RuntimeError(f"rank {r} posts {op} twice")
            peer = (r + _DEST[side]) % p
            key = (what, r, peer) if what == "send" else (what, peer, r)
            posted.setdefault(key, []).append(msg)
            mine[r][op] = (key, len(posted[key]) - 1)

    def matched(r, op):
        (what, src, dst), idx = mine[r][op]
        other = posted.get(("recv" if what == "send" else "send", src, dst), [])
        if idx >= len(other):
            return False
        if other[idx] != op[2]:
            raise RuntimeError(f"rank {r}: {what} #{idx} {src}->{dst} carries "
                               f"{other[idx] if what == 'recv' else op[2]}, expected "
                               f"{op[2] if what == 'recv' else other[idx]}")
        return True

    while True:
        progress = False
        for r in range(p):
            while True:
                if blocked[r] is not None:
                    if not all(matched(r, op) for op in blocked[r]):
                        break
                    waited[r].update(blocked[r])
                    blocked[r], pos[r], progress = None, pos[r] + 1, True
                if pos[r] == len(plans[r]):
                    break
                entry = plans[r][pos[r]]
                if entry[0] in ("comm", "post"):
                    post(r, entry[1])
                    progress = True
                if entry[0] in ("comm", "wait"):
                    missing = [op for op in entry[1] if op not in mine[r] or op in waited[r]]
                    if missing:
                        raise RuntimeError(f"rank {r} waits for {missing}, not posted (or "
                                           f"already waited)")
                    blocked[r] = list(entry[1])
                    continue
                pos[r] += 1
        if all(pos[r] == len(plans[r]) for r in range(p)):
            break
        if not progress:
            stuck = {r: plans[r][pos[r]] for r in range(p) if pos[r] < len(plans[r])}
            raise RuntimeError(f"deadlock: ranks wait in {stuck}")
    for r in range(p):
        unwaited = [op for op in mine[r] if op not in waited[r]]
        if unwaited:
            raise RuntimeError(f"rank {r} never waits for {unwaited}")
