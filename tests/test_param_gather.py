"""``--overlap-param-gather`` (Megatron's): the distributed optimizer's parameter all-gather
leaves the optimizer step for the next forward (``paraloom.data_parallel.param_gather``).

Four layouts (dp 4 with small buckets, so the gathers chain bucket after bucket; tp 2 x dp 2
with sequence parallelism, full recomputation and bf16; 1F1B pp 2 x dp 2, whose tied embedding
is a bucket of its own; interleaved pp 2 x vpp 3 x dp 2, where the schedule launches each chunk's
gathers), each trained 4 steps with the distributed optimizer with and without
the flag: the same model (losses and gradient norms equal), and the ledgers differ by exactly
the move — step 1 has no parameter all-gather at all (Megatron-LM turns the forward pre-hooks on
after the first successful step), later steps have each of them in ``forward`` (async) instead
of ``optimizer``, same count and bytes, everything else the same; ``paraloom check`` is exact on
every step, the step after a checkpoint included (the checkpoint gathered: that forward gathers
nothing); a checkpoint written with the flag resumes under another layout without it. Megatron's
own order (``examples/megatron_gpt_step.py`` with the flag) is compared in
``tests/test_megatron_step.py``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from conftest import assert_same_metrics

from paraloom.analysis.hardware import GPUS
from paraloom.analysis.steptime import Options, step_time
from paraloom.analysis.view import comm_view
from paraloom.commands import main
from paraloom.config import ModelConfig, ParallelConfig, TrainConfig
from paraloom.run_folder import load_events, read_metrics

SMALL = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16",
         "--micro-batch-size", "1", "--steps", "4", "--ledger-steps", "4", "--timeout", "120",
         "--distributed-optimizer"]
LAYOUTS = {
    "dp4-small-buckets": ["--tp", "1", "--pp", "1", "--dp", "4", "--global-batch-size", "8",
                          "--bucket-size", "700"],
    "tp2-dp2-sp-bf16-recompute": ["--tp", "2", "--pp", "1", "--dp", "2", "--sequence-parallel",
                                  "--dtype", "bf16", "--recompute", "full",
                                  "--global-batch-size", "4"],
    "pp2-dp2": ["--tp", "1", "--pp", "2", "--dp", "2", "--global-batch-size", "8"],
    # interleaved: the schedule launches each chunk's gathers (--align-param-gather): chunks 0
    # and 1 at its start, chunk 2 at the forward step Megatron's preprocess names
    "pp2-vpp3-dp2": ["--tp", "1", "--pp", "2", "--dp", "2", "--vpp", "3", "--layers", "6",
                     "--global-batch-size", "8"],
    # --no-align-param-gather: each chunk's own pre-hooks launch its chain
    "pp2-vpp3-dp2-no-align": ["--tp", "1", "--pp", "2", "--dp", "2", "--vpp", "3", "--layers",
                              "6", "--global-batch-size", "8", "--no-align-param-gather"],
}
SAVED = "dp4-small-buckets"
"""Its run with the flag saves after step 2: step 3's forward finds the parameters gathered."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("param_gather")
    out = {}
    for name, flags in LAYOUTS.items():
        folders = []
        for on in (False, True):
            folder = root / f"{name}-{'on' if on else 'off'}"
            save = ["--save-every", "2" if on and name == SAVED else "0"]
            argv = ["train", *SMALL, *flags, *save, "--out", str(folder)]
            assert main(argv + (["--overlap-param-gather"] if on else [])) == 0, name
            folders.append(folder)
        out[name] = tuple(folders)
    return out


def _metrics(folder: Path) -> list[dict]:
    return read_metrics(folder / "metrics.jsonl")


def _key(e: dict) -> tuple:
    return (e["rank"], e["kind"], e["op"], e["phase"], e["bytes"], bool(e.get("async")))


def _comms(folder: Path, step: int) -> list[dict]:
    return [e for e in load_events(folder) if e["step"] == step and e["op"] != "compute"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_flag_trains_the_same_model(runs, name):
    off, on = runs[name]
    assert_same_metrics(_metrics(on), _metrics(off), rtol=1e-6)  # the same arithmetic


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_flag_moves_the_parameter_gathers_into_the_next_forward(runs, name):
    off, on = runs[name]
    for step in range(1, 5):
        was, now = _comms(off, step), _comms(on, step)
        gathers = [e for e in was if e["op"] == "all_gather" and e["kind"] == "dp"]
        assert gathers and {e["phase"] for e in gathers} == {"optimizer"}
        assert not any(e["op"] == "all_gather" and e["kind"] == "dp" and not e.get("async")
                       for e in now), step  # the hooks' gathers are asynchronous
        moved = [e for e in now if e["op"] == "all_gather" and e["kind"] == "dp"]
        rest_on = Counter(_key(e) for e in now if e not in moved)
        rest_off = Counter(_key(e) for e in was if e not in gathers)
        assert rest_on == rest_off, (name, step)  # nothing else changes
        if step == 1 or (name == SAVED and step == 3):
            assert moved == [], (name, step)  # hooks off / the checkpoint gathered them
            continue
        assert {e["phase"] for e in moved} == {"forward"}
        assert Counter((e["rank"], e["bytes"]) for e in moved) == \
            Counter((e["rank"], e["bytes"]) for e in gathers)
        assert {e["site"] for e in moved} == \
            {"DistributedDataParallel.start_param_sync:param_shards"}
        assert all(e["microbatch"] == 0 for e in moved)
        if "vpp" not in name or "no-align" in name:  # at the module whose pre-hook launched it
            assert all(e["module"] for e in moved)
        else:  # launched by the schedule (--align-param-gather), outside any module
            assert all(e["module"] is None for e in moved)
    if name == SAVED:  # buckets gathered one after the other: several per rank, in order
        ranks0 = [e["bucket"] for e in _comms(on, 2) if e["op"] == "all_gather"
                  and e["rank"] == 0]
        assert len(ranks0) >= 3 and ranks0 == sorted(ranks0, reverse=True)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_check_is_exact_with_the_flag(runs, name, capsys):
    _, on = runs[name]
    capsys.readouterr()
    assert main(["check", str(on)]) == 0, capsys.readouterr().out
    assert "rows agree" in capsys.readouterr().out
    if name == SAVED:
        lines = {m["step"]: m for m in _metrics(on)}
        assert lines[3].get("params_gathered_at_save") and not lines[2].get(
            "params_gathered_at_save")


def test_a_checkpoint_with_the_flag_resumes_elsewhere_without_it(runs, tmp_path):
    _, on = runs[SAVED]
    out = tmp_path / "resumed"
    assert main(["train", "--resume", str(on / "checkpoints" / "step_2"), "--tp", "2", "--dp",
                 "2", "--no-overlap-param-gather", "--out", str(out), "--timeout", "120"]) == 0
    assert not json.loads((out / "config.json").read_text())["overlap_param_gather"]
    assert_same_metrics(_metrics(out), _metrics(on)[2:])


def test_refused_before_any_rank_starts(capsys, no_ranks):
    base = ["train", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16",
            "--global-batch-size", "8", "--micro-batch-size", "1", "--steps", "1"]
    for extra, said in (
            (["--dp", "2", "--tp", "1", "--pp", "1"], "needs --distributed-optimizer"),
            (["--dp", "2", "--tp", "1", "--pp", "1", "--distributed-optimizer",
              "--no-overlap-grad-reduce"], "needs --overlap-grad-reduce")):
        assert main(base + extra + ["--overlap-param-gather"]) == 2, extra
        assert said in capsys.readouterr().err, extra


def test_plan_hides_the_gather_under_the_next_forward():
    model = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16,
                        seq_length=2048, vocab_size=51200)
    cfg = TrainConfig(model=model, parallel=ParallelConfig(tp=1, pp=1, dp=64),
                      global_batch_size=256, micro_batch_size=1, distributed_optimizer=True,
                      overlap_param_gather=True, dtype="bf16")
    view = comm_view(cfg)
    assert view.overlap_param_gather and view.param_gather_forward
    hw = GPUS["h100-sxm"]
    hidden = step_time(view, hw, Options(overlap_param_gather=True))["breakdown_s"]["dp_comm"]
    plain = step_time(view, hw)["breakdown_s"]["dp_comm"]
    assert hidden < plain
