"""The local ranks of ``paraloom record --nproc N``: start them, watch them, stop them.

Each rank is a fresh interpreter running :mod:`.bootstrap` with torchrun's variables (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); the
program calls ``init_process_group`` itself. If one rank fails, the others get a grace period,
then SIGTERM (each flushes its ledger) and, if still running, SIGKILL; a timeout or a signal to
the launcher stops them the same way. Ranks end with the launcher, however it ends
(``PR_SET_PDEATHSIG``). What each rank left in its status file decides whom to blame
(:func:`culprit`).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..launch import PEER_GONE
from ..run_folder import rank_status
from .bootstrap import HANG_AFTER, MEGATRON_ON_CPU

__all__ = ["launch_ranks", "culprit", "status", "wait_for_statuses", "KILL_S", "JOIN_WAIT_S"]

_GRACE_S = 5.0
"""How long the other ranks may go on after one failed before the launcher stops them."""
KILL_S = 2.0
"""How long a rank the launcher stopped (SIGTERM) has to flush its ledger before SIGKILL: a rank
deadlocked in C++ holding the GIL never runs its Python SIGTERM handler."""
JOIN_WAIT_S = 60.0
"""How long rank 0 of a joined (torchrun) record waits for the other ranks' status files."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_launcher(launcher: int):
    """``preexec_fn`` of a rank: on Linux the kernel sends it SIGTERM when the launcher dies,
    even by SIGKILL (``PR_SET_PDEATHSIG``); if the launcher is already gone, stop now."""
    def arm():
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
            if os.getppid() != launcher:  # died between fork and prctl
                os.kill(os.getpid(), signal.SIGTERM)
    return arm


def _catch_signals(stop: dict) -> None:
    """SIGTERM / SIGINT to the launcher: note it; the launcher's loop stops the ranks (see
    :func:`_stop_ranks`), then merges what they left. A second one kills them at once."""
    def caught(signum, frame):
        stop["signal"] = signal.Signals(signum).name
        stop["count"] = stop.get("count", 0) + 1

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, caught)


def _stop_ranks(procs: dict, stop: dict) -> None:
    """SIGTERM to every running rank (each flushes its ledger), SIGKILL to those still running
    :data:`KILL_S` later (or at a second signal); notes them in ``stop``."""
    running = [r for r, p in procs.items() if p.poll() is None]
    stop["ranks"] = set(running)
    for r in running:
        procs[r].send_signal(signal.SIGTERM)
    deadline, count = time.monotonic() + KILL_S, stop.get("count", 0)
    while time.monotonic() < deadline and stop.get("count", 0) <= count \
            and any(procs[r].poll() is None for r in running):
        time.sleep(0.05)
    for r in running:
        if procs[r].poll() is None:
            stop["killed"].add(r)
            procs[r].kill()


def launch_ranks(nproc: int, target: list[str], out: Path, *, steps: int | None, compute: bool,
                 timeout: float, megatron_on_cpu: bool = False, hang_after: float = 0.0,
                 check=None) -> tuple[dict[int, int], dict]:
    """Start ``nproc`` ranks running ``target`` under the recorder and wait; returns each rank's
    exit code (negative: signal) and why the launcher stopped ranks: ``{"why": None | "failure" |
    "timeout" | "hang" | "SIGTERM" | "SIGINT", "ranks": the ranks it stopped, "killed": those it
    had to SIGKILL, "diagnosis": what ``check`` found}``. ``check(alive_ranks)``, called in the
    loop, returns something true when the ranks hang (they beat every 0.5 s when
    ``hang_after`` > 0); a failed rank's peers are stopped after a grace period, or at once
    when ``check`` sees them blocked."""
    env = dict(os.environ, WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               PARALOOM_RECORD_T0=repr(time.time()))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    if megatron_on_cpu:
        env[MEGATRON_ON_CPU] = "1"
    if hang_after > 0:
        env[HANG_AFTER] = repr(hang_after)
    cmd = [sys.executable, "-m", "paraloom.record.bootstrap", str(out), str(steps or 0),
           "1" if compute else "0", *target]
    arm = _die_with_launcher(os.getpid())
    procs = {r: subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                 preexec_fn=arm)
             for r in range(nproc)}
    stop = {"why": None, "ranks": set(), "killed": set()}
    _catch_signals(stop)
    deadline, first_fail = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs.values()):
        now = time.monotonic()
        failed = [r for r, p in procs.items() if p.returncode not in (None, 0)]
        if failed and first_fail is None:
            first_fail = now
        if "signal" in stop:
            stop["why"] = stop["signal"]
        elif now > deadline:
            stop["why"] = "timeout"
        elif first_fail is not None and now - first_fail > _GRACE_S:
            stop["why"] = "failure"
        elif check is not None:
            found = check([r for r, p in procs.items() if p.poll() is None])
            if found:
                stop["why"] = "failure" if first_fail is not None else "hang"
                stop["diagnosis"] = found
        if stop["why"]:
            _stop_ranks(procs, stop)
            break
        time.sleep(0.05)
    return {r: p.wait() for r, p in procs.items()}, stop


def status(out: Path, rank: int) -> dict:
    """What rank ``rank`` wrote about how it ended (``{}`` if nothing)."""
    path = rank_status(out, rank)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def culprit(codes: dict[int, int], statuses: dict[int, dict], stopped: set[int]) -> int:
    """The rank to blame: its own error first (earliest), then one killed from outside, then
    one that chose its own non-zero exit (``sys.exit(3)``, no error), then one that only saw a
    peer go away (the peer may be the one that exited), then any other non-zero exit."""
    def secondary(r: int) -> bool:
        return any(s in (statuses[r].get("error") or "").lower() for s in PEER_GONE)

    bad = [r for r, c in codes.items() if c != 0]
    tiers = ([r for r in bad if statuses[r].get("error") and not secondary(r)],
             [r for r in bad if codes[r] < 0 and r not in stopped],
             [r for r in bad if codes[r] > 0 and r not in stopped and statuses[r]
              and not statuses[r].get("error")],
             [r for r in bad if statuses[r].get("error")],
             [r for r in bad if r not in stopped], bad)
    tier = next(t for t in tiers if t)
    return min(tier, key=lambda r: (statuses[r].get("time", float("inf")), r))


def wait_for_statuses(out: Path, world: int, patience_s: float | None = None) -> list[int]:
    """Rank 0 of a joined (torchrun) record: wait, at most ``patience_s`` (default
    :data:`JOIN_WAIT_S`), until every rank below ``world`` left its status in ``out``; returns
    the ranks still missing."""
    deadline = time.monotonic() + (JOIN_WAIT_S if patience_s is None else patience_s)

    def absent() -> list[int]:
        return [r for r in range(world) if not rank_status(out, r).exists()]
    while time.monotonic() < deadline and absent():
        time.sleep(0.2)
    return absent()
