"""The result of a diagnosis and how a rank's state and failure are worded.

:class:`Diagnosis` carries the contract keys (``verdict``, ``culprits``, ``divergence``,
``explanation``); :func:`row` is one rank's line of the divergence; :func:`ended` says how a
rank ended, with a plain hint where its error names a known cause (DDP's unused parameters).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from .evidence import RankEvidence

__all__ = ["Diagnosis", "PEER_GONE_WORDS", "HINTS", "who", "row", "ended", "failed", "secondary",
           "hint"]

PEER_GONE_WORDS = ("connection closed by peer", "connection reset", "broken pipe",
                   "peer went away", "received data size doesn't match", "timed out",
                   "enforce fail", "socket", "gloo")
"""Errors a rank sees because of another: not evidence that it diverged itself."""


@dataclass
class Diagnosis:
    verdict: str
    culprits: list[int]
    divergence: dict | None
    explanation: str
    decided: bool = True
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        return {"verdict": self.verdict, "culprits": self.culprits,
                "divergence": self.divergence, "explanation": self.explanation,
                "decided": self.decided, "notes": self.notes}


def who(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _state(ev: RankEvidence, e: dict | None, known: bool) -> str:
    if e is None:
        return "absent"
    if e.get("failed"):
        return "failed"
    if not e.get("pending") and (known or e.get("completion") != "unknown"):
        return "done"
    if ev.exit not in (None, 0) and not ev.stopped:
        return "failed"
    return "waiting" if e.get("completion") != "unknown" else "launched"


def row(ev: RankEvidence, e: dict | None, known: bool) -> dict:
    keys = ("op", "dtype", "shape", "bytes", "site", "phase", "module")
    row = {k: (e or {}).get(k) for k in keys}
    row["state"] = _state(ev, e, known)
    for k in ("gseq", "pseq", "peer", "root", "input_splits", "output_splits"):
        if e is not None and e.get(k) is not None:
            row[k] = e[k]
    return row


def ended(ev: RankEvidence) -> str:
    if ev.exit is not None and ev.exit < 0:
        try:
            return f"rank {ev.rank} was killed by {signal.Signals(-ev.exit).name}"
        except ValueError:
            return f"rank {ev.rank} was killed by signal {-ev.exit}"
    error = ev.error or ""
    short = error if len(error) <= 110 else error[:107] + "..."
    return f"rank {ev.rank} exited {ev.exit}" + (f" ({short})" if short else "") + hint(error)


HINTS = (
    ("find_unused_parameters",
     "DDP found a parameter that got no gradient on this rank (a layer skipped under a "
     "rank-local condition, so its bucket never completed): make every rank use the same "
     "layers, or pass find_unused_parameters=True to DistributedDataParallel"),
    ("received data size doesn't match",
     "gloo read a message of another size than this rank expected: a peer launched this "
     "collective with another shape"),
)
"""(words in an error, what they mean in plain terms), for errors whose cause is known."""


def hint(error: str | None) -> str:
    """`` -- what it means`` for an error that names a known cause, else ``""``."""
    low = (error or "").lower()
    return next((f" -- {meaning}" for words, meaning in HINTS if words in low), "")


def failed(evidence) -> str:
    """Where errors surfaced (often not on the culprit)."""
    bad = [ev for ev in evidence.ranks.values() if ev.exit not in (None, 0) and not ev.stopped]
    if not bad:
        return ""
    bad.sort(key=lambda ev: (ev.exit is None or ev.exit >= 0, ev.time or float("inf"), ev.rank))
    return f" It surfaced as: {'; '.join(ended(ev) for ev in bad[:3])}" + \
        (f" (and {len(bad) - 3} more)" if len(bad) > 3 else "") + "."


def secondary(ev: RankEvidence) -> bool:
    return any(w in (ev.error or "").lower() for w in PEER_GONE_WORDS)


