"""Megatron programs under ``paraloom record --megatron-on-cpu``, started as real processes.

Each record runs in its own process group, so a record that outlives its wait is killed as a
tree (the recorder and every rank it started) before the test fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_record(out: Path, program: Path, args: list[str], *, nproc: int = 4,
                 timeout: int = 300) -> subprocess.Popen:
    """``paraloom record --megatron-on-cpu --nproc N --out OUT -- PROGRAM ARGS``, started."""
    return subprocess.Popen(
        [sys.executable, "-m", "paraloom", "record", "--megatron-on-cpu", "--nproc", str(nproc),
         "--out", str(out), "--timeout", str(timeout), "--", str(program), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """``(exit code, output)`` of a started record; past ``timeout`` its group is killed."""
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return proc.returncode, text
