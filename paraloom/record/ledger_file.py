"""One rank's ledger file while ``record_comms(out=...)`` runs: final lines, then provisional ones.

``out/ledger/rank_R.jsonl`` holds the rank's events in launch order: first those flushed with
their final fields (:meth:`LedgerFile.flush`: at every optimizer step, when ``steps`` is reached,
at interpreter exit, on SIGTERM and when the block ends), then a provisional line for each event
launched since (:meth:`LedgerFile.provisional`, written before the operation starts: a stamp not
resolved yet reads as the host's time, an operation not completed yet keeps its ``pending``
mark). The next flush writes the final lines over them.

So a rank that dies without running Python again (SIGKILL, a segfault, gloo or NCCL aborting
the process inside the collective) leaves its ledger up to the operation it died in, which is
what ``paraloom diagnose`` needs to tell which rank diverged. Both writes are one system call on
a raw file descriptor, and a flush truncates only when the final lines come out shorter than the
provisional ones they replace (``benchmarks/record_overhead.py``).
"""

from __future__ import annotations

import json
import os
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
    """The file of ``ledger``'s events at ``path`` (made, empty, on the first write)."""

    def __init__(self, ledger: Ledger, path: Path) -> None:
        self.ledger, self.path = ledger, path
        self.flushed = 0  # events[:flushed] are in the file with their final fields
        self._final = 0  # byte offset where the provisional lines start
        self._end = 0  # byte offset of the file's end
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        return self._fd

    def _write(self, data: bytes, at: int) -> int:
        """Write all of ``data`` at offset ``at``; returns the offset after it."""
        fd, view = self._open(), memoryview(data)
        while view:
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n
        return at

    def provisional(self, event: dict) -> None:
        """Append ``event`` as it is now (its operation is about to start)."""
        if self.ledger._event_type is None:
            line = encode(event)
        else:  # a CUDA event stamp not resolved yet: the host's time now
            host = self.ledger.now()
            line = json.dumps(event, default=lambda _: host)
        self._end = self._write((line + "\n").encode(), self._end)

    def flush(self) -> None:
        """Write the events since the last flush with their current (final) fields over their
        provisional lines."""
        end = len(self.ledger.events)
        if end == self.flushed:
            return
        self.ledger.resolve(self.flushed)  # CUDA: waits for these events only
        text = "".join(encode(e) + "\n" for e in self.ledger.events[self.flushed:end])
        final = self._write(text.encode(), self._final)
        if final < self._end:  # shorter than the provisional lines: cut their rest
            os.ftruncate(self._fd, final)
        self._final = self._end = final
        self.flushed = end

    def close(self) -> None:
        """Flush and close the file."""
        self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
