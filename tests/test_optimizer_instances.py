"""``--num-distributed-optimizer-instances N`` (Megatron's partial distributed optimizer): each
gradient bucket is reduce-scattered within a block of ``dp x cp / N`` ranks and its shard then
all-reduced across the ``N`` blocks; parameters are gathered within the block, the grad norm
summed over one instance (``paraloom.data_parallel.ddp``, ``paraloom.mesh``).

One reference (dp 4, small buckets, the distributed optimizer with one instance) and the flag on
four layouts: dp 4 (blocks of 2), tp 2 x dp 2 with sp and full recomputation (blocks of one
rank: no reduce-scatter, the all-reduce across does it all), cp 2 x dp 2 with
``--overlap-param-gather`` (blocks of 2 over dp x cp), 1F1B zero-bubble pp 2 x dp 2; and a MoE
pair (ep 2 x dp 4, whose expert buckets have blocks of one). Every run trains the same model as
its reference (losses and grad norms over 4 steps), ``paraloom check`` is exact on each, the
ledger changes exactly as Megatron's does against one instance (the run against Megatron-Core's
own record is in ``tests/test_megatron_step.py``), and checkpoints reshard both ways.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from conftest import assert_same_metrics

from paraloom.analysis.formulas import expected_comm
from paraloom.analysis.memory_formulas import memory_per_gpu
from paraloom.analysis.view import comm_view
from paraloom.commands import main
from paraloom.config import ModelConfig, ParallelConfig, TrainConfig
from paraloom.run_folder import load_events, read_metrics

SMALL = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16",
         "--micro-batch-size", "1", "--global-batch-size", "8", "--steps", "4",
         "--ledger-steps", "4", "--timeout", "120", "--distributed-optimizer"]
ON = ["--num-distributed-optimizer-instances", "2"]
LAYOUTS = {
    "reference": ["--tp", "1", "--pp", "1", "--dp", "4", "--bucket-size", "700",
                  "--save-every", "2"],
    "dp4": ["--tp", "1", "--pp", "1", "--dp", "4", "--bucket-size", "700", "--save-every", "2",
            *ON],
    "tp2-dp2-sp-recompute": ["--tp", "2", "--pp", "1", "--dp", "2", "--sequence-parallel",
                             "--recompute", "full", *ON],
    "cp2-dp2-opg": ["--tp", "1", "--pp", "1", "--dp", "2", "--cp", "2",
                    "--overlap-param-gather", *ON],
    "pp2-dp2-zb": ["--tp", "1", "--pp", "2", "--dp", "2", "--schedule", "zb-h1", *ON],
}
MOE = ["--num-experts", "4", "--ep", "2", "--tp", "1", "--pp", "1", "--dp", "4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("instances")
    out = {}
    for name, flags in LAYOUTS.items():
        out[name] = root / name
        assert main(["train", *SMALL, *flags, "--out", str(out[name])]) == 0, name
    for name, extra in (("moe-reference", []), ("moe", ON)):
        out[name] = root / name
        assert main(["train", *SMALL, *MOE, *extra, "--out", str(out[name])]) == 0, name
    return out


def _comms(folder: Path, step: int) -> list[dict]:
    return [e for e in load_events(folder) if e["step"] == step and e["op"] != "compute"]


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "reference"] + ["moe"])
def test_every_layout_trains_the_same_model(runs, name):
    want = runs["moe-reference" if name == "moe" else "reference"]
    assert_same_metrics(read_metrics(runs[name] / "metrics.jsonl"),
                        read_metrics(want / "metrics.jsonl"))


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "reference"] + ["moe"])
def test_check_is_exact(runs, name, capsys):
    capsys.readouterr()
    assert main(["check", str(runs[name])]) == 0, capsys.readouterr().out
    assert "rows agree" in capsys.readouterr().out


def _key(e: dict) -> tuple:
    return (e["rank"], e["kind"], e["op"], e["phase"], e["bytes"], bool(e.get("async")),
            len(e["group"]))


def test_the_ledger_changes_as_megatrons_does(runs):
    """Against one instance, per step and rank: every bucket's reduce-scatter covers 2 ranks
    instead of 4 and is synchronous, followed by its shard's all-reduce across the 2 blocks
    (half the bytes, kind dp_inter); each parameter all-gather covers 2 ranks with twice the
    shard; the grad norm (and the first step's flag) covers one instance (2 ranks); nothing
    else changes."""
    for step in range(1, 5):
        was, now = _comms(runs["reference"], step), _comms(runs["dp4"], step)
        scatters = [e for e in was if e["op"] == "reduce_scatter"]
        assert scatters and all(len(e["group"]) == 4 for e in scatters)
        pairs = [(a, b) for a, b in zip(now, now[1:], strict=False)
                 if a["op"] == "reduce_scatter"]
        assert Counter((a["rank"], a["bytes"], a["phase"]) for a, _ in pairs) == \
            Counter((e["rank"], e["bytes"], e["phase"]) for e in scatters), step
        for a, b in pairs:
            assert len(a["group"]) == 2 and not a["async"]
            assert (b["kind"], b["op"], b["phase"], b["bytes"], b["async"], len(b["group"])) \
                == ("dp_inter", "all_reduce", a["phase"], a["bytes"] // 2, False, 2)
            assert {a["rank"], *a["group"]} == set(a["group"]) and a["rank"] in b["group"]
            assert not set(a["group"]) & set(b["group"]) - {a["rank"]}  # block x across
        gathers = [e for e in was if e["op"] == "all_gather" and e["kind"] == "dp"]
        assert Counter((e["rank"], 2 * e["bytes"], 2) for e in gathers) == Counter(
            (e["rank"], e["bytes"], len(e["group"])) for e in now
            if e["op"] == "all_gather" and e["kind"] == "dp")
        norms = [e for e in now if e["kind"] == "distopt"]
        assert norms and all(len(e["group"]) == 2 for e in norms)
        moved = {"reduce_scatter", "all_gather"}
        rest_off = Counter(_key(e)[:6] for e in was if e["op"] not in moved
                           and e["kind"] != "distopt")
        rest_on = Counter(_key(e)[:6] for e in now if e["op"] not in moved
                          and e["kind"] not in ("distopt", "dp_inter"))
        assert rest_on == rest_off, step


def test_a_checkpoint_reshards_with_and_without_the_flag(runs, tmp_path):
    """Saved at step 2 with two instances, resumed at tp 2 x dp 2 with one; saved with one,
    resumed at dp 4 with four (blocks of one rank): both continue the same model."""
    want = read_metrics(runs["reference"] / "metrics.jsonl")[2:]
    for saved, flags in ((runs["dp4"], ["--tp", "2", "--dp", "2",
                                        "--num-distributed-optimizer-instances", "1"]),
                         (runs["reference"], ["--tp", "1", "--dp", "4",
                                              "--num-distributed-optimizer-instances", "4"])):
        out = tmp_path / saved.name
        assert main(["train", "--resume", str(saved / "checkpoints" / "step_2"), *flags,
                     "--out", str(out), "--timeout", "120"]) == 0, saved.name
        assert_same_metrics(read_metrics(out / "metrics.jsonl"), want)


def test_refused_before_any_rank_starts(capsys, no_ranks):
    base = ["train", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16",
            "--global-batch-size", "8", "--micro-batch-size", "1", "--steps", "1", "--tp", "1",
            "--pp", "1", "--dp", "4"]
    for extra, said in (
            (ON, "needs --distributed-optimizer"),
            (["--distributed-optimizer", "--num-distributed-optimizer-instances", "3"],
             "must divide dp * cp = 4 * 1 = 4"),
            (["--distributed-optimizer", "--num-distributed-optimizer-instances", "0"],
             "num_distributed_optimizer_instances"),
            (["--distributed-optimizer", "--num-experts", "4", "--ep", "2",
              "--num-distributed-optimizer-instances", "4"],
             "expert-data-parallel size dp * cp / ep = 4 / 2 = 2")):
        assert main(base + extra) == 2, extra
        assert said in capsys.readouterr().err, extra


def test_plan_counts_the_instances():
    """The optimizer state is sharded over dp / N, the reduce-scatter and gathers stay in the
    block, the shard's all-reduce across is one more dp_inter op per bucket."""
    model = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16,
                        seq_length=2048, vocab_size=51200)
    one = TrainConfig(model=model, parallel=ParallelConfig(tp=1, pp=1, dp=64),
                      global_batch_size=256, micro_batch_size=1, distributed_optimizer=True,
                      dtype="bf16")
    eight = one.replace(num_distributed_optimizer_instances=8)
    mem1, mem8 = memory_per_gpu(comm_view(one)), memory_per_gpu(comm_view(eight))
    assert mem8["optimizer"] == pytest.approx(8 * mem1["optimizer"])
    assert mem8["weights"] == mem1["weights"]
    comm1, comm8 = expected_comm(comm_view(one), 0), expected_comm(comm_view(eight), 0)

    def total(comm, kind, op):
        return [sum(v[f] for (k, o, _), v in comm.items() if (k, o) == (kind, op))
                for f in ("count", "bytes")]
    scatters, across = total(comm8, "dp", "reduce_scatter"), total(comm8, "dp_inter",
                                                                   "all_reduce")
    assert scatters == total(comm1, "dp", "reduce_scatter") and scatters[0] > 1
    assert across == [scatters[0], scatters[1] // 8]  # one per bucket, a block's shard each
    assert total(comm1, "dp_inter", "all_reduce") == [0, 0]
    gathers = total(comm8, "dp", "all_gather")
    assert gathers == [total(comm1, "dp", "all_gather")[0],
                       8 * total(comm1, "dp", "all_gather")[1]]


def test_plan_search_tries_instances_within_a_node(capsys):
    """16 GPUs on 2 nodes of 8: layouts whose dp ranks span both nodes are also tried with the
    reduce-scatter inside a node (2 instances), and the table says so (zero ``on/2``)."""
    argv = ["plan", "--search", "--gpus", "16", "--layers", "8", "--hidden", "1024", "--heads",
            "16", "--seq-len", "1024", "--global-batch-size", "64", "--top", "400", "--json"]
    assert main(argv) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    both = [x for x in ranked if x["distributed_optimizer"] and x["tp"] * x["cp"] == 1
            and x["dp"] == 16]
    assert {x["instances"] for x in both} == {1, 2}
    assert all(x["instances"] == 1 for x in ranked if x["tp"] * x["cp"] * x["dp"] <= 8)
    assert main(argv[:-1]) == 0
    assert " on/2 " in capsys.readouterr().out
