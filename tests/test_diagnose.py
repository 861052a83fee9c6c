"""``paraloom diagnose`` and ``record --hang-after``: every failure class of
``tests/_diagnose_cases.py`` on 4 gloo ranks, diagnosed live, with the culprit and its line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _diagnose_cases as cases
import pytest

from paraloom.commands import main as paraloom

HANG_AFTER = 3
PROGRAM = Path(cases.__file__)


def _record(tmp: Path, case: str) -> dict:
    out = tmp / case
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "paraloom", "record", "--nproc", "4",
                           "--hang-after", str(HANG_AFTER), "--timeout", "120", "--out",
                           str(out), "--", str(PROGRAM), case],
                          capture_output=True, text=True, timeout=180)
    return {"out": out, "code": proc.returncode, "stderr": proc.stderr,
            "seconds": time.monotonic() - start}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case recorded once (three at a time: most of a hang is waiting)."""
    tmp = tmp_path_factory.mktemp("diagnose")
    with ThreadPoolExecutor(3) as pool:
        done = dict(zip(cases.CULPRIT, pool.map(lambda c: _record(tmp, c), cases.CULPRIT),
                        strict=True))
    return done


BROKEN = [c for c, r in cases.CULPRIT.items() if r is not None]


@pytest.mark.parametrize("case", BROKEN)
def test_live_diagnosis_names_culprit_and_line(runs, case, capsys):
    run = runs[case]
    assert run["code"] != 0, run["stderr"]
    assert "diagnosis" in run["stderr"], run["stderr"]
    saved = json.loads((run["out"] / "diagnosis.json").read_text())
    assert saved["verdict"] in ("mismatch", "hang", "failed")
    assert saved["culprits"] == [cases.CULPRIT[case]], saved["explanation"]
    line = f"_diagnose_cases.py:{cases.marker(case)}"
    sites = [row.get("site") or "" for row in saved["divergence"]["ranks"].values()] \
        if saved["divergence"] else []
    assert line in saved["explanation"] or any(line in s for s in sites), saved
    # found within --hang-after + 15 s of the hang (rank start-up included), not at a timeout
    assert run["seconds"] < 4 * 3 + HANG_AFTER + 15 + 10
    # the same from the folder afterwards, as JSON with the contract keys
    assert paraloom(["diagnose", str(run["out"]), "--json"]) == 1
    again = json.loads(capsys.readouterr().out)
    assert set(again) >= {"verdict", "culprits", "divergence", "explanation"}
    assert again["culprits"] == saved["culprits"]
    per_rank = again["divergence"]["ranks"]
    assert set(next(iter(per_rank.values()))) >= {"op", "dtype", "shape", "bytes", "site",
                                                   "phase", "module", "state"}


def test_hang_is_stopped_with_exit_3(runs):
    for case in ("order", "skip", "p2p", "pipeline"):
        assert runs[case]["code"] == 3, (case, runs[case]["stderr"])


def test_healthy_program_is_ok(runs, capsys):
    run = runs["ok"]
    assert run["code"] == 0, run["stderr"]
    assert not (run["out"] / "diagnosis.json").exists()
    assert paraloom(["diagnose", str(run["out"])]) == 0
    text = capsys.readouterr().out
    assert text.startswith("verdict: ok")


def test_explanations_say_what_diverged(runs):
    def explanation(case):
        return json.loads((runs[case]["out"] / "diagnosis.json").read_text())["explanation"]
    assert "float64" in explanation("dtype") and "float32" in explanation("dtype")
    assert "[120]" in explanation("size") and "[100]" in explanation("size")
    assert "all_gather" in explanation("op")
    assert "root 1" in explanation("root")
    assert "extra all_reduce" in explanation("condition")
    assert "`if loss > 3.2 and step == 1:`" in explanation("condition")
    assert "another order" in explanation("order")
    assert "layers.1" in explanation("fsdp")
    assert "loop" in explanation("pipeline")
    assert "find_unused_parameters" in explanation("ddp")


def test_bad_input_exits_2(tmp_path, capsys):
    assert paraloom(["diagnose", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert paraloom(["diagnose", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "empty" in err and "Traceback" not in err


def test_live_diagnosis_under_torchrun(tmp_path):
    """``torchrun -m paraloom record --hang-after``: rank 0 watches the ledgers every rank writes,
    stops the hung job and names the culprit, as the local launcher does."""
    out = tmp_path / "torchrun"
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         "-m", "paraloom", "record", "--hang-after", str(HANG_AFTER), "--timeout", "120",
         "--out", str(out), "--", str(PROGRAM), "condition"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        raise
    assert proc.returncode != 0 and "the ranks hung" in text, text[-3000:]
    saved = json.loads((out / "diagnosis.json").read_text())
    assert saved["verdict"] == "mismatch" and saved["culprits"] == [3], saved["explanation"]
    assert f"_diagnose_cases.py:{cases.marker('condition')}" in saved["explanation"]
    assert time.monotonic() - start < 60  # the watch, not the 120 s collective timeout


def test_train_names_a_rank_that_dies(tmp_path):
    """``paraloom train --hang-after``: ranks that make progress are never called hung (a
    healthy start with a 2 s watch), and a rank killed mid-run ends the world at once with a
    message naming it, not at the collective timeout."""
    out = tmp_path / "train"
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "paraloom", "train", "--nproc", "4", "--tp", "2", "--pp", "2",
         "--dp", "1", "--steps", "2000", "--hang-after", "2", "--save-every", "0",
         "--timeout", "300", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        live = out / "ledger" / "rank_2.live.json"
        while not live.is_file() and time.monotonic() - start < 120 and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(4)  # two watch periods of healthy training first
        assert proc.poll() is None, "a healthy run ended (or was called hung)"
        os.kill(json.loads(live.read_text())["pid"], 9)
        killed = time.monotonic()
        text, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode not in (0, 3), text[-3000:]  # failed, not a hang verdict
    assert "rank 2" in text, text[-3000:]
    assert time.monotonic() - killed < 60


def test_an_uneven_gather_is_no_mismatch():
    """Megatron's alltoall dispatcher gathers each tp rank's own number of rows (``output_splits``
    the same everywhere): the members agree; different splits, or another row width, do not."""
    from paraloom.diagnose.match import signature

    def gather(rows, splits, width=32):
        return {"op": "all_gather", "dtype": "float32", "shape": [rows, width],
                "output_splits": splits}
    assert signature(gather(17, [17, 16])) == signature(gather(16, [17, 16]))
    assert signature(gather(17, [17, 16])) != signature(gather(16, [17, 15]))
    assert signature(gather(17, [17, 16])) != signature(gather(16, [17, 16], width=8))
    assert signature(gather(17, None)) != signature(gather(16, None))  # even: shapes must match
