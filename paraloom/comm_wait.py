"""Waiting on paraloom's communication: handles, the timeout every wait obeys, and the flight
recorder a timeout prints (the last operations this rank launched).

:mod:`paraloom.comm` launches every operation and returns a :class:`Handle` (or waits on it at
once); nothing here calls a collective. A wait past the timeout raises :class:`CommTimeout`,
naming the operation and its group, after printing the flight recorder to stderr.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from datetime import timedelta

import torch.distributed as dist

from . import ledger as _ledger

__all__ = ["CommTimeout", "Handle", "P2PHandle", "set_timeout", "get_timeout",
           "flight_recorder", "RECENT"]

_TIMEOUT = timedelta(seconds=300)


class CommTimeout(RuntimeError):
    """A communication did not complete within the timeout (a peer is slow, dead or mismatched)."""


def set_timeout(seconds: float) -> None:
    """Timeout for every wait in this process (the process group's own timeout is set at init)."""
    global _TIMEOUT
    if seconds <= 0:
        raise ValueError(f"timeout must be positive seconds, got {seconds}")
    _TIMEOUT = timedelta(seconds=seconds)


def get_timeout() -> timedelta:
    return _TIMEOUT


class Handle:
    """An operation in flight. ``wait()`` blocks (bounded by the timeout) and returns the result."""

    __slots__ = ("_works", "_event", "_result", "_finish", "_desc", "_done")

    def __init__(self, works, result, event=None, finish=None, desc: str = "") -> None:
        self._works, self._result, self._event, self._finish = works, result, event, finish
        self._desc, self._done = desc, False

    def wait(self):
        if self._done:
            return self._result
        event, led = self._event, _ledger.active()
        if event is not None and led is not None:
            event["t_wait"] = led.stamp()
        for work in self._works:
            _wait(work, self._desc)
        if self._finish is not None:
            self._result = self._finish(self._result)
        if event is not None and led is not None:
            event["t_end"] = led.stamp()  # on CUDA: after the stream was made to wait
            led.completed(event)
        self._done = True
        return self._result


RECENT: deque = deque(maxlen=16)
"""Flight recorder: the last operations launched on this rank (always on; a deque append)."""


def flight_recorder() -> str:
    """The recent operations of this rank, oldest first, as text (what a hang was waiting on)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    now = time.time()
    lines = [f"  {now - t:8.3f} s ago: {desc}" for t, desc in RECENT]
    return f"flight recorder, rank {rank}, last {len(lines)} operations (oldest first):\n" + \
        "\n".join(lines)


def _wait(work, desc: str) -> None:
    try:
        ok = work.wait(_TIMEOUT)
        limit = _TIMEOUT.total_seconds()
        problem = None if ok is not False else f"did not complete within {limit:g} s"
    except RuntimeError as err:  # gloo raises on timeout or on a peer that went away
        problem = f"failed or timed out after {_TIMEOUT.total_seconds():g} s: {err}"
    if problem is not None:
        record = flight_recorder()
        print(f"paraloom: {desc} {problem}\n{record}", file=sys.stderr, flush=True)
        raise CommTimeout(f"{desc} {problem}\n{record}")


class P2PHandle(Handle):
    __slots__ = ("_events",)

    def __init__(self, works, result, events, desc) -> None:
        super().__init__(works, result, None, None, desc)
        self._events = events

    def wait(self):
        led = _ledger.active()
        for event in self._events:
            event["t_wait"] = led.stamp() if led else event["t_wait"]
        result = super().wait()
        for event in self._events:
            if led:
                event["t_end"] = led.stamp()
                led.completed(event)
        return result
