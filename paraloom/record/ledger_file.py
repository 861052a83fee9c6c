"""One rank's ledger file while ``record_comms(out=...)`` runs: final lines, then provisional ones.

``out/ledger/rank_R.jsonl`` holds the rank's events in launch order: first those flushed with
their final fields (:meth:`LedgerFile.flush`: at every optimizer step, when ``steps`` is reached,
at interpreter exit, on SIGTERM and when the block ends), then provisional lines for the events
launched since (a stamp not resolved yet reads as the host's time, an operation not completed
yet keeps its ``pending`` mark). The next flush writes the final lines over them.

Who writes a provisional line, and when:

* the program's thread, before the operation starts, for an operation not seen before (a new
  site, op, size, dtype or group, or any all-to-all with split sizes, send/recv or rooted op):
  where ranks diverge, a rank that gloo or NCCL aborts inside the collective, or that is
  SIGKILLed there, still leaves it -- what ``paraloom diagnose`` needs to tell who diverged;
* a daemon thread, for the repeats (a DDP bucket's all-reduce at every step) that are still
  not flushed when it looks a second time (it looks every ``period`` seconds): a rank blocked in
  one (gloo and NCCL release the GIL while they wait) leaves it within two periods; a rank
  killed by a signal in the middle of a step loses at most the last two periods of repeats.
  A program whose steps are shorter than a period never has a repeat encoded twice: its step
  flush writes them first.

A line per collective on the program's thread cost DDP about 4% of its step on 2 cores
(``benchmarks/record_overhead.py``); repeats cost it one final line each. Writes are
``pwrite`` on a raw descriptor; a flush truncates only when the final lines come out shorter
than the provisional ones they replace.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from pathlib import Path

from ..ledger import Ledger

__all__ = ["LedgerFile", "encode"]

_C_ENCODER = getattr(json.encoder, "c_make_encoder", None)
_ENCODER = _C_ENCODER(None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii,
                      None, ": ", ", ", False, False, True) if _C_ENCODER else None


def encode(event: dict) -> str:
    """``json.dumps(event)``, through one C encoder made once (``json.dumps`` makes a new one
    per call: measurable at a line per collective)."""
    if _ENCODER is None:
        return json.dumps(event)
    return "".join(_ENCODER(event, 0))


_OPEN: weakref.WeakSet = weakref.WeakSet()  # the files being written by this process


def _after_fork_in_child() -> None:
    """A forked child gets fresh locks (the writer thread may have held one at the fork) and
    no writer thread (threads do not survive a fork)."""
    for f in list(_OPEN):
        f._lock = threading.RLock()
        f._thread = None


os.register_at_fork(after_in_child=_after_fork_in_child)


class LedgerFile:
    """The file of ``ledger``'s events at ``path`` (made, empty, on the first write).
    Thread-safe: the program's thread launches and flushes, the writer thread (:meth:`start`)
    adds the repeats' provisional lines."""

    def __init__(self, ledger: Ledger, path: Path, *, period: float = 0.1) -> None:
        self.ledger, self.path, self.period = ledger, path, period
        self.flushed = 0  # events[:flushed] are in the file with their final fields
        self._looked = 0  # events[flushed:_looked] have provisional lines (or are being flushed)
        self._marked = 0  # events[:_marked] were launched before the writer's last look
        self._early: set[int] = set()  # events at or past _looked written at their launch
        self._seen: set[tuple] = set()  # the operations written at launch once
        self._final = 0  # byte offset where the provisional lines start
        self._end = 0  # byte offset of the file's end
        self._fd: int | None = None
        self._lock = threading.RLock()  # reentrant: a SIGTERM flush may interrupt a flush
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        _OPEN.add(self)

    def start(self) -> LedgerFile:
        """Start the daemon thread that writes the repeats' provisional lines."""
        self._thread = threading.Thread(target=self._run, name="paraloom-ledger-writer",
                                        daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.write_provisional()
            except Exception:  # noqa: BLE001 - never disturb the program; next period
                pass

    def _write(self, data: bytes, at: int) -> int:
        """Write all of ``data`` at offset ``at``; returns the offset after it."""
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        view = memoryview(data)
        while view:
            n = os.pwrite(self._fd, view, at)
            view, at = view[n:], at + n
        return at

    def _line(self, event: dict) -> str:
        if self.ledger._event_type is None:
            return encode(event)
        host = self.ledger.now()  # a CUDA event stamp not resolved yet: the host's time now
        return json.dumps(event, default=lambda _: host)

    def launched(self, event: dict, fields: bool) -> None:
        """``event`` (the ledger's last) is about to start: its provisional line now unless it
        repeats an operation already written so (``fields``: it has peer, root or split
        fields, which are always written)."""
        key = (event["site"], event["op"], event["bytes"], event["dtype"], event.get("pg"),
               event["phase"])
        if not fields and key in self._seen:
            return
        self._seen.add(key)
        line = (self._line(event) + "\n").encode()
        with self._lock:
            self._end = self._write(line, self._end)
            self._early.add(len(self.ledger.events) - 1)

    def write_provisional(self) -> None:
        """Append provisional lines for the events that have none and were launched before the
        previous look (each copied first: the program's thread may complete one while it is
        encoded); what is flushed before a second look is never written twice."""
        events = self.ledger.events
        with self._lock:
            start, end = max(self._looked, self.flushed), self._marked
            self._marked = len(events)
            if end <= start:
                return
            picked = [dict(events[i]) for i in range(start, end) if i not in self._early]
            if picked:
                text = "".join(self._line(e) + "\n" for e in picked)
                self._end = self._write(text.encode(), self._end)
            self._looked = end

    def flush(self) -> None:
        """Write the events since the last flush with their current (final) fields over their
        provisional lines."""
        with self._lock:
            end = len(self.ledger.events)
            if end == self.flushed:
                return
            self.ledger.resolve(self.flushed)  # CUDA: waits for these events only
            text = "".join(encode(e) + "\n" for e in self.ledger.events[self.flushed:end])
            final = self._write(text.encode(), self._final)
            if final < self._end:  # shorter than the provisional lines: cut their rest
                os.ftruncate(self._fd, final)
            self._final = self._end = final
            self.flushed = self._looked = end
            self._early.clear()

    def close(self) -> None:
        """Stop the writer, flush, close the file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.period + 1)
            self._thread = None
        with self._lock:
            self.flush()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
