"""``paraloom train --use-megatron-fsdp --data-parallel-sharding-strategy S`` (``no_shard``,
``optim``, ``optim_grads``, ``optim_grads_params``): Megatron-FSDP's data parallelism
(``paraloom.data_parallel.megatron_fsdp``, its layout ``paraloom.data_parallel.fsdp_layout``,
ZeRO-3's gathers ``paraloom.data_parallel.megatron_fsdp_unshard``).

One reference (dp 4, Megatron's DDP and distributed optimizer, 4 steps) and the flag on four
layouts: dp 4 under ZeRO-2 with small buckets (several, cut by ``--bucket-size``), tp 2 x dp 2
with sp and full recomputation under ZeRO-1, cp 2 x dp 2 without sharding, dp 2 in bf16 under
ZeRO-2 (against its own bf16 reference; Megatron-FSDP's bf16 default reduces bf16 gradients);
ZeRO-3 at tp 2 x dp 2 with sp, cp 2 x dp 2 with full recomputation and dp 2 in bf16;
with experts (against Megatron's DDP with them) ZeRO-3 at dp 4 x ep 2 and the same in two
optimizer instances (hybrid sharding).
Each trains the same model as its reference, ``paraloom check`` is exact, the ledger changes
against the distributed optimizer exactly as Megatron-FSDP communicates, and checkpoints
reshard both ways. The layout is megatron-core's own (``build_data_parallel_buffer_index``,
compared on random shapes); the recorded sequence against megatron-core's Megatron-FSDP is in
``tests/test_megatron_fsdp.py``.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from pathlib import Path

import pytest
from _megatron_source import megatron_file
from conftest import assert_same_metrics

from paraloom.commands import main
from paraloom.data_parallel.fsdp_layout import fsdp_layout
from paraloom.run_folder import load_events, read_metrics

SMALL = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16",
         "--micro-batch-size", "1", "--global-batch-size", "8", "--steps", "4",
         "--ledger-steps", "4", "--timeout", "120"]
FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy"]
DP4 = ["--tp", "1", "--pp", "1", "--dp", "4"]
MOE = ["--ep", "2", "--num-experts", "4", "--moe-aux-loss-coeff", "0.01", "--disable-bias-linear"]
LAYOUTS = {
    "reference": [*DP4, "--distributed-optimizer", "--save-every", "2"],
    "dp4-optim_grads": [*DP4, *FSDP, "optim_grads", "--bucket-size", "2000",
                        "--save-every", "2"],
    "tp2-dp2-sp-recompute-optim": ["--tp", "2", "--pp", "1", "--dp", "2", "--sequence-parallel",
                                   "--recompute", "full", *FSDP, "optim"],
    "cp2-dp2-no_shard": ["--tp", "1", "--pp", "1", "--dp", "2", "--cp", "2", *FSDP, "no_shard"],
    "bf16-reference": ["--tp", "1", "--pp", "1", "--dp", "2", "--dtype", "bf16",
                       "--distributed-optimizer"],
    "bf16-dp2-optim_grads": ["--tp", "1", "--pp", "1", "--dp", "2", "--dtype", "bf16", *FSDP,
                             "optim_grads"],
    # ZeRO-3: Megatron-LM's default strategy
    "tp2-dp2-sp-optim_grads_params": ["--tp", "2", "--pp", "1", "--dp", "2",
                                      "--sequence-parallel", "--use-megatron-fsdp"],
    "cp2-dp2-optim_grads_params": ["--tp", "1", "--pp", "1", "--dp", "2", "--cp", "2", *FSDP,
                                   "optim_grads_params", "--recompute", "full"],
    "bf16-dp2-optim_grads_params": ["--tp", "1", "--pp", "1", "--dp", "2", "--dtype", "bf16",
                                    *FSDP, "optim_grads_params"],
    # experts (aux loss on): the reference is Megatron's DDP + distributed optimizer with them
    "moe-reference": [*DP4, *MOE, "--distributed-optimizer"],
    "moe-dp4-ep2-optim_grads_params": [*DP4, *MOE, "--use-megatron-fsdp"],
    # hybrid sharding: ZeRO-3 within 2 blocks of 2 ranks, the pieces summed across them
    "moe-dp4-ep2-instances2-optim_grads_params": [*DP4, *MOE, "--use-megatron-fsdp",
                                                  "--num-distributed-optimizer-instances", "2",
                                                  "--save-every", "2"],
}
BF16_RTOL = 2e-3
"""bf16 against bf16: the same rounding of every product, the sums over microbatches and ranks
in another order (one bf16 ulp is 2**-8 of a value; after 4 steps the losses agree to ~1e-4)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("megatron_fsdp_train")
    out = {}
    for name, flags in LAYOUTS.items():
        out[name] = root / name
        assert main(["train", *SMALL, *flags, "--out", str(out[name])]) == 0, name
    return out


def _comms(folder: Path, step: int) -> list[dict]:
    return [e for e in load_events(folder) if e["step"] == step and e["op"] != "compute"]


@pytest.mark.parametrize("name", [n for n in LAYOUTS if "reference" not in n])
def test_every_layout_trains_the_same_model(runs, name):
    bf16 = name.startswith("bf16")  # (tp2-dp2 with sp: global batch 8, as the reference's)
    want = runs["bf16-reference" if bf16 else "moe-reference" if name.startswith("moe")
                else "reference"]
    assert_same_metrics(read_metrics(runs[name] / "metrics.jsonl"),
                        read_metrics(want / "metrics.jsonl"), rtol=BF16_RTOL if bf16 else 1e-5)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if "reference" not in n])
def test_check_is_exact(runs, name, capsys):
    capsys.readouterr()
    assert main(["check", str(runs[name])]) == 0, capsys.readouterr().out
    assert "rows agree" in capsys.readouterr().out


def _dp(folder: Path, step: int, rank: int = 0) -> list[tuple]:
    return [(e["op"], e["phase"], bool(e.get("async")), e["bytes"])
            for e in _comms(folder, step) if e["rank"] == rank and e["kind"] == "dp"
            and "loss" not in e["site"]]


def test_megatron_fsdp_overlap_param_gather_changes_no_communication():
    """Under Megatron-FSDP ``--overlap-param-gather`` is its own flag (megatron-core 0.19.2:
    ZeRO-3 sets it itself; ``optim``/``optim_grads`` issue the optimizer step's gathers
    through the prefetch call, the same operations; ``benchmarks/megatron_sweep.py``'s ``-opg``
    Megatron-FSDP layouts): no forward pre-hooks of Megatron's DDP, and the analysis' view the
    same as without it; under DDP the flag keeps its meaning."""
    from paraloom.analysis.view import comm_view
    from paraloom.config import TrainConfig
    from paraloom.config.megatron_fsdp_checks import ddp_overlaps_param_gather

    def cfg(**kw):
        return TrainConfig.from_dict({"parallel": {"tp": 1, "pp": 1, "dp": 4}, **kw})
    for strategy in ("optim", "optim_grads", "optim_grads_params"):
        fsdp = dict(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy)
        on, off = cfg(**fsdp, overlap_param_gather=True), cfg(**fsdp)
        assert not ddp_overlaps_param_gather(on)
        assert comm_view(on) == comm_view(off)
    ddp = cfg(distributed_optimizer=True, overlap_param_gather=True)
    assert ddp_overlaps_param_gather(ddp) and comm_view(ddp).overlap_param_gather


def test_hybrid_sharding_changes_the_ledger_as_megatron_fsdp(runs):
    """Two optimizer instances (ZeRO-3 with experts at dp4 x ep2, 2 microbatches): the dense
    buckets' reduce-scatters and gathers within a block of 2 ranks instead of 4 (the experts':
    a block of one rank, none); after the last microbatch's reduce-scatter each bucket's piece
    all-reduced across the blocks (``dp_inter``, synchronous), nowhere else; the gradient norm
    over the block; every other event as before."""
    for step in (1, 2):
        one = [e for e in _comms(runs["moe-dp4-ep2-optim_grads_params"], step) if e["rank"] == 0]
        two = [e for e in _comms(runs["moe-dp4-ep2-instances2-optim_grads_params"], step)
               if e["rank"] == 0]
        for events, block, experts in ((one, 4, {2}), (two, 2, set())):
            dp = [e for e in events if e["kind"] == "dp" and "loss" not in e["site"]]
            assert {len(e["group"]) for e in dp if not e.get("expert")} == {block}
            assert {len(e["group"]) for e in dp if e.get("expert")} == experts
        inter = [e for e in two if e["kind"] == "dp_inter"]
        assert len(inter) == 4 + 1  # each layer's dense and expert bucket, and the rest
        assert all(e["op"] == "all_reduce" and not e["async"] and len(e["group"]) == 2
                   and e["microbatch"] == 1 and e["phase"] == "backward" for e in inter)
        assert {len(e["group"]) for e in two if e["kind"] == "distopt"} == {2}

        def rest(events):
            return [(e["op"], e["kind"], e["bytes"]) for e in events
                    if e["kind"] not in ("dp", "dp_inter", "distopt")]
        assert rest(one) == rest(two)


def test_the_ledger_changes_as_megatron_fsdp_communicates(runs):
    """Against the distributed optimizer (one bucket: the same bytes padded otherwise): ZeRO-2
    reduce-scatters after each of the 4 microbatches, synchronously, in backward; the first
    step's forward gathers every bucket (async); the optimizer step's gathers are async; no
    other communication changes. Without sharding: one synchronous all-reduce in backward,
    no gathers, the grad norm over the model-parallel group (kind mp, none at dp only)."""
    ref, zero2 = runs["bf16-reference"], runs["bf16-dp2-optim_grads"]
    for step in (1, 2):
        was, now = _dp(ref, step), _dp(zero2, step)
        (scatter,) = [e for e in was if e[0] == "reduce_scatter"]
        (gather,) = [e for e in was if e[0] == "all_gather"]
        assert scatter[2] and not gather[2]  # DDP: overlapped reduce, synchronous gather
        mine = [e for e in now if e[0] == "reduce_scatter"]
        assert [e[:3] for e in mine] == [("reduce_scatter", "backward", False)] * 4
        # Megatron-FSDP's padding: the parameters back to back (no 64-element starts), the
        # bucket to dp x chunk = 2 x 128 (fc2's rows); no_shard's all-reduce: unpadded. In bf16
        # Megatron-FSDP reduces bf16 gradients (its main grads take the parameters' dtype)
        size = mine[0][3] // 2
        (plain,) = [e[3] // 4 for e in _dp(runs["cp2-dp2-no_shard"], step)]
        assert plain <= size < plain + 256 and size % 256 == 0 and size < scatter[3] // 4
        gathers = [e for e in now if e[0] == "all_gather"]
        phases = ["forward"] * (step == 1) + ["optimizer"]
        assert [(e[1], e[2], e[3]) for e in gathers] == [(p, True, size // 2 * 2)
                                                          for p in phases]  # bf16: 2 bytes
        rest = Counter((e["kind"], e["op"], e["phase"]) for e in _comms(ref, step)
                       if e["kind"] != "dp")
        assert rest == Counter((e["kind"], e["op"], e["phase"]) for e in _comms(zero2, step)
                               if e["kind"] != "dp"), step
    assert [e[:3] for e in _dp(runs["cp2-dp2-no_shard"], 2)] == [("all_reduce", "backward",
                                                                   False)]
    kinds = {e["kind"] for e in _comms(runs["cp2-dp2-no_shard"], 2)}
    assert "distopt" not in kinds
    several = [e for e in _dp(runs["dp4-optim_grads"], 2) if e[0] == "reduce_scatter"]
    assert len(several) > 2 and len(several) % 2 == 0  # buckets x 2 microbatches (dp 4)


def test_zero3_gathers_before_each_use_and_reduces_per_layer(runs):
    """ZeRO-3 (steady step, rank 0, 4 microbatches of 2 layers): every parameter gather async,
    a 1/dp piece; in forward only from the second microbatch (the optimizer step left all
    gathered), in backward both layers each microbatch, after the update every bucket (the
    layers' two and the rest); a reduce-scatter per layer and one for the rest per microbatch,
    synchronous; ZeRO-2's run of the same layout has none of the forward/backward gathers."""
    ops = _dp(runs["tp2-dp2-sp-optim_grads_params"], 2)
    gathers = [(phase, bool(a)) for op, phase, a, _ in ops if op == "all_gather"]
    assert gathers == [("backward", True)] * 2 + ([("forward", True)] * 2 + [
        ("backward", True)] * 2) * 3 + [("optimizer", True)] * 3, ops
    scatters = [(phase, a) for op, phase, a, _ in ops if op == "reduce_scatter"]
    assert scatters == [("backward", False)] * 3 * 4
    first = [phase for op, phase, _, _ in _dp(runs["tp2-dp2-sp-optim_grads_params"], 1)
             if op == "all_gather"]
    assert first[:3] == ["forward"] * 3  # the first forward: the rest, then both layers


def test_a_checkpoint_reshards_with_and_without_the_flag(runs, tmp_path):
    """Saved at step 2 under ZeRO-2 with several buckets (its own layout), resumed at tp 2 x dp 2
    with Megatron's DDP and distributed optimizer; saved by the reference (DDP), resumed under
    ZeRO-3 at dp 2 x cp 2 (its kept pieces taken from the loaded parameters): each continues the
    same model; with experts, saved under ZeRO-3 in two optimizer instances, resumed at
    tp 2 x dp 2 x ep 2 with sp under Megatron's DDP (the experts' pieces from their own blocks)."""
    for saved, flags, ref in (
            (runs["dp4-optim_grads"], ["--tp", "2", "--dp", "2", "--no-use-megatron-fsdp"],
             "reference"),
            (runs["reference"], ["--tp", "1", "--dp", "2", "--cp", "2", "--use-megatron-fsdp"],
             "reference"),
            (runs["moe-dp4-ep2-instances2-optim_grads_params"], [
                "--tp", "2", "--dp", "2", "--ep", "2", "--sequence-parallel",
                "--num-distributed-optimizer-instances", "1", "--no-use-megatron-fsdp"],
             "moe-reference")):
        out = tmp_path / f"{saved.name}-{len(flags)}"
        assert main(["train", "--resume", str(saved / "checkpoints" / "step_2"), *flags,
                     "--out", str(out), "--timeout", "120"]) == 0, saved.name
        config = json.loads((out / "config.json").read_text())  # the layout resumed under
        assert config["use_megatron_fsdp"] == ("--no-use-megatron-fsdp" not in flags)
        assert_same_metrics(read_metrics(out / "metrics.jsonl"),
                            read_metrics(runs[ref] / "metrics.jsonl")[2:])


def test_the_layout_is_megatron_cores():
    """:func:`fsdp_layout` against megatron-core 0.19.2's own ``build_data_parallel_buffer_
    index`` (offsets of every parameter, the padded size) on random buckets of matrices and
    vectors, and its chunk size rule on the real model's bucket (recorded: 118784 elements at
    dp 2 for 2 layers of hidden 64, ffn 256, vocabulary 256, sequence 32)."""
    import sys

    import torch
    src = megatron_file("distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py").parents[1]
    sys.path.insert(0, str(src))  # megatron_fsdp as its own package: no megatron.core import
    try:
        from megatron_fsdp import param_and_grad_buffer as mf
    finally:
        sys.path.remove(str(src))

    class Config:
        data_parallel_sharding_strategy = "optim"

    rng = random.Random(0)
    for _ in range(400):
        shapes = [torch.Size([rng.choice([3, 5, 64, 192, 320])]) if rng.random() < 0.4 else
                  torch.Size([rng.choice([1, 2, 7, 32]), rng.choice([3, 8, 64, 96, 256])])
                  for _ in range(rng.randint(1, 7))]
        dp = rng.choice([1, 2, 4])
        ((start, end, members),) = fsdp_layout(
            [(s.numel(), s[1:].numel(), False) for s in shapes], None, shard_over=dp,
            sharded=True)
        order = sorted(range(len(shapes)), key=lambda i: -shapes[i][1:].numel())
        chunk = _chunk_of(shapes, order)
        items, bucket, _ = mf.build_data_parallel_buffer_index(
            [shapes[i] for i in order], 0, dp, True, Config, chunk_size_factor=chunk)
        theirs = sorted((order[it.item_id], it.global_data_index,
                         it.global_data_index + it.size) for it in items.values())
        assert sorted(members) == theirs and end - start == bucket.size, (shapes, dp)
    h, f, v, s = 64, 256, 256, 32
    layer = [(h, 1), (h, 1), (h * h, h), (h, 1), (3 * h * h, h), (3 * h, 1), (h, 1), (h, 1),
             (f * h, h), (f, 1), (h * f, f), (h, 1)]
    model = [(v * h, h), (s * h, h), *layer, *layer, (h, 1), (h, 1)]
    ((_, end, _),) = fsdp_layout([(n, r, False) for n, r in model], None, shard_over=2,
                                 sharded=True)
    assert end == 118784
    ((_, end, _),) = fsdp_layout([(n, r, False) for n, r in model], None)
    assert end == 118528  # no_shard: no padding


def _chunk_of(shapes, order) -> int:
    """Megatron-FSDP's chunk size rule, as its parameter grouping computes it."""
    chunk = shapes[order[0]][1:].numel()
    for i in order:
        row, numel = shapes[i][1:].numel(), shapes[i].numel()
        if not (row == chunk or (chunk % row == 0 and numel % chunk == 0) or numel < chunk):
            chunk = math.lcm(chunk, row)
    return chunk


def test_refused_before_any_rank_starts(capsys, no_ranks):
    base = ["train", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16",
            "--global-batch-size", "8", "--micro-batch-size", "1", "--steps", "1", *DP4]
    for extra, said in (
            (["--data-parallel-sharding-strategy", "optim"], "needs --use-megatron-fsdp"),
            ([*FSDP, "optim", "--overlap-param-gather", "--no-overlap-grad-reduce"],
             "--overlap-param-gather needs --overlap-grad-reduce"),
            ([*FSDP, "optim_grads", "--pp", "2", "--dp", "2"], "with --pp 2: megatron-core "
                                                               "0.19.2's Megatron-FSDP lays"),
            ([*FSDP, "no_shard", "--num-experts", "4", "--ep", "2"],
             "no_shard with --ep 2: megatron-core 0.19.2 reduces no_shard's gradient norm")):
        capsys.readouterr()
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert said in err, (extra, err)


def test_plan_counts_what_megatron_fsdp_holds_and_waits_for():
    """``plan``: ZeRO-2 holds the full fp32 gradient buffer plus its 1/dp pieces, ZeRO-1 and
    no_shard the buffer alone (optimizer states sharded under ZeRO only); the exposed
    data-parallel time of ZeRO-2 grows with the microbatches (a reduce-scatter after each),
    ZeRO-1's does not."""
    from paraloom.analysis.hardware import hardware_from
    from paraloom.analysis.memory_formulas import memory_per_gpu
    from paraloom.analysis.steptime import Options, step_time
    from paraloom.analysis.view import comm_view
    from paraloom.config import ModelConfig, ParallelConfig, TrainConfig

    def view(strategy, batch=16):
        return comm_view(TrainConfig(model=ModelConfig(num_layers=2, hidden_size=64,
                                                       num_attention_heads=4, seq_length=32),
                                     parallel=ParallelConfig(tp=1, pp=1, dp=2),
                                     global_batch_size=batch, micro_batch_size=2,
                                     use_megatron_fsdp=True,
                                     data_parallel_sharding_strategy=strategy))

    mem = {s: memory_per_gpu(view(s)) for s in ("no_shard", "optim", "optim_grads")}
    assert mem["optim"]["grads"] == mem["no_shard"]["grads"]
    assert mem["optim_grads"]["grads"] == pytest.approx(1.5 * mem["optim"]["grads"])
    assert mem["optim"]["optimizer"] == pytest.approx(mem["no_shard"]["optimizer"] / 2)
    hw = hardware_from("a100-80gb")

    def exposed(strategy, batch):
        return step_time(view(strategy, batch), hw, Options())["breakdown_s"]["dp_comm"]
    # 4 then 8 microbatches: ZeRO-2 is 4 (8) reduce-scatters + the gathers, ZeRO-1 one of each
    one = (exposed("optim_grads", 16) - exposed("optim", 16)) / 3
    assert one > 0 and exposed("optim_grads", 32) - exposed("optim_grads", 16) == \
        pytest.approx(4 * one)
    assert exposed("optim", 32) == pytest.approx(exposed("optim", 16))


def test_plan_search_tries_megatron_fsdp(capsys):
    """``plan --search`` ranks the fastest distributed-optimizer layouts again under each
    sharding strategy paraloom trains (pp 1, no experts), the zero column naming the stage."""
    from paraloom.analysis.hardware import hardware_from
    from paraloom.analysis.search import search

    fits, _ = search(8, hardware_from("a100-80gb"), layers=4, hidden=512, heads=8, seq_len=1024,
                     global_batch=32)
    fsdp = [x for x in fits if x.fsdp]
    assert {x.fsdp for x in fsdp} == {"optim", "optim_grads", "optim_grads_params"}
    assert all(x.pp == 1 and x.distributed_optimizer for x in fsdp)
    def key(x):
        return x.tp, x.cp, x.cp_comm_type, x.dp, x.micro_batch, x.sequence_parallel, x.recompute
    plain = {key(x): x for x in fits if x.distributed_optimizer and not x.fsdp
             and x.instances == 1}
    for x in fsdp:  # ZeRO-2/3 hold more gradient memory than ZeRO-1 here, never less
        assert x.memory_bytes >= plain[key(x)].memory_bytes
    assert main(["plan", "--search", "--gpus", "8", "--layers", "4", "--hidden", "512",
                 "--heads", "8", "--seq-len", "1024", "--global-batch-size", "32"]) == 0
    assert "fsdp3" in capsys.readouterr().out
