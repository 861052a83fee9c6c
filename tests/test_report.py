"""Communication order table and Perfetto trace on ledgers recorded from real GPT runs (tp=2)."""

from __future__ import annotations

import csv
import io
import json
import re

import pytest
from _gpt_ledger import L, record_gpt

from paraloom.commands.table import main as table_main
from paraloom.commands.trace import main as trace_main
from paraloom.report.table import render_table, table_rows
from paraloom.report.trace import build_trace, write_trace


@pytest.fixture(scope="module")
def runs(world4):
    out = {}
    for name, args in {"async": (2, False, "none", True), "sync": (2, False, "none", False),
                       "sp": (2, True, "full", False)}.items():
        out[name] = [e for events in world4.run(record_gpt, *args) for e in events]
    return out


EN_HEAD = "| # | Parallel type | Split object | Primitive | Trigger location | Async |"
ZH_HEAD = "| # | 并行类型 | 切分对象 | 通信原语 | 触发位置 | 是否异步 |"


def test_table_en_snapshot_tp2_async(runs):
    lines = render_table(runs["async"]).splitlines()
    assert lines[0] == EN_HEAD and lines[1] == "|---|---|---|---|---|---|"
    assert lines[2:5] == [
        "| 1 | tp | embedding rows, vocabulary range | all_reduce | forward · "
        "VocabParallelEmbedding output · embedding.word_embeddings | no |",
        "| 2 | tp | RowParallelLinear weight, input dim | all_reduce | forward · "
        "RowParallelLinear output · layers.0.attention.proj | no |",
        "| 3 | tp | RowParallelLinear weight, input dim | all_reduce | forward · "
        "RowParallelLinear output · layers.0.mlp.fc2 | no |",
    ]
    # backward: the input-grad all-reduce is async and overlaps the weight-gradient GEMM
    assert lines[11] == (
        "| 10 | tp | ColumnParallelLinear weight, output dim | all_reduce | backward · "
        "ColumnParallelLinear input grad · layers.1.mlp.fc1 | yes, overlaps: "
        "ColumnParallelLinear wgrad (layers.1.mlp.fc1) |")
    # emb + 2L forward, CE max + target + exp sum (Megatron's three), output + 2L backward
    assert len(lines) == 2 + 4 * L + 5
    # every tp rank communicates the same, in the same order
    assert render_table(runs["async"], rank=3) == render_table(runs["async"], rank=0)


def test_table_zh_snapshot_and_sync_rows(runs):
    lines = render_table(runs["async"], lang="zh").splitlines()
    assert lines[0] == ZH_HEAD
    assert lines[2] == ("| 1 | tp | 词嵌入的行，按词表范围切分 | all_reduce | 前向 · "
                        "VocabParallelEmbedding 输出 · embedding.word_embeddings | 否 |")
    assert lines[11].endswith("| 是, 重叠: ColumnParallelLinear 权重梯度 GEMM (layers.1.mlp.fc1) |")
    sync = table_rows(runs["sync"])
    grads = [r for r in sync if r["site"] == "ColumnParallelLinear.backward:input_grad"]
    assert len(grads) == 2 * L and all(r["async"] == "no" for r in grads)
    assert all(r["primitive"] == "all_reduce" and r["phase"] == "backward" for r in grads)


_IDENTIFIER = re.compile(r"^([A-Z][A-Za-z]*[a-z][A-Z]\w*|[\w.]*[._\d][\w.*]*|GEMM|MoE|logits|"
                         r"tokens?|rank|[a-z]?[A-Z]?|tp|dp|cp|ep|pp|mp|dK|dV|LayerNorm|"
                         r"(b?float|u?int)\d+|x\d+)$")
"""Words a Chinese table keeps: class, module and dtype names, abbreviations, counts."""


def _english(text: str) -> list[str]:
    text = re.sub(r"\([\w.*]+\)", "", text)  # a module path in parentheses
    return [w for w in re.findall(r"[A-Za-z][\w.*]*", text) if not _IDENTIFIER.match(w)]


def test_zh_table_has_no_english_words(runs):
    """Every split paraloom's runtime writes has its Chinese (a source walk), and the zh table
    of real runs (tp2 async / sync, sp with full recomputation; split, phase and the compute an
    async row overlaps) keeps only identifiers."""
    import ast
    from pathlib import Path

    from paraloom.report import zh
    root = Path(zh.__file__).parents[1]
    written = set()
    for path in root.rglob("*.py"):
        if path.parts[-2] in ("report", "explain"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "split" \
                    and isinstance(node.value, ast.Constant):
                written.add(node.value.value)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.endswith((", output dim", ", input dim", "vocabulary range")):
                written.add(node.value)
    assert len(written) >= 20 and written <= set(zh.SPLITS), written - set(zh.SPLITS)
    for text in zh.SPLITS.values():
        assert not _english(text), text
    for events in runs.values():
        for row in table_rows(events, lang="zh"):
            where = row["trigger_location"].split(" · ")
            tag = where[1].split(" ", 1)[1] if " " in where[1] else ""  # after the code name
            cells = row["split_object"] + " " + row["async"] + " " + where[0] + " " + tag
            assert not _english(cells), row
            assert row["overlaps"] == [] or row["async"].startswith("是"), row  # sync: none
    # every tag paraloom's train writes has its Chinese (the sites of a Megatron-LM loop too)
    for text in zh.TAGS.values():
        assert not _english(text.replace("logits", "").replace("logit", "").replace(
            "token", "").replace("Megatron", "").replace("MoE", "").replace("GEMM", "")), text


def test_table_sp_rows_in_megatron_order(runs):
    rows = table_rows(runs["sp"])
    assert {r["parallel_type"] for r in rows} == {"sp", "tp"}  # tp: the cross-entropy only
    # learned positions: the embedding all-reduced [b, s, h], then split (Megatron's choice)
    assert [r["primitive"] for r in rows[:5]] == ["all_reduce", "all_gather",
                                                  "reduce_scatter", "all_gather",
                                                  "reduce_scatter"]
    fc1 = [r for r in rows if r["module"] == "layers.1.mlp.fc1" and r["phase"] == "backward"
           and "recompute" not in r["trigger_location"]]
    assert [(r["primitive"], r["overlaps"]) for r in fc1] == [
        ("all_gather", ["ColumnParallelLinear dgrad (layers.1.mlp.fc1)"]),
        ("reduce_scatter", ["ColumnParallelLinear wgrad (layers.1.mlp.fc1)"])]
    assert sum("backward (recompute)" in r["trigger_location"] for r in rows) == 4 * L


def test_csv_and_json_parse_back(runs):
    events = runs["async"]
    parsed = list(csv.reader(io.StringIO(render_table(events, fmt="csv"))))
    assert parsed[0] == ["#", "Parallel type", "Split object", "Primitive", "Trigger location",
                         "Async"]
    assert len(parsed) == 1 + 4 * L + 5
    assert parsed[2][3] == "all_reduce" and parsed[2][4].endswith("layers.0.attention.proj")
    doc = json.loads(render_table(events, fmt="json", lang="zh"))
    assert doc["rank"] == 0 and doc["step"] == 0
    assert doc["columns"]["parallel_type"] == "并行类型"
    assert [r["primitive"] for r in doc["rows"]] == [row[3] for row in parsed[1:]]
    assert doc["rows"][9]["overlaps"] == ["ColumnParallelLinear wgrad (layers.1.mlp.fc1)"]


def test_group_folds_identical_layers_only(runs):
    lines = render_table(runs["async"], group=True).splitlines()
    assert len(lines) == 2 + 2 * 2 + 5
    folded = [ln for ln in lines if "(x2 layers)" in ln]
    assert len(folded) == 4 and not any("layers.0" in ln or "layers.1" in ln for ln in lines)
    assert "layers.*.mlp.fc2 (x2 layers)" in lines[4]
    assert "(x2 层)" in render_table(runs["async"], group=True, lang="zh")
    sp = render_table(runs["sp"], group=True).splitlines()
    # emb, layer block, output, CE x3, output backward (re-gather, reduce-scatter: as every
    # sequence-parallel column layer), layer block backward, emb backward
    assert len(sp) == 2 + 1 + 4 + 1 + 3 + 2 + 10 + 1
    # a layer whose rows differ (here: one primitive changed) is not folded
    altered = [dict(e) for e in runs["async"]]
    next(e for e in altered if e["rank"] == 0 and e["module"] == "layers.1.mlp.fc2")["op"] = \
        "all_gather"
    assert "x2 layers" not in render_table(altered, group=True).split("backward")[0]


def test_group_folds_microbatches_that_communicate_alike(runs):
    """A step of 3 microbatches whose rows are alike reads as one block marked (x3
    microbatches); the rows outside microbatches, and a microbatch that differs, stay apart."""
    one = [dict(e) for e in runs["async"] if e["rank"] == 0 and e["step"] == 0]
    per_mb = [e for e in one if e.get("microbatch") is not None]
    span = max(e["t_end"] for e in one) - min(e["t_start"] for e in one)
    events = [e for e in one if e.get("microbatch") is None and e["phase"] == "optimizer"]
    for mb in range(3):
        events += [dict(e, microbatch=mb, seq=e["seq"] + 1000 * mb, t_start=e["t_start"] + mb
                        * span, t_end=e["t_end"] + mb * span) for e in per_mb]
    events.sort(key=lambda e: e["seq"])
    once = render_table([dict(e, seq=e["seq"]) for e in one], group=True).splitlines()
    lines = render_table(events, group=True).splitlines()
    folded = [ln for ln in lines if "(x3 microbatches)" in ln]
    assert folded and len(lines) == len(once), "\n".join(lines)
    assert all("(x3 microbatches)" not in ln for ln in lines if "optimizer" in ln)
    assert "(x3 个微批次)" in render_table(events, group=True, lang="zh")
    events[next(i for i, e in enumerate(events) if e["microbatch"] == 1
                and e["op"] == "all_reduce")]["op"] = "all_gather"
    assert "x3 microbatches" not in render_table(events, group=True)


def test_table_without_ledger_names_both_writers(tmp_path, capsys):
    assert table_main([str(tmp_path)]) == 2
    assert "written by paraloom train or paraloom record" in capsys.readouterr().err


def test_table_main_reads_run_dir_and_rejects_bad_values(runs, tmp_path, capsys):
    with open(tmp_path / "ledger.jsonl", "w") as f:
        for e in runs["async"]:
            f.write(json.dumps(e) + "\n")
    assert table_main([str(tmp_path), "--lang", "zh", "--rank", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == ZH_HEAD
    assert table_main([str(tmp_path), "--rank", "7"]) == 2
    assert "rank 7" in capsys.readouterr().err
    assert table_main([str(tmp_path), "--step", "5"]) == 2
    assert "step 5" in capsys.readouterr().err
    assert table_main([str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        table_main([str(tmp_path), "--format", "xml"])
    assert err.value.code == 2


def _check_chrome_trace(trace: dict, ranks: set[int]) -> None:
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert {"ph", "name", "pid"} <= e.keys(), e
        if e["ph"] in ("X", "b", "e", "i"):
            assert isinstance(e["ts"], (int, float)) and "tid" in e
        if e["ph"] == "X":
            assert e["dur"] >= 0
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in ranks}
    assert {e["pid"] for e in events} == ranks
    begins = {(e["pid"], e["id"]): e for e in events if e["ph"] == "b"}
    ends = {(e["pid"], e["id"]): e for e in events if e["ph"] == "e"}
    assert begins.keys() == ends.keys()
    for key, b in begins.items():
        assert b["ts"] <= ends[key]["ts"] and b["cat"] == ends[key]["cat"] == "async"


def test_trace_is_valid_chrome_json(runs, tmp_path):
    trace = json.loads(json.dumps(build_trace(runs["async"])))
    _check_chrome_trace(trace, {0, 1, 2, 3})
    events = trace["traceEvents"]
    threads = {(e["pid"], e["args"]["name"]): e["tid"] for e in events
               if e["name"] == "thread_name"}
    assert threads[0, "compute"] == 0 and threads[0, "tp"] == 1
    asyncs = [e for e in events if e["ph"] == "b" and e["pid"] == 0]
    assert len(asyncs) == 2 * L + 1  # input-grad all-reduces: column layers and output layer
    waits = [e for e in events if e["ph"] == "i" and e["pid"] == 0]
    assert len(waits) == len(asyncs)
    ends = {e["id"]: e["ts"] for e in events if e["ph"] == "e"}
    for b, w in zip(asyncs, waits, strict=True):
        assert b["ts"] <= w["ts"] <= ends[b["id"]]
    wgrad = [e for e in events if e["ph"] == "X" and e["tid"] == 0 and e["pid"] == 0
             and e["name"].endswith("wgrad")]
    assert len(wgrad) == 4 * L + 1  # column and row layers, and the output layer
    sync = [e for e in events if e["ph"] == "X" and e["tid"] == 1 and e["pid"] == 0]
    assert len(sync) == 2 * L + 4 and all(e["args"]["op"] == "all_reduce" for e in sync)
    # trace_main rebuilds RUN_DIR/trace.json; sp kinds get their own thread
    run = tmp_path / "run"
    run.mkdir()
    (run / "ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in runs["sp"]))
    assert trace_main([str(run)]) == 0
    rebuilt = json.loads((run / "trace.json").read_text())
    _check_chrome_trace(rebuilt, {0, 1, 2, 3})
    assert {e["args"]["name"] for e in rebuilt["traceEvents"] if e["name"] == "thread_name"} \
        == {"compute", "tp", "sp"}
    assert trace_main([str(tmp_path / "missing")]) == 2
    write_trace(runs["sync"], tmp_path / "t.json")
    assert not [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]
                if e["ph"] == "b"]


def test_trigger_location_of_a_recorded_program_keeps_file_and_line():
    from paraloom.report.table import _site

    assert _site("/home/u/job/train.py:42 Trainer.step") == "train.py:42 Trainer.step"
    assert _site("ColumnParallelLinear.backward:input_grad") == "ColumnParallelLinear input grad"


def test_split_of_a_recorded_program_is_its_tensor():
    from paraloom.report.table import _split

    event = {"kind": "group[0,1]", "op": "all_reduce", "phase": "backward", "shape": [16448],
             "dtype": "float32", "site": "/job/ddp.py:9 <module>", "param_grad": True}
    assert _split(event, "en") == "gradients, float32 [16448]"  # a DDP bucket hook's
    assert _split({**event, "param_grad": False}, "en") == "float32 [16448]"  # nothing guessed
    setup = {**event, "kind": "emb", "phase": "setup", "param_grad": False,
             "site": "/x/language_module.py:308 LanguageModule.setup_embeddings_and_output_layer"}
    assert _split(setup, "zh") == "初始化数据, float32 [16448]"  # not "tied embedding grads"
    norm = {**event, "phase": "optimizer", "site": "clip_grads.py:132 get_grad_norm_fp32"}
    assert _split(norm, "en") == "gradient norm, float32 [16448]"
    p2p = {**event, "kind": "pp", "op": "recv", "phase": "backward", "shape": [8, 1, 4]}
    assert _split(p2p, "en") == "activation grads [8, 1, 4] from the next stage"
    own = {**event, "kind": "tp", "site": "RowParallelLinear.forward:output"}
    assert _split(own, "en") == "—"  # paraloom's own events always name their split


def test_reports_of_a_program_that_never_ran_a_step(tmp_path):
    """Only setup communication (no forward ever ran): every report is written, the page shows
    the setup section (it once failed: 'step 0 has no events')."""
    from paraloom.report.run_reports import write_reports
    from paraloom.run_folder import write_events
    events = [{"rank": r, "seq": 0, "step": 0, "microbatch": 0, "phase": "setup", "kind": "world",
               "op": "all_reduce", "site": "/x/prog.py:9 main", "module": None, "split": None,
               "async": False, "bytes": 16, "shape": [4], "dtype": "float32", "group": [0, 1],
               "t_start": 0.0, "t_wait": 0.0, "t_end": 0.001} for r in (0, 1)]
    write_events(tmp_path, events)
    assert write_reports(tmp_path, events) == []
    page = (tmp_path / "report.html").read_text()
    assert "rank 0, step setup" in page and "初始化" in page
    assert "## setup" not in (tmp_path / "comm_table.md").read_text()  # nothing else to tell


def test_commands_list_only_what_they_wrote(tmp_path):
    """train's and record's last line: a --save-every 0 run has no checkpoints/ to list, a
    report that could not be written is not listed."""
    from paraloom.commands.train import RUN_FILES
    from paraloom.run_folder import written
    (tmp_path / "ledger.jsonl").write_text("")
    (tmp_path / "checkpoints").mkdir()  # made, but nothing saved in it
    assert written(tmp_path, RUN_FILES) == "ledger.jsonl"
    (tmp_path / "checkpoints" / "step_3").mkdir()
    (tmp_path / "report.html").write_text("<html>")
    assert written(tmp_path, RUN_FILES) == "report.html, ledger.jsonl, checkpoints/"
    assert written(tmp_path / "none", RUN_FILES) == "nothing"
