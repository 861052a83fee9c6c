"""``paraloom train``: every 3D layout trains the same model; resume and reshard continue it.

Each layout is a fresh local world (``launch.spawn`` forks from this process) running the real
training loop; the per-step losses and gradient norms in metrics.jsonl are compared.
"""

from __future__ import annotations

import json
import time

import pytest

from paraloom import launch
from paraloom.config import ModelConfig, ParallelConfig, TrainConfig

MODEL = ModelConfig(vocab_size=256, hidden_size=32, num_layers=8, num_attention_heads=4,
                    seq_length=16)
BASE = TrainConfig().replace(parallel=ParallelConfig(), model=MODEL,
                             global_batch_size=8, micro_batch_size=1, steps=5, lr=3e-3,
                   warmup_steps=1, save_every=0, ledger_steps=1, timeout_s=60)


def _rank(rank, world, cfg, t0):
    from paraloom.training.loop import run_rank
    run_rank(cfg, t0)


def train(tmp_path, name, *, tp=1, pp=1, dp=1, sp=False, vpp=None, cp=1, **kw) -> list[dict]:
    schedule = "interleaved" if vpp else ("1f1b" if pp > 1 else "none")
    cfg = BASE.replace(parallel=ParallelConfig(tp=tp, pp=pp, dp=dp, vpp=vpp, cp=cp,
                                                sequence_parallel=sp),
                  schedule=schedule, out=str(tmp_path / name), **kw)
    launch.spawn(_rank, cfg.parallel.world_size, cfg, time.time(), timeout_s=60)
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _assert_same(got, want, rtol=1e-5):
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=rtol), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=rtol), (a, b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref"), "single")


@pytest.mark.parametrize("layout", [
    dict(tp=2, pp=2, dp=2, sp=True, vpp=2),
    dict(tp=2, pp=1, dp=2, sp=True),
    dict(tp=1, pp=4, dp=1, vpp=2),
    dict(tp=4, pp=1, dp=1, sp=True),
    dict(tp=1, pp=1, dp=4),
    dict(tp=2, pp=2, dp=1, distributed_optimizer=False),
    dict(tp=1, pp=2, dp=2, distributed_optimizer=True),
], ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_every_layout_trains_the_same_model(tmp_path, reference, layout):
    got = train(tmp_path, "run", **layout)
    _assert_same(got, reference)
    assert got[-1]["loss"] < got[0]["loss"]  # and it learns


def test_resume_continues_exactly(tmp_path):
    # the straight run saves at step 3 on its way; resuming from that checkpoint must replay 3..5
    straight = train(tmp_path, "straight", tp=2, pp=2, steps=6, save_every=3)
    step3 = str(tmp_path / "straight" / "checkpoints" / "step_3")
    resumed = train(tmp_path, "second", tp=2, pp=2, steps=6, resume=step3)
    assert [m["step"] for m in resumed] == [3, 4, 5]
    for a, b in zip(resumed, straight[3:], strict=True):  # same layout: bitwise on fp32 CPU
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    for layout in (dict(dp=2), dict(tp=4), dict(dp=2, distributed_optimizer=True)):
        name = "re-" + "-".join(f"{k}{v}" for k, v in layout.items())
        other = train(tmp_path, name, steps=6, resume=step3, **layout)
        _assert_same(other, straight[3:])


def test_eval_gives_the_same_loss_under_any_layout(tmp_path, capfd):
    from paraloom.commands import main
    train(tmp_path, "run", tp=2, pp=2, steps=2, save_every=2)
    capfd.readouterr()
    results = []
    for layout in (["--tp", "1"], ["--tp", "4", "--sequence-parallel"], ["--pp", "2", "--dp", "2"]):
        assert main(["eval", "--resume", str(tmp_path / "run"), "--batches", "2", *layout]) == 0
        line = [x for x in capfd.readouterr().out.splitlines() if x.startswith("{")][-1]
        results.append(json.loads(line))
    assert results[0]["step"] == 2 and results[0]["tokens"] == 2 * 8 * MODEL.seq_length
    for r in results[1:]:
        assert r["loss"] == pytest.approx(results[0]["loss"], rel=1e-5)
    assert main(["eval", "--resume", str(tmp_path / "nowhere")]) == 2
