"""Live diagnosis: the launcher's check of its running ranks, and rank 0's watch under torchrun.

:func:`checker` gives a launcher (``record --nproc``, ``train``) a function it calls twice a
second with the ranks still alive; it answers a :class:`~.verdict.Diagnosis` once every one of
them has been blocked ``hang_after`` seconds (:func:`paraloom.heartbeat.blocked`) *and* the
evidence shows a disagreement (a mismatch, or a collective some member never launched) -- a
slow all-reduce every member waits in is not one. Under torchrun no parent sees every rank, so
:func:`watch_in_rank_0` runs the same check in a daemon thread of rank 0 over the files it sees
(a folder every node shares), prints the diagnosis, writes ``diagnosis.json`` and ends the
process with :data:`HANG_EXIT`, which makes torchrun stop the other ranks.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..heartbeat import blocked
from ..run_folder import rank_status
from .evidence import load
from .render import render
from .verdict import Diagnosis, diagnose

__all__ = ["checker", "watch_in_rank_0", "write_diagnosis", "after_run", "HANG_EXIT"]

HANG_EXIT = 3
"""Exit code of ``record`` / ``train`` when they stopped ranks that hung (diagnosis printed)."""

_EVERY_S = 0.5


def checker(out: str | Path, hang_after: float) -> Callable[[list[int]], Diagnosis | None]:
    """``check(alive)``: a diagnosis when ``alive`` have all been blocked ``hang_after`` s and
    disagree, else ``None`` (cheap until then: one small file read per rank per call)."""
    state = {"next": 0.0}

    def check(alive: list[int]) -> Diagnosis | None:
        now = time.monotonic()
        if hang_after <= 0 or now < state["next"]:
            return None
        state["next"] = now + _EVERY_S
        if not blocked(out, alive, hang_after):
            return None
        d = diagnose(load(out))
        if d.verdict in ("mismatch", "hang", "failed") and d.culprits:
            return d
        state["next"] = now + max(_EVERY_S, hang_after / 2)  # every member waits: not yet
        return None
    return check


def write_diagnosis(out: str | Path, d: Diagnosis) -> Path:
    path = Path(out) / "diagnosis.json"
    path.write_text(json.dumps(d.as_json(), indent=2) + "\n")
    return path


def watch_in_rank_0(out: str | Path, world: int, hang_after: float, prefix: str) -> None:
    """Start rank 0's watch thread (torchrun): ranks that left a status have ended."""
    check = checker(out, hang_after)

    def run() -> None:
        while True:
            time.sleep(_EVERY_S)
            alive = [r for r in range(world) if not rank_status(out, r).exists()]
            try:
                d = check(alive)
            except Exception:  # noqa: BLE001 - a damaged file mid-write: look again
                continue
            if d is not None:
                write_diagnosis(out, d)
                print(f"{prefix}: the ranks hung (every rank blocked {hang_after:g} s); "
                      f"diagnosis:\n{render(d, load(out))}", file=sys.stderr, flush=True)
                os._exit(HANG_EXIT)
    threading.Thread(target=run, name="paraloom-hang-watch", daemon=True).start()


def after_run(out: str | Path, codes: dict[int, int], stopped, prefix: str,
              found: Diagnosis | None = None) -> Diagnosis | None:
    """After a run that did not succeed: note how each rank ended in ``out/failure.json``
    (``stopped``: ranks the launcher ended), diagnose (or take the live diagnosis ``found``),
    write ``diagnosis.json`` and print it. Nothing when every rank exited 0."""
    if all(c == 0 for c in codes.values()) and found is None:
        return None
    ranks = {str(r): {"exit": c, "stopped": r in stopped} for r, c in codes.items()}
    (Path(out) / "failure.json").write_text(json.dumps({"ranks": ranks}, indent=2) + "\n")
    evidence = load(out)
    d = diagnose(evidence)  # the final evidence: how every rank ended, the live part's too
    path = write_diagnosis(out, d)
    print(f"{prefix}: diagnosis ({path}):\n{render(d, evidence)}", file=sys.stderr, flush=True)
    return d
