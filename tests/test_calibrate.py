"""``paraloom plan --calibrate``: this machine measured as hardware, and the fits behind it."""

from __future__ import annotations

import json

import pytest

from paraloom.analysis.hardware import hardware_from
from paraloom.commands.plan_calibrate import main as calibrate_main
from paraloom.measure.calibrate import (
    _fit_alpha_beta,
    _fit_gemm,
    calibrate,
    fit_hardware,
    predict_run,
    to_toml,
)


def test_fits_recover_known_machines():
    # GEMMs timed by a machine of 50 GFLOP/s with half-efficiency dimension 64
    shapes = [(512, 64, 256), (512, 256, 256), (128, 512, 512), (1024, 1024, 1024)]
    gemm = {f"{m},{n},{k}": 2 * m * n * k / (50e9 * m / (m + 64) * n / (n + 64))
            for m, n, k in shapes}
    peak, d0 = _fit_gemm(gemm)
    assert peak == pytest.approx(50e9, rel=1e-6) and d0 == 64
    # all-reduces on 4 ranks of alpha 300 us, beta 1.5 GB/s
    times = {n: 2 * 3 * (300e-6 + 4 * n / (4 * 1.5e9)) for n in (1, 4096, 65536, 1 << 20)}
    alpha, beta = _fit_alpha_beta(4, times)
    assert alpha == pytest.approx(300e-6, rel=1e-6) and beta == pytest.approx(1.5e9, rel=1e-6)


def test_calibrate_two_ranks_writes_hardware_that_predicts(tmp_path, capsys):
    hw, med = calibrate(2, repeat=1)
    assert hw.gpus_per_node == 2 and 1e8 < hw.peak_flops < 1e13
    assert 0 < hw.intra_latency < 0.1 and hw.intra_bw > 1e6 and hw.gather_factor >= 1
    assert 0 < hw.op_overhead < 1e-2 and set(med) >= {"gemm", "add", "allreduce"}
    assert fit_hardware(2, json.loads(json.dumps(med))) == hw  # saved medians fit the same
    path = tmp_path / "local.toml"
    path.write_text(to_toml(hw))
    again = hardware_from(path=str(path))
    assert again == hw
    cfg = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                     "seq_length": 32, "vocab_size": 256},
           "parallel": {"tp": 2, "pp": 1, "dp": 1, "sequence_parallel": False},
           "micro_batch_size": 2, "global_batch_size": 4, "dtype": "fp32"}
    r = predict_run(cfg, again)
    assert r["step_time_s"] > 0 and r["breakdown_s"]["tp_comm"] > 0
    assert calibrate_main(["--calibrate", "--nprocs", "0"]) == 2
    assert "--nprocs" in capsys.readouterr().err


def test_calibrate_cli_writes_toml(tmp_path, capsys, monkeypatch):
    import paraloom.commands.plan_calibrate as cal
    from paraloom.analysis.hardware import GPUS

    measured = GPUS["a100-80gb"]  # the measuring itself is tested above; here the command
    monkeypatch.setattr(cal, "calibrate", lambda nprocs, repeat: (measured, {}))
    out = tmp_path / "one.toml"
    assert calibrate_main(["--calibrate", "--nprocs", "1", "--repeat", "1", "--out",
                           str(out)]) == 0
    assert "GEMM peak 312000.0 GFLOP/s" in capsys.readouterr().out
    assert hardware_from(path=str(out)) == measured
