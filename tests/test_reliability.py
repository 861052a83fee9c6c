"""Reliability: bad input is named before ranks start, faults end the world naming the rank,
a crash during a save loses nothing, NaN steps are skipped, and runs are deterministic."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import replace

import pytest

from paraloom import launch
from paraloom.commands import main
from paraloom.config import ModelConfig, ParallelConfig, TrainConfig
from paraloom.data_parallel.clip_grads import GradNorm

MODEL = ModelConfig(vocab_size=256, hidden_size=32, num_layers=4, num_attention_heads=4,
                    seq_length=16)
BASE = TrainConfig().replace(parallel=ParallelConfig(), model=MODEL,
                             global_batch_size=8, micro_batch_size=1, steps=4, lr=3e-3,
                   warmup_steps=1, save_every=0, ledger_steps=1, timeout_s=10)


def _config(tmp_path, name, *, tp=1, pp=1, dp=1, **kw):
    return BASE.replace(parallel=ParallelConfig(tp=tp, pp=pp, dp=dp),
                   schedule="1f1b" if pp > 1 else "none", out=str(tmp_path / name), **kw)


def _metrics(cfg) -> list[dict]:
    lines = (open(os.path.join(cfg.run.out, "metrics.jsonl")).read().splitlines())
    return [json.loads(line) for line in lines]


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

            def nan_norm(self, device):
                value = real_norm(self, device)
                return value * float("nan") if state["step"] in steps and rank == who else value
            loop.train_step = counted_step
            GradNorm.local_sq_norm = nan_norm
    loop.run_rank(cfg, t0)


def _spawn(cfg, fault=None):
    launch.spawn(_rank, cfg.parallel.world_size, cfg, time.time(), fault, timeout_s=cfg.run.timeout_s)


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
    assert len(_metrics(cfg)) == 1  # step 0 was written and flushed before the fault


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
    got = [m for m in _metrics(resumed) if m["step"] >= 2]
    want = [m for m in _metrics(straight) if m["step"] >= 2]
    assert [m["step"] for m in got][-4:] == [2, 3, 4, 5]
    for a, b in zip(got[-4:], want, strict=True):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]


def test_resume_from_a_different_model_is_refused_before_ranks_start(tmp_path, capsys):
    cfg = _config(tmp_path, "small", steps=1, save_every=1)
    _spawn(cfg)
    assert main(["train", "--resume", cfg.run.out, "--hidden", "64", "--layers", "4"]) == 2
    err = capsys.readouterr().err
    assert "hidden_size = 32 in the checkpoint, 64 here" in err
    assert "seq_length" not in err  # a flag not typed is taken from the checkpoint
    assert _no_rank_left()


def test_same_command_twice_gives_identical_losses(tmp_path):
    runs = []
    for name in ("a", "b"):
        cfg = _config(tmp_path, name, tp=2, dp=2)
        _spawn(cfg)
        runs.append([(m["loss"], m["grad_norm"]) for m in _metrics(cfg)])
    assert runs[0] == runs[1]


def test_nan_steps_are_skipped_then_the_run_stops(tmp_path):
    cfg = _config(tmp_path, "once", tp=2, pp=2)
    _spawn(cfg, ("nan", 3, {1}))  # rank 3 (last stage) sees a NaN gradient at step 1
    metrics = _metrics(cfg)
    assert [bool(m.get("skipped")) for m in metrics] == [False, True, False, False]
    assert all(m["loss"] == m["loss"] for m in metrics)  # the loss itself stayed finite
    cfg = _config(tmp_path, "always", tp=2, steps=8, max_bad_steps=3)
    with pytest.raises(RuntimeError, match="stopping at step 3: 3 consecutive steps"):
        _spawn(cfg, ("nan", 0, set(range(1, 8))))


BAD = [
    (["--tp", "3"], "hidden_size = 64 is not divisible by tp = 3"),
    (["--tp", "0"], "tp must be a positive integer, got 0"),
    (["--pp", "-1"], "pp must be a positive integer, got -1"),
    (["--dp", "0"], "dp must be a positive integer, got 0"),
    (["--heads", "3"], "hidden_size = 64 is not divisible by num_attention_heads = 3"),
    (["--tp", "8", "--heads", "4", "--pp", "1", "--dp", "1"],
     "num_attention_heads = 4 is not divisible by tp = 8"),
    (["--layers", "5"], "--num-layers 5 is not divisible by --pp 2"),
    (["--vpp", "3"], "--num-layers 4 is not divisible by --pp 2 * --vpp 3 = 6"),
    (["--vpp", "2", "--layers", "8", "--global-batch-size", "12", "--micro-batch-size", "2"],
     "(3) to be a multiple of pp = 2"),
    (["--sequence-parallel", "--seq-len", "63"], "seq_length = 63 is not divisible by tp = 2"),
    (["--sequence-parallel", "--async-grad-allreduce"], "cannot be combined"),
    (["--global-batch-size", "10"], "global_batch_size = 10 is not divisible by"),
    (["--micro-batch-size", "0"], "micro_batch_size must be a positive integer, got 0"),
    (["--steps", "0"], "steps must be a positive integer, got 0"),
    (["--seq-len", "0"], "seq_length must be a positive integer, got 0"),
    (["--hidden", "0"], "hidden_size must be a positive integer, got 0"),
    (["--vocab", "100"], "--vocab 100"),
    (["--dropout", "1.5"], "dropout must be in [0, 1), got 1.5"),
    (["--lr", "0"], "lr (--lr) must be a positive number, got 0.0"),
    (["--lr", "-1"], "lr (--lr) must be a positive number, got -1.0"),
    (["--lr", "nan"], "lr (--lr) must be a positive number, got nan"),
    (["--min-lr", "1"], "min_lr (--min-lr) must be between 0 and lr = 0.003"),
    (["--weight-decay", "-1"], "weight_decay (--weight-decay) must be >= 0, got -1.0"),
    (["--bucket-size", "0"], "bucket_size (--bucket-size, elements) must be a positive integer"),
    (["--ledger-steps", "0"], "(--ledger-steps) must be a positive number of steps or -1"),
    (["--ledger-steps", "-5"], "(--ledger-steps) must be a positive number of steps or -1"),
    (["--clip-grad", "nan"], "clip_grad (nan) must be >= 0"),
    (["--out", __file__], "exists and is not a folder"),
    (["--tp", "2", "--pp", "1", "--dp", "1", "--nprocs", "4"], "--nprocs 4 does not match"),
    (["--schedule", "none"], "schedule none (no pipelining) needs pp = 1, got pp = 2"),
    (["--schedule", "interleaved"],
     "needs vpp >= 2 (--vpp, virtual stages per pipeline rank), got no vpp"),
    (["--data", "/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
    (["--resume", "/nonexistent/run"], "/nonexistent/run"),
    (["--max-bad-steps", "0"], "max_bad_steps must be a positive integer, got 0"),
    (["--timeout", "0"], "timeout_s (--timeout) must be a positive number of seconds, got 0.0"),
    (["--timeout", "nan"], "must be a positive number of seconds, got nan"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_named_before_any_rank_starts(capsys, argv, message):
    tic = time.time()
    assert main(["train", *argv]) == 2
    assert time.time() - tic < 10
    err = capsys.readouterr().err
    assert message in err, err
    assert _no_rank_left()


def test_unknown_flag_and_foreign_resume_folder(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--tensor-parallel", "2"])
    assert exit_.value.code == 2
    assert "--tensor-parallel" in capsys.readouterr().err
    foreign = tmp_path / "checkpoints" / "step_3"
    foreign.mkdir(parents=True)
    (foreign / ".metadata").write_bytes(b"not ours")
    (foreign / "meta.json").write_text(json.dumps({"step": 3}))
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "is not a paraloom checkpoint" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["train", "--data", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err


def test_moe_flags_without_experts_are_noted(capsys):
    assert main(["train", "--moe-router-topk", "1", "--moe-aux-loss-coeff", "0.5", "--tp",
                 "0"]) == 2  # stopped by --tp 0 after the flags were read
    err = capsys.readouterr().err
    assert ("--moe-aux-loss-coeff, --moe-router-topk have no effect without --num-experts"
            in err), err


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
