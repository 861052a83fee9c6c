"""``paraloom explain FILE --run DIR``: static sites marked with the recorded events.

A small file with a direct call, a call spread over two lines, a helper and a call the static
reading cannot see (``getattr(dist, "all_reduce")``), and a ledger whose ``site`` fields name
lines of it the way ``paraloom record`` writes them (``path:LINE function``). The recorded
Megatron-Core run is checked in test_record_megatron.py.
"""

from __future__ import annotations

import json

import pytest

from paraloom.commands import main
from paraloom.explain import explain
from paraloom.explain.run import annotate, parse_site
from paraloom.report.explain_text import render_run

SOURCE = '''\
import torch.distributed as dist
from torch.distributed import all_gather_into_tensor as ag


class Block:
    def forward(self, x, out):
        ag(out, x)
        return out

    def backward(self, g, buf):
        handle = dist.all_reduce(
            g, async_op=True)
        handle.wait()
        helper(g)
        return g


def helper(t):
    dist.broadcast(t, src=0)
    other = getattr(dist, "all_reduce")
    other(t)
'''


def ev(rank, seq, op, phase, site, nbytes=64, asy=False):
    return {"rank": rank, "seq": seq, "step": 0, "microbatch": 0, "phase": phase, "kind": "tp",
            "op": op, "site": site, "module": None, "split": None, "async": asy,
            "bytes": nbytes, "shape": [nbytes // 4], "dtype": "float32", "group": [0, 1],
            "t_start": 0.0, "t_wait": 0.0, "t_end": 0.0}


@pytest.fixture
def case(tmp_path):
    src = tmp_path / "pkg" / "block.py"
    src.parent.mkdir()
    src.write_text(SOURCE)
    events = []
    for r in (0, 1):
        rows = [("all_gather", "forward", f"{src}:7 Block.forward", False),
                ("compute", "forward", "span", False),  # compute spans have no order index
                ("all_gather", "forward", "elsewhere.py:7 f", False),  # another file
                ("all_reduce", "backward", f"{src}:12 Block.backward", True),  # 2nd line of 11-12
                ("broadcast", "backward", "pkg/block.py:19 helper", False),  # relative path
                ("all_reduce", "backward", f"{src}:21 helper", False),  # static reading misses
                ("all_reduce", "backward", "RowParallelLinear.forward:output", False)]
        events += [ev(r, i, op, ph, site, 64 * (r + 1), a) for i, (op, ph, site, a)
                   in enumerate(rows)]
        events[-4]["module"] = "blocks.0"  # the all_reduce of lines 11-12
    run = tmp_path / "run"
    run.mkdir()
    (run / "ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return src, run


def test_parse_site():
    assert parse_site("/a/b.py:12 C.f") == ("/a/b.py", 12, "C.f")
    assert parse_site("b.py:3") == ("b.py", 3, None)
    assert parse_site("ColumnParallelLinear.backward:input_grad") is None
    assert parse_site(None) is None


def test_sites_marked_with_their_events(case, monkeypatch):
    src, run = case
    monkeypatch.chdir(src.parent.parent)  # the relative site "pkg/block.py" resolves here
    facts = explain(str(src))
    marked = annotate(facts, str(run), rank=0)
    by_line = {m["line"]: m for m in marked["sites"]}
    assert sorted(by_line) == [7, 11, 19]  # direct sites only; line 14 is via the helper
    assert by_line[11]["range"] == [11, 12]
    got = {line: [(e["op"], e["phase"], e["async"], e["bytes"], e["index"]) for e in m["events"]]
           for line, m in by_line.items()}
    assert got == {7: [("all_gather", "forward", False, 64, 0)],
                   11: [("all_reduce", "backward", True, 64, 2)],
                   19: [("broadcast", "backward", False, 64, 3)]}
    assert [(e["line"], e["op"], e["index"]) for e in marked["missed"]] == [(21, "all_reduce", 4)]
    assert [(v["line"], v["to"] is not None and facts["sites"][v["to"]]["line"], v["elsewhere"])
            for v in marked["via"]] == [(14, 19, None)]
    every = annotate(facts, str(run), rank=None)
    assert sorted(e["rank"] for m in every["sites"] for e in m["events"]) == [0, 0, 0, 1, 1, 1]


def test_snippet_range_limits_missed_events(case):
    src, run = case
    facts = explain(f"{src}:1-15")  # lines 19 and 21 lie outside
    marked = annotate(facts, str(run), rank=1)
    assert {m["line"]: len(m["events"]) for m in marked["sites"]} == {7: 1, 11: 1}
    assert marked["missed"] == []


def test_cli_text_and_json(case, capsys):
    src, run = case
    assert main(["explain", str(src), "--run", str(run), "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "## Recorded run:" in out
    assert ("- line 11 Block.backward: all_reduce (static: needs more context, async True) -> "
            "recorded: rank 1: 1x all_reduce backward async 128 B at #2 in blocks.0") in out
    assert ("- line 14 Block.backward: broadcast (static: needs more context, async False) -> "
            "via helper: at line 19 (all its callers): rank 1: 1x broadcast backward sync 128 B "
            "at #3") in out
    assert "- line 21 helper: rank 1: 1x all_reduce backward sync 128 B at #4" in out
    assert main(["explain", str(src), "--run", str(run), "--lang", "zh"]) == 0
    assert "## 实际运行记录" in capsys.readouterr().out
    assert main(["explain", str(src), "--run", str(run), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["run"]["rank"] == 0 and doc["run"]["ranks"] == [0, 1]
    assert [e["line"] for e in doc["run"]["missed"]] == [21]


def test_a_file_the_run_never_called_from_gets_a_hint(case, tmp_path):
    src, run = case
    other = tmp_path / "other.py"
    other.write_text("import torch.distributed as dist\n\n\ndef f(t):\n    dist.all_reduce(t)\n")
    facts = explain(str(other))
    marked = annotate(facts, str(run), rank=0)
    assert marked["matched"] == 0 and [m["events"] for m in marked["sites"]] == [[]]
    text = render_run(facts, marked)
    assert "-> not run in the recorded run" in text
    assert f"the run's calls come from: {src} (3), elsewhere.py (1), pkg/block.py (1)" in text


def test_bad_input_exits_2(case, tmp_path, capsys):
    src, run = case
    assert main(["explain", str(src), "--run", str(tmp_path / "missing")]) == 2
    assert "--run" in capsys.readouterr().err
    assert main(["explain", str(src), "--run", str(run), "--rank", "7"]) == 2
    assert "--rank 7: the run in" in capsys.readouterr().err
    assert main(["explain", str(src), "--run", str(run), "--rank", "x"]) == 2
    assert "expected a rank number or 'all'" in capsys.readouterr().err


DTENSOR = '''\
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class MLP(torch.nn.Module):
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


mesh = init_device_mesh("cpu", (2,))
m = parallelize_module(MLP(), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
m(torch.ones(4, 8)).sum().backward()
'''


def test_a_dtensor_plans_collectives_are_given_to_its_site(tmp_path):
    """torch's plan code communicates, so the recorder names the lines of FILE that ran it
    (the forward call, ``backward()``): they belong to the plan's static sites, by op and phase,
    not to 'missed by the static reading'."""
    src = tmp_path / "tp.py"
    src.write_text(DTENSOR)
    facts = explain(str(src))
    plan = [(s["op"], s["phase"]) for s in facts["sites"] if s["via"]]
    assert sorted(plan) == [("all_reduce", "backward"), ("all_reduce", "forward")], facts["sites"]
    rows = [("scatter", "other", f"{src}:12 <module>"),  # the plan distributing the weights
            ("all_reduce", "forward", f"{src}:8 MLP.forward"),
            ("all_reduce", "backward", f"{src}:13 <module>")]
    run = tmp_path / "run"
    run.mkdir()
    (run / "ledger.jsonl").write_text("".join(
        json.dumps(ev(0, i, op, ph, site, asy=op == "all_reduce")) + "\n"
        for i, (op, ph, site) in enumerate(rows)))
    marked = annotate(facts, str(run), rank=0)
    got = {facts["sites"][v["site"]]["phase"]: [e["line"] for e in v["events"]]
           for v in marked["via"]}
    assert got == {"forward": [8], "backward": [13]}
    assert [e["op"] for e in marked["missed"]] == ["scatter"]
    text = render_run(facts, marked)
    assert "defined outside this file; recorded where this file runs it, line 13" in text, text


DDP_FSDP = '''\
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

model = DDP(torch.nn.Linear(8, 8))
model(torch.ones(2, 8)).sum().backward()
other = torch.nn.Linear(8, 8)
fully_shard(other)
other(torch.ones(2, 8)).sum().backward()
dist.barrier()
'''


def test_collectives_inside_torchs_wrappers_are_not_called_missed(tmp_path):
    """DDP's and FSDP's collectives are torch's code: the static reading finds no site for them
    in FILE, and the run lists them as inside the wrapper (with the line that wrapped the
    module), not as missed; a collective FILE calls itself and the reading missed stays missed."""
    src = tmp_path / "dp.py"
    src.write_text(DDP_FSDP)
    facts = explain(str(src))
    rows = [("broadcast", "setup", f"{src}:6 <module>"),  # DDP's constructor
            ("all_reduce", "backward", f"{src}:7 <module>"),  # its reducer
            ("all_gather", "forward", f"{src}:10 <module>"),  # FSDP's unshard
            ("reduce_scatter", "backward", f"{src}:10 <module>"),
            ("send", "other", f"{src}:8 <module>")]  # neither a site of FILE nor a wrapper
    run = tmp_path / "run"
    run.mkdir()
    (run / "ledger.jsonl").write_text("".join(
        json.dumps(ev(0, i, op, ph, site)) + "\n" for i, (op, ph, site) in enumerate(rows)))
    marked = annotate(facts, str(run), rank=0)
    assert [(e["op"], e["wrapper"]) for e in marked["inside"]] == [
        ("broadcast", "DistributedDataParallel (line 6)"),
        ("all_reduce", "DistributedDataParallel (line 6)"),
        ("all_gather", "fully_shard (line 9)"), ("reduce_scatter", "fully_shard (line 9)")]
    assert [e["op"] for e in marked["missed"]] == ["send"]
    text = render_run(facts, marked)
    assert "inside torch's wrappers" in text and "<- fully_shard (line 9)" in text, text


def test_a_train_runs_labels_are_matched_to_their_owners_sites(tmp_path, capsys):
    """A ``paraloom train`` ledger names labels (``RowParallelLinear.forward:output``), not
    lines: each is matched to the static sites of its owner with its op and phase, instead of
    every site reading "not run" or "not defined in this file"."""
    from pathlib import Path

    import paraloom.tensor_parallel.layers as layers
    run = tmp_path / "run"
    assert main(["train", "--tp", "2", "--pp", "1", "--dp", "1", "--sequence-parallel",
                 "--layers", "2", "--steps", "1", "--global-batch-size", "2",
                 "--micro-batch-size", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    file = str(Path(layers.__file__))
    facts = explain(file)
    got = annotate(facts, str(run))
    groups = {(g["label"], g["op"], g["phase"]): g for g in got["labels"]}
    rs = groups[("RowParallelLinear.forward:output", "reduce_scatter", "forward")]
    lines = {facts["sites"][i]["line"] for i in rs["candidates"]}
    want = {s["line"] for s in facts["sites"] if s["class"] == "RowParallelLinear"
            and s["op"] == "reduce_scatter" and s["phase"] == "forward"}
    # proj and fc2 of two layers, two microbatches
    assert lines == want and want and len(rs["events"]) == 8
    assert {e["module"] for e in rs["events"]} == {f"layers.{i}.{m}" for i in (0, 1)
                                                   for m in ("attention.proj", "mlp.fc2")}
    ag = groups[("ColumnParallelLinear.forward:input", "all_gather", "forward")]
    assert len(ag["events"]) == 8 and ag["candidates"]  # qkv and fc1 likewise
    assert got["labels_elsewhere"] > 0  # the embedding, the loss, the loop's collectives
    assert got["matched"] == 0
    assert main(["explain", file, "--run", str(run)]) == 0
    text = capsys.readouterr().out
    assert "## Recorded by label" in text
    assert "recorded by label (below): RowParallelLinear.forward:output" in text
    row = next(x for x in text.splitlines() if x.startswith("- RowParallelLinear.forward:output"))
    assert "reduce_scatter forward" in row and "static site" in row, row
    assert main(["explain", file, "--run", str(run), "--lang", "zh"]) == 0
    assert "按标签记录到" in capsys.readouterr().out
