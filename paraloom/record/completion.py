"""When a recorded operation ends: the Works and functional outputs :mod:`.intercept` hands over.

A ``c10d`` op returns a ``Work``: Python waits on it (``Work.wait``, patched here to time the
wait: ``t_wait`` when it begins, ``t_end`` when it returns, the Work held so that Python gets
back the same object), or C++ does (DDP's reducer): then ``t_end`` (and ``t_wait``) is the first
time the recorder saw it completed, polled at the next launch, at optimizer steps and by the
heartbeat (an upper bound). A functional op returns a tensor that ``wait_tensor`` waits on
(through the dispatcher, or through ``funcol.wait_tensor`` from inside DTensor's own
``__torch_dispatch__``, patched here too).
"""

from __future__ import annotations

import time
from functools import partial

import torch
import torch.distributed._functional_collectives as funcol

__all__ = ["install", "uninstall", "hold_work", "hold_output", "timed_wait", "prune", "settle",
           "poll", "poll_now"]

_Work = torch._C._distributed_c10d.Work
_ORIG_WAIT = _Work.wait
_ORIG_FUNCOL_WAIT = funcol.wait_tensor

_SINK = None  # the active recorder: .now(), .completed(event)
_WORKS: dict[int, list] = {}  # id(Work) -> [Work, event, 0 | 1 waited | 2 seen complete]
_UNSEEN: list[list] = []  # the entries of _WORKS neither waited nor seen complete yet
_TENSORS: dict[int, list] = {}  # data_ptr of a functional output -> [tensor, event, waited]


def install(sink) -> None:
    global _SINK
    _SINK = sink
    _Work.wait = _observed_wait
    funcol.wait_tensor = _observed_wait_tensor


def uninstall() -> None:
    global _SINK
    _Work.wait = _ORIG_WAIT
    funcol.wait_tensor = _ORIG_FUNCOL_WAIT
    _SINK = None
    _WORKS.clear()
    _UNSEEN.clear()
    _TENSORS.clear()


def hold_work(work, event: dict) -> None:
    """``work`` (unboxed) belongs to ``event``: time its end."""
    entry = [work, event, 0]
    _WORKS[id(work)] = entry
    _UNSEEN.append(entry)


def hold_output(tensor, event: dict) -> None:
    """``tensor``, a functional op's output, belongs to ``event``: time its ``wait_tensor``."""
    _TENSORS[tensor.data_ptr()] = [tensor, event, False]


def prune() -> None:
    """Drop finished Works and all functional outputs (called at optimizer steps): the holds
    only exist to match a later wait, and must not keep tensors alive across steps."""
    if _SINK is not None and _UNSEEN:
        poll_now(_SINK.now)
    if _WORKS:
        for key in [key for key, entry in _WORKS.items() if entry[2]]:
            del _WORKS[key]
    if _TENSORS:
        for entry in _TENSORS.values():  # never waited: done by now (DTensor waits its own)
            entry[1].pop("pending", None)
        _TENSORS.clear()


def settle(patience_s: float = 0.5) -> None:
    """At the end of a record: give Works still in flight a moment to complete, so that a
    healthy program ends with nothing ``pending`` (what :mod:`paraloom.diagnose` reads)."""
    deadline = time.monotonic() + patience_s
    while _SINK is not None and _UNSEEN:
        poll_now(_SINK.now)
        if not _UNSEEN or time.monotonic() > deadline:
            break
        time.sleep(0.01)


def poll() -> None:
    """:func:`poll_now` on the active recorder's clock (called when an optimizer step starts)."""
    if _SINK is not None and _UNSEEN:
        poll_now(_SINK.now)


def poll_now(now) -> None:
    """Give Works nobody waited on from Python (DDP's reducer waits in C++) the first time they
    are seen complete as their end. Polled at each launch and optimizer step, not by a future
    callback: that would run Python on the backend's worker thread, which then queues for the
    GIL while the next collectives wait behind it (measured: DDP steps 15-30% slower)."""
    t = None
    keep = []
    for entry in _UNSEEN:
        if entry[2]:  # waited from Python meanwhile: timed there
            continue
        if not entry[0].is_completed():
            keep.append(entry)
            continue
        t = now() if t is None else t
        entry[1]["t_wait"] = entry[1]["t_end"] = t
        if not _succeeded(entry[0]):
            entry[1]["failed"] = True
        if _SINK is not None:
            _SINK.completed(entry[1])
        entry[2] = 2  # seen complete; a later Python wait still times itself
    _UNSEEN[:] = keep


def _succeeded(work) -> bool:
    try:
        return work.is_success()
    except RuntimeError:  # torch asks for completion first on some backends
        return True


def _observed_wait(self, *args, **kwargs):
    entry = _WORKS.pop(id(self), None)
    sink = _SINK
    if entry is None or sink is None or entry[0] is not self:
        return _ORIG_WAIT(self, *args, **kwargs)
    event = entry[1]
    event["t_wait"] = sink.now()
    entry[2] = 1
    try:
        return _ORIG_WAIT(self, *args, **kwargs)
    except BaseException:
        event["failed"] = True  # gloo raised: a peer went away or sent something else
        raise
    finally:
        event["t_end"] = sink.now()
        sink.completed(event)


def timed_wait(tensor, wait):
    """Run ``wait()`` for a functional output, timing it if it is a recorded one."""
    entry = _TENSORS.pop(tensor.data_ptr(), None)
    sink = _SINK
    if entry is None or sink is None:
        return wait()
    if not entry[2]:
        entry[1]["t_wait"] = sink.now()
        entry[2] = True
    try:
        return wait()
    finally:
        entry[1]["t_end"] = sink.now()
        sink.completed(entry[1])


def _observed_wait_tensor(tensor):
    """``funcol.wait_tensor``, which DTensor's AsyncCollectiveTensor calls from inside its own
    ``__torch_dispatch__`` (autograd keys excluded there, so the dispatcher kernel misses it):
    timed here so those waits get their ``t_wait``/``t_end`` too."""
    return timed_wait(tensor, partial(_ORIG_FUNCOL_WAIT, tensor))
