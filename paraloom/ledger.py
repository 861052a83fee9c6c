"""The communication record: one :class:`CommEvent` per collective, send/recv or compute span.

A :class:`Ledger` is active on a rank while ``with recording(ledger):`` runs. ``comm.py`` asks
:func:`active` before every operation; when it returns ``None`` nothing is allocated or timed, so
recording costs nothing when it is off. Events are plain dicts in the JSON Lines schema of
DESIGN.md (the contract), written by :meth:`Ledger.dump`, merged over ranks by :func:`merge`
and read back by :mod:`paraloom.run_folder`.

Times are seconds since the ledger's ``t0`` on the wall clock (``time.time``), which all ranks of a
local run share; a launcher that wants one origin for every rank passes the same ``t0`` to each.
On CPU the wall clock is exact enough: operations run when the host calls them. On CUDA the host
only enqueues kernels, so a ledger built with ``event_type`` (``torch.cuda.Event`` with timing,
from :func:`paraloom.device.timing_event_type`) stamps each ``t_start`` / ``t_wait`` / ``t_end``
with an event recorded on the current stream -- when the GPU reaches that point -- and
:meth:`Ledger.resolve` turns the events into seconds after the step, against an anchor event
recorded when the ledger was made (the one moment host and device clocks are tied). Recording adds
no synchronisation: :meth:`Ledger.dump` resolves after a step whose loss was already read back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

__all__ = ["Ledger", "active", "recording", "span", "merge", "FIELDS"]

FIELDS = ("rank", "seq", "step", "microbatch", "phase", "kind", "op", "site", "module", "split",
          "async", "bytes", "shape", "dtype", "group", "t_start", "t_wait", "t_end")
"""Contract field order of one event (extra keys such as ``bucket`` or ``peer`` follow them)."""

_ACTIVE: Ledger | None = None


def active() -> Ledger | None:
    """The ledger recording on this rank, or ``None`` (the fast path)."""
    return _ACTIVE


@contextmanager
def recording(ledger: Ledger) -> Iterator[Ledger]:
    """Make ``ledger`` the active one for the duration of the block (nesting restores the outer)."""
    global _ACTIVE
    outer, _ACTIVE = _ACTIVE, ledger
    try:
        yield ledger
    finally:
        _ACTIVE = outer


class Ledger:
    """Events of one rank, in the order they were launched (``seq``)."""

    def __init__(self, rank: int = 0, t0: float | None = None, event_type=None) -> None:
        self.rank = rank
        self.t0 = time.time() if t0 is None else t0
        self._event_type = event_type
        """``None``: stamps are wall-clock seconds; else a class whose instances ``record()`` a
        point on the device stream and give ``elapsed_time(other)`` in ms (``torch.cuda.Event``)."""
        self._anchor = None
        if event_type is not None:  # host time and device time at one moment (device idle)
            self._anchor = (event_type(), self.now())
            self._anchor[0].record()
        self.events: list[dict] = []
        self.next_seq = 0
        """``seq`` of the next event: it keeps counting when ``events`` is cleared after a flush
        (the training loop writes a step at a time), so ``(rank, seq)`` stays unique."""
        self.step = 0
        self.microbatch = 0
        self.recompute = False
        """True while activation recomputation re-runs a forward (events get ``recompute``)."""
        self._group_seq: dict = {}
        self._pair_seq: dict = {}
        self.activity = time.time()
        """Host time of the last launch or completion: what a hang watch reads."""

    def use_device_clock(self, event_type) -> None:
        """From now on stamp with ``event_type`` (device events; see :meth:`stamp`), anchored
        at this moment: for a recorder that learns only at a program's first CUDA collective
        that it runs on a GPU. Stamps taken before stay wall-clock seconds."""
        if self._event_type is None and event_type is not None:
            self._event_type = event_type
            self._anchor = (event_type(), self.now())
            self._anchor[0].record()

    def now(self) -> float:
        """Host wall-clock seconds since ``t0``."""
        return time.time() - self.t0

    def stamp(self):
        """The time of "now" for an event field: :meth:`now` on CPU; on CUDA an event recorded on
        the current stream (what the device reaches next), turned into seconds by
        :meth:`resolve`."""
        if self._event_type is None:
            return time.time() - self.t0
        event = self._event_type()
        event.record()
        return event

    def resolve(self, start: int = 0) -> None:
        """Replace every event stamp in :attr:`events` (from index ``start``) by seconds since
        ``t0`` (device events: anchor time + elapsed device time). Waits for those events only
        (they are done once the step's loss was read back)."""
        if self._anchor is None:
            return
        anchor, anchor_t = self._anchor
        for event in self.events[start:]:
            for key in ("t_start", "t_wait", "t_end"):
                mark = event[key]
                if not isinstance(mark, (int, float)):
                    mark.synchronize()
                    event[key] = anchor_t + anchor.elapsed_time(mark) / 1e3

    @contextmanager
    def at(self, *, step: int | None = None, microbatch: int | None = None) -> Iterator[None]:
        """Attribute the events of the block to ``step`` / ``microbatch``."""
        saved = self.step, self.microbatch
        if step is not None:
            self.step = step
        if microbatch is not None:
            self.microbatch = microbatch
        try:
            yield
        finally:
            self.step, self.microbatch = saved

    def record(self, *, op: str, phase: str, kind: str, site: str, module: str | None = None,
               split: str | None = None, async_op: bool = False, tensor=None, nbytes: int = 0,
               group: Iterable[int] = (), pg: str | None = None, **extra) -> dict:
        """Append one event launched now; the caller fills ``t_wait``/``t_end`` when it
        completes (and calls :meth:`completed`).

        Communication events are numbered so that ranks can be matched without guessing:
        ``gseq``, the position of a collective in its process group's sequence on this rank
        (the group is ``pg``, a name every member uses, and ``group``'s ranks), and for
        ``send``/``recv`` ``pseq``, the position in the sequence of messages from the sender to
        the receiver (``peer`` is the other side). They stay ``pending`` until completed."""
        shape, dtype = None, None
        if tensor is not None:
            shape, dtype = list(tensor.shape), str(tensor.dtype).removeprefix("torch.")
            nbytes = nbytes or tensor.numel() * tensor.element_size()
        return self.event(op, phase, kind, site, module, split, async_op, nbytes, shape, dtype,
                          list(group), pg, extra or None)

    def event(self, op: str, phase: str, kind: str, site: str, module: str | None,
              split: str | None, async_op: bool, nbytes: int, shape: list | None,
              dtype: str | None, group: list[int], pg: str | None, extra: dict | None) -> dict:
        """:meth:`record` with every field given, positionally (``group`` a list the event may
        keep): the recorder's path, called at every collective of a foreign program."""
        t = self.stamp()
        event = {"rank": self.rank, "seq": self.next_seq, "step": self.step,
                 "microbatch": self.microbatch, "phase": phase, "kind": kind, "op": op,
                 "site": site, "module": module, "split": split, "async": async_op,
                 "bytes": nbytes, "shape": shape, "dtype": dtype, "group": group,
                 "t_start": t, "t_wait": t, "t_end": t}
        if extra:
            event.update(extra)
        if self.recompute:
            event["recompute"] = True
        if op != "compute":
            self._number(event, op, pg)
        self.events.append(event)
        self.next_seq += 1
        return event

    def _number(self, event: dict, op: str, pg: str | None) -> None:
        event["pending"] = True
        if pg is not None:
            event["pg"] = pg
        peer = event.get("peer")
        if op in ("send", "recv") and peer is not None:
            pair = (pg, self.rank, peer) if op == "send" else (pg, peer, self.rank)
            n = event["pseq"] = self._pair_seq.get(pair, 0)
            self._pair_seq[pair] = n + 1
        else:
            key = (pg, tuple(event["group"]))
            n = event["gseq"] = self._group_seq.get(key, 0)
            self._group_seq[key] = n + 1
        self.activity = time.time()

    def completed(self, event: dict) -> None:
        """``event`` has completed (its ``t_end`` is set): it is no longer ``pending``."""
        event.pop("pending", None)
        self.activity = time.time()

    def span(self, site: str, *, phase: str, module: str | None = None, kind: str = "compute",
             **extra) -> _Span:
        """Record a compute span (op ``compute``), e.g. a GEMM or a pipeline forward step.

        A context manager: the event is recorded on entry (and is the ``as`` target); its
        ``t_wait``/``t_end`` are set on exit, also when the block raises."""
        return _Span(self, dict(op="compute", phase=phase, kind=kind, site=site, module=module,
                                **extra))

    def dump(self, path: str | Path, mode: str = "w") -> None:
        """Write the events as JSON Lines (``mode="a"`` appends, for per-step flushing)."""
        self.resolve()
        with open(path, mode) as f:
            for event in self.events:
                f.write(json.dumps(event) + "\n")


class _Span:
    """:meth:`Ledger.span`'s context manager: a plain class rather than a generator, because it
    wraps every GEMM of the tensor-parallel layers and must cost next to nothing."""

    __slots__ = ("_ledger", "_fields", "_event")

    def __init__(self, ledger: Ledger, fields: dict) -> None:
        self._ledger, self._fields, self._event = ledger, fields, None

    def __enter__(self) -> dict:
        self._event = self._ledger.record(**self._fields)
        return self._event

    def __exit__(self, *exc) -> None:
        self._event["t_wait"] = self._event["t_end"] = self._ledger.stamp()


_NO_SPAN = nullcontext()  # reusable; ``as`` gives None


def span(site: str, *, phase: str, module: str | None = None, **extra):
    """:meth:`Ledger.span` on the active ledger; does nothing (``as`` gives ``None``) when none is.

    Use it directly in a ``with`` statement (the active ledger is looked up on the call)."""
    ledger = _ACTIVE
    if ledger is None:
        return _NO_SPAN
    return ledger.span(site, phase=phase, module=module, **extra)


def merge(per_rank: Iterable[Iterable[dict]]) -> list[dict]:
    """All ranks' events in one list ordered by ``(rank, seq)``, as the ledger file stores them."""
    return sorted((e for events in per_rank for e in events),
                  key=lambda e: (e["rank"], e.get("seq", 0)))
