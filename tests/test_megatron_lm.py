"""Megatron-LM's training loop (``megatron.training.pretrain``) runs on CPU ranks under
``paraloom record --megatron-on-cpu``, and its record holds what Megatron-LM's run communicates
beyond the model step.

``examples/megatron_lm_pretrain.py`` drives ``pretrain`` as Megatron-LM's GPT script does
(Megatron-LM's argument parser, mock data, ``get_batch_on_this_tp_rank``), with Megatron-LM's own
command line: 4 layers, hidden 64, seq 32, micro batch 2, global batch 8, 3 iterations, gloo. Two
layouts on 4 ranks, recorded two at a time: tp2 x pp2, and tp2 x dp2 with sequence parallelism.
Each must finish its 3 iterations (without the patches of ``record/megatron_lm_cpu.py`` the
loop stops at import, at ``assert torch.cuda.is_available()``, or silently skips model
parallelism) and its record must show Megatron-LM's own collectives: the set-up ones, the batch
broadcast over tp from tp rank 0 for every microbatch, and the rerun state machine's vote.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from _megatron_record import finish, start_record
from _megatron_source import megatron_file

from paraloom.record import megatron_lm_cpu
from paraloom.run_folder import load_events

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "megatron_lm_pretrain.py"
ARGS = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 "
        "--train-iters 3 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 256 "
        "--transformer-impl local --no-gradient-accumulation-fusion --no-bias-gelu-fusion "
        "--no-bias-dropout-fusion --no-masked-softmax-fusion --no-persist-layer-norm "
        "--no-rope-fusion --position-embedding-type learned_absolute --eval-iters 0 "
        "--eval-interval 1000 --distributed-backend gloo --use-cpu-initialization "
        "--hidden-dropout 0 --attention-dropout 0").split()
LAYOUTS = {
    "tp2-pp2": "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
    # with Megatron-LM's logged statistics: the parameter norm after the step (its dp, expert
    # dp and mp all-reduces) and the zero count in the optimizer step (then a MAX over mp)
    "tp2-dp2-sp": "--tensor-model-parallel-size 2 --sequence-parallel --log-params-norm "
                  "--log-num-zeros-in-grad",
}
INTERLEAVED = {  # Megatron-LM's default overlapped p2p (compared with paraloom train only)
    "pp4-vpp2": "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1 "
                "--num-layers 8 --log-interval 2",  # the timers' barriers in iterations 1 and 2
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    megatron_file("models/gpt/gpt_model.py")  # installed (the README's test command), or fail
    tmp = tmp_path_factory.mktemp("megatron_lm")
    procs = {name: start_record(tmp / name, EXAMPLE, [*ARGS, *layout.split()], timeout=400)
             for name, layout in {**LAYOUTS, **INTERLEAVED}.items()}
    out = {}
    for name, proc in procs.items():
        code, text = finish(proc, 720)
        out[name] = (code, text, load_events(tmp / name))
    return out


def _step(events, rank, step=2):
    return [e for e in events if e["rank"] == rank and e["op"] != "compute"
            and e["phase"] != "setup" and e["step"] == step]


def _function(e):
    return e["site"].rpartition(" ")[2]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_megatron_lm_loop_runs_on_cpu_ranks(runs, name):
    code, text, events = runs[name]
    assert code == 0, text[-4000:]
    assert "iteration        1/       3" in text and "after training is done" in text, \
        text[-3000:]
    kinds = {e["kind"] for e in events}
    assert {"tp", "mp", "world"} <= kinds  # model parallelism was initialised (not skipped)
    assert ("pp" in kinds) == ("pp" in name) and ("dp" in kinds)
    steps = {e["step"] for e in events if e["phase"] != "setup"}
    assert steps == {1, 2, 3}  # Megatron-LM's iterations 1/3 .. 3/3


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_megatron_lms_own_collectives_are_on_the_record(runs, name):
    """Setup: the data loaders' int64 [3] flags broadcast, the float64 start-time all-reduce,
    barriers; per step: one broadcast over tp per batch tensor and microbatch, from tp rank 0
    (first stage: tokens, positions, mask; last stage: labels, loss mask, mask; all five at
    pp = 1), and the rerun state machine's int32 [1] vote over the world."""
    _, _, events = runs[name]
    setup = [e for e in events if e["rank"] == 0 and e["phase"] == "setup"]
    sites = Counter((_function(e), e["op"], e.get("dtype"), tuple(e.get("shape") or ()))
                    for e in setup)
    assert sites[("build_train_valid_test_data_loaders", "broadcast", "int64", (3,))] == 1
    stats = Counter((_function(e).split(".")[0], e["kind"]) for e in _step(events, 0))
    if "--log-params-norm" in LAYOUTS[name]:  # 2 over dp, 2 over expert dp, 1 over mp
        assert [stats[("calc_params_l2_norm", k)] for k in ("dp", "edp", "mp")] == [2, 2, 1]
        assert stats[("count_zeros_fp32", "mp")] == 1
    else:
        assert not any(f in ("calc_params_l2_norm", "count_zeros_fp32") for f, _ in stats)
    assert sites[("pretrain", "all_reduce", "float64", (1,))] >= 1
    assert sum(1 for e in setup if e["op"] == "barrier") >= 5
    microbatches = 4 if "pp" in name else 2  # global batch 8 = micro 2 x m x dp
    expect = {0: 3, 3: 3} if "pp" in name else {0: 5, 3: 5}
    for rank, per_microbatch in expect.items():
        step = _step(events, rank)
        batch = [e for e in step if e["op"] == "broadcast" and e["kind"] == "tp"
                 and "get_batch_on_this_tp_rank" in e["site"]]
        assert len(batch) == per_microbatch * microbatches, (rank, len(batch))
        assert {e["root"] for e in batch} == {rank - rank % 2}  # tp rank 0 of the group
        vote = [e for e in step if "RerunStateMachine" in e["site"]]
        assert [(e["op"], e["dtype"], e["shape"], e["kind"]) for e in vote] == [
            ("all_reduce", "int32", [1], "world")]


def test_patches_are_documented():
    assert set(megatron_lm_cpu.PATCHES) == {"typing.override", "one CUDA device",
                                             "compile_helpers"}
    readme = (ROOT / "README.md").read_text()
    for patch in megatron_lm_cpu.PATCHES:
        assert f"| {patch} |" in readme, patch


@pytest.mark.parametrize("name", [*LAYOUTS, *INTERLEAVED])
def test_paraloom_train_with_the_megatron_lm_command_line_communicates_as_megatron_lm(
        runs, name, tmp_path, capsys):
    """``paraloom train --nproc 4`` with the very arguments Megatron-LM was given: it trains
    with Megatron-LM's defaults where paraloom's differ (a Megatron-LM command line: gradient
    reduction after backward, blocking p2p batches, every step recorded), names what it
    accepted without acting on (kernels, mock data, evaluation), and communicates as
    Megatron-LM's whole run (names aside; interleaving with Megatron-LM's overlapped p2p): its
    set-up (``diff --step setup``: the start-up
    barriers, clocks and timers, the tied embeddings, the parameter groups, the data
    builders' barriers and flags) and every iteration (``--step 1-3``: the model step, the
    batch broadcast over tp, the rerun vote, the log's learning rate, the timers' barriers and
    the last one after training). Without the loop's extras (``--no-megatron-lm-loop``)
    exactly those are missing."""
    from paraloom.commands import main
    from paraloom.record.diff import Options, compare, sequences

    out = tmp_path / "paraloom"
    layout = {**LAYOUTS, **INTERLEAVED}[name]
    common = ["train", "--nproc", "4", *ARGS, *layout.split(), "--save-every", "0"]
    assert main([*common, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "--transformer-impl local" in text and "--mock-data" in text
    assert "a Megatron-LM command line (--num-layers" in text
    megatron_dir = tmp_path / "megatron"
    megatron_dir.mkdir()
    (megatron_dir / "ledger.jsonl").write_text(
        "".join(__import__("json").dumps(e) + "\n" for e in runs[name][2]))
    for steps in ("setup", "1-3"):
        assert main(["diff", str(megatron_dir), str(out), "--step", steps,
                     "--ignore-names"]) == 0, capsys.readouterr().out[-4000:]
        capsys.readouterr()
    # the learning rate: Megatron-LM logs iteration 1 after its scheduler stepped, i.e. the
    # rate of iteration 2 (linear decay, no warm-up, from --lr 1e-4 over --train-iters 3)
    import re
    logged = [float(x) for x in re.findall(r"learning rate: ([0-9.E+-]+)", runs[name][1])]
    metrics = [__import__("json").loads(x)
               for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged and logged[0] == pytest.approx(metrics[1]["lr"], rel=1e-6), (logged, metrics)
    assert [m["lr"] for m in metrics] == pytest.approx([1e-4, 2e-4 / 3, 1e-4 / 3])
    if name != "tp2-pp2":
        return
    bare = tmp_path / "bare"
    assert main([*common, "--no-megatron-lm-loop", "--out", str(bare)]) == 0
    options = Options(fields=("phase", "kind", "op", "async", "dtype", "bytes", "shape", "peer",
                              "group"), steps={2})
    megatron = sequences(runs[name][2], options)
    ours = sequences(load_events(bare), options)
    extras = set()
    for rank, r in compare(megatron, ours, options).items():
        assert r["changed"] == 0 and r["only_b"] == 0 and r["equal"] == len(ours[rank]) > 40
        for _, i1, i2, _, _ in r["hunks"]:
            extras |= {_function(e) for e in megatron[rank][i1:i2]}
    assert extras == {"get_batch_on_this_tp_rank.<locals>._broadcast",
                      "RerunStateMachine._reduce_any",
                      "reduce_max_stat_across_model_parallel_group"}


def test_logged_iterations_are_megatron_lms():
    """training_log's interval timer: the process's first iteration (also after a resume) and
    every --log-interval-th (iterations counted from 1)."""
    from paraloom.training.megatron_lm_loop import logged_iteration

    assert [i for i in range(1, 8) if logged_iteration(i, 3, i == 1)] == [1, 3, 6]
    assert [i for i in range(5, 10) if logged_iteration(i, 3, i == 5)] == [5, 6, 9]
    assert [i for i in range(1, 251) if logged_iteration(i, 100, i == 1)] == [1, 100, 200]
