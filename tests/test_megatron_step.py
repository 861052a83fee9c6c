"""Megatron-Core's whole training step, recorded on CPU, communicates as ``paraloom train``'s.

``examples/megatron_gpt_step.py`` trains megatron-core 0.19.2's own ``GPTModel`` with its
``DistributedDataParallel``, ``get_megatron_optimizer``, ``get_forward_backward_func()`` and
``finalize_model_grads``, driven as Megatron-LM's ``train_step`` drives them, on 4 gloo ranks
under ``paraloom record --megatron-on-cpu``. ``paraloom train`` runs the same model (4 layers,
hidden 64, 4 heads, seq 32, vocabulary 256, micro batch 2, 4 microbatches per data-parallel rank,
tied embeddings) and layout with Megatron-Core's blocking p2p batches. For each layout — tp2 x pp2,
interleaved pp4 (vpp 2, 8 layers), tp2 x pp2 with full recomputation, tp2 x dp2 with sp in bf16,
two that once differed (plain 1F1B on 3 stages, tp2 x dp2 with sp and full recomputation),
``--overlap-param-gather`` on dp4 with 3000-element buckets (launched as each completes) and on
pp2 x dp2 (the tied embedding's bucket of its own), and ``--num-distributed-optimizer-instances
2`` on dp4 (its parameter gathers in the optimizer step), and ``--calculate-per-token-loss`` on
pp2 x dp2 (the token count's broadcast and all-reduce) — ``paraloom diff --step 2
--ignore-names`` exits 0 (the steady state), and so does ``--step 1`` (the first iteration, where
Megatron's DDP launches no bucket from its hooks). ``benchmarks/megatron_sweep.py`` runs the
same comparison over 52 layouts (these and the ones left out of the suite for its time:
tp2 x dp2 with sp in fp32, pp2 x dp2 and dp4 with small buckets under the distributed optimizer,
...).
The two programs share nothing but the configuration; any of the differences the Megatron
whole-step issue listed (cross-entropy, sp embedding and output layer, grad norm, buckets,
distributed optimizer, first iteration, align-grad-reduce, shapes) makes a layout differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _megatron_record import finish, start_record
from _megatron_source import megatron_file

from paraloom.commands import main
from paraloom.report.table import table_rows
from paraloom.run_folder import load_events

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "megatron_gpt_step.py"
MODEL = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq-len", "32",
         "--micro-batch-size", "2"]
LAYOUTS = {  # name: (the example's flags, paraloom train's flags)
    "tp2-pp2": ("--tp 2 --pp 2", "--tp 2 --pp 2 --dp 1 --global-batch-size 8"),
    "pp4-vpp2": ("--pp 4 --vpp 2 --layers 8",
                 "--tp 1 --pp 4 --dp 1 --vpp 2 --global-batch-size 8 --layers 8"),
    "tp2-pp2-recompute": ("--tp 2 --pp 2 --recompute",
                          "--tp 2 --pp 2 --dp 1 --global-batch-size 8 --recompute full"),
    "tp2-dp2-sp-bf16": ("--tp 2 --sequence-parallel --bf16", "--tp 2 --pp 1 --dp 2 "
                        "--sequence-parallel --global-batch-size 16 --dtype bf16"),
    # three orders once found different: 1F1B's warm-up sends at pp >= 3 (a middle stage posts
    # recv, send, recv), small buckets launched as each completes, sp under full recomputation
    # (the re-run before the output gradient's all-gather)
    "pp3": ("--pp 3 --layers 6", "--tp 1 --pp 3 --dp 1 --global-batch-size 8 --layers 6"),
    "tp2-dp2-sp-recompute": ("--tp 2 --sequence-parallel --recompute",
                             "--tp 2 --pp 1 --dp 2 --sequence-parallel --recompute full "
                             "--global-batch-size 16"),
    # --overlap-param-gather: the parameter all-gathers in the next forward, bucket after
    # bucket from the forward pre-hooks (none in step 1); small buckets make a chain of them,
    # pp 2 puts the last stage's tied embedding in a bucket of its own
    "dp4-distopt-opg-small-buckets": ("--distributed-optimizer --bucket-size 3000 "
                                      "--overlap-param-gather",
                                      "--tp 1 --pp 1 --dp 4 --distributed-optimizer "
                                      "--bucket-size 3000 --overlap-param-gather "
                                      "--global-batch-size 32"),
    "pp2-dp2-distopt-opg": ("--pp 2 --distributed-optimizer --overlap-param-gather",
                            "--tp 1 --pp 2 --dp 2 --distributed-optimizer "
                            "--overlap-param-gather --global-batch-size 16"),
    # --calculate-per-token-loss: finalize_model_grads ends with the step's token count
    # broadcast from the last stage over pp and all-reduced over dp (int32 [])
    "pp2-dp2-distopt-per-token": ("--pp 2 --distributed-optimizer --calculate-per-token-loss",
                                  "--tp 1 --pp 2 --dp 2 --distributed-optimizer "
                                  "--calculate-per-token-loss --global-batch-size 16"),
    # --num-distributed-optimizer-instances 2: each bucket reduce-scattered over a block of 2
    # dp ranks, its shard then all-reduced across the blocks, both synchronous
    "dp4-distopt-instances": ("--distributed-optimizer --bucket-size 3000 "
                              "--num-distributed-optimizer-instances 2",
                              "--tp 1 --pp 1 --dp 4 --distributed-optimizer --bucket-size 3000 "
                              "--num-distributed-optimizer-instances 2 --global-batch-size 32"),
}
WORLD = {"pp3": 3}
"""Ranks of a layout that does not use 4."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (Megatron's record folder, paraloom's run folder); two records at a time."""
    megatron_file("models/gpt/gpt_model.py")  # installed (the README's test command), or fail
    tmp = tmp_path_factory.mktemp("megatron_step")
    out, names = {}, list(LAYOUTS)
    for i in range(0, len(names), 2):
        procs = {n: start_record(tmp / f"megatron-{n}", EXAMPLE,
                                 [*MODEL, *LAYOUTS[n][0].split()], nproc=WORLD.get(n, 4))
                 for n in names[i:i + 2]}
        for name, proc in procs.items():
            code, text = finish(proc, 420)
            assert code == 0, f"{name}: {text[-3000:]}"
            assert "step 2: loss" in text, text[-2000:]
    for name, (_, flags) in LAYOUTS.items():
        ours = tmp / f"paraloom-{name}"
        assert main(["train", *MODEL, *flags.split(), "--steps", "2", "--ledger-steps", "2",
                     "--no-overlap-p2p-communication", "--no-megatron-lm-loop",
                     "--save-every", "0", "--timeout", "120",
                     "--out", str(ours)]) == 0, name
        out[name] = (tmp / f"megatron-{name}", ours)
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_megatron_whole_step_equals_paraloom_train(runs, name, capsys):
    megatron, ours = runs[name]
    capsys.readouterr()
    for step in ("2", "1"):
        code = main(["diff", str(megatron), str(ours), "--step", step, "--ignore-names"])
        text = capsys.readouterr().out
        assert code == 0, f"{name} step {step}:\n{text}"
        assert text.count(": equal (") == WORLD.get(name, 4), text
    # not vacuous: Megatron's own step, every part of it, is in the record
    events = [e for e in load_events(megatron) if e["op"] != "compute" and e["step"] == 2
              and e["phase"] != "setup"]
    kinds = {e["kind"] for e in events}
    assert {"mp", "dp"} <= kinds and ({"pp", "emb"} <= kinds or "pp" not in name)
    sites = {e["site"].rpartition(" ")[2] for e in events}
    assert {"get_grad_norm_fp32", "_ParamAndGradBucketGroup.start_grad_sync", "agree"} <= sites
    counts = [e for e in events if e["site"].endswith("finalize_model_grads")
              and e["dtype"] == "int32" and e["shape"] == []]  # the per-token loss's count
    assert {e["op"] for e in counts} == ({"broadcast", "all_reduce"} if "per-token" in name
                                         else set()), counts
    if "distopt" in name:
        assert {e["op"] for e in events if e["kind"] == "dp"} == \
            {"reduce_scatter", "all_gather", "all_reduce"}  # buckets, parameters, the loss
        gathers = {e["phase"] for e in events if e["op"] == "all_gather" and e["kind"] == "dp"}
        assert gathers == ({"forward"} if "opg" in name else {"optimizer"}), gathers
        across = [e for e in events if e["kind"] == "dp_inter"]
        assert bool(across) == ("instances" in name)  # the shards' all-reduce, in backward
        assert all(e["op"] == "all_reduce" and not e["async"] and len(e["group"]) == 2
                   for e in across)
    # the names differ (two implementations): without --ignore-names they are compared
    assert main(["diff", str(megatron), str(ours), "--step", "2"]) == 1


def test_record_sections_and_labels_of_megatrons_step(runs):
    """Setup is its own section; the table reads what moves: set-up values, gradients, norm."""
    events = load_events(runs["tp2-pp2"][0])
    setup = table_rows(events, rank=0, step="setup")
    assert setup and {r["phase"] for r in setup} == {"setup"}
    assert setup[0]["parallel_type"] == "emb" and setup[0]["split_object"].startswith(
        "set-up values")  # the tied embedding's init all-reduce: not a gradient
    step = table_rows(events, rank=3, step=2)
    assert all(r["phase"] != "setup" for r in step)
    split = {r["site"].rpartition(" ")[2]: r["split_object"] for r in step}
    assert split["get_grad_norm_fp32"] == "gradient norm, float32 [1]"
    assert split["_allreduce_embedding_grad"] == "gradients, float32 [128, 64]"
    pp = [r for r in step if r["parallel_type"] == "pp"]
    assert {(r["primitive"], r["split_object"]) for r in pp} == {
        ("recv", "activations [32, 2, 64] from the previous stage"),
        ("send", "activation grads [32, 2, 64] to the previous stage")}
    assert {r["parallel_type"] for r in step} == {"tp", "pp", "dp", "emb", "mp"}


def test_megatron_on_cpu_names_what_does_not_apply(monkeypatch):
    """Another megatron-core: a warning naming the tested versions; a patch whose target moved
    is named, not silently skipped (fake modules: nothing of megatron is imported here)."""
    import importlib.metadata
    import types

    from paraloom.record import megatron_core_cpu

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.20.1")
    with pytest.warns(UserWarning, match=r"tested on megatron-core 0\.19\.x, found 0\.20\.1"):
        megatron_core_cpu._check_version()
    for name, patch in (("megatron.core.tensor_parallel.random", "inference RNG tracker"),
                        ("megatron.core.transformer.torch_norm", "sequence-parallel torch norm"),
                        ("megatron.core.optimizer.clip_grads", "torch on CPU")):
        with pytest.warns(UserWarning, match=f"patch '{patch}' did not apply"):
            megatron_core_cpu._patch_module(types.ModuleType(name))
    assert set(megatron_core_cpu.PATCHES) >= {"inference RNG tracker",
                                               "sequence-parallel torch norm", "torch on CPU",
                                               "recomputation RNG state"}
