"""``paraloom train --num-experts``: the run folder and record of an expert-parallel run, and bad
MoE flags (exit 2 naming the values, before any rank starts). Layout equivalence is proved in
test_moe.py (warm world, no files)."""

from __future__ import annotations

import pytest

from paraloom.commands import main


def test_expert_parallel_run_is_on_the_record_and_reshards(tmp_path, capsys):
    """A tp2-sp-dp2-ep2 run with the alltoall dispatcher: metrics, expert_load.png, the table
    (en/zh) with the all-to-alls in forward and backward, ``paraloom check`` exact (and a
    forged split size caught); its checkpoint resumed at dp4-ep4 continues the same model."""
    import json
    import shutil

    from paraloom.commands.check import main as check_main
    from paraloom.commands.table import main as table_main

    run = tmp_path / "run"
    shape = ["--num-experts", "4", "--moe-layer-freq", "2", "--layers", "4", "--hidden", "32",
             "--heads", "4", "--seq-len", "16", "--global-batch-size", "8",
             "--micro-batch-size", "1", "--ledger-steps", "1", "--out", str(run),
             "--moe-token-dispatcher-type", "alltoall"]
    assert main(["train", "--tp", "2", "--pp", "1", "--dp", "2", "--ep", "2",
                 "--sequence-parallel", "--steps", "4", "--save-every", "2", *shape]) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(m["aux_loss"] > 0 and set(m["tokens_per_expert"]) == {"0", "2"} for m in metrics)
    assert (run / "expert_load.png").stat().st_size > 0
    capsys.readouterr()
    assert check_main([str(run), "--only-diff"]) == 0, capsys.readouterr().out
    for lang, words, forward in (("en", "tokens to their experts' ranks", "forward"),
                                 ("zh", "token 发往所选专家", "前向")):
        capsys.readouterr()
        assert table_main([str(run), "--lang", lang]) == 0
        rows = [r for r in capsys.readouterr().out.splitlines() if "| ep |" in r]
        assert any(words in r and forward in r for r in rows)
        # 2 MoE layers x (combine, probabilities, dispatch) x 4 microbatches
        backward = {"en": "backward", "zh": "反向"}[lang]
        assert sum("all_to_all" in r and backward in r for r in rows) == 2 * 3 * 4
    _megatron_dispatch_order(run)
    forged = tmp_path / "forged"
    shutil.copytree(run, forged, ignore=shutil.ignore_patterns("checkpoints"))
    lines = (forged / "ledger.jsonl").read_text().splitlines()
    for i, line in enumerate(lines):
        event = json.loads(line)
        if event["kind"] == "ep" and event["site"].endswith(":tokens"):
            event["output_splits"][0] += 1
            lines[i] = json.dumps(event)
            break
    (forged / "ledger.jsonl").write_text("\n".join(lines) + "\n")
    assert check_main([str(forged), "--only-diff"]) == 1
    assert "splits" in capsys.readouterr().out
    # resume the step-2 checkpoint under another expert layout (experts and their Adam moments
    # resharded from ep 2 to ep 4, ZeRO on): steps 3 and 4 again, the same numbers
    again = tmp_path / "again"
    assert main(["train", "--resume", str(run / "checkpoints" / "step_2"), "--tp", "1",
                 "--dp", "4", "--ep", "4", "--distributed-optimizer", "--steps", "4",
                 "--out", str(again)]) == 0
    resumed = [json.loads(line) for line in (again / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in resumed] == [3, 4]
    for got, want in zip(resumed, metrics[2:], strict=True):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5)


def _megatron_dispatch_order(run) -> None:
    """Dropless under sp, one MoE layer's forward on rank 0 is Megatron's alltoall dispatcher:
    the aux counts all-reduced over tp (sp, E int64), no router logits or tokens gathered over
    tp, the counts all-gathered over tp x ep (4 ranks), this rank's 8 tokens x top-2 sent by
    all-to-all with their probabilities, the received rows and probabilities all-gathered over
    tp with uneven sizes, the outputs reduce-scattered over tp with the same sizes, then sent
    back."""
    import json

    events = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    layer = [e for e in events if e["rank"] == 0 and e.get("module") == "layers.0.mlp"
             and e.get("microbatch") == 0 and e["phase"] == "forward"]
    seen = [(e["kind"], e["op"], e["site"].rpartition(".")[2], e.get("pg")) for e in layer]
    assert seen == [
        ("sp", "all_reduce", "router:tokens_per_expert", "tp_cp"),
        ("ep", "all_gather", "forward:tokens_per_expert", "tp_ep"),
        ("ep", "all_to_all", "forward:tokens", "ep"), ("ep", "all_to_all", "forward:probs", "ep"),
        ("ep", "all_gather", "forward:tokens_tp", "tp"),
        ("ep", "all_gather", "forward:probs_tp", "tp"),
        ("ep", "reduce_scatter", "forward:tokens_tp", "tp"),
        ("ep", "all_to_all", "forward:tokens", "ep")], seen
    counts, send, _, gather, _, scatter, _ = layer[1:]
    assert len(counts["group"]) == 4 and counts["shape"] == [4]
    assert sum(send["input_splits"]) == 16 // 2 * 2
    assert sum(gather["output_splits"]) == sum(scatter["input_splits"])
    assert gather["output_splits"] == scatter["input_splits"]
    # plan's count of the dispatcher's exchanges is the record's (bytes: balanced routing)
    from paraloom.analysis.moe_formulas import moe_plan
    from paraloom.verify.check import config_from_run

    config = config_from_run(json.loads((run / "config.json").read_text()))
    ours = [e for e in events if e["rank"] == 0 and e["kind"] == "ep" and e["step"] == 1]
    assert moe_plan(config, 0)["ep_ops"] == len(ours) == 2 * 4 * 13


def test_allgather_dispatcher_is_megatrons_on_the_record(tmp_path, capsys):
    """Megatron's default dispatcher in a tp2-sp-dp2-ep2 run: one MoE layer's forward on rank 0
    is the aux counts' all-reduce over tp, then the routing map (bool), the probabilities and
    the tokens all-gathered over the 4 tp x ep ranks, and the outputs reduce-scattered there in
    fp32; no all-to-all. ``paraloom check`` exact (every size is the layout's), the table
    names them (en/zh), and plan counts the record's ep exchanges. Padding to capacity with it
    exits 2 before any rank starts."""
    import json

    from paraloom.analysis.moe_formulas import moe_plan
    from paraloom.commands.check import main as check_main
    from paraloom.commands.table import main as table_main
    from paraloom.verify.check import config_from_run

    run = tmp_path / "run"
    shape = ["--num-experts", "4", "--moe-layer-freq", "2", "--layers", "2", "--hidden", "32",
             "--heads", "4", "--seq-len", "16", "--global-batch-size", "4",
             "--micro-batch-size", "1", "--ledger-steps", "1", "--tp", "2", "--pp", "1",
             "--dp", "2", "--ep", "2", "--sequence-parallel"]
    assert main(["train", *shape, "--steps", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    assert check_main([str(run), "--only-diff"]) == 0, capsys.readouterr().out
    events = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    layer = [e for e in events if e["rank"] == 0 and e.get("module") == "layers.0.mlp"
             and e.get("microbatch") == 0 and e["phase"] == "forward"]
    seen = [(e["kind"], e["op"], e["site"].rpartition(":")[2], e.get("pg"), e["dtype"])
            for e in layer]
    assert seen == [("sp", "all_reduce", "tokens_per_expert", "tp_cp", "int64"),
                    ("ep", "all_gather", "routing_map", "tp_ep", "bool"),
                    ("ep", "all_gather", "probs", "tp_ep", "float32"),
                    ("ep", "all_gather", "tokens", "tp_ep", "float32"),
                    ("ep", "reduce_scatter", "tokens", "tp_ep", "float32")], seen
    assert layer[3]["shape"] == [8, 32] and layer[4]["shape"] == [32, 32]  # 16 / tp tokens
    assert not any(e["op"] == "all_to_all" for e in events)
    for lang, words in (("en", "tokens [tokens, h] of every tp x ep rank"),
                        ("zh", "各 tp x ep rank 的 token")):
        capsys.readouterr()
        assert table_main([str(run), "--lang", lang]) == 0
        assert words in capsys.readouterr().out
    config = config_from_run(json.loads((run / "config.json").read_text()))
    ep = [e for e in events if e["rank"] == 0 and e["kind"] == "ep" and e["step"] == 1]
    assert moe_plan(config, 0)["ep_ops"] == len(ep) == 2 * 7  # 2 microbatches x 7
    capsys.readouterr()
    assert main(["train", *shape, "--moe-expert-capacity-factor", "1.0",
                 "--moe-pad-expert-input-to-capacity", "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert "moe_pad_expert_input_to_capacity" in err and "alltoall" in err


@pytest.mark.parametrize("capacity", [None, "1.0", "pad"], ids=["dropless", "capacity", "padded"])
def test_moe_with_context_parallelism_is_exact_on_the_record(tmp_path, capsys, capacity):
    """cp2-ep2 with full recomputation: ``paraloom check`` exact, the router's counts summed over
    cp (dropless) or its logits gathered over cp (capacity) on the ledger, kind cp, forward and
    recompute; tokens per expert of whole microbatches (layout equivalence with one process:
    test_moe.py's cp layouts)."""
    import json

    from paraloom.commands.check import main as check_main

    run = tmp_path / "cp2"
    extra = ["--moe-token-dispatcher-type", "alltoall"]
    extra += ["--moe-expert-capacity-factor", "1.0"] if capacity else []
    if capacity == "pad":  # every expert gets exactly its capacity: fixed splits, no counts sent
        extra.append("--moe-pad-expert-input-to-capacity")
    assert main(["train", "--num-experts", "4", "--moe-layer-freq", "2", "--layers", "2",
                 "--hidden", "32", "--heads", "4", "--seq-len", "16", "--global-batch-size", "2",
                 "--micro-batch-size", "1", "--steps", "2", "--ledger-steps", "1", "--tp", "1",
                 "--pp", "1", "--dp", "1", "--cp", "2", "--ep", "2", "--recompute", "full",
                 *extra, "--out", str(run)]) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:  # 2 sequences x 16 tokens x top-2, both cp halves counted
        kept = sum(m["tokens_per_expert"]["0"])
        assert m["aux_loss"] > 0 and kept + m.get("dropped_tokens", 0) == 2 * 16 * 2
    capsys.readouterr()
    assert check_main([str(run), "--only-diff"]) == 0, capsys.readouterr().out
    events = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    site, op = ("MoELayer.router:logits", "all_gather") if capacity else \
        ("MoELayer.router:tokens_per_expert", "all_reduce")
    assert {(e["kind"], e["op"], bool(e.get("recompute"))) for e in events
            if e["site"] == site} == {("cp", op, False), ("cp", op, True)}
    tokens = [e for e in events if e["kind"] == "ep" and e["op"] == "all_to_all"
              and e["site"].endswith(":tokens")]
    counts = [e for e in events if e["kind"] == "ep" and e.get("dtype") == "int64"]
    assert all(e["op"] == "all_gather" for e in counts)  # Megatron's: over tp x ep
    if capacity == "pad":  # capacity ceil(16 tokens x 2 / 4 x 1.0) = 8 rows per expert
        assert not counts
        assert {sum(e["input_splits"]) for e in tokens} == {4 * 8}
    else:
        assert counts


@pytest.mark.parametrize("extra", [
    ["--sequence-parallel", "--distributed-optimizer"],
    ["--moe-shared-expert-intermediate-size", "48", "--moe-shared-expert-gate"],
    ["--moe-shared-expert-intermediate-size", "48", "--sequence-parallel"]],
    ids=["mixtral-sp-zero", "shared-expert-gate-tp", "shared-expert-sp"])
def test_mixtral_style_experts_train_check_and_reshard(tmp_path, capsys, extra):
    """SwiGLU experts without biases in a Llama-family model (Mixtral's shape) under
    tp2-dp2-ep2: with sp and ZeRO; with a shared expert, gated without sp (its fc2's all-reduce
    forward, fc1's backward) or under sp (its gathers and reduce-scatters). ``paraloom check`` is
    exact (the experts' buckets, the tp/sp traffic), and the step-2 checkpoint resumed at
    tp1-dp4-ep4 (each expert's ``[gate_r; up_r]`` fc1 rows rejoined from tp 2) continues the
    same model."""
    import json

    from paraloom.commands.check import main as check_main

    run = tmp_path / "run"
    shape = ["--num-experts", "4", "--moe-layer-freq", "2", "--layers", "4", "--hidden", "32",
             "--heads", "4", "--seq-len", "16", "--global-batch-size", "8",
             "--micro-batch-size", "1", "--ledger-steps", "1", "--normalization", "RMSNorm",
             "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
             "--group-query-attention", "--num-query-groups", "2",
             "--untie-embeddings-and-output-weights", *extra]
    assert main(["train", "--tp", "2", "--dp", "2", "--ep", "2", "--steps", "4",
                 "--save-every", "2", *shape, "--out", str(run)]) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    config = json.loads((run / "config.json").read_text())["model"]
    assert config["swiglu"] and not config["add_bias_linear"]
    capsys.readouterr()
    assert check_main([str(run), "--only-diff"]) == 0, capsys.readouterr().out
    again = tmp_path / "again"
    assert main(["train", "--resume", str(run / "checkpoints" / "step_2"), "--tp", "1",
                 "--dp", "4", "--ep", "4", "--steps", "4", "--out", str(again)]) == 0
    resumed = [json.loads(line) for line in (again / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in resumed] == [3, 4]
    for got, want in zip(resumed, metrics[2:], strict=True):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5)


def test_shared_expert_overlap_moves_its_communication_into_the_dispatcher(tmp_path, capsys):
    """``--moe-shared-expert-overlap`` (tp2-dp2-ep2, sp, alltoall, gated shared expert): the same
    losses and grad norms as the shared expert run first; ``paraloom check`` exact; on the
    record, the shared expert's input gathered after the token counts and before the tokens'
    all-to-all (not before the router), its output reduce-scattered right after the combine
    all-to-all, its backward reduce-scatter after the tokens' gradient all-to-all and no
    re-gather of its input; the checkpoint resumes at tp1-dp4-ep4 with the same losses."""
    import json

    from paraloom.commands.check import main as check_main

    shape = ["--num-experts", "4", "--moe-layer-freq", "2", "--layers", "2", "--hidden", "32",
             "--heads", "4", "--seq-len", "16", "--global-batch-size", "4",
             "--micro-batch-size", "1", "--ledger-steps", "1", "--disable-bias-linear",
             "--moe-token-dispatcher-type", "alltoall", "--moe-shared-expert-intermediate-size",
             "48", "--moe-shared-expert-gate", "--sequence-parallel", "--tp", "2", "--dp", "2",
             "--ep", "2", "--pp", "1"]
    on, off, again = tmp_path / "on", tmp_path / "off", tmp_path / "again"
    assert main(["train", *shape, "--moe-shared-expert-overlap", "--steps", "4",
                 "--save-every", "2", "--out", str(on)]) == 0
    assert main(["train", *shape, "--steps", "2", "--out", str(off)]) == 0

    def metrics(run):
        return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for got, want in zip(metrics(on)[:2], metrics(off), strict=True):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5)
    capsys.readouterr()
    assert check_main([str(on), "--only-diff"]) == 0, capsys.readouterr().out

    def layer0(run):  # rank 0's first microbatch of step 1: layer 0's MLP communication
        events = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
        return [(e["phase"], e["op"], e["site"].split(":")[0].split(".")[0] + ":"
                 + e["site"].rsplit(":", 1)[-1]) for e in events
                if e["rank"] == 0 and e["step"] == 1 and e["microbatch"] == 0
                and e["op"] != "compute" and (e.get("module") or "").startswith("layers.0.mlp")]
    a2a = "MoEAlltoAllTokenDispatcher:"
    dispatch = [("forward", "all_gather", a2a + "tokens_per_expert"),
                ("forward", "all_to_all", a2a + "tokens"), ("forward", "all_to_all", a2a + "probs"),
                ("forward", "all_gather", a2a + "tokens_tp"),
                ("forward", "all_gather", a2a + "probs_tp"),
                ("forward", "reduce_scatter", a2a + "tokens_tp"),
                ("forward", "all_to_all", a2a + "tokens")]
    back = [("backward", "all_to_all", a2a + "tokens_grad"),
            ("backward", "all_gather", a2a + "tokens_tp_grad"),
            ("backward", "reduce_scatter", a2a + "probs_tp_grad"),
            ("backward", "reduce_scatter", a2a + "tokens_tp_grad"),
            ("backward", "all_to_all", a2a + "probs_grad"),
            ("backward", "all_to_all", a2a + "tokens_grad")]
    counts = ("forward", "all_reduce", "MoELayer:tokens_per_expert")
    assert layer0(off) == [
        ("forward", "all_gather", "ColumnParallelLinear:input"),
        ("forward", "reduce_scatter", "RowParallelLinear:output"), counts, *dispatch, *back,
        ("backward", "all_gather", "RowParallelLinear:output_grad"),
        ("backward", "all_gather", "ColumnParallelLinear:input (re-gather)"),
        ("backward", "reduce_scatter", "ColumnParallelLinear:input_grad")]
    assert layer0(on) == [
        counts, dispatch[0], ("forward", "all_gather", "SharedExpertMLP:input"), *dispatch[1:],
        ("forward", "reduce_scatter", "SharedExpertMLP:output"),
        ("backward", "all_gather", "SharedExpertMLP:output_grad"), *back,
        ("backward", "reduce_scatter", "SharedExpertMLP:input_grad")]
    assert main(["train", "--resume", str(on / "checkpoints" / "step_2"), "--tp", "1",
                 "--dp", "4", "--ep", "4", "--steps", "4", "--out", str(again)]) == 0
    for got, want in zip(metrics(again), metrics(on)[2:], strict=True):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5)


def test_grouped_gemm_orders_the_expert_buckets_as_megatron_and_reshards(tmp_path, capsys):
    """``--moe-grouped-gemm`` (tp1-dp4-ep2: two local experts per rank, their gradients reduced
    over edp = 2; buckets of 6144 elements, so boundaries fall between experts): the same losses
    as without it; the expert buckets hold, last layer first, fc2 of every local expert before
    their fc1 (Megatron's TEGroupedMLP order) where without it they go expert by expert, so the
    buckets themselves change; ``paraloom check`` exact; a checkpoint saved without the flag
    resumes with it at tp2-dp2-ep2 and continues the same model."""
    import json

    from paraloom.commands.check import main as check_main

    shape = ["--num-experts", "4", "--moe-layer-freq", "2", "--layers", "4", "--hidden", "32",
             "--ffn-hidden-size", "64", "--heads", "4", "--seq-len", "16",
             "--global-batch-size", "8", "--micro-batch-size", "1", "--ledger-steps", "1",
             "--swiglu", "--disable-bias-linear", "--bucket-size", "6144",
             "--overlap-grad-reduce", "--pp", "1"]
    on, off, again = tmp_path / "on", tmp_path / "off", tmp_path / "again"
    assert main(["train", *shape, "--tp", "1", "--dp", "4", "--ep", "2", "--steps", "4",
                 "--save-every", "2", "--out", str(off)]) == 0
    assert main(["train", *shape, "--tp", "1", "--dp", "4", "--ep", "2", "--steps", "2",
                 "--moe-grouped-gemm", "--out", str(on)]) == 0

    def metrics(run):
        return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for got, want in zip(metrics(on), metrics(off)[:2], strict=True):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5)
    capsys.readouterr()
    assert check_main([str(on), "--only-diff"]) == 0, capsys.readouterr().out

    def expert_buckets(run):  # rank 0, step 1: the expert gradient buckets, launch order
        events = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
        return [[p.split("layers.", 1)[1] for p in e["params"]] for e in events
                if e["rank"] == 0 and e["step"] == 1 and e.get("params")
                and all(".experts." in p for p in e["params"])]
    grouped, sequential = expert_buckets(on), expert_buckets(off)
    # fc1 is 2f x h = 4096 elements, fc2 h x f = 2048; a bucket closes once it holds >= 6144,
    # filled last parameter first: grouped, layer 2's fc2 of experts 1 and 0 and its expert 1
    # fc1 make the first bucket (8192), where expert by expert each expert is one (6144)
    w = "{}.mlp.experts.{}.{}.weight".format
    assert grouped == [[w(2, 1, "fc2"), w(2, 0, "fc2"), w(2, 1, "fc1")],
                       [w(2, 0, "fc1"), w(0, 1, "fc2")], [w(0, 0, "fc2"), w(0, 1, "fc1")],
                       [w(0, 0, "fc1")]]
    assert sequential == [[w(layer, g, "fc2"), w(layer, g, "fc1")] for layer in (2, 0)
                          for g in (1, 0)]
    assert main(["train", "--resume", str(off / "checkpoints" / "step_2"), "--tp", "2",
                 "--dp", "2", "--ep", "2", "--moe-grouped-gemm", "--steps", "4",
                 "--out", str(again)]) == 0
    # the checkpoint has experts: no note that the flag needs --num-experts
    assert "no effect without --num-experts" not in capsys.readouterr().err
    for got, want in zip(metrics(again), metrics(off)[2:], strict=True):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5)
