"""Reliability: bad input is named before ranks start, faults end the world naming the rank,
a crash during a save loses nothing, NaN steps are skipped, and runs are deterministic."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time

import pytest
from conftest import layout_config, metrics

from paraloom import launch
from paraloom.config import ModelConfig, ParallelConfig, TrainConfig
from paraloom.data_parallel.clip_grads import GradNorm

MODEL = ModelConfig(vocab_size=256, hidden_size=32, num_layers=4, num_attention_heads=4,
                    seq_length=16)
BASE = TrainConfig().replace(parallel=ParallelConfig(), model=MODEL,
                             global_batch_size=8, micro_batch_size=1, steps=4, lr=3e-3,
                   warmup_steps=1, save_every=0, ledger_steps=1, timeout_s=10)


def _config(tmp_path, name, **layout):
    return layout_config(BASE, tmp_path / name, **layout)


def _metrics(cfg) -> list[dict]:
    return metrics(cfg.run.out)


def _no_rank_left() -> bool:
    children = [p for p in multiprocessing.active_children() if p.name.startswith("paraloom")]
    return not children


def _rank(rank, world, cfg, t0, fault=None):
    """The real training loop, with an optional fault injected into this forked rank."""
    from paraloom.training import checkpoint, loop, train
    if fault is not None:
        kind, who, when = fault
        if kind in ("raise", "kill") and rank == who:
            real = train.train_step

            def faulty(run, step):
                if step == when:
                    if kind == "raise":
                        raise ValueError(f"injected fault on rank {rank} at step {step}")
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(run, step)
            loop.train_step = faulty
        if kind == "kill-during-save" and rank == who:
            real_replace = checkpoint.os.replace

            def dying_replace(src, dst):
                if str(dst).endswith(f"step_{when}"):
                    os.kill(os.getpid(), signal.SIGKILL)  # files written, rename never happens
                return real_replace(src, dst)
            checkpoint.os.replace = dying_replace
        if kind == "nan":
            real_norm = GradNorm.local_sq_norm
            steps, state = set(when), {"step": 0}
            real_step = loop.train_step

            def counted_step(run, step):
                state["step"] = step
                return real_step(run, step)

            def nan_norm(self, device, expert=False):
                value = real_norm(self, device, expert)
                return value * float("nan") if state["step"] in steps and rank == who else value
            loop.train_step = counted_step
            GradNorm.local_sq_norm = nan_norm
    loop.run_rank(cfg, t0)


def _spawn(cfg, fault=None):
    launch.spawn(_rank, cfg.parallel.world_size, cfg, time.time(), fault,
                 timeout_s=cfg.run.timeout_s)


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2), dict(dp=2)],
                         ids=["tp", "pp", "dp"])
@pytest.mark.parametrize("kind", ["raise", "kill"])
def test_a_failing_rank_ends_the_world_and_is_named(tmp_path, layout, kind):
    cfg = _config(tmp_path, "run", **layout)
    tic = time.time()
    with pytest.raises(RuntimeError) as err:
        _spawn(cfg, (kind, 1, 1))
    assert time.time() - tic < cfg.run.timeout_s + 15
    message = str(err.value)
    if kind == "raise":
        assert message.startswith("rank 1 failed") and "injected fault on rank 1" in message
    else:
        assert message.startswith("rank 1 died") and "SIGKILL" in message
    assert _no_rank_left()
    assert len(_metrics(cfg)) == 1  # step 1 was written and flushed before the fault


def test_kill_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    kw = dict(tp=2, pp=2, steps=6, save_every=2)
    straight = _config(tmp_path, "straight", **kw)
    _spawn(straight)
    crashed = _config(tmp_path, "crashed", **kw)
    with pytest.raises(RuntimeError, match="rank 0 died"):
        _spawn(crashed, ("kill-during-save", 0, 4))
    ckpts = sorted(p.name for p in (tmp_path / "crashed" / "checkpoints").iterdir())
    assert ckpts == ["step_2", "step_4.tmp"]
    resumed = crashed.replace(resume=str(tmp_path / "crashed"))
    _spawn(resumed)
    got = [m for m in _metrics(resumed) if m["step"] >= 3]
    want = [m for m in _metrics(straight) if m["step"] >= 3]
    assert [m["step"] for m in got][-4:] == [3, 4, 5, 6]
    for a, b in zip(got[-4:], want, strict=True):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]


def test_same_command_twice_gives_identical_losses(tmp_path):
    runs = []
    for name in ("a", "b"):
        cfg = _config(tmp_path, name, tp=2, dp=2)
        _spawn(cfg)
        runs.append([(m["loss"], m["grad_norm"]) for m in _metrics(cfg)])
    assert runs[0] == runs[1]


def test_nan_steps_are_skipped_then_the_run_stops(tmp_path):
    cfg = _config(tmp_path, "once", tp=2, pp=2)
    _spawn(cfg, ("nan", 3, {1}))  # rank 3 (last stage) sees a NaN gradient at step 2
    metrics = _metrics(cfg)
    assert [bool(m.get("skipped")) for m in metrics] == [False, True, False, False]
    assert all(m["loss"] == m["loss"] for m in metrics)  # the loss itself stayed finite
    cfg = _config(tmp_path, "always", tp=2, steps=8, max_bad_steps=3)
    with pytest.raises(RuntimeError, match="stopping at step 4: 3 consecutive steps"):
        _spawn(cfg, ("nan", 0, set(range(1, 8))))


def test_ctrl_c_and_a_closed_pipe_end_without_a_traceback(monkeypatch, capsys):
    import paraloom.commands as cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_main", interrupted)
    assert cli.main(["train"]) == 130
    assert capsys.readouterr().err.strip() == "paraloom: interrupted"
    r, w = os.pipe()  # stdout a pipe whose reader is gone: plan | head
    os.close(r)
    out = os.fdopen(w, "w")
    monkeypatch.setattr(sys, "stdout", out)

    def closed(argv):
        raise BrokenPipeError

    monkeypatch.setattr(cli, "_main", closed)
    try:
        assert cli.main(["plan"]) == 141
        out.write("after the reader left\n")
        out.flush()  # stdout now goes nowhere instead of raising again
    finally:
        out.close()
