"""The step-time model: hardware descriptions, collectives over the links a group spans,
published Megatron throughput (validation), and the layout search."""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace

import pytest

from paraloom.analysis.costs import (
    Options,
    collective_time,
    gemm_time,
    layer_time,
    node_lanes,
    spans_nodes,
)
from paraloom.analysis.formulas import CommConfig
from paraloom.analysis.hardware import GPUS, hardware_from
from paraloom.analysis.memory_formulas import memory_per_gpu
from paraloom.analysis.search import search
from paraloom.analysis.spec import Architecture
from paraloom.analysis.steptime import step_time
from paraloom.commands.plan import main as plan_main
from paraloom.commands.plan_search import main as search_main
from paraloom.verify.validation import CALIBRATION_ROWS, ROWS, fit, summary, validate

A100 = GPUS["a100-80gb"]
H100 = GPUS["h100-sxm"]


def test_presets_toml_and_overrides(tmp_path):
    assert GPUS["h100-sxm"].peak_flops == 989e12 and GPUS["b200"].hbm_bytes == 180e9
    assert GPUS["h200"].hbm_bw == 4.8e12 and A100.gpus_per_node == 8
    f = tmp_path / "hw.toml"
    f.write_text('gpu = "h100-sxm"\ngpus_per_node = 4\ninter_bw = 25e9\n')
    hw = hardware_from(path=str(f), inter_latency=2e-5)
    assert (hw.peak_flops, hw.gpus_per_node, hw.inter_bw, hw.inter_latency) == \
        (989e12, 4, 25e9, 2e-5)
    f.write_text("gpus_per_nodes = 4\n")
    with pytest.raises(ValueError, match="unknown keys.*gpus_per_nodes"):
        hardware_from(path=str(f))
    with pytest.raises(ValueError, match="'v100'.*known: a100-40gb"):
        hardware_from("v100")
    with pytest.raises(ValueError, match="gemm_efficiency"):
        replace(A100, gemm_efficiency=1.5)


def test_groups_and_collectives_follow_the_links():
    # tp fastest: tp=8 stays in a node of 8, tp=16 does not; dp with stride 8 always leaves it
    assert not spans_nodes(1, 8, 8) and spans_nodes(1, 16, 8) and spans_nodes(8, 2, 8)
    assert not spans_nodes(2, 4, 8) and spans_nodes(4, 4, 8) and not spans_nodes(1, 1, 8)
    alpha, beta = A100.link(True)
    n, nbytes = 4, 1e9
    assert collective_time("all_reduce", n, nbytes, A100, True) == pytest.approx(
        2 * (n - 1) * (alpha + nbytes / (n * beta)))
    assert collective_time("all_gather", n, nbytes, A100, True) == pytest.approx(
        collective_time("all_reduce", n, nbytes, A100, True) / 2)
    assert collective_time("p2p", 2, nbytes, A100, False) < collective_time(
        "p2p", 2, nbytes, A100, True)
    assert collective_time("all_reduce", 1, nbytes, A100, True) == 0
    with pytest.raises(ValueError, match="broadcast"):
        collective_time("broadcast", 2, 1, A100, True)


def test_a_ring_across_nodes_runs_on_as_many_nics_as_it_has_ranks_in_a_node():
    # dp with stride 1 has 8 ranks in each node of 8: eight channels leave each node side by
    # side, one NIC each; dp with stride 8 (after tp = 8) has one rank per node and one NIC
    assert (node_lanes(1, 32, 8), node_lanes(2, 16, 8), node_lanes(8, 4, 8)) == (8, 4, 1)
    assert node_lanes(1, 4, 8) == 4  # a small group: only its own ranks
    one = collective_time("reduce_scatter", 32, 1e9, A100, True)
    eight = collective_time("reduce_scatter", 32, 1e9, A100, True, lanes=8)
    assert eight == pytest.approx(31 * (A100.inter_latency + 1e9 / (32 * 8 * A100.inter_bw
                                                                     * A100.link_efficiency)))
    assert one > 7 * eight
    h100 = GPUS["h100-sxm"]  # NVLink feeds at most its own bandwidth to the NICs
    assert h100.link(True, 16)[1] == h100.link(False)[1]
    # a p2p or an all-to-all is one rank's own transfer: no lanes
    assert collective_time("p2p", 2, 1e9, A100, True, lanes=8) == collective_time(
        "p2p", 2, 1e9, A100, True)
    # in the step: tp = 1 reduces its gradients over 8 NICs a node, tp = 8 over one
    flat = dict(layers=24, hidden=2304, heads=24, seq_len=2048, vocab=51200, pp=1, dp=32,
                num_microbatches=16, dtype_bytes=2, overlap_grad_reduce=False, buckets=(1,))
    dp1 = step_time(CommConfig(tp=1, **flat), A100)["breakdown_s"]["dp_comm"]
    params = 24 * 12 * 2304 ** 2  # roughly: the all-reduce of 4-byte gradients over 32 ranks
    assert dp1 == pytest.approx(2 * 31 / 32 * params * 4 / (8 * 25e9 * A100.link_efficiency),
                                rel=0.2)


def test_fused_attention_tp_comm_overlap_and_param_gather_overlap():
    c = _gpt(seq_len=4096, recompute="none", pp=1, num_microbatches=4, vocab=131072)
    base = step_time(c, A100)["breakdown_s"]
    # fused attention: no score bytes; a causal kernel does half the score GEMMs' work, its
    # backward 2.5x its forward (QK^T again): 3.5 halves instead of 3 wholes
    sdpa = replace(c, arch=Architecture(attention="sdpa"))
    plain_layer, flash_layer = (layer_time(x, A100, Options(), 8) for x in (c, sdpa))
    d, s, b, a, t = 128, 4096, 1, 96, 8  # QK^T and AV forward: batched (s, s, d) GEMMs
    attention = gemm_time(A100, s, s, d, b * a / t) + gemm_time(A100, s, d, s, b * a / t)
    assert plain_layer["gemm"] - flash_layer["gemm"] == pytest.approx(1.25 * attention)
    scores = 3 * 2 * 4 * b * a / t * s * s / (A100.hbm_bw * A100.mem_efficiency)
    assert plain_layer["elementwise"] - flash_layer["elementwise"] == pytest.approx(scores)
    assert step_time(sdpa, A100)["step_time_s"] < step_time(c, A100)["step_time_s"]
    # selective recomputation: the fused kernel's (half) forward again, no score bytes
    sel = _gpt(seq_len=4096, pp=1, num_microbatches=4, vocab=131072)
    sel_sdpa = replace(sel, arch=Architecture(attention="sdpa"))
    assert layer_time(sel_sdpa, A100, Options(), 8)["recompute"] == pytest.approx(attention / 2)
    assert layer_time(sel, A100, Options(), 8)["recompute"] > attention
    # --tp-comm-overlap hides the sp collectives under their GEMMs
    over = step_time(c, A100, Options(tp_comm_overlap=True))["breakdown_s"]
    assert over["tp_comm"] < base["tp_comm"] / 2 and over["compute"] == base["compute"]
    # --overlap-param-gather: the ZeRO all-gather under the next forward, but its first bucket
    many = _gpt(pp=1, dp=16, num_microbatches=4, buckets=None)
    plain = step_time(many, A100)["breakdown_s"]["dp_comm"]
    hidden = step_time(many, A100, Options(overlap_param_gather=True))["breakdown_s"]["dp_comm"]
    assert hidden < plain
    assert step_time(replace(many, distributed_optimizer=False), A100,
                     Options(overlap_param_gather=True))["breakdown_s"]["dp_comm"] == \
        step_time(replace(many, distributed_optimizer=False), A100)["breakdown_s"]["dp_comm"]


def test_interleaving_hides_each_chunks_reduction_under_the_other_chunks_backward():
    # Megatron's grad_sync_func: a chunk's buckets go once its last backward is done, so with
    # vpp chunks all but the first chunk's reduction run under the last microbatch group's
    # backward of the others; 1F1B has only the last microbatch's backward to hide under
    base = dict(layers=96, hidden=12288, heads=96, seq_len=4096, vocab=131072, tp=8, pp=6,
                dp=96, num_microbatches=12, sequence_parallel=True, dtype_bytes=2)
    plain = step_time(CommConfig(**base), GPUS["h100-sxm"])["breakdown_s"]["dp_comm"]
    chunks = step_time(CommConfig(vpp=16, **base), GPUS["h100-sxm"])["breakdown_s"]["dp_comm"]
    assert chunks < plain / 3
    # what stays exposed is at least the first chunk's own share (its layer and the embedding)
    lone = replace(GPUS["h100-sxm"], overlap_efficiency=0.0)
    everything = step_time(CommConfig(vpp=16, **base), lone)["breakdown_s"]["dp_comm"]
    assert chunks >= everything * (0.9 / 16)


def _gpt(**kw) -> CommConfig:
    base = dict(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=51200, tp=8, pp=8,
                dp=16, num_microbatches=96, sequence_parallel=True, recompute="selective",
                distributed_optimizer=True, dtype_bytes=2, buckets=(1,))
    return CommConfig(**{**base, **kw})


def test_step_time_parts_move_the_right_way():
    r = step_time(_gpt(), A100)
    parts = r["breakdown_s"]
    assert r["step_time_s"] == pytest.approx(sum(parts.values()))
    assert 0.3 < r["mfu"] < 0.7 and r["hfu"] > r["mfu"]
    assert r["tokens_per_s"] == pytest.approx(1536 * 2048 / r["step_time_s"])
    # the bubble is (p-1)/(v m) of the pipeline time; interleaving shrinks it
    assert step_time(_gpt(vpp=2), A100)["breakdown_s"]["bubble"] == pytest.approx(
        parts["bubble"] / 2, rel=0.05)
    assert step_time(_gpt(recompute="full"), A100)["breakdown_s"]["recompute"] > \
        5 * parts["recompute"]
    assert step_time(_gpt(recompute="none"), A100)["breakdown_s"]["recompute"] == 0
    # a zero-bubble schedule, a faster GPU, a slower network
    assert step_time(_gpt(), A100, Options(bubble_scale=0))["breakdown_s"]["bubble"] == 0
    assert step_time(_gpt(), GPUS["h100-sxm"])["step_time_s"] < r["step_time_s"]
    slow = replace(A100, inter_bw=2.5e9)
    assert step_time(_gpt(), slow)["breakdown_s"]["dp_comm"] > parts["dp_comm"]
    assert parts["ep_comm"] == parts["cp_comm"] == 0


def test_published_megatron_rows_mean_within_5_and_each_within_10_percent():
    rows = validate()
    assert len(rows) == len(ROWS) == 29
    assert {r["gpu"] for r in rows} == {"a100-80gb", "h100-sxm"}
    assert sum(r["gpu"] == "h100-sxm" for r in rows) == 11
    fitted = [r for r in rows if r["calibration"]]
    held_out = [r for r in rows if not r["calibration"]]
    assert [r["row"] for r in fitted] == list(CALIBRATION_ROWS) and len(held_out) == 25
    table = "\n".join(f"{r['row']:<24} {r['predicted']:8.2f} {r['published']:8.2f} "
                      f"{r['error']:+.1%}{' (calibration)' if r['calibration'] else ''}"
                      for r in rows)
    print("\npredicted vs published\n" + table)
    s = summary(rows)
    assert s["rows"] == 25 and s["mean_abs_error"] <= 0.05, table
    assert all(abs(r["error"]) <= 0.10 for r in held_out), table
    assert all(abs(r["error"]) <= 0.10 for r in fitted), table
    for gpu in ("a100-80gb", "h100-sxm"):  # each GPU's rows on their own
        assert summary([r for r in rows if r["gpu"] == gpu])["mean_abs_error"] <= 0.05, table
    # the presets carry exactly what the fit on the calibration rows finds
    hw, worst = fit()
    for name in ("a100-80gb", "h100-sxm"):
        assert (hw[name].gemm_efficiency, hw[name].gemm_half_dim, hw[name].link_efficiency) == \
            (GPUS[name].gemm_efficiency, GPUS[name].gemm_half_dim, GPUS[name].link_efficiency)
    assert GPUS["h200"].gemm_efficiency == GPUS["h100-sxm"].gemm_efficiency
    assert worst <= 0.10
    # a time row's error is a throughput's: the model too slow is negative
    time_row = next(r for r in rows if r["row"] == "korthikanti-full-530B")
    assert time_row["unit"] == "s per iteration"
    assert time_row["error"] == pytest.approx(49.05 / time_row["predicted"] - 1)


def test_explain_error_sets_a_row_against_its_publication(capsys):
    from paraloom.analysis.flops import hardware_flops
    from paraloom.verify.validation import _layout, explain_row
    rows = {r.name: r for r in ROWS}
    r = explain_row("narayanan-76.1B")
    config, options = _layout(rows["narayanan-76.1B"])
    # the published TFLOP/s per GPU is the step's hardware FLOPs over its time: the step it gives
    flops = hardware_flops(config, early_stop=options.early_stop)
    assert r["published_step_s"] == pytest.approx(flops / (140e12 * 1024))
    assert sum(p["seconds"] for p in r["parts"]) == pytest.approx(r["predicted_step_s"])
    assert r["gap_s"] == pytest.approx(r["predicted_step_s"] - r["published_step_s"])
    assert r["error"] == pytest.approx(
        next(v["error"] for v in validate() if v["row"] == "narayanan-76.1B"))
    for p in r["parts"]:  # each part scaled by its factor alone makes the published step
        assert r["predicted_step_s"] - p["seconds"] + p["seconds"] * p["alone"] == \
            pytest.approx(r["published_step_s"])
    assert (r["layout"]["dp"], r["layout"]["microbatches"]) == (32, 1792 // 32)
    assert not r["calibration"] and explain_row("korthikanti-1T")["calibration"]
    # a row published as seconds per iteration: that is its step
    t = explain_row("korthikanti-full-530B")
    assert t["published_step_s"] == pytest.approx(49.05) and t["unit"] == "s per iteration"
    assert (t["layout"]["recompute"], t["layout"]["sequence_parallel"]) == ("full", False)
    # an H100 row runs on the H100 preset, interleaved one layer per virtual stage
    h = explain_row("h100-177B")
    assert h["hardware"] == "h100-sxm" and h["layout"]["vpp"] == 16
    assert (h["layout"]["seq_len"], h["layout"]["vocab"], h["layout"]["dp"]) == (4096, 131072, 48)
    assert h["layout"]["fused_attention"] and h["layout"]["tp_comm_overlap"]
    assert explain_row("h100-16B")["layout"]["micro_batch"] == 4
    assert plan_main(["--explain-error", "narayanan-76.1B"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"published +140 TFLOP/s per GPU", out) and "pipeline bubble" in out
    assert f"{r['error']:+.1%}" in out
    assert plan_main(["--explain-error", "all"]) == 0
    s = summary(validate())
    out = capsys.readouterr().out
    assert f"mean |error| {s['mean_abs_error']:.1%}, worst {s['worst_abs_error']:.1%}" in out
    assert s["rows"] == len(ROWS) - len(CALIBRATION_ROWS)
    assert plan_main(["--explain-error", "narayanan-77B"]) == 2  # named, with the valid rows
    err = capsys.readouterr().err
    assert "'narayanan-77B'" in err and "narayanan-76.1B" in err and "korthikanti-1T" in err


def test_search_fits_memory_and_ranks_tp_across_nodes_low():
    job = dict(layers=32, hidden=4096, heads=32, seq_len=2048, global_batch=256)
    tic = time.perf_counter()
    fits, too_big = search(32, A100, **job)
    assert time.perf_counter() - tic < 10
    assert fits and too_big > 0
    assert all(x.memory_bytes <= 0.9 * A100.hbm_bytes for x in fits)
    for x in fits[:20]:  # the memory the search used is the plan's, for that very layout
        assert x.prediction["step_time_s"] == x.step_time_s
    times = [x.step_time_s for x in fits]
    assert times == sorted(times)

    def rank(**want):
        return next(i for i, x in enumerate(fits)
                    if all(getattr(x, k) == v for k, v in want.items()))
    same = dict(pp=1, micro_batch=1, sequence_parallel=True, recompute="selective",
                distributed_optimizer=True, vpp=1)
    assert rank(tp=8, **same) < rank(tp=16, **same)       # tp across two nodes loses
    assert rank(tp=4, **same) < rank(tp=16, **same)
    # the default model does not fit one 80 GB GPU without splitting it
    c = CommConfig(layers=32, hidden=4096, heads=32, seq_len=2048, vocab=50304,
                   num_microbatches=256, dtype_bytes=2, buckets=(1,))
    assert memory_per_gpu(c)["total"] > 0.9 * A100.hbm_bytes


def test_search_1024_gpus_in_seconds_and_cli(capsys):
    argv = ["--search", "--gpus", "1024", "--layers", "96", "--hidden", "12288", "--heads",
            "96", "--seq-len", "2048", "--global-batch-size", "1536", "--top", "5"]
    tic = time.perf_counter()
    assert plan_main(argv) == 0
    assert time.perf_counter() - tic < 10
    out = capsys.readouterr().out
    assert "layouts fit" in out and "fastest" in out and "vs best" in out
    assert search_main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["ranked"]) == 5 and data["ranked"][0]["tp"] <= 8
    with pytest.raises(SystemExit) as exc:  # argparse names the choices
        plan_main(argv + ["--gpu", "v100"])
    assert exc.value.code == 2 and "a100-80gb" in capsys.readouterr().err
    assert search_main(argv[:-2] + ["--top", "0"]) == 2
    assert "--top must be >= 1" in capsys.readouterr().err


def test_search_says_why_no_layout_splits_the_job(capsys):
    argv = ["--search", "--gpus", "3", "--layers", "4", "--hidden", "64", "--heads", "4",
            "--seq-len", "64", "--global-batch-size", "16"]
    assert plan_main(argv) == 1
    out = capsys.readouterr().out
    assert "no layout of 3 GPUs splits this job (memory is not the problem)" in out, out
    assert "pp must divide --layers 4" in out and "GPU counts that do: 1, 2, 4" in out
    assert "nothing fits" not in out


def test_plan_prints_step_time_and_json(capsys):
    argv = ["--layers", "24", "--hidden", "2048", "--heads", "16", "--seq-len", "2048",
            "--global-batch-size", "64", "--micro-batch-size", "1", "--tp", "2", "--pp", "2",
            "--dp", "2", "--gpu", "h100-sxm", "--gpus-per-node", "4"]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert "predicted step time" in out and "MFU / HFU" in out and "pipeline bubble" in out
    assert plan_main(argv + ["--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["hardware"]["gpus_per_node"] == 4 and p["step_time"]["mfu"] > 0
    assert plan_main(argv + ["--peak-flops", "-1"]) == 2
    assert "peak_flops" in capsys.readouterr().err


def _moe(ep: int, **kw) -> CommConfig:
    from paraloom.analysis.moe_formulas import MoECommConfig
    moe = MoECommConfig(num_experts=16, topk=2, ep=ep)
    return _gpt(layers=32, hidden=4096, heads=32, tp=1, pp=1, dp=32, num_microbatches=8,
                moe=moe, **kw)


def test_cp_ep_and_llama_shapes_in_step_time():
    # cp: half the tokens per rank, the K/V ring's steps hide under attention inside a node,
    # across nodes (tp=8 x cp=2 > 8) they do not; all-gather is exposed
    short = dict(layers=32, hidden=4096, heads=32, seq_len=16384, tp=4, pp=1, dp=2,
                 num_microbatches=4)
    base = step_time(_gpt(**short), A100)["breakdown_s"]
    cp2 = step_time(_gpt(**{**short, "dp": 1}, cp=2), A100)["breakdown_s"]
    assert cp2["compute"] < 0.6 * base["compute"] and base["cp_comm"] == 0
    inside = step_time(_gpt(**{**short, "dp": 1, "seq_len": 2048}, cp=2), A100)["breakdown_s"]
    across = step_time(_gpt(**{**short, "dp": 1, "tp": 8, "seq_len": 2048}, cp=2), A100)
    assert across["breakdown_s"]["cp_comm"] > 10 * inside["cp_comm"] >= 0
    gather = step_time(_gpt(**{**short, "dp": 1}, cp=2, cp_comm_type="all_gather"), A100)
    assert gather["breakdown_s"]["cp_comm"] > cp2["cp_comm"]
    # ep: the all-to-alls over the ep group; ep=16 leaves the node (InfiniBand)
    ep8, ep16 = (step_time(_moe(ep), A100)["breakdown_s"] for ep in (8, 16))
    assert 0 < ep8["ep_comm"] < ep16["ep_comm"] / 3
    assert step_time(_moe(1), A100)["breakdown_s"]["ep_comm"] == 0
    # the MoE model's FLOPs are the router's and topk experts', not the dense MLP's
    dense = step_time(_gpt(layers=32, hidden=4096, heads=32, tp=1, pp=1, dp=32,
                           num_microbatches=8), A100)
    moe = step_time(_moe(8), A100)
    n, h = 8 * 32 * 2048, 4096                          # tokens per step
    dense_mlp, moe_mlp = 16 * n * h * h, 2 * n * h * 16 + 2 * 16 * n * h * h
    assert moe["model_tflops_per_gpu"] * moe["step_time_s"] * 32e12 == pytest.approx(
        dense["model_tflops_per_gpu"] * dense["step_time_s"] * 32e12
        + 3 * 32 * (moe_mlp - dense_mlp))
    # GQA's K/V projections are smaller: less GEMM time
    from paraloom.analysis.arch import Architecture
    gqa = step_time(_gpt(arch=Architecture(num_query_groups=8)), A100)["breakdown_s"]
    assert gqa["compute"] < step_time(_gpt(), A100)["breakdown_s"]["compute"]


def test_plan_prints_cp_and_ep_rows(capsys):
    argv = ["--layers", "8", "--hidden", "1024", "--heads", "16", "--seq-len", "8192",
            "--global-batch-size", "16", "--micro-batch-size", "1", "--tp", "2", "--pp", "1",
            "--dp", "8", "--cp", "2", "--ep", "4", "--num-experts", "8", "--gpu", "h100-sxm",
            "--gpus-per-node", "2"]  # cp (stride tp=2) and ep (stride tp cp=4) leave the node
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert "on 32 x" in out and "exposed cp comm" in out and "ep dispatcher comm" in out
    assert plan_main(argv + ["--json"]) == 0
    parts = json.loads(capsys.readouterr().out)["step_time"]["breakdown_s"]
    assert parts["cp_comm"] > 0 and parts["ep_comm"] > 0


def test_search_with_cp_and_ep_ranks_bad_spans_low_and_long_sequences_need_cp(capsys):
    # a short sequence: cp across nodes (tp=8 x cp=2) loses to the same layout without cp
    job = dict(layers=32, hidden=4096, heads=32, seq_len=2048, global_batch=256)
    fits, _ = search(32, A100, **job)
    assert {x.cp for x in fits} >= {1, 2, 4}

    def rank(fits, **want):
        return next(i for i, x in enumerate(fits)
                    if all(getattr(x, k) == v for k, v in want.items()))
    same = dict(pp=1, micro_batch=1, sequence_parallel=True, recompute="selective",
                distributed_optimizer=True, vpp=1)
    assert rank(fits, tp=8, cp=1, **same) < rank(fits, tp=8, cp=2, **same)
    # MoE: ep spanning nodes loses to ep inside a node
    small = dict(job, layers=16, hidden=2048, heads=16)
    moe, _ = search(32, A100, **small, num_experts=16, moe_topk=2)
    assert {x.ep for x in moe} >= {1, 2, 4, 8, 16}
    assert all(x.memory_bytes <= 0.9 * A100.hbm_bytes for x in moe)
    one = dict(same, sequence_parallel=False)                # sp needs tp > 1
    assert rank(moe, tp=1, cp=1, ep=8, **one) < rank(moe, tp=1, cp=1, ep=16, **one)
    assert rank(moe, tp=2, cp=1, ep=4, **same) < rank(moe, tp=2, cp=1, ep=8, **same)
    # s = 65536 on 16 x 80 GB: no cp=1 layout fits (the recomputed attention's scores), cp wins
    long = dict(job, seq_len=65536, global_batch=16)
    fits, too_big = search(16, A100, **long)
    assert fits and too_big and all(x.cp > 1 for x in fits)
    assert search(16, A100, **long, cps=(1,))[0] == []
    # s = 32768 on 16 x 40 GB: cp=1 fits only with tp across nodes, and is slower
    fits, _ = search(16, GPUS["a100-40gb"], **dict(long, seq_len=32768))
    assert fits[0].cp > 1 and all(x.tp > 8 for x in fits if x.cp == 1)
    # the CLI: cp and ep columns
    argv = ["--search", "--gpus", "32", "--layers", "16", "--hidden", "2048", "--heads", "16",
            "--seq-len", "2048", "--global-batch-size", "256", "--num-experts", "16", "--top",
            "3"]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert " ep " in out and " cp " in out and "fastest" in out
    assert search_main(argv + ["--moe-router-topk", "32"]) == 2
    assert "moe_router_topk = 32 is larger than num_experts = 16" in capsys.readouterr().err
    assert search_main(argv[:-4] + ["--num-experts", "0"]) == 2
    assert "num_experts must be a positive integer, got 0" in capsys.readouterr().err


def test_search_llama_keeps_gqa_groups_whole(capsys):
    from paraloom.analysis.arch import Architecture
    llama = Architecture(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                         num_query_groups=2, untie_embeddings_and_output_weights=True,
                         add_bias_linear=False)
    job = dict(layers=8, hidden=1024, heads=16, seq_len=2048, global_batch=32, ffn=2816)
    fits, _ = search(16, A100, **job, arch=llama)
    assert fits and {x.tp for x in fits} == {1, 2}          # 2 key/value groups: tp <= 2
    gpt, _ = search(16, A100, **job)
    assert max(x.tp for x in gpt) == 16
    argv = ["--search", "--gpus", "16", "--layers", "8", "--hidden", "1024", "--heads", "16",
            "--seq-len", "2048", "--global-batch-size", "32", "--arch", "llama",
            "--group-query-attention", "--num-query-groups", "2", "--top", "2"]
    assert plan_main(argv) == 0 and "fastest" in capsys.readouterr().out
    # Mixtral's shape (SwiGLU experts) is searched too, ep among the layouts; a shared expert
    # makes every step slower
    assert plan_main(argv + ["--num-experts", "4", "--json"]) == 0
    moe = json.loads(capsys.readouterr().out)["ranked"]
    assert any(x["ep"] > 1 for x in moe)
    shared = ["--moe-shared-expert-intermediate-size", "2816"]
    assert plan_main(argv + ["--num-experts", "4", "--json", *shared]) == 0
    with_shared = json.loads(capsys.readouterr().out)["ranked"]
    assert with_shared[0]["step_time_s"] > moe[0]["step_time_s"]
    # both token dispatchers where something is dispatched; --moe-token-dispatcher-type pins one
    fits, _ = search(16, A100, **job, arch=llama, num_experts=4,
                     dispatchers=("allgather", "alltoall"))
    assert {x.dispatcher for x in fits if x.ep > 1} == {"allgather", "alltoall"}
    assert all(x.dispatcher == "allgather" for x in fits if x.ep == 1 and not
               (x.tp > 1 and x.sequence_parallel))
    assert plan_main(argv + ["--num-experts", "4", "--json", "--top", "400",
                             "--moe-token-dispatcher-type", "alltoall"]) == 0
    pinned = json.loads(capsys.readouterr().out)["ranked"]
    assert {x["dispatcher"] for x in pinned} == {"alltoall"}


def test_search_tries_each_cp_comm_type_where_it_applies(capsys):
    """cp > 1 layouts come with the ring, the all-gather and Ulysses' all-to-all; a2a only where
    cp divides a tp rank's key/value heads; ``--cp-comm-type`` pins one."""
    job = dict(layers=8, hidden=1024, heads=16, seq_len=16384, global_batch=16)
    fits, _ = search(16, A100, **job, cps=(1, 2, 4), cp_comm_types=("p2p", "all_gather", "a2a"))
    kinds = {(x.cp > 1, x.cp_comm_type) for x in fits}
    assert {(True, "p2p"), (True, "all_gather"), (True, "a2a")} <= kinds
    from paraloom.analysis.arch import Architecture
    gqa = Architecture(num_query_groups=2)
    fits, _ = search(16, A100, **job, cps=(1, 2, 4), arch=gqa, cp_comm_types=("a2a", "p2p"))
    assert all(2 // x.tp % x.cp == 0 for x in fits if x.cp_comm_type == "a2a" and x.cp > 1)
    assert any(x.cp_comm_type == "a2a" and x.cp == 2 for x in fits)
    argv = ["--search", "--gpus", "16", "--layers", "8", "--hidden", "1024", "--heads", "16",
            "--seq-len", "16384", "--global-batch-size", "16", "--max-cp", "4", "--json",
            "--top", "100000"]
    assert plan_main(argv + ["--cp-comm-type", "a2a"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert {x["cp_comm_type"] for x in ranked if x["cp"] > 1} == {"a2a"}
    # hierarchical a2a+p2p: only where a level of at least 2 leaves at least 2 groups (cp 4 =
    # 2 x 2 here), a level within a node that divides a tp rank's heads
    fits, _ = search(16, A100, **job, cps=(1, 2, 4), cp_comm_types=("p2p", "a2a+p2p"))
    hier = {(x.tp, x.cp, x.cp_a2a) for x in fits if x.cp_comm_type == "a2a+p2p"}
    assert hier and {(cp, a) for _, cp, a in hier} == {(4, 2)}
    assert plan_main(argv + ["--cp-comm-type", "a2a+p2p"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert {(x["cp"], x["cp_a2a"]) for x in ranked if x["cp"] > 1} == {(4, 2)}


def test_hierarchical_cp_keeps_the_all_to_all_in_the_node():
    """cp = 16 with tp = 4 on 8-GPU nodes: Ulysses over all 16 cp ranks all-to-alls across
    nodes; a2a+p2p 2 x 8 keeps the all-to-all inside a node and rings across: with nothing to
    hide behind it costs less than the plain ring (7 steps across nodes, not 15), and once
    attention hides its ring only the in-node all-to-alls are left, less than Ulysses' across
    nodes."""
    from dataclasses import replace

    from paraloom.analysis.costs import cp_comm_time
    from paraloom.analysis.spec import CommConfig
    c = CommConfig(layers=8, hidden=4096, heads=32, seq_len=65536, vocab=50304, micro_batch=1,
                   num_microbatches=1, tp=4, pp=1, dp=1, cp=16, dtype_bytes=2)
    a2a = cp_comm_time(replace(c, cp_comm_type="a2a"), H100, attention=0.0)
    hier = cp_comm_time(replace(c, cp_comm_type="a2a+p2p", cp_a2a=2), H100, attention=0.0)
    ring = cp_comm_time(replace(c, cp_comm_type="p2p"), H100, attention=0.0)
    assert hier[0] < ring[0] and hier[1] < ring[1]
    # with attention long enough to hide every ring step, only the in-node all-to-alls remain
    inner = cp_comm_time(replace(c, cp_comm_type="a2a+p2p", cp_a2a=2), H100, attention=1e3)
    assert 0 < inner[0] < a2a[0] and inner[0] < hier[0] and inner[0] == inner[1]


def test_a_dense_models_dp_reduction_is_its_parameters_all_reduce_alone():
    """Without experts there is no expert reduction to time: not even its latency (the
    ``2 (dp - 1)`` alpha terms of an empty all-reduce over the expert-data-parallel ranks)."""
    from paraloom.analysis.costs import collective_time, node_lanes, spans_nodes
    from paraloom.analysis.spec import CommConfig
    from paraloom.analysis.steptime import Options, _dp_comm
    c = CommConfig(layers=8, hidden=1024, heads=16, seq_len=2048, vocab=50304, micro_batch=1,
                   num_microbatches=4, tp=2, pp=1, dp=16, overlap_grad_reduce=False)
    params = 10 ** 8
    reduce, gather = _dp_comm(c, A100, Options(), params, 0, gemm=1.0)
    lanes = node_lanes(2, 16, A100.gpus_per_node)
    assert gather == 0.0
    assert reduce == collective_time("all_reduce", 16, params * 4, A100,
                                     spans_nodes(2, 16, A100.gpus_per_node), lanes)
