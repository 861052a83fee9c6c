"""benchmarks/gpu.sh, run here in its CPU mode: the same pipeline (train, throughput and MFU,
``paraloom check``) on local gloo ranks, so the script a GPU machine runs is itself tested; it
must exit non-zero when any part is not sound."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_summary  # noqa: E402


def _gpu_sh(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, DEVICE="cpu", PYTHON=sys.executable, OUT_DIR=str(tmp_path / "run"),
                **env)
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh")], env=full, text=True,
                          capture_output=True, timeout=600)


def test_gpu_sh_trains_reports_and_checks(tmp_path):
    done = _gpu_sh(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for expected in ("tokens/s: ", "MFU: ", "held-out loss: ", "rows agree", "gpu.sh: all sound"):
        assert expected in out, f"{expected!r} missing from:\n{out[-3000:]}"
    mfu = float(out.split("MFU: ")[1].split("%")[0])
    assert 0 < mfu < 100
    # the summary refuses a run it cannot time (too few steps after the warm-up)
    run = tmp_path / "run"
    assert gpu_summary.main([str(run), "--gpus", "2", "--device-name", "cpu",
                             "--warmup", "7", "--peak-tflops", "1"]) == 1


def test_gpu_sh_fails_on_a_layout_the_devices_do_not_fit(tmp_path):
    done = _gpu_sh(tmp_path, TP="3")
    assert done.returncode == 2 and "do not divide into TP=3" in done.stderr


def test_device_names_map_to_their_peaks():
    assert gpu_summary.peak_of("NVIDIA H200") == ("h200", 989e12)
    assert gpu_summary.peak_of("NVIDIA H100 80GB HBM3")[0] == "h100-sxm"
    assert gpu_summary.peak_of("NVIDIA H100 PCIe") == (None, None)  # no preset: not guessed
    assert gpu_summary.peak_of("NVIDIA A100-SXM4-40GB")[0] == "a100-40gb"
    assert gpu_summary.peak_of("Tesla T4") == (None, None)
