"""``paraloom train --resume RUN`` continues that run: a rank killed with SIGKILL mid-run, then
``--resume RUN`` with no other flag, gives the uninterrupted run's metrics step for step (dropout
on, so the RNG streams in the checkpoint matter too); flags typed with ``--resume`` override and
are named; ``--out`` elsewhere branches.

The killed run is a real ``python -m paraloom train`` subprocess; the other runs fork their ranks
from this process through the same CLI entry point (``paraloom.commands.main``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import assert_same_metrics, checkpoint_folder, layout_config, run_training

from paraloom.commands import main
from paraloom.commands.flags import given
from paraloom.commands.train import parser
from paraloom.config import ModelConfig, ParallelConfig, TrainConfig

STEPS, EVERY, KILL_AFTER = 16, 4, 6
FLAGS = ["--tp", "1", "--pp", "1", "--dp", "2", "--layers", "2", "--hidden", "32", "--heads", "4",
         "--seq-len", "16", "--global-batch-size", "4", "--micro-batch-size", "1",
         "--steps", str(STEPS), "--save-every", str(EVERY), "--dropout", "0.1", "--lr", "3e-3",
         "--warmup-steps", "3", "--timeout", "20", "--ledger-steps", "1"]


def _metrics(run) -> list[dict]:
    path = Path(run) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _ranks_of(pid: int) -> list[int]:
    """The rank processes of a ``paraloom train`` process: its children, in start order (a
    ``spawn`` start also has multiprocessing's resource tracker, which is not a rank)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    ranks = [c for c in children
             if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]
    return sorted(ranks)


def _kill_one_rank_mid_run(out: Path) -> tuple[int, str]:
    """Start ``paraloom train``, SIGKILL its last rank once KILL_AFTER steps are in the
    metrics; returns the train command's exit code and stderr."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-m", "paraloom", "train", *FLAGS, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= KILL_AFTER:
                os.kill(_ranks_of(proc.pid)[-1], signal.SIGKILL)
                break
            time.sleep(0.01)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run and a run whose rank 1 was killed, then resumed by RUN alone."""
    root = tmp_path_factory.mktemp("resume")
    assert main(["train", *FLAGS, "--out", str(root / "straight")]) == 0
    code, err = _kill_one_rank_mid_run(root / "crashed")
    return root, code, err


def test_killed_run_resumed_with_no_other_flag_equals_the_uninterrupted_run(runs, capsys):
    root, code, err = runs
    crashed = root / "crashed"
    assert code == 1 and "rank 1 died" in err and "SIGKILL" in err, err
    done = _metrics(crashed)
    assert KILL_AFTER <= len(done) < STEPS  # killed mid-run, after a checkpoint
    ckpts = sorted(int(p.name[5:]) for p in (crashed / "checkpoints").glob("step_*")
                   if not p.name.endswith(".tmp"))
    assert ckpts and ckpts[-1] < STEPS
    assert main(["train", "--resume", str(crashed)]) == 0
    notes = capsys.readouterr().err
    assert f"resuming {str(crashed)!r} after step {ckpts[-1]} of {STEPS}" in notes, notes
    assert "no setting changed from the checkpoint" in notes
    got, want = _metrics(crashed), _metrics(root / "straight")
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))  # replaced, not duplicated
    for a, b in zip(got, want, strict=True):
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"]), a
    # the ledger kept the step the uninterrupted run recorded, and only that
    ledger = [json.loads(x) for x in (crashed / "ledger.jsonl").read_text().splitlines()]
    assert {e["step"] for e in ledger} == {0, 1} and {e["rank"] for e in ledger} == {0, 1}
    config = json.loads((crashed / "config.json").read_text())
    assert config["steps"] == STEPS and config["model"]["num_layers"] == 2


def test_flags_with_resume_override_and_are_named(runs, capsys):
    root, _, _ = runs
    straight = root / "straight"
    branch = root / "branch"
    argv = ["--resume", str(straight / "checkpoints" / "step_12"), "--steps", str(STEPS + 2),
            "--tp", "2", "--dp", "1", "--out", str(branch)]
    assert main(["train", *argv]) == 0
    notes = capsys.readouterr().err
    assert f"branching: {str(branch)!r} starts from" in notes and "after step 12" in notes, notes
    assert f"steps {STEPS} -> {STEPS + 2}" in notes
    assert "parallel.tp 1 -> 2, parallel.dp 2 -> 1" in notes
    assert "re-seeded from (seed, step)" in notes  # dropout streams cannot change layout
    assert [m["step"] for m in _metrics(branch)] == list(range(13, STEPS + 3))
    assert len(_metrics(straight)) == STEPS  # the branch copied and changed nothing there
    # a model flag contradicting the checkpoint is still refused before ranks start
    assert main(["train", "--resume", str(straight / "checkpoints" / "step_12"), "--hidden",
                 "64"]) == 2
    assert "hidden_size = 32 in the checkpoint, 64 here" in capsys.readouterr().err
    assert main(["train", "--resume", str(straight)]) == 2  # its last checkpoint is its end
    assert f"is after step {STEPS} and the run has --steps {STEPS}" in capsys.readouterr().err
    # a dtype change is refused before ranks start (the optimizer state does not convert)
    assert main(["train", "--resume", str(straight), "--dtype", "bf16", "--steps",
                 str(STEPS + 2)]) == 2
    assert "trained with --dtype fp32 and --dtype bf16 is given here" in (
        capsys.readouterr().err)
    # in place from an earlier checkpoint, recording every step: the later checkpoint is moved
    # aside, the metrics are the same, the ledger continues in order and in time
    before = _metrics(straight)
    assert main(["train", "--resume", str(straight / "checkpoints" / "step_12"),
                 "--ledger-steps", "-1"]) == 0
    assert "ledger_steps 1 -> -1" in capsys.readouterr().err
    assert [(m["loss"], m["grad_norm"]) for m in _metrics(straight)] == [
        (m["loss"], m["grad_norm"]) for m in before]
    assert (straight / "checkpoints" / "superseded_step_16").is_dir()
    ledger = [json.loads(x) for x in (straight / "ledger.jsonl").read_text().splitlines()]
    for rank in (0, 1):
        mine = [e for e in ledger if e["rank"] == rank]
        assert sorted({e["step"] for e in mine}) == [0, 1, 13, 14, 15, 16]
        assert [e["seq"] for e in mine] == list(range(len(mine)))
        assert [e["step"] for e in mine] == sorted(e["step"] for e in mine)
        first_run = max(e["t_end"] for e in mine if e["step"] <= 1)
        assert min(e["t_start"] for e in mine if e["step"] > 1) >= first_run


def test_explicit_flags_are_told_from_defaults():
    args = parser().parse_args(["--resume", "r", "--steps", "150", "--tp=2"])
    assert set(given(args)) == {"run.resume", "steps", "parallel.tp"}  # defaults, but typed


MODEL = ModelConfig(vocab_size=256, hidden_size=32, num_layers=2, num_attention_heads=4,
                    seq_length=16, dropout=0.1)
BASE = TrainConfig().replace(model=MODEL, parallel=ParallelConfig(tp=2), global_batch_size=8,
                   micro_batch_size=1, steps=6, warmup_steps=1, save_every=3, ledger_steps=1,
                   timeout_s=30, schedule="none")


def test_dropout_resume_is_bitwise_with_tensor_parallel_streams(tmp_path):
    want = run_training(BASE.replace(out=str(tmp_path / "straight")))[3:]
    step3 = str(tmp_path / "straight" / "checkpoints" / "step_3")
    got = run_training(BASE.replace(out=str(tmp_path / "resumed"), resume=step3))
    assert [m["step"] for m in got] == [4, 5, 6]
    for a, b in zip(got, want, strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (a, b)


def test_a_new_run_in_a_used_folder_sets_the_old_checkpoints_aside(runs, capfd):
    """A new run into a folder whose checkpoints came from another run renames them, so
    ``--resume FOLDER`` finds the new run's, never the old model."""
    from paraloom.training.checkpoint import find_checkpoint
    root, _, _ = runs
    used = root / "used"
    assert main(["train", *FLAGS, "--steps", "4", "--out", str(used)]) == 0
    assert (used / "checkpoints" / "step_4").is_dir()
    capfd.readouterr()
    assert main(["train", *FLAGS, "--steps", "2", "--save-every", "2", "--hidden", "16",
                 "--out", str(used)]) == 0
    err = capfd.readouterr().err  # printed by rank 0
    assert "held 1 checkpoint(s) of an earlier run in this folder (step_4)" in err, err
    ckpt, meta = find_checkpoint(str(used))
    assert ckpt.name == "step_2" and meta["config"]["model"]["hidden_size"] == 16
    assert (used / "checkpoints" / "superseded_step_4").is_dir()


def test_ranks_end_with_a_killed_launcher(tmp_path):
    """SIGKILL to the ``paraloom train`` process (not its process group) ends its ranks too."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-m", "paraloom", "train", *FLAGS, "--steps",
                             "1000000", "--save-every", "0", "--out", str(tmp_path / "run")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 120
        metrics = tmp_path / "run" / "metrics.jsonl"
        while time.monotonic() < deadline and not (metrics.is_file() and metrics.read_text()):
            time.sleep(0.05)
        ranks = _ranks_of(proc.pid)
        assert len(ranks) == 2 and proc.poll() is None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(Path(f"/proc/{r}").exists() and b"Z" not in
                                                  _state(r) for r in ranks):
            time.sleep(0.05)
        assert not [r for r in ranks if Path(f"/proc/{r}").exists() and b"Z" not in _state(r)]
    finally:
        if proc.poll() is None:
            proc.kill()


def _state(pid: int) -> bytes:
    """The state letter of ``/proc/PID/stat`` (``Z``: a zombie, i.e. ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return b"Z"


SHAPE = ModelConfig(vocab_size=256, hidden_size=32, num_layers=8, num_attention_heads=4,
                    seq_length=16)
LAYOUTS = TrainConfig().replace(parallel=ParallelConfig(), model=SHAPE, global_batch_size=8,
                                micro_batch_size=1, steps=5, lr=3e-3, warmup_steps=1,
                                save_every=0, ledger_steps=1, timeout_s=60)


def _train(tmp_path, name, **layout) -> list[dict]:
    return run_training(layout_config(LAYOUTS, tmp_path / name, **layout))


def test_resume_continues_exactly_and_reshards(tmp_path):
    """Same layout: bitwise; another (dp, tp, ZeRO-1): the same losses to float tolerance."""
    # the straight run saves after step 3 on its way; resuming from it must replay steps 4..6
    straight = _train(tmp_path, "straight", tp=2, pp=2, steps=6, save_every=3)
    step3 = str(tmp_path / "straight" / "checkpoints" / "step_3")
    resumed = _train(tmp_path, "second", tp=2, pp=2, steps=6, resume=step3)
    assert [m["step"] for m in resumed] == [4, 5, 6]
    for a, b in zip(resumed, straight[3:], strict=True):  # same layout: bitwise on fp32 CPU
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    for layout in (dict(dp=2), dict(tp=4), dict(dp=2, distributed_optimizer=True)):
        name = "re-" + "-".join(f"{k}{v}" for k, v in layout.items())
        other = _train(tmp_path, name, steps=6, resume=step3, **layout)
        assert_same_metrics(other, straight[3:])


@pytest.mark.parametrize("command", ["train", "eval"])
def test_resume_of_a_missing_path_or_an_empty_folder_is_told_apart(tmp_path, capsys, no_ranks,
                                                                   command):
    missing, empty = tmp_path / "nope", tmp_path / "empty"
    empty.mkdir()
    assert main([command, "--resume", str(missing)]) == 2
    assert f"--resume {str(missing)!r} does not exist" in capsys.readouterr().err
    assert main([command, "--resume", str(empty)]) == 2
    assert f"--resume {str(empty)!r}: no complete paraloom checkpoint there" in (
        capsys.readouterr().err)


def test_resume_from_a_different_model_is_refused_before_ranks_start(tmp_path, capsys,
                                                                    no_ranks):
    cfg = layout_config(BASE, tmp_path / "small", steps=1, save_every=1)
    checkpoint_folder(cfg.run.out, cfg)  # what is compared before ranks start: its settings
    assert main(["train", "--resume", cfg.run.out, "--hidden", "64", "--layers", "4",
                 "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "hidden_size = 32 in the checkpoint, 64 here" in err
    assert "seq_length" not in err  # a flag not typed is taken from the checkpoint


@pytest.mark.parametrize("saved, now, same", [
    (dict(tp=2, pp=2, dp=2), dict(tp=2, pp=2, dp=2), True),
    (dict(tp=2, pp=2, dp=2), dict(tp=2, pp=2, dp=2, vpp=1), True),  # vpp 1 is no vpp
    (dict(pp=2, dp=2, vpp=2), dict(pp=2, dp=2), False),      # another virtual-stage split
    (dict(dp=4, ep=2), dict(dp=4, ep=4), False),             # another expert split
    (dict(dp=2, cp=2), dict(dp=4), False),
])
def test_same_layout_means_every_split_a_rank_holds(saved, now, same):
    """A rank restores its own RNG streams only when it holds the same part of the model: tp,
    cp, ep, dp, pp and the virtual stages all alike."""
    from paraloom.training.resume import same_layout
    moe = ModelConfig(vocab_size=256, hidden_size=32, num_layers=4, num_attention_heads=4,
                      seq_length=16, num_experts=4)
    def cfg(parallel):
        return TrainConfig().replace(model=moe, parallel=ParallelConfig(**parallel),
                                     global_batch_size=16, micro_batch_size=1, schedule=None)
    assert same_layout({"config": cfg(saved).to_dict()}, cfg(now)) is same
