"""The analytical model against published figures and against recorded GPT ledgers (exactly)."""

from __future__ import annotations

import itertools
import json

import pytest
from _flops_closed_form import flops_per_iteration, model_flops_per_iteration
from _gpt_ledger import A, B, H, L, S, V, record_gpt

from paraloom.analysis.formulas import CommConfig, expected_comm
from paraloom.analysis.layout import param_count, params_per_rank
from paraloom.analysis.memory_formulas import activation_bytes_per_layer
from paraloom.analysis.plan import plan
from paraloom.commands.plan import main as plan_main
from paraloom.pipeline_parallel.timetable import pipeline_bubble as bubble_fraction
from paraloom.verify.check import all_ok, check_run, compare, render_diff, tally


def _config(tp, sp, recompute, **kw) -> CommConfig:
    return CommConfig(layers=L, hidden=H, heads=A, seq_len=S, vocab=V, micro_batch=B, tp=tp,
                      dp=4 // tp, sequence_parallel=sp, recompute=recompute, grad_sync=False,
                      **kw)


@pytest.fixture(scope="module")
def ledgers(world4):
    """Every (tp, sp, recompute) layout recorded once, all ranks merged."""
    out = {}
    for tp, sp, rc in itertools.product([2, 4], [False, True], ["none", "full"]):
        out[tp, sp, rc] = [e for events in world4.run(record_gpt, tp, sp, rc) for e in events]
    return out


def test_formulas_equal_recorded_gpt_ledgers_exactly(ledgers):
    for (tp, sp, rc), events in ledgers.items():
        rows = check_run(_config(tp, sp, rc), events)
        assert {r["rank"] for r in rows} == {0, 1, 2, 3}
        assert all_ok(rows), f"tp={tp} sp={sp} recompute={rc}\n{render_diff(rows)}"
    # the shape of the numbers, not just their agreement: tp=2, sp off, L=2, [s,b,h] fp32
    exp = expected_comm(_config(2, False, "none"))
    act = S * B * H * 4
    # (2 rows + embedding) [s, b, h], Megatron's 3 cross-entropy all-reduces of fp32 [s, b]
    assert exp["tp", "all_reduce", "forward"] == {"count": 2 * L + 1 + 3,
                                                   "bytes": (2 * L + 1) * act + 3 * S * B * 4}
    assert exp["tp", "all_reduce", "backward"] == {"count": 2 * L + 1, "bytes": (2 * L + 1) * act}
    full = expected_comm(_config(4, True, "full"))
    # recompute re-runs the whole layer, as Megatron's: QKV/fc1 gathers, proj/fc2 reduce-scatters
    assert full["sp", "reduce_scatter", "recompute"] == {"count": 2 * L, "bytes": 2 * L * act}
    assert full["sp", "all_gather", "recompute"] == {"count": 2 * L, "bytes": 2 * L * act // 4}


def test_check_names_an_altered_ledger(ledgers):
    events = ledgers[2, False, "none"]
    config = _config(2, False, "none")
    dropped = list(events)
    dropped.remove(next(e for e in events if e["rank"] == 1 and e["op"] == "all_reduce"
                        and e["phase"] == "backward"))
    rows = check_run(config, dropped)
    bad = [r for r in rows if not r["ok"]]
    assert [(r["rank"], r["kind"], r["op"], r["phase"]) for r in bad] == \
        [(1, "tp", "all_reduce", "backward")]
    assert bad[0]["recorded_count"] == bad[0]["expected_count"] - 1
    assert "rank 1 tp all_reduce backward" in render_diff(rows)

    changed = [dict(e) for e in events]
    victim = next(e for e in changed if e["rank"] == 0 and e["site"].endswith(":sum_exp"))
    victim["bytes"] += 1
    rows = compare(expected_comm(config), changed, rank=0)
    assert [(r["op"], r["phase"], r["recorded_bytes"] - r["expected_bytes"])
            for r in rows if not r["ok"]] == [("all_reduce", "forward", 1)]
    assert "DIFF" in render_diff(rows, only_diff=True)


def test_async_grad_allreduce_and_recompute_keys(ledgers, world4):
    events = [e for ev in world4.run(record_gpt, 2, False, "none", True) for e in ev]
    assert all_ok(check_run(_config(2, False, "none"), events))
    assert any(e["async"] for e in events if e["op"] == "all_reduce")
    counts = tally(ledgers[2, False, "full"], rank=0)
    assert counts["tp", "all_reduce", "recompute"]["count"] == 2 * L
    assert {e["module"] for e in ledgers[2, False, "full"] if e.get("recompute")
            and e["op"] != "compute"} == {f"layers.{i}.{m}" for i in range(L)
                                          for m in ("attention.proj", "mlp.fc2")}
    assert ("tp", "all_reduce", "recompute") not in tally(ledgers[2, False, "none"], rank=0)


def test_pipeline_and_data_parallel_formulas():
    act = 2048 * 1 * 1024 * 2
    c = CommConfig(layers=8, hidden=1024, heads=16, seq_len=2048, vocab=50304, tp=2, pp=4,
                   dp=2, num_microbatches=8, dtype_bytes=2, buckets=(1000, 3000))
    mid = expected_comm(c, 1)
    for key in [("pp", "send", "forward"), ("pp", "recv", "forward"), ("pp", "send", "backward"),
                ("pp", "recv", "backward")]:
        assert mid[key] == {"count": 8, "bytes": 8 * act}
    first, last = expected_comm(c, 0), expected_comm(c, 3)
    assert ("pp", "recv", "forward") not in first and ("pp", "send", "forward") not in last
    assert mid["dp", "all_reduce", "backward"] == {"count": 2, "bytes": 4000 * 4}
    assert first["emb", "all_reduce", "optimizer"]["bytes"] == 50304 * 1024 // 2 * 4
    assert ("emb", "all_reduce", "optimizer") not in mid
    # interleaved: v chunks per rank, v times the p2p (first rank has no predecessor once)
    vi = expected_comm(CommConfig(layers=8, hidden=1024, heads=16, seq_len=2048, vocab=50304,
                                  pp=4, vpp=2, num_microbatches=8, dtype_bytes=2), 0)
    assert vi["pp", "send", "forward"]["count"] == 2 * 8
    assert vi["pp", "recv", "forward"]["count"] == 8
    # sequence parallel halves the p2p tensor; distributed optimizer: reduce-scatter + all-gather
    spd = expected_comm(CommConfig(layers=8, hidden=1024, heads=16, seq_len=2048, vocab=50304,
                                   tp=2, pp=4, dp=2, sequence_parallel=True, dtype_bytes=2,
                                   distributed_optimizer=True, buckets=(1000,)), 1)
    assert spd["pp", "send", "forward"]["bytes"] == act // 2
    assert spd["dp", "reduce_scatter", "backward"] == {"count": 1, "bytes": 4000}
    assert spd["dp", "all_gather", "optimizer"] == {"count": 1, "bytes": 500 * 2}
    assert spd["sp", "all_reduce", "optimizer"]["bytes"] == 2 * 6 * 1024 * 4


def test_train_step_buckets_finalize_and_loss():
    """A train step's additions, per rank, as Megatron's: under the distributed optimizer every
    bucket is reduce-scattered (the tied embedding's own bucket too) and its shard all-gathered
    (not when the step was skipped); one bucket besides the embedding's without overlap; the
    grad norm over the optimizer instance (once more in the first step), the update and norm
    agreed over tp x pp, the loss [sum, tokens] over dp on the last stage."""
    from dataclasses import replace

    from paraloom.analysis.layout import default_buckets

    c = CommConfig(layers=4, hidden=32, heads=4, seq_len=16, vocab=256, pp=2, dp=2,
                   num_microbatches=4, distributed_optimizer=True, overlap_grad_reduce=False)
    emb = 256 * 32
    for r in (0, 1):
        exp = expected_comm(c, r)
        rest = params_per_rank(c, r) - emb
        buckets = default_buckets(c, r)
        # the first stage's embedding is registered first (its bucket comes last), the last
        # stage's tied copy last (first); buckets padded to multiples of lcm(dp, 128)
        assert buckets[1 - r] == emb and buckets[r] >= rest and buckets[r] % 128 == 0
        assert exp["dp", "reduce_scatter", "optimizer"] == {"count": 2,
                                                            "bytes": sum(buckets) * 4}
        assert exp["dp", "all_gather", "optimizer"] == {"count": 2,
                                                        "bytes": sum(buckets) // 2 * 4}
        assert exp["emb", "all_reduce", "optimizer"] == {"count": 1, "bytes": emb * 4}
        assert exp["distopt", "all_reduce", "optimizer"] == {"count": 1, "bytes": 4}
        assert expected_comm(replace(c, first_step=True), r)[
            "distopt", "all_reduce", "optimizer"] == {"count": 2, "bytes": 8}
        assert exp["mp", "all_reduce", "optimizer"] == {"count": 2, "bytes": 8}
        loss = exp.get(("dp", "all_reduce", "optimizer"))
        assert loss == ({"count": 1, "bytes": 8} if r == 1 else None)
        assert ("dp", "all_gather", "optimizer") not in expected_comm(
            replace(c, optimizer_step=False), r)
    small = replace(c, bucket_size=5000, distributed_optimizer=False, overlap_grad_reduce=True)
    assert len(default_buckets(small, 0)) > 2 and sum(default_buckets(small, 0)) == \
        params_per_rank(small, 0)
    assert len(default_buckets(small, 1)) == 1  # Megatron: no bucketing after the first stage
    assert not expected_comm(CommConfig(layers=4, hidden=32, heads=4, seq_len=16, vocab=256))


def test_korthikanti_activation_memory_gpt3_175b():
    # Korthikanti et al. 2022, Table 2 evaluated for their GPT-3 175B row (s=2048, b=1,
    # h=12288, a=96, t=8). The paper notes 5as/h = 80 for GPT-3, so 5as/(ht) = 10 at t=8;
    # sbh = 25,165,824. Per layer: no parallelism sbh(34+80) = 114 sbh; tp sbh(10+3+10) = 23 sbh;
    # tp+sp sbh(4.25+10) = 14.25 sbh; selective+tp 13 sbh; selective+tp+sp 4.25 sbh; full 2 sbh.
    sbh = 2048 * 1 * 12288
    assert 5 * 96 * 2048 / 12288 == 80
    args = (2048, 1, 12288, 96)
    assert activation_bytes_per_layer(*args) == 114 * sbh == 2_868_903_936
    assert activation_bytes_per_layer(*args, 8) == 23 * sbh == 578_813_952
    assert activation_bytes_per_layer(*args, 8, sequence_parallel=True) == 14.25 * sbh
    assert activation_bytes_per_layer(*args, 8, recompute="selective") == 13 * sbh
    assert activation_bytes_per_layer(*args, 8, sequence_parallel=True,
                                      recompute="selective") == 4.25 * sbh == 106_954_752
    assert activation_bytes_per_layer(*args, 8, recompute="full") == 2 * sbh


def test_narayanan_flops_and_parameter_counts():
    # Narayanan et al. 2021 eq. (3): 96 B s l h^2 (1 + s/(6h) + V/(16 l h)); GPT-3 175B with
    # B=1536, s=2048, l=96, h=12288, V=51200 evaluated by hand: 4.5110e18 per iteration.
    f = flops_per_iteration(1536, 2048, 96, 12288, 51200)
    by_hand = 96 * 1536 * 2048 * 96 * 12288 ** 2 * (1 + 2048 / 73728 + 51200 / 18874368)
    assert f == pytest.approx(by_hand, rel=1e-12)
    assert f == pytest.approx(4.5110e18, rel=1e-4)
    # ~ 8 N B s (forward + backward + recompute = 4 passes of 2 N FLOPs/token) with N = 174.6B
    assert f / (8 * 174.6e9 * 1536 * 2048) == pytest.approx(1.0, abs=0.03)
    # Narayanan et al. Table 1: 145.6B (h=12288, l=80) and 1008.0B (h=25600, l=128), V=51200,
    # s=2048; Section 5.2: GPT-3 175B = 174.6B (h=12288, l=96). Ours adds the final LayerNorm.
    for l_, h_, billions in [(80, 12288, 145.6), (96, 12288, 174.6), (128, 25600, 1008.0)]:
        assert param_count(l_, h_, 51200, 2048) / 1e9 == pytest.approx(billions, abs=0.05)
    # per-rank parameters add up to the model (the tied copy on the last stage counted once)
    c = CommConfig(layers=8, hidden=64, heads=4, seq_len=32, vocab=128, pp=2)
    assert params_per_rank(c, 0) + params_per_rank(c, 1) - 128 * 64 == param_count(8, 64, 128, 32)


def test_bubble():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, vpp=2) == pytest.approx(3 / 19)


def test_plan_gpt3_on_1024_gpus(capsys):
    c = CommConfig(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=51200, tp=8, pp=16,
                   dp=8, num_microbatches=192, sequence_parallel=True, recompute="selective",
                   distributed_optimizer=True, dtype_bytes=2)
    p = plan(c)
    assert p["gpus"] == 1024 and p["global_batch_size"] == 1536
    assert p["bubble_fraction"] == pytest.approx(15 / 207)
    model_flops = model_flops_per_iteration(1536, 2048, 96, 12288, 51200)
    assert p["flops_per_step"] == pytest.approx(model_flops)  # no recomputation: MFU's FLOPs
    assert p["hardware_flops_per_step"] == pytest.approx(  # selective: QK^T and attention x V
        model_flops + 4 * 1536 * 2048 ** 2 * 12288 * 96)   # again (Megatron's whole re-run)
    assert p["parameters"]["total"] / 1e9 == pytest.approx(174.6, abs=0.05)
    mem = p["memory_per_gpu_bytes"]
    assert mem["activations"] == pytest.approx(6 * 16 * 4.25 * 2048 * 12288)  # L/p * p in flight
    assert 0 < mem["total"] < 80 * 2 ** 30
    assert set(p["comm_bytes_per_step"]) >= {"sp", "pp", "dp", "emb"}
    argv = ["--layers", "96", "--hidden", "12288", "--heads", "96", "--seq-len", "2048",
            "--vocab", "51200", "--global-batch-size", "1536", "--micro-batch-size", "1",
            "--tp", "8", "--pp", "16", "--dp", "8", "--sequence-parallel", "--recompute",
            "selective", "--distributed-optimizer"]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert "1024 GPUs" in out and "GiB" in out and "bubble" in out
    assert plan_main(argv[:-4] + ["--json"]) == 0
    assert plan_main(argv[:2] + ["--hidden", "100", "--heads", "3"] + argv[6:]) == 2
    assert "hidden" in capsys.readouterr().err


def test_plan_vocab_is_trains_and_pads_like_megatron(capsys):
    from paraloom.analysis.plan import GPT2_VOCAB
    from paraloom.config.model import padded_vocab_rows as padded_vocab

    assert GPT2_VOCAB == 50257
    assert padded_vocab(50257, 128, 1) == 50304 and padded_vocab(50257, 128, 8) == 51200
    assert padded_vocab(51200, 128, 8) == 51200  # already a multiple: unchanged
    argv = ["--layers", "4", "--hidden", "256", "--heads", "8", "--seq-len", "128",
            "--global-batch-size", "8", "--micro-batch-size", "1", "--tp", "8", "--pp", "1",
            "--dp", "1"]
    assert plan_main(argv) == 0  # no --vocab: train's, 256 bytes, padded to 128 * tp
    out = capsys.readouterr().out
    assert "vocabulary 256 (paraloom train's default, bytes; --vocab-size 50257 is GPT-2's " \
           "BPE), padded to 1024 rows" in out
    assert plan_main(argv + ["--vocab-size", "50257"]) == 0
    assert "vocabulary 50257 (given), padded to 51200 rows (a multiple of 128 x tp 8" \
        in capsys.readouterr().out
    assert plan_main(argv + ["--vocab-size", "50257", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    expected = param_count(4, 256, 51200, 128, None)
    assert p["parameters"]["total"] == expected
    assert plan_main(argv + ["--vocab", "51200"]) == 0
    assert "vocabulary 51200 (given)" in capsys.readouterr().out
