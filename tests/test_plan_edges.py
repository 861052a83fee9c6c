"""``paraloom plan``'s edges as a new user meets them: what train refuses, bad hardware values,
the memory verdict, the display of small and MoE models, the search's one-line refusals."""

from __future__ import annotations

import json

import pytest

from paraloom.analysis.search import no_valid_layout
from paraloom.commands.plan import main as plan_main

SMALL = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--seq-len", "4096",
         "--global-batch-size", "512", "--micro-batch-size", "1"]


def test_plan_counts_mixtral_8x7b(capsys):
    """Mixtral 8x7B's shape (SwiGLU experts without biases, GQA, untied): 46,702,792,704
    parameters (its published count), plus the 256 padding rows of the two vocabulary tables at
    tp = 4 (32000 -> 32256, Megatron's padding)."""
    argv = [*SMALL, "--arch", "llama", "--group-query-attention", "--num-query-groups", "8",
            "--ffn", "14336", "--vocab", "32000", "--num-experts", "8", "--tp", "4", "--pp", "4",
            "--dp", "8", "--ep", "8", "--json"]
    assert plan_main(argv) == 0
    params = json.loads(capsys.readouterr().out)["parameters"]
    assert params["total"] == 46_702_792_704 + 2 * (32256 - 32000) * 4096


@pytest.mark.parametrize("extra, message", [
    (["--pp", "1", "--vpp", "2"], "vpp = 2 needs pipeline parallelism"),
    (["--pp", "4", "--vpp", "2", "--dp", "1", "--global-batch-size", "6"],
     "the interleaved schedule needs the number of microbatches (6) to be a multiple of pp"),
    (["--inter-bw", "nan"], "inter_bw (--inter-bw) must be a finite number, got nan"),
    (["--peak-flops", "inf"], "peak_flops (--peak-flops) must be a finite number"),
    (["--op-overhead", "-1"], "op_overhead (--op-overhead) must be >= 0, got -1.0"),
])
def test_plan_refuses_what_train_refuses_and_bad_hardware(capsys, extra, message):
    assert plan_main(SMALL + extra) == 2
    captured = capsys.readouterr()
    assert message in captured.err and not captured.out, captured.err


def test_verdict_says_whether_the_layout_fits_and_require_fit_exits_1(capsys):
    assert plan_main(SMALL + ["--tp", "8", "--pp", "2", "--dp", "4"]) == 0
    out = capsys.readouterr().out
    assert "verdict: fits (" in out and "usable of the a100-80gb's" in out, out
    assert plan_main(SMALL + ["--tp", "8", "--pp", "2", "--dp", "4", "--require-fit"]) == 0
    capsys.readouterr()
    one = SMALL + ["--gpus", "1"]  # Megatron-LM's layout of one GPU: tp = pp = dp = 1
    assert plan_main(one) == 0  # one GPU: the verdict, exit 0 without --require-fit
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("verdict:"))
    assert "does NOT fit" in line and "x too much" in line and "--recompute" in line, line
    assert "--distributed-optimizer" not in line  # nothing to shard over with dp = 1
    assert plan_main(one + ["--require-fit"]) == 1
    capsys.readouterr()
    assert plan_main(one + ["--require-fit", "--json"]) == 1
    fit = json.loads(capsys.readouterr().out)["memory_fit"]
    assert fit["fits"] is False and fit["need_bytes"] > fit["budget_bytes"] > 0


def test_header_shows_small_models_dtype_and_experts(capsys):
    argv = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "64", "--vocab",
            "256", "--global-batch-size", "8", "--micro-batch-size", "1", "--tp", "1", "--pp", "1",
            "--dp", "2", "--num-experts", "4", "--ep", "2", "--dtype", "fp32"]
    assert plan_main(argv) == 0
    head = capsys.readouterr().out.splitlines()
    assert head[0].split()[0].endswith("K") and "0.0B" not in head[0], head[0]
    assert "4 experts top-2 ep=2" in head[0] and head[0].endswith("fp32)"), head[0]
    assert "parameters per GPU" in head[2] and head[2].rstrip().endswith("K"), head[2]
    assert plan_main(SMALL + ["--tp", "8", "--pp", "2", "--dp", "4"]) == 0
    out = capsys.readouterr().out
    assert "(the stage holding most)" in out and "at its busiest stage" in out


def test_search_refuses_layout_flags_in_one_line(capsys):
    argv = ["--search", "--gpus", "8", *SMALL]
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--micro-batch-size" in err, err
    assert "the search tries every value" in err


def test_no_valid_layout_names_the_query_groups():
    # 3 layers, one sequence per step: only tp and pp = 3 split the job; 8 GPUs would need tp = 8
    # (or 8/3), which 4 key/value groups cannot be split into: the nearest counts exclude 8 and 24
    kw = dict(layers=3, hidden=8192, heads=64, seq_len=4097, global_batch=1)
    why = no_valid_layout(16, **kw, query_groups=4)
    assert "--num-query-groups 4" in why and why.endswith("GPU counts that do: 4, 6, 12"), why
    assert no_valid_layout(16, **kw).endswith("GPU counts that do: 8, 12, 24")
