"""``record_comms``: the ledger of every communication of this process, for any program.

    with paraloom.record.record_comms(out="rec") as rec:   # rec is a paraloom.ledger.Ledger
        train()                                            # DDP, FSDP2, DTensor, Megatron-Core...
    rec.events                                             # contract event dicts (DESIGN.md)

It installs the dispatcher kernels of :mod:`.intercept`, the hooks of :mod:`.tracking` and the
mesh collection of :mod:`.kinds`, and turns what they see into ledger events. With ``out``, the
events go to ``out/ledger/rank_R.jsonl`` (:mod:`.ledger_file`): as provisional lines while they
run (an operation not seen before written before it starts, so even a rank killed inside it
leaves it; repeats by a thread within 0.1 s), rewritten with their final times at every
optimizer step, when ``steps`` is reached, at interpreter exit, on SIGTERM and when the block
ends.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from ..device import timing_event_type
from ..heartbeat import Heartbeat
from ..ledger import Ledger
from ..run_folder import rank_ledger
from . import intercept, megatron_step, pipeline
from .attribution import ACCUMULATE_GRAD
from .kinds import KindResolver
from .ledger_file import LedgerFile
from .ops import nbytes
from .tracking import Tracker

__all__ = ["record_comms", "Recorder", "mark_step"]


_DTYPES: dict = {}  # torch dtype -> its name in an event

class Recorder:
    """The sink of :mod:`.intercept`: one rank's :class:`Ledger` plus where to write it."""

    def __init__(self, ledger: Ledger, *, steps: int | None, compute: bool,
                 path: Path | None) -> None:
        self.ledger = ledger
        self.on = True
        self.steps = steps
        self.file = None if path is None else LedgerFile(ledger, path)
        self.kinds = KindResolver()
        self.tracker = Tracker(compute=compute, on_step=self._stepped,
                               on_optimizer=intercept.poll,
                               on_optimizer_done=self._optimizer_done,
                               on_setup_end=self._setup_ended, ledger=ledger)
        self._setup: list[tuple[dict, str]] = []  # setup events and their phase as seen
        self._groups: dict = {}  # process group -> (its name, its ranks, its description)
        self.now = ledger.stamp  # a device event once the program communicates on CUDA

    def launch(self, op: str, tensors: list, pg, peer, async_op: bool, coalesced: bool,
               fields: dict | None = None) -> dict:
        """Record one operation launched now; returns its event (times are filled later).
        ``fields``: ``root`` (a group rank, recorded as the global one) or all-to-all
        ``input_splits``/``output_splits``. Runs at every collective of the program: keep it
        short (``benchmarks/record_overhead.py``)."""
        known = self._groups.get(pg)  # by the group object: no property read per launch
        if known is None:
            known = self._groups[pg] = (pg.group_name, dist.get_process_group_ranks(pg),
                                        getattr(pg, "group_desc", "") or "")
        name, ranks, desc = known
        phase, module, where, node = self.tracker.where(sys._getframe(1))
        extra = None
        if peer is not None or op == "recv" or fields or (coalesced and len(tensors) != 1):
            extra = self._extra(op, phase, tensors, ranks, peer, coalesced, fields)
            phase = extra.pop("phase")
        if tensors:
            first = tensors[0]
            if torch.cuda._initialized and first.is_cuda:  # no CUDA tensor before CUDA is up
                self._device_clock(first.device)
            dtype = _DTYPES.get(first.dtype)
            if dtype is None:
                dtype = _DTYPES[first.dtype] = str(first.dtype).removeprefix("torch.")
            shape = list(first.shape)
            size = first.nbytes if len(tensors) == 1 else nbytes(tensors)
        else:
            shape = dtype = None
            size = 0
        event = self.ledger.event(op, phase, self.kinds.kind(name, desc, ranks), where, module,
                                  None, async_op, size, shape, dtype, list(ranks), name, extra)
        if node is not None and type(node) is ACCUMULATE_GRAD:
            event["param_grad"] = True  # fired by a parameter's gradient (a DDP bucket hook)
        if self.tracker.setup:
            self._setup.append((event, phase))
            event["phase"] = "setup"
        if self.file is not None:  # before it starts: a rank that dies in it keeps it
            self.file.launched(event, extra is not None)
        return event

    @staticmethod
    def _extra(op: str, phase: str, tensors: list, ranks: list[int], peer, coalesced: bool,
               fields: dict | None) -> dict:
        """The fields of a point-to-point, rooted, split or coalesced operation (and its phase:
        a pipelining send/recv gets its stage method's role)."""
        if op in ("send", "recv") and tensors:
            role = pipeline.p2p_phase(tensors[0])
            phase = role if role is not None and phase == "other" else phase
        extra = {"phase": phase}
        if peer is not None:
            extra["peer"] = ranks[peer] if 0 <= peer < len(ranks) else peer
        elif op == "recv":
            extra["peer"] = -1  # any source
        if fields:
            extra.update(fields)
            if "root" in fields:
                extra["root"] = ranks[fields["root"]] if 0 <= fields["root"] < len(ranks) \
                    else fields["root"]
        if coalesced and len(tensors) != 1:
            extra["tensors"] = len(tensors)
        return extra

    def _device_clock(self, device) -> None:
        """At the program's first collective on a CUDA tensor: stamp with CUDA events on the
        current stream from now on (when the device gets there, as ``paraloom train`` does),
        resolved into seconds when the lines are rewritten (:meth:`flush`)."""
        if self.ledger._event_type is None:
            self.ledger.use_device_clock(timing_event_type(device))

    def completed(self, event: dict) -> None:
        """An operation of this rank completed (a wait returned, or its Work was seen done)."""
        self.ledger.completed(event)

    def _setup_ended(self, by_forward: bool) -> None:
        """The first iteration began; a setup that ended at an optimizer step without any
        forward was step 1 after all: its events get back the phase they were seen in."""
        self.ledger.step = 1
        if not by_forward:
            for event, phase in self._setup:
                event["phase"], event["step"] = phase, 1
        self._setup = []

    def _stepped(self, step: int) -> None:
        self.ledger.step = step
        if self.steps is not None and step > self.steps:
            self.on = False
            self.tracker.stop_compute()  # no compute spans past the last recorded step either
        self.flush()

    def _optimizer_done(self) -> None:
        intercept.prune()
        self.flush()

    @property
    def flushed(self) -> int:
        """How many events the ledger file holds with their final fields."""
        return 0 if self.file is None else self.file.flushed

    def flush(self) -> None:
        """Write the events since the last flush with their final fields."""
        if self.file is not None:
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        self.ledger.resolve()  # the events a caller reads back: seconds, not CUDA events


_CURRENT: Recorder | None = None


def _flush_current(*_args) -> None:
    if _CURRENT is not None:
        _CURRENT.flush()


def _on_sigterm(signum, frame) -> None:
    _flush_current()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def mark_step() -> None:
    """Say that a training-loop iteration begins here (call it at the top of each iteration).

    For loops the automatic rule does not fit (:mod:`.tracking`: an iteration begins at the first
    forward after an optimizer step). From the first call on, only these calls move the step:
    the first ends ``setup``, each later one begins the next step. Does nothing when nothing is
    being recorded, so a program may keep the call in production."""
    if _CURRENT is not None:
        _CURRENT.tracker.iteration_begins(explicit=True)


@contextmanager
def record_comms(*, out: str | os.PathLike | None = None, steps: int | None = None,
                 compute: bool = False, rank: int | None = None, t0: float | None = None,
                 heartbeat: float = 0.0):
    """Record every communication of this process while the block runs; yields the Ledger.

    ``out``: a folder; this rank's events go to ``out/ledger/rank_R.jsonl``. ``steps``: stop
    recording when iteration ``steps + 1`` begins, so steps ``1 .. steps`` are whole (the program
    runs on; :mod:`.tracking` says where an iteration begins). ``compute``: also record
    leaf modules' forward/backward compute spans (op ``compute``). ``rank`` defaults to the
    process group's rank, else ``$RANK``, else 0; ``t0`` is the clock origin (default: now).
    ``heartbeat``: with ``out``, a hang watch's ``hang_after`` seconds (0: none): the rank then
    beats (:class:`paraloom.heartbeat.Heartbeat`) so a watcher can tell it is blocked.
    """
    global _CURRENT
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be a positive integer (iterations), got {steps!r}")
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    path = None if out is None else rank_ledger(out, rank)
    if path is not None and path.exists():
        path.unlink()  # a fresh record, not appended to an older one
    ledger = Ledger(rank, t0)
    rec = Recorder(ledger, steps=steps, compute=compute, path=path)
    intercept.install(rec)
    rec.kinds.install()
    rec.tracker.install()
    pipeline.install_phases()
    megatron_step.install(rec.tracker)
    if compute:
        pipeline.install(ledger, lambda: rec.on)
    _CURRENT = rec
    if rec.file is not None:
        rec.file.start()
    beat = None
    if path is not None and heartbeat > 0:
        beat = Heartbeat(ledger, out, unflushed=lambda: rec.ledger.events[rec.flushed:],
                         poll=intercept.poll, tail_after=min(1.0, heartbeat / 2)).start()
    old_term = None
    if path is not None:
        atexit.register(_flush_current)
        try:
            old_term = signal.signal(signal.SIGTERM, _on_sigterm)
        except ValueError:  # not the main thread: no handler, the other flushes still hold
            old_term = None
    try:
        yield ledger
    finally:
        rec.on = False
        intercept.settle()
        if beat is not None:
            beat.stop()
        pipeline.uninstall()
        pipeline.uninstall_phases()
        megatron_step.uninstall()
        rec.tracker.uninstall()
        rec.kinds.uninstall()
        intercept.uninstall()
        rec.close()
        _CURRENT = None
        if path is not None:
            atexit.unregister(_flush_current)
            if old_term is not None:
                signal.signal(signal.SIGTERM, old_term)
