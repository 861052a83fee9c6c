"""``paraloom record``'s launcher: bad input is refused (exit 2) before any rank starts, and
the ranks die with the launcher, whether it is stopped (SIGTERM, escalated to SIGKILL for a rank
that ignores it) or killed (SIGKILL). A rank keeps its program's objects alive until it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HANG = """\
import signal, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(2)
dist.all_reduce(t)
if sys.argv[1:] == ["deaf"] and dist.get_rank() == 1:  # as a rank deadlocked holding the GIL
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(120)
"""


def test_broken_program_refused_before_ranks_start(tmp_path, capsys):
    from paraloom.commands.record import main as record_main
    (tmp_path / "syn.py").write_text("def f(:\n    pass\n")
    assert record_main(["--nproc", "2", "--out", str(tmp_path / "o"), "--",
                        str(tmp_path / "syn.py")]) == 2
    assert record_main(["--nproc", "2", "-m", "no_such_pkg_h6.train"]) == 2
    err = capsys.readouterr().err
    assert "does not compile" in err and "syn.py" in err
    assert "'no_such_pkg_h6.train' cannot be found" in err
    assert not (tmp_path / "o" / "ledger").exists()  # no rank ever started


def test_module_found_in_the_working_folder_as_python_m_does(tmp_path, monkeypatch):
    from paraloom.commands.record import _preflight
    (tmp_path / "main_h6.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    path = list(sys.path)
    assert _preflight(["-m", "main_h6"]) is None
    assert sys.path == path


KEEP = """\
import sys
class Model:
    def __del__(self):
        print("finalized", flush=True)
model = Model()
if sys.argv[1] == "exit":
    sys.exit(3)
if sys.argv[1] == "raise":
    raise ValueError("boom")
"""


def test_program_objects_outlive_the_program(tmp_path):
    """The program's globals are not freed when it ends (returns, exits or raises): freeing a
    module-level DDP there deadlocks gloo's thread against the GIL (see ``bootstrap._KEEP``)."""
    (tmp_path / "keep.py").write_text(KEEP)
    driver = textwrap.dedent(f"""
        import gc, os, sys
        from paraloom.record.bootstrap import run_program
        for how in ("return", "exit", "raise"):
            code = run_program({str(tmp_path / "o")!r}, None, False,
                               [{str(tmp_path / "keep.py")!r}, how])
            gc.collect()  # the program's globals are a cycle (its functions' __globals__)
            print("ended", how, code, flush=True)
        os._exit(0)  # as a rank ends
    """)
    proc = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["ended return 0", "ended exit 3", "ended raise 1"], \
        proc.stdout
    assert "finalized" not in proc.stdout


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
    """With SIGTERM, rank 1 ignores the SIGTERM it is sent: the launcher kills it."""
    (tmp_path / "hang.py").write_text(HANG)
    log = tmp_path / "log"
    with open(log, "w") as f:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "paraloom", "record", "--nproc", "2", "--out",
             str(tmp_path / "o"), "--", str(tmp_path / "hang.py"),
             *(["deaf"] if sig == signal.SIGTERM else [])],
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
        if sig == signal.SIGTERM:
            assert launcher.returncode == 128 + signal.SIGTERM
            assert "the run was stopped by SIGTERM to the launcher; ranks 0-1 still running " \
                "got SIGTERM, then SIGKILL: rank 1 did not exit within" in log.read_text()
        ledgers = sorted((tmp_path / "o" / "ledger").glob("rank*.jsonl"))
        assert len(ledgers) == 2 and all(p.read_text().strip() for p in ledgers)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL) if launcher.poll() is None else None
