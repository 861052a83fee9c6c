"""Megatron-FSDP, megatron-core 0.19.2's own, recorded on CPU: what each sharding strategy sends.

``examples/megatron_gpt_step.py --use-megatron-fsdp --data-parallel-sharding-strategy S`` wraps
megatron-core's ``GPTModel`` in its ``FullyShardedDataParallel`` (Megatron-LM's ``get_model`` with
``--use-megatron-fsdp``) and trains two steps on 2 gloo ranks (dp 2, two microbatches per step)
under ``paraloom record --megatron-on-cpu``; the baseline is the same program with Megatron's
``DistributedDataParallel`` and distributed optimizer. Each strategy trains what the baseline
trains (loss and gradient norm as printed), so the CPU patches (:mod:`paraloom.record.
megatron_fsdp_cpu`: CUDA device names, CPU device meshes, PREMUL_SUM as scale-then-sum) change no
number; and the steady step (2) holds each strategy's pattern: ``no_shard`` one gradient
all-reduce; ``optim`` (ZeRO-1) one reduce-scatter after the last microbatch and the parameter
all-gather in the optimizer step; ``optim_grads`` (ZeRO-2) a reduce-scatter after every
microbatch; ``optim_grads_params`` (ZeRO-3) besides, parameter all-gathers in forward and again
in backward. ``paraloom train --use-megatron-fsdp`` with the strategies it builds diffs equal
against these records, step 1 and 2. With experts (ZeRO-3 at dp4 x ep2, the aux loss on) each
layer's dense and expert buckets (these over edp) are gathered in Megatron-FSDP's group order
and one optimizer reduces the gradient norm; ``paraloom train`` diffs equal but for its MoE
statistics' all-reduce (``tests/test_megatron_moe.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _megatron_record import finish, start_record
from _megatron_source import megatron_file

from paraloom.commands import main
from paraloom.config.megatron_fsdp_checks import BUILT
from paraloom.run_folder import load_events

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "megatron_gpt_step.py"
MODEL = ["--layers", "2", "--microbatches", "2", "--steps", "2"]
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
EXPERTS = ["--ep", "2", "--num-experts", "4", "--moe-aux-loss-coeff", "0.01"]
STEP = re.compile(r"step (\d): loss (\S+)\s+grad_norm (\S+)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (record folder, the printed (step, loss, grad norm) lines); two at a time."""
    megatron_file("distributed/fsdp/mcore_fsdp_adapter.py")  # installed, or fail
    tmp = tmp_path_factory.mktemp("megatron_fsdp")
    flags = {"baseline": ["--distributed-optimizer"],
             **{s: ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", s]
                for s in STRATEGIES},
             "experts": ["--use-megatron-fsdp", *EXPERTS]}
    out, names = {}, list(flags)
    for i in range(0, len(names), 2):
        procs = {n: start_record(tmp / n, EXAMPLE, [*MODEL, *flags[n]], timeout=200,
                                 nproc=4 if n == "experts" else 2) for n in names[i:i + 2]}
        for name, proc in procs.items():
            code, text = finish(proc, 300)
            assert code == 0, f"{name}: {text[-3000:]}"
            out[name] = (tmp / name, STEP.findall(text))
    return out


def _dp(folder: Path, step: int) -> list[tuple[str, str]]:
    """Rank 0's data-parallel operations of ``step`` (the loss's own all-reduce left out):
    (op, phase) in order."""
    return [(e["op"], e["phase"]) for e in load_events(folder)
            if e["rank"] == 0 and e["step"] == step and e["kind"] == "dp"
            and not e["site"].endswith(" train_step")]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_trains_what_ddp_trains(runs, strategy):
    baseline = runs["baseline"][1]
    assert len(baseline) == 2, baseline
    assert runs[strategy][1] == baseline


def test_the_steady_step_of_each_strategy(runs):
    ops = {s: _dp(runs[s][0], 2) for s in STRATEGIES}
    assert ops["no_shard"] == [("all_reduce", "backward")]
    assert ops["optim"] == [("reduce_scatter", "backward"), ("all_gather", "optimizer")]
    assert ops["optim_grads"] == [("reduce_scatter", "backward")] * 2 + \
        [("all_gather", "optimizer")]
    zero3 = ops["optim_grads_params"]
    assert {op for op, _ in zero3} == {"all_gather", "reduce_scatter"}
    gathers = {phase for op, phase in zero3 if op == "all_gather"}
    assert gathers == {"forward", "backward", "optimizer"}, zero3
    scatters = [phase for op, phase in zero3 if op == "reduce_scatter"]
    assert scatters and set(scatters) == {"backward"} and len(scatters) % 2 == 0
    # each microbatch's backward: gathers of the units' parameters, then their reduce-scatters
    backward = [op for op, phase in zero3 if phase == "backward"]
    half = len(backward) // 2
    assert backward[:half] == backward[half:] and backward[0] == "all_gather"


def test_zero3_gathers_are_asynchronous_and_shards(runs):
    """The parameter all-gathers are launched ahead (async, the prefetch) with a 1/dp shard
    each; the gradient reduce-scatters wait at once (the recorded op's own flag on gloo)."""
    events = [e for e in load_events(runs["optim_grads_params"][0])
              if e["rank"] == 0 and e["step"] == 2 and e["kind"] == "dp"
              and e["op"] in ("all_gather", "reduce_scatter")]
    gathers = [e for e in events if e["op"] == "all_gather"]
    scatters = [e for e in events if e["op"] == "reduce_scatter"]
    assert all(e["async"] for e in gathers) and not any(e["async"] for e in scatters)
    assert all(len(e["group"]) == 2 for e in events)
    assert {e["shape"][0] for e in gathers} <= {e["shape"][0] // 2 for e in scatters}


@pytest.mark.parametrize("strategy", BUILT)
def test_paraloom_train_communicates_as_megatron_fsdp(runs, strategy, tmp_path, capsys):
    """``paraloom train --use-megatron-fsdp`` with the same model, layout and strategy:
    ``paraloom diff --ignore-names`` equal in the first step (the unsharding gathers in
    forward) and the steady one, on both ranks; the buckets are the same size to the element
    (megatron-core's layout and padding)."""
    ours = tmp_path / strategy
    assert main(["train", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32",
                 "--micro-batch-size", "2", "--global-batch-size", "8", "--tp", "1", "--pp",
                 "1", "--dp", "2", "--steps", "2", "--ledger-steps", "2", "--save-every", "0",
                 "--no-overlap-p2p-communication", "--no-megatron-lm-loop", "--timeout", "120",
                 "--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy,
                 "--out", str(ours)]) == 0
    for step in ("1", "2"):
        capsys.readouterr()
        code = main(["diff", str(runs[strategy][0]), str(ours), "--step", step,
                     "--ignore-names"])
        text = capsys.readouterr().out
        assert code == 0 and text.count(": equal (") == 2, f"{strategy} step {step}:\n{text}"
    scatter = "all_reduce" if strategy == "no_shard" else "reduce_scatter"  # not vacuous
    assert (scatter, "backward") in _dp(runs[strategy][0], 2)


def test_paraloom_train_communicates_as_megatron_fsdp_with_experts(runs, tmp_path, capsys):
    """ZeRO-3 with experts at dp4 x ep2: every event of steps 1 and 2 agrees (op, kind, group,
    phase, async, dtype, bytes, shape), but paraloom's MoE statistics' all-reduce, the last of
    each step on every rank; the experts' buckets are gathered and reduce-scattered over their
    own 2 ranks (edp), one gradient norm for dense and expert parameters."""
    megatron, ours = runs["experts"][0], tmp_path / "experts"
    assert main(["train", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32",
                 "--micro-batch-size", "2", "--global-batch-size", "16", "--tp", "1", "--pp",
                 "1", "--dp", "4", *EXPERTS, "--steps", "2", "--ledger-steps", "2",
                 "--save-every", "0", "--no-overlap-p2p-communication", "--no-megatron-lm-loop",
                 "--timeout", "120", "--use-megatron-fsdp", "--out", str(ours)]) == 0
    for step in ("1", "2"):
        capsys.readouterr()
        assert main(["diff", str(megatron), str(ours), "--step", step, "--ignore-names"]) == 1
        text = capsys.readouterr().out
        counts = re.findall(r"rank \d: different \((\d+) vs (\d+) communications: (\d+) equal, "
                            r"0 changed, 0 only in A, 1 only in B\)", text)
        assert len(counts) == 4 and all(int(b) == int(a) + 1 == int(eq) + 1
                                        for a, b, eq in counts), text
        assert len(re.findall(r"\|\s+\d+\s+optimizer\s+world\s+all_reduce", text)) == 4, text
    expert = {(e["op"], e["phase"]) for e in load_events(megatron) if e["rank"] == 0
              and e["step"] == 2 and e["kind"] == "edp" and len(e["group"]) == 2}
    assert expert == {("all_gather", "forward"), ("all_gather", "backward"),
                      ("reduce_scatter", "backward"), ("all_gather", "optimizer")}, expert
    norms = [e for e in load_events(megatron) if e["rank"] == 0 and e["step"] == 2
             and e["kind"] == "distopt" and e["dtype"] == "float32"]
    assert len(norms) == 1, norms


def test_fsdp_patches_are_documented_and_named_when_they_miss():
    """Each patch has its README row; one whose target moved is named, not skipped."""
    import types

    from paraloom.record import megatron_core_cpu, megatron_fsdp_cpu

    readme = (ROOT / "README.md").read_text()
    for patch in megatron_fsdp_cpu.PATCHES:
        assert f"| {patch} |" in readme and patch in megatron_core_cpu.PATCHES, patch
    name = megatron_fsdp_cpu.FSDP_MODULES[2]  # param_and_grad_buffer, without its targets
    with pytest.warns(UserWarning) as caught:
        megatron_core_cpu._patch_module(types.ModuleType(name))
    said = " ".join(str(w.message) for w in caught)
    assert "'Megatron-FSDP on CPU' did not apply" in said
    assert "'PREMUL_SUM on gloo' did not apply" in said
