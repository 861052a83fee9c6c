"""Live hang detection, rank side: a heartbeat per rank, and the test of "every rank blocked".

A rank that waits in a collective some peer never launched does not come back to Python, so
nothing the program does can tell. The :class:`Heartbeat` is a daemon thread (gloo and NCCL
release the GIL while they wait) that, every ``period`` seconds, writes the rank's state to
``RUN/ledger/rank_R.live.json``: the host time of its last launch or completion (``activity``)
and how many of its operations are still ``pending``. Once the rank has been idle with something
pending for ``tail_after`` seconds it also writes the events it has not flushed yet to
``rank_R.tail.jsonl`` (with their ``pending`` marks), because a rank blocked in C++ never runs its
SIGTERM flush. A healthy rank pays one small file write per period.

The watcher (:mod:`paraloom.diagnose.watch`: ``record``'s and ``train``'s launcher, or rank 0's
thread under torchrun) calls :func:`blocked` with the ranks still alive: a hang is suspected
when every one of them has had something pending and no activity for ``hang_after`` seconds (a
long all-reduce of a big bucket completes and counts as activity; compute without pending
communication is not blocked). The diagnosis (:mod:`.verdict`) then decides whether the ranks
really disagree.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from .run_folder import rank_live, rank_tail

__all__ = ["Heartbeat", "blocked", "read_live", "STALE_S"]

STALE_S = 5.0
"""A heartbeat older than this means the rank's threads cannot run (a C++ deadlock holding the
GIL): the rank counts as blocked since its last beat."""


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Heartbeat:
    """The rank-side thread. ``ledger``: the rank's :class:`~paraloom.ledger.Ledger`;
    ``unflushed()``: its events not yet in its ledger file; ``poll()``: optional, run first at
    each beat (the recorder's check of Works that C++ waits on)."""

    def __init__(self, ledger, out: str | Path, *, unflushed: Callable[[], list[dict]],
                 poll: Callable[[], None] | None = None, period: float = 0.5,
                 tail_after: float = 1.0) -> None:
        self.ledger, self.unflushed, self.poll = ledger, unflushed, poll
        self.period, self.tail_after = period, tail_after
        self.live, self.tail = rank_live(out, ledger.rank), rank_tail(out, ledger.rank)
        self._tailed_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paraloom-heartbeat",
                                        daemon=True)

    def start(self) -> Heartbeat:
        self.live.parent.mkdir(parents=True, exist_ok=True)
        self.tail.unlink(missing_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating; the rank is done (its ledger file now holds everything)."""
        self._stop.set()
        self._thread.join(timeout=2 * self.period + 1)
        self.tail.unlink(missing_ok=True)
        self.live.unlink(missing_ok=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - the watch must never disturb the program
                pass

    def beat(self) -> None:
        """One beat (also callable directly, e.g. by a test)."""
        if self.poll is not None:
            try:
                self.poll()
            except RuntimeError:  # the program changed the Works while we looked: next beat
                pass
        led, now = self.ledger, time.time()
        events = list(self.unflushed())
        pending = [e for e in events if e.get("pending")]
        state = {"rank": led.rank, "pid": os.getpid(), "time": now, "activity": led.activity,
                 "pending": len(pending), "waiting": pending[0]["seq"] if pending else None,
                 "launched": led.next_seq}
        _write_atomic(self.live, json.dumps(state))
        if pending and now - led.activity >= self.tail_after \
                and self._tailed_at != led.activity:
            host = led.now()  # a CUDA event stamp not resolved yet: the host's time now
            lines = "".join(json.dumps(e, default=lambda _: host) + "\n" for e in events)
            _write_atomic(self.tail, lines)
            self._tailed_at = led.activity


def read_live(out: str | Path, rank: int) -> dict | None:
    """Rank ``rank``'s last heartbeat, or ``None``."""
    try:
        return json.loads(rank_live(out, rank).read_text())
    except (OSError, ValueError):
        return None


def blocked(out: str | Path, ranks: Iterable[int], hang_after: float,
            now: float | None = None) -> bool:
    """Whether every rank of ``ranks`` (those still alive) has been blocked ``hang_after``
    seconds: something pending and no launch or completion since, or a heartbeat gone stale
    that long ago. ``False`` while any rank has not beaten yet or makes progress."""
    now = time.time() if now is None else now
    ranks = list(ranks)
    if not ranks:
        return False
    for r in ranks:
        live = read_live(out, r)
        if live is None:
            return False
        if now - live["time"] > STALE_S:
            if now - live["time"] < hang_after:
                return False
            continue
        if not live["pending"] or now - live["activity"] < hang_after:
            return False
    return True
