"""``paraloom record``'s launcher: bad input is refused (exit 2) before any rank starts, and
the ranks die with the launcher, whether it is stopped (SIGTERM) or killed (SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HANG = """\
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(2)
dist.all_reduce(t)
print("ready", flush=True)
time.sleep(120)
"""


def test_broken_program_refused_before_ranks_start(tmp_path, capsys):
    from paraloom.record.command import record_main
    (tmp_path / "syn.py").write_text("def f(:\n    pass\n")
    assert record_main(["--nproc", "2", "--out", str(tmp_path / "o"), "--",
                        str(tmp_path / "syn.py")]) == 2
    assert record_main(["--nproc", "2", "-m", "no_such_pkg_h6.train"]) == 2
    err = capsys.readouterr().err
    assert "does not compile" in err and "syn.py" in err
    assert "'no_such_pkg_h6.train' cannot be found" in err
    assert not (tmp_path / "o" / "ledger").exists()  # no rank ever started


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and prctl")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_ranks_die_with_the_launcher(tmp_path, sig):
    (tmp_path / "hang.py").write_text(HANG)
    log = tmp_path / "log"
    with open(log, "w") as f:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "paraloom", "record", "--nproc", "2", "--out",
             str(tmp_path / "o"), "--", str(tmp_path / "hang.py")],
            stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        deadline = time.monotonic() + 60
        while log.read_text().count("ready") < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, log.read_text()
            time.sleep(0.2)
        ranks = [int(p) for p in subprocess.run(
            ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()]
        assert len(ranks) == 2
        launcher.send_signal(sig)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(_alive(r) for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [r for r in ranks if _alive(r)], f"ranks outlived the launcher ({sig.name})"
        assert launcher.returncode != 0
        ledgers = sorted((tmp_path / "o" / "ledger").glob("rank*.jsonl"))
        assert len(ledgers) == 2 and all(p.read_text().strip() for p in ledgers)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL) if launcher.poll() is None else None
