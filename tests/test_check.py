"""``paraloom check`` on real ``paraloom train`` runs: the formulas equal the ledger exactly.

Six tiny runs (one recorded step each) are trained once for the module through the real command
line (``paraloom.commands.main(["train", ...])`` forks the local ranks) and shared by every test: tp
with dp (synchronous column all-reduce, overlap off: one bucket), sp with full recomputation and
dp (several small buckets), pp 1F1B with tp (the default switches: async column all-reduce),
interleaved pp, pp with the distributed optimizer (and Megatron-Core's blocking p2p batches),
and everything at once in bf16.
"""

from __future__ import annotations

import json
import shutil

import pytest

from paraloom.analysis.layout import chunk_buckets, chunk_params
from paraloom.commands import main
from paraloom.commands.check import main as check_main
from paraloom.report.table import render_table, table_rows
from paraloom.run_folder import read_json_lines as load
from paraloom.verify.check import config_from_run

TINY = ["--layers", "4", "--hidden", "32", "--heads", "4", "--seq-len", "16",
        "--global-batch-size", "8", "--micro-batch-size", "1", "--steps", "1",
        "--ledger-steps", "1", "--save-every", "0", "--timeout", "60"]
LAYOUTS = {  # name: (flags, kinds the ledger must hold)
    "tp-dp": ("--tp 2 --pp 1 --dp 2 --no-async-tensor-model-parallel-allreduce "
              "--bucket-size 3000 --no-overlap-grad-reduce", {"tp", "dp", "mp", "world"}),
    "sp-dp": ("--tp 2 --pp 1 --dp 2 --sequence-parallel --recompute full --bucket-size 3000",
              {"sp", "tp", "dp", "mp", "world"}),
    "1f1b": ("--tp 2 --pp 2 --dp 1", {"tp", "pp", "emb", "mp", "world"}),
    "interleaved": ("--tp 1 --pp 2 --dp 1 --vpp 2 --layers 8", {"pp", "emb", "mp", "world"}),
    "zero": ("--tp 1 --pp 2 --dp 2 --distributed-optimizer --no-overlap-p2p-communication",
             {"pp", "dp", "emb", "distopt", "mp", "world"}),
    "3d-bf16": ("--tp 2 --pp 2 --dp 2 --sequence-parallel --distributed-optimizer "
                "--bucket-size 5000 --dtype bf16", {"sp", "tp", "pp", "dp", "emb", "distopt",
                                                     "mp", "world"}),
    "bare": ("--tp 2 --pp 2 --dp 1 --no-megatron-lm-loop --rerun-mode disabled",
             {"tp", "pp", "emb", "mp"}),
}
"""(Megatron-LM's loop is on by default: its rerun vote and barriers run over the world.)"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("check_runs")
    out = {}
    for name, (flags, _) in LAYOUTS.items():
        path = root / name
        assert main(["train", *TINY, *flags.split(), "--out", str(path)]) == 0, name
        out[name] = path
    return out


def _altered(src, dst, change) -> str:
    """A copy of run ``src`` at ``dst`` whose ledger events went through ``change(events)``."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    events = change(load(src / "ledger.jsonl"))
    (dst / "ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(dst)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_check_agrees_exactly_on_real_runs(runs, name, capsys):
    events = load(runs[name] / "ledger.jsonl")
    kinds = {e["kind"] for e in events if e["op"] != "compute" and e["phase"] != "setup"}
    assert kinds == LAYOUTS[name][1]  # the check is not vacuous: every kind is there
    assert check_main([str(runs[name])]) == 0
    out = capsys.readouterr().out
    assert "## step 1" in out and "rows agree" in out and "DIFF" not in out


def test_check_through_cli_and_bucket_layout(runs, capsys):
    assert main(["check", str(runs["tp-dp"]), "--step", "1"]) == 0
    assert "DIFF" not in capsys.readouterr().out
    # Megatron's buckets: without overlap one bucket, reduced synchronously at finish
    def buckets(name, rank=0):
        return [e for e in load(runs[name] / "ledger.jsonl") if e["rank"] == rank
                and e["site"].startswith(("DistributedDataParallel", "DistributedOptimizer"))]
    cfg = config_from_run(json.loads((runs["tp-dp"] / "config.json").read_text()))
    one = buckets("tp-dp")
    assert [e["bytes"] for e in one] == [4 * b.numel for b in chunk_buckets(cfg, 0)]
    assert len(one) == 1 and not one[0]["async"] and one[0]["phase"] == "optimizer"
    # with overlap, several buckets; the first step launches them all at finish (Megatron's
    # DDP launches from its hooks only once it has seen a step): the derived layout is real
    cfg = config_from_run(json.loads((runs["sp-dp"] / "config.json").read_text()))
    many = buckets("sp-dp")
    assert [e["bytes"] for e in many] == [4 * b.numel for b in chunk_buckets(cfg, 0)]
    assert len(many) > 3 and {(e["phase"], e["async"]) for e in many} == {("optimizer", True)}
    # distributed optimizer: every bucket reduce-scattered, the tied embedding's on its own;
    # the first stage launches at finish, the last one (--align-grad-reduce) from the schedule
    assert [(e["op"], e["phase"]) for e in buckets("zero", 0)] == \
        [("reduce_scatter", "optimizer")] * 2 + [("all_gather", "optimizer")] * 2
    assert [(e["op"], e["phase"]) for e in buckets("zero", 2)] == \
        [("reduce_scatter", "backward")] * 2 + [("all_gather", "optimizer")] * 2


def _input_grad_all_reduces(run) -> list[dict]:
    return [e for e in load(run / "ledger.jsonl") if e["kind"] == "tp"
            and e["op"] == "all_reduce" and e["phase"] == "backward"]


def test_default_column_backward_all_reduce_is_async(runs):
    """Megatron-Core's default (tp > 1, no sp): every column layer's input-gradient all-reduce
    (QKV, fc1 and the output layer) is launched before the weight-gradient GEMM and waited after
    it; the --no- switch restores the synchronous all-reduce, same count and bytes."""
    default = _input_grad_all_reduces(runs["1f1b"])
    # per rank: 8 microbatches x (2 layers x (qkv, fc1) + the output layer on the last stage)
    assert [sum(e["rank"] == r for e in default) for r in range(4)] == [32, 32, 40, 40]
    assert all(e["async"] for e in default)
    wgrad = [e for e in load(runs["1f1b"] / "ledger.jsonl")
             if e["op"] == "compute" and e["site"].endswith("backward:wgrad")]
    for a in default:  # each overlaps its own layer's weight-gradient GEMM
        assert any(w["rank"] == a["rank"] and w["module"] == a["module"]
                   and a["t_start"] <= w["t_start"] <= w["t_end"] <= a["t_wait"]
                   for w in wgrad), a
    rows = [r for r in table_rows(load(runs["1f1b"] / "ledger.jsonl"), rank=2)
            if r["parallel_type"] == "tp" and r["phase"] == "backward"]
    assert len(rows) == 40 and all(r["async"].startswith("yes, overlaps") for r in rows)
    sync = _input_grad_all_reduces(runs["tp-dp"])
    # per rank: 4 microbatches x (4 layers x (qkv, fc1) + the output layer)
    assert [sum(e["rank"] == r for e in sync) for r in range(4)] == [36] * 4
    assert not any(e["async"] for e in sync)
    parallel = [json.loads((runs[n] / "config.json").read_text())["parallel"]
                for n in ("1f1b", "tp-dp")]
    assert [p["async_grad_allreduce"] for p in parallel] == [None, False]


def test_no_overlap_p2p_communication_runs_blocking_batches(runs):
    """The default (gloo) posts pipeline p2p ahead (async); --no-overlap-p2p-communication runs
    Megatron-Core's blocking batches; the check above agrees exactly for both."""
    def pp(name):
        return [e for e in load(runs[name] / "ledger.jsonl") if e["kind"] == "pp"]
    # isend/irecv either way (async); the blocking batches pair a send with a receive
    assert {e["async"] for e in pp("1f1b") + pp("zero")} == {True}
    assert not any("_recv_" in e["site"] for e in pp("1f1b"))
    assert any(e["site"] == "p2p.send_forward_recv_backward" for e in pp("zero"))
    assert json.loads((runs["zero"] / "config.json").read_text())["overlap_p2p_comm"] is False


def test_check_names_a_removed_event(runs, tmp_path, capsys):
    def drop(events):
        victim = next(e for e in events if e["rank"] == 2 and e["kind"] == "pp"
                      and e["op"] == "send" and e["phase"] == "backward")
        return [e for e in events if e is not victim]
    assert check_main([_altered(runs["1f1b"], tmp_path / "a", drop)]) == 1
    out = capsys.readouterr().out
    assert out.count("DIFF") == 1
    assert "1 of" in out and "rank 2 pp send backward: expected 8 ops" in out
    assert "recorded 7 /" in out


def test_check_names_a_changed_byte_count(runs, tmp_path, capsys):
    def grow(events):
        victim = next(e for e in events if e["rank"] == 1 and e["kind"] == "dp"
                      and e["op"] == "reduce_scatter")
        victim["bytes"] += 4
        return events
    assert check_main([_altered(runs["zero"], tmp_path / "b", grow), "--only-diff"]) == 1
    out = capsys.readouterr().out
    assert "rank 1 dp reduce_scatter optimizer" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("| 1 | dp | reduce_scatter"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert int(cells[7]) - int(cells[6]) == 4 and cells[8] == "DIFF"
    assert "| 0 |" not in out  # --only-diff: the agreeing rows are left out


def test_check_rejects_bad_run_folders(runs, tmp_path, capsys):
    assert check_main([str(tmp_path / "missing")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert check_main([str(runs["tp-dp"]), "--step", "3"]) == 2
    assert "step 3" in capsys.readouterr().err
    # a rank that recorded nothing at all is missing, not skipped
    silent = _altered(runs["tp-dp"], tmp_path / "c", lambda ev: [e for e in ev if e["rank"] != 3])
    assert check_main([silent]) == 1
    assert "rank 3 dp all_reduce optimizer" in capsys.readouterr().out


def test_check_says_a_recorded_folder_has_no_formulas(tmp_path, capsys):
    (tmp_path / "ledger").mkdir()
    (tmp_path / "ledger.jsonl").write_text("")
    (tmp_path / "ledger" / "rank_0.status.json").write_text("{}")
    assert check_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "recorded by paraloom record" in err and "no formulas" in err
    assert "written by paraloom train" not in err


def test_check_skipped_step_expects_no_parameter_all_gather(runs, tmp_path, capsys):
    """A non-finite step skips the optimizer step (metrics.jsonl ``skipped``), so the
    distributed optimizer all-gathers nothing; the check expects exactly that."""
    def skip(events):
        return [e for e in events if not (e["kind"] == "dp" and e["op"] == "all_gather")]
    run = tmp_path / "skipped"
    _altered(runs["zero"], run, skip)
    assert check_main([str(run)]) == 1  # not marked skipped: the all-gathers are missing
    assert "dp all_gather optimizer: expected 2 ops" in capsys.readouterr().out
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": float("nan"),
                                                   "skipped": True}) + "\n")
    assert check_main([str(run)]) == 0
    capsys.readouterr()


def _cells(row: dict) -> tuple:
    return (row["parallel_type"], row["split_object"], row["primitive"],
            row["trigger_location"], row["async"].split(",")[0])


def test_table_snapshot_pipeline_en(runs):
    events = load(runs["1f1b"] / "ledger.jsonl")
    rows = table_rows(events, rank=0)
    assert [_cells(r) for r in rows[:3]] == [  # Megatron-LM's get_batch_on_this_tp_rank
        ("tp", f"the microbatch's {what}", "broadcast",
         f"data · get_batch_on_this_tp_rank {what}", "no")
        for what in ("tokens", "position ids", "attention mask")]
    rows = [r for r in rows if r["phase"] != "data"]
    assert [_cells(r) for r in rows[:4]] == [
        ("tp", "embedding rows, vocabulary range", "all_reduce",
         "forward · VocabParallelEmbedding output · embedding.word_embeddings", "no"),
        ("tp", "RowParallelLinear weight, input dim", "all_reduce",
         "forward · RowParallelLinear output · layers.0.attention.proj", "no"),
        ("tp", "RowParallelLinear weight, input dim", "all_reduce",
         "forward · RowParallelLinear output · layers.0.mlp.fc2", "no"),
        ("tp", "RowParallelLinear weight, input dim", "all_reduce",
         "forward · RowParallelLinear output · layers.1.attention.proj", "no")]
    pp = [r for r in rows if r["parallel_type"] == "pp"]
    assert {(r["primitive"], r["phase"], r["split_object"]) for r in pp} == {
        ("send", "forward", "activations [16, 1, 32] to the next stage"),
        ("recv", "backward", "activation grads [16, 1, 32] from the next stage")}
    assert len(pp) == 2 * 8  # 8 microbatches, first stage: sends activations, gets grads
    last = [_cells(r) for r in table_rows(events, rank=2)]
    assert {c[2] for c in last if c[0] == "pp"} == {"recv", "send"}
    assert last[-10:] == [
        ("emb", "tied word-embedding grads [V/tp, h], first + last stage", "all_reduce",
         "optimizer · finalize_model_grads embedding grads", "no"),
        ("world", "whether any rank re-runs the step", "all_reduce",
         "optimizer · rerun_state_machine vote", "no"),
        ("mp", "this rank's squared gradient norm", "all_reduce",
         "optimizer · get_grad_norm_fp32 squared norm", "no"),
        ("mp", "whether any rank has separately-normed parameters", "all_reduce",
         "optimizer · has_grad_norm_group flag", "no"),
        ("mp", "whether this rank updated", "all_reduce",
         "optimizer · train_step update successful", "no"),
        ("mp", "the gradient norm", "all_reduce", "optimizer · train_step grad norm", "no"),
        ("mp", "the learning rate, for the log", "all_reduce",
         "optimizer · training_log learning rate", "no"),
        ("world", "—", "barrier", "optimizer · training_log interval timer stop", "no"),
        ("world", "—", "barrier", "optimizer · training_log interval timer start", "no"),
        ("world", "—", "barrier", "optimizer · pretrain after training is done", "no")]
    bare = [_cells(r) for r in table_rows(load(runs["bare"] / "ledger.jsonl"), rank=2)]
    assert bare[-1][3] == "optimizer · train_step grad norm"  # the step alone
    assert not any(c[0] == "world" or c[2] == "broadcast" for c in bare)
    md = render_table(events, rank=0).splitlines()
    assert md[0] == "| # | Parallel type | Split object | Primitive | Trigger location | Async |"
    assert md[2].startswith("| 1 | tp | the microbatch's tokens | broadcast | ")


def test_table_snapshot_data_parallel_zh(runs):
    rows = table_rows(load(runs["tp-dp"] / "ledger.jsonl"), rank=0, lang="zh")
    dp = [_cells(r) for r in rows if r["parallel_type"] == "dp"]
    assert dp == [("dp", "梯度桶（各副本相同）", "all_reduce",
                   "优化器 · DistributedDataParallel 梯度桶", "否"),
                  ("dp", "损失之和与 token 数", "all_reduce", "优化器 · train_step 损失", "否")]
    assert not any(r["parallel_type"] == "pp" for r in rows)
    zero = load(runs["zero"] / "ledger.jsonl")
    head = render_table(zero, rank=3, lang="zh").splitlines()[0]
    assert head == "| # | 并行类型 | 切分对象 | 通信原语 | 触发位置 | 是否异步 |"
    rows = table_rows(zero, rank=3, lang="zh")  # last stage, dp rank 1
    assert [(c[2], c[1]) for c in map(_cells, rows) if c[0] == "dp"] == [
        ("reduce_scatter", "梯度桶，每个 dp rank 保留连续的 1/dp 分片"),
        ("reduce_scatter", "梯度桶，每个 dp rank 保留连续的 1/dp 分片"),
        ("all_gather", "参数桶，每个 dp rank 提供连续的 1/dp 分片"),
        ("all_gather", "参数桶，每个 dp rank 提供连续的 1/dp 分片"),
        ("all_reduce", "损失之和与 token 数")]
    pp = [c for c in map(_cells, rows) if c[0] == "pp"]
    assert {(c[2], c[1]) for c in pp} == {("recv", "激活 [16, 1, 32]，来自上一流水级"),
                                          ("send", "激活梯度 [16, 1, 32]，发往上一流水级")}
    emb = [c[1] for c in map(_cells, rows) if c[0] == "emb"]
    assert emb == ["共享词嵌入梯度 [V/tp, h]，首末流水级"]


def test_layout_matches_the_model_and_its_grad_buffer():
    """The derived parameter list and bucket cut equal GPTModel's and GradBuffer's (tp=1)."""
    from paraloom.analysis.formulas import CommConfig
    from paraloom.config import ModelConfig
    from paraloom.data_parallel.grad_buffer import GradBuffer
    from paraloom.mesh import ParallelMesh
    from paraloom.models.gpt import GPTModel

    c = CommConfig(layers=4, hidden=32, heads=4, seq_len=16, vocab=256, pp=2, dp=2,
                   bucket_size=4000, distributed_optimizer=True)
    cfg = ModelConfig(vocab_size=256, hidden_size=32, num_layers=4, num_attention_heads=4,
                      seq_length=16)
    for pp_rank, layers in ((0, range(0, 2)), (1, range(2, 4))):
        model = GPTModel(cfg, ParallelMesh(), layer_ids=layers, pre_process=pp_rank == 0,
                         post_process=pp_rank == 1)
        model.embedding.word_embeddings.weight.shared_embedding = True  # as with pp > 1
        named = list(model.named_parameters())
        assert [(p.name, p.numel) for p in chunk_params(c, pp_rank)] == \
            [(n, p.numel()) for n, p in named]
        # Megatron: bucket_size on the first stage only; the distributed optimizer's layout
        buf = GradBuffer(named, bucket_size=4000 if pp_rank == 0 else None, shard_over=2,
                         hold_params=True)
        assert [(b.numel, b.reduce_scatter, b.names) for b in chunk_buckets(c, pp_rank)] == \
            [(b.numel, True, tuple(b.names)) for b in buf.buckets]
        # the first stage cuts at 4000 elements; the last stage is one bucket and the embedding's
        assert len(buf.buckets) > 2 if pp_rank == 0 else len(buf.buckets) == 2


def test_a_resumed_runs_earlier_part_ends_with_its_own_last_step():
    """A run resumed with more --steps: the first process's last step ended with Megatron-LM's
    "after training is done" barrier although the saved config's --steps is the later total."""
    from dataclasses import replace

    from paraloom.analysis.formulas import CommConfig
    from paraloom.verify.check import step_config
    config = replace(CommConfig(layers=2, hidden=32, heads=4, seq_len=16, vocab=256,
                                micro_batch=1, num_microbatches=1, tp=1, pp=1, dp=1),
                     megatron_lm_loop=True, total_steps=5, log_interval=100)
    metrics = {1: {"first_of_process": True}, 2: {}, 3: {"first_of_process": True}, 4: {},
               5: {}}
    lasts = [step_config(config, s, metrics).last_step for s in range(1, 6)]
    firsts = [step_config(config, s, metrics).first_step for s in range(1, 6)]
    assert lasts == [False, True, False, False, True] and firsts == [True, False, True, False,
                                                                     False]


def test_damaged_run_folders_are_named_by_every_reader(runs, tmp_path, capfd):
    """What a killed writer leaves (a last line cut short) is left out with a note by table,
    trace, report and check; anything else exits 2 naming the file and the line."""
    src = runs["tp-dp"]
    torn = tmp_path / "torn"
    shutil.copytree(src, torn)
    text = (torn / "ledger.jsonl").read_text()
    (torn / "ledger.jsonl").write_text(text[:-30])
    for command in ("table", "trace", "report"):
        assert main([command, str(torn)]) == 0, command
        err = capfd.readouterr().err
        assert "ledger.jsonl': its last line was cut off (a writer stopped mid-line)" in err, (
            command, err)
    assert check_main([str(torn)]) in (0, 1)
    assert "its last line was cut off" in capfd.readouterr().err
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    lines = (bad / "metrics.jsonl").read_text().splitlines()
    (bad / "metrics.jsonl").write_text("\n".join([lines[0], '{"step": 1, "lo', *lines[1:]])
                                       + "\n")
    for command in ("check", "report"):
        assert main([command, str(bad)]) == 2, command
        err = capfd.readouterr().err
        assert "metrics.jsonl' is not a JSON Lines file: line 2 is not JSON" in err, err
    (bad / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    for text, message in (('{"model": ', "config.json' is not valid JSON"),
                          ("[]", "config.json' holds list, not a run configuration")):
        (bad / "config.json").write_text(text)
        for command in ("check", "report"):
            assert main([command, str(bad)]) == 2
            assert message in capfd.readouterr().err


def test_check_reads_config_json_through_the_train_config(runs, tmp_path, capsys):
    """One description of a run: ``check`` reads config.json as ``--resume`` does
    (``TrainConfig.from_dict``), so the derived settings are the configuration's own (SwiGLU's
    MLP width, the padded vocabulary, microbatches), an older folder is migrated, and a
    setting this version does not know is named (exit 2), not silently defaulted."""
    from paraloom.analysis.view import comm_view
    from paraloom.config import ModelConfig, ParallelConfig, TrainConfig
    cfg = TrainConfig(model=ModelConfig(vocab_size=300, hidden_size=96, num_layers=2,
                                        num_attention_heads=4, seq_length=16, swiglu=True),
                      parallel=ParallelConfig(tp=2, dp=2), global_batch_size=8,
                      micro_batch_size=1)
    view = config_from_run(json.loads(json.dumps(cfg.to_dict())))
    assert view == comm_view(cfg)
    # int(4h 2/3/64)*64; 300 rounded up to a multiple of 128 * tp (Megatron-LM's padding)
    assert (view.ffn, view.vocab, view.num_microbatches) == (256, 512, 4)
    saved = json.loads((runs["tp-dp"] / "config.json").read_text())
    assert config_from_run(saved).megatron_lm_loop  # this run's loop, as it ran
    older = {k: v for k, v in saved.items() if k != "megatron_lm_loop"}
    older.update(older.pop("optim"))  # an earlier version's flat layout: lr, ... at the top
    assert not config_from_run(older).megatron_lm_loop  # written before the loop existed
    run = tmp_path / "newer"
    shutil.copytree(runs["tp-dp"], run)
    (run / "config.json").write_text(json.dumps({**saved, "wormholes": 2}))
    assert check_main([str(run)]) == 2
    assert "'wormholes'" in capsys.readouterr().err


def test_plan_of_a_run_folder_is_the_run_check_proves(runs, tmp_path, capsys):
    """``paraloom plan RUN_FOLDER`` plans the run config.json describes, through the same view
    ``check`` proves against the ledger (Megatron-LM's loop included: the rerun vote over the
    world), not plan's flag defaults; model or layout flags beside it are refused."""
    from paraloom.analysis.plan import plan

    run = runs["tp-dp"]
    capsys.readouterr()
    assert main(["plan", str(run), "--json", "--gpu", "h100-sxm"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = plan(config_from_run(json.loads((run / "config.json").read_text())))
    assert got["parameters"] == want["parameters"] and got["parameters"]["total"] > 0
    assert got["comm_ops_per_step"] == want["comm_ops_per_step"]
    assert got["comm_ops_per_step"].get("world", 0) >= 1  # the loop's rerun vote
    assert got["gpus"] == 4 and got["hardware"]["name"] == "h100-sxm"
    assert main(["plan", str(run), "--tp", "4"]) == 2
    assert "with a run folder the model and the layout come from" in capsys.readouterr().err
    assert main(["plan", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err
