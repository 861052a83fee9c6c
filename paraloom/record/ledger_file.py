"""One rank's ledger file while ``record_comms(out=...)`` runs: final lines, then provisional ones.

``out/ledger/rank_R.jsonl`` holds the rank's events in launch order: first those flushed with
their final fields (:meth:`LedgerFile.flush`: at every optimizer step, when ``steps`` is reached,
at interpreter exit, on SIGTERM and when the block ends), then a provisional line for each event
launched since, written by a daemon thread every ``period`` seconds (a stamp not resolved yet
reads as the host's time; an operation not completed yet keeps its ``pending`` mark). The next
flush rewrites the provisional lines in place.

So a rank that dies without running Python again (SIGKILL, a segfault, the OOM killer) leaves
its ledger up to at most ``period`` seconds before it died, and a rank blocked in a collective
(gloo and NCCL release the GIL while they wait) leaves that collective too. The program's own
thread writes nothing per collective: a line written and flushed at every launch cost DDP a
tenth of its step time on 2 cores (``benchmarks/record_overhead.py``); one write per step does
not show.
"""

from __future__ import annotations

import json
import threading
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


class LedgerFile:
    """The file of ``ledger``'s events at ``path`` (made on the first write). Thread-safe: the
    program's thread flushes, the writer thread (:meth:`start`) adds provisional lines."""

    def __init__(self, ledger: Ledger, path: Path, *, period: float = 0.1) -> None:
        self.ledger, self.path, self.period = ledger, path, period
        self.flushed = 0  # events[:flushed] are in the file with their final fields
        self.written = 0  # events[flushed:written] follow them as provisional lines
        self._final = 0  # byte offset where the provisional lines start
        self._file = None
        self._lock = threading.RLock()  # reentrant: a SIGTERM flush may interrupt a flush
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LedgerFile:
        """Start the daemon thread that writes the provisional lines."""
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

    def _open(self):
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "wb")  # noqa: SIM115 - kept open for the record
        return self._file

    def _write(self, text: str) -> int:
        data = text.encode()
        self._file.write(data)
        self._file.flush()
        return len(data)

    def write_provisional(self) -> None:
        """Append provisional lines for the events launched since the last write (each copied
        first: the program's thread may complete one while it is encoded)."""
        events = self.ledger.events
        with self._lock:
            start, end = max(self.written, self.flushed), len(events)
            if end <= start:
                return
            snapshot = [dict(e) for e in events[start:end]]
            host = self.ledger.now()
            text = "".join(json.dumps(e, default=lambda _: host) + "\n" for e in snapshot)
            self._open()
            self._write(text)
            self.written = end

    def flush(self) -> None:
        """Write the events since the last flush with their current (final) fields, over their
        provisional lines if the writer got to them. One write, no other system call, when
        it did not."""
        with self._lock:
            end = len(self.ledger.events)
            if end == self.flushed:
                return
            f = self._open()
            if self.written > self.flushed:
                f.seek(self._final)
                f.truncate()
            self.ledger.resolve(self.flushed)  # CUDA: waits for these events only
            text = "".join(encode(e) + "\n" for e in self.ledger.events[self.flushed:end])
            self._final += self._write(text)
            self.flushed = self.written = end

    def close(self) -> None:
        """Stop the writer, flush, close the file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.period + 1)
            self._thread = None
        with self._lock:
            self.flush()
            if self._file is not None:
                self._file.close()
                self._file = None
