"""paraloom explain: facts read from megatron-core 0.19.2's own source (never imported), from
hand-written snippets that lack context, and cross-checked against paraloom's recorded ledger."""

from __future__ import annotations

import io
import json
import re

import pytest
from _megatron_source import megatron_file

from paraloom.commands.explain import main as explain_main
from paraloom.explain import explain
from paraloom.explain.rules import UNKNOWN


def _line(path, pattern: str, after: str | None = None, start: int = 0) -> int:
    """1-based line of the first match of ``pattern`` (after the first match of ``after`` that
    comes after line ``start``)."""
    lines = path.read_text().splitlines()
    if after:
        start = next(i for i in range(start, len(lines)) if re.search(after, lines[i]))
    return next(i + 1 for i in range(start, len(lines)) if re.search(pattern, lines[i]))


def _sites(facts, **want):
    return [s for s in facts["sites"] if all(s[k] == v for k, v in want.items())]


@pytest.fixture(scope="module")
def mappings():
    path = megatron_file("tensor_parallel/mappings.py")
    return path, explain(str(path))


@pytest.fixture(scope="module")
def layers():
    path = megatron_file("tensor_parallel/layers.py")
    return path, explain(str(path))


def test_megatron_mappings_sees_through_helpers_and_aliases(mappings):
    path, f = mappings
    # _reduce wraps torch.distributed.all_reduce: the region's backward is where it happens
    copy_bwd = _line(path, r"return _reduce\(grad_output", "class _CopyToModelParallelRegion")
    [s] = _sites(f, line=copy_bwd)
    assert (s["class"], s["function"], s["op"], s["phase"], s["kind"], s["async"]) == (
        "_CopyToModelParallelRegion", "backward", "all_reduce", "backward", "tp", False)
    assert s["via"] == ["_reduce"] and s["condition"].startswith("ctx.group.size() != 1 (read as")
    fwd = _line(path, r"return _reduce\(input_, group\)", r'"""Forward function."""',
                start=_line(path, r"class _ReduceFromModelParallelRegion"))
    assert [(x["op"], x["phase"]) for x in _sites(f, line=fwd)] == [("all_reduce", "forward")]
    # inside the helper itself the phase is not decided by the file
    inner = _line(path, r"torch\.distributed\.all_reduce\(input_")
    [s] = _sites(f, line=inner)
    assert s["helper"] and s["phase"] == UNKNOWN and s["function"] == "_reduce"
    # dist_all_gather_func is an alias of torch.distributed.all_gather_into_tensor
    alias = _line(path, r"dist_all_gather_func\(output, input_")
    assert [x["op"] for x in _sites(f, line=alias)] == ["all_gather"]
    # backward of gather_from_sequence_parallel: reduce-scatter only if tensor_parallel_output_grad
    rs = _line(path, r"_reduce_scatter_along_first_dim\(", "class _GatherFromSequenceParallel")
    [s] = _sites(f, line=rs)
    assert (s["op"], s["phase"], s["kind"]) == ("reduce_scatter", "backward", "sp")
    assert s["condition"].startswith("tensor_parallel_output_grad")
    assert any(w["source"] == "group.size()" for w in f["world_sizes"])


def test_megatron_layers_sites_partitions_weights(layers):
    path, f = layers
    cls = "LinearWithGradAccumulationAndAsyncCommunication"
    ar = _line(path, r"handle = torch\.distributed\.all_reduce\(grad_input")
    [s] = _sites(f, line=ar)
    assert (s["class"], s["function"], s["phase"], s["kind"], s["async"]) == (
        cls, "backward", "backward", "tp", True)
    assert s["condition"] == "ctx.allreduce_dgrad"
    rs = _line(path, r"handle = dist_reduce_scatter_func\(")
    [s] = _sites(f, line=rs)
    assert (s["op"], s["phase"], s["kind"], s["async"]) == ("reduce_scatter", "backward", "sp",
                                                           True)
    assert s["condition"] == "ctx.sequence_parallel"
    fwd_ag = _line(path, r"dist_all_gather_func\(all_gather_buffer, input, group=tp_group\)")
    [s] = _sites(f, line=fwd_ag)
    assert (s["op"], s["phase"], s["async"], s["condition"]) == ("all_gather", "forward", False,
                                                                 "sequence_parallel")
    bwd_ag = _line(path, r"handle = dist_all_gather_func\(")
    assert [(x["phase"], x["async"]) for x in _sites(f, line=bwd_ag)] == [("backward", True)]
    # the column layer's copy_to region: identity forward, all-reduce of the input grad backward
    copy = _line(path, r"copy_to_tensor_model_parallel_region\(input_")
    [s] = _sites(f, line=copy)
    assert (s["class"], s["op"], s["phase"]) == ("ColumnParallelLinear", "all_reduce", "backward")
    row = _line(path, r"output_ = reduce_from_tensor_model_parallel_region\(")
    [s] = _sites(f, line=row)
    assert (s["class"], s["op"], s["phase"]) == ("RowParallelLinear", "all_reduce", "forward")
    # partitions: divide(output_size, world_size) with world_size = get_pg_size(self.tp_group)
    div = _line(path, r"self\.output_size_per_partition = divide\(output_size, world_size\)")
    [p] = [p for p in f["partitions"] if p["line"] == div]
    assert p["into"] == "self.output_size_per_partition"
    assert p["parts_from"]["source"] == "get_pg_size(self.tp_group)"
    assert any(w["name"] == "world_size" and w["group"] == "self.tp_group"
               for w in f["world_sizes"])
    layouts = {(w["class"], w["layout"]) for w in f["weights"] if w["shape"]}
    assert {("ColumnParallelLinear", "column-parallel"), ("RowParallelLinear", "row-parallel"),
            ("VocabParallelEmbedding", "vocab-parallel embedding")} <= layouts


def test_megatron_layers_checklist_answers(layers):
    path, f = layers
    a = f["answers"]
    guard = _line(path, r"if self\.allreduce_dgrad and self\.sequence_parallel:")
    rs = _line(path, r"handle = dist_reduce_scatter_func\(")
    assert {guard, rs} <= set(a["sp_forbids_async"]["lines"])
    assert "reduce-scattered" in a["sp_forbids_async"]["text"]
    copy = _line(path, r"copy_to_tensor_model_parallel_region\(input_")
    assert copy in a["all_reduce_phase"]["lines"]
    assert f"line {copy} (ColumnParallelLinear.forward): all_reduce in backward" in \
        a["all_reduce_phase"]["text"]
    div = _line(path, r"self\.input_size_per_partition = divide\(input_size")
    assert div in a["world_size_and_divide"]["lines"]
    assert "split on the input dim" in a["input_vs_weight"]["text"]
    assert all(a[k]["text"] != UNKNOWN for k in a)
    rows = f["table"]
    assert rows[0]["primitive"] and [r["index"] for r in rows] == list(range(1, len(rows) + 1))
    phases = [r["trigger_location"].split(" · ")[0] for r in rows]
    assert phases.index("backward") > phases.index("forward")
    assert "backward" not in phases[:phases.index("backward")]


def test_megatron_p2p_communication():
    path = megatron_file("pipeline_parallel/p2p_communication.py")
    f = explain(str(path))
    batched = _sites(f, function="_batched_p2p_ops")
    assert {s["op"] for s in batched} == {"send", "recv", "batch_p2p"}
    assert all(s["kind"] == "pp" and s["async"] is True and s["helper"] for s in batched)
    isend = _line(path, r"send_next_req = torch\.distributed\.isend\(")
    [s] = _sites(f, line=isend)
    assert s["condition"] == "group.rank() % 2 == 0 and tensor_send_next is not None"
    # recv_forward -> self._communicate -> p2p_func (alias of _batched_p2p_ops / _p2p_ops)
    recv = _line(path, r"input_tensor, _, _ = self\._communicate\(", "def recv_forward")
    got = _sites(f, line=recv)
    # it passes tensor_send_next=None and tensor_send_prev=None: it receives, never sends
    assert "recv" in {s["op"] for s in got} and "send" not in {s["op"] for s in got}
    assert all(s["phase"] == "forward" and s["via"][0] == "P2PCommunicator._communicate"
               for s in got)
    sb = _line(path, r"self\._communicate\(", "def send_backward")
    assert {s["phase"] for s in _sites(f, line=sb)} == {"backward"}


def test_range_without_its_class_needs_more_context(layers, capsys):
    path, _ = layers
    start = _line(path, r"@custom_bwd", "class LinearWithGradAccumulationAndAsync") - 1
    end = _line(path, r"handle = dist_reduce_scatter_func\(") + 2
    f = explain(f"{path}:{start}-{end}")
    assert f["lines"] == [start, end]
    ar = _line(path, r"handle = torch\.distributed\.all_reduce\(grad_input")
    [s] = _sites(f, line=ar)  # line numbers are the file's
    assert s["phase"] == UNKNOWN and s["class"] is None and s["async"] is True
    assert f["answers"]["input_vs_weight"]["text"] == UNKNOWN
    assert explain_main([f"{path}:{start}-{end}", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {"sites", "partitions", "world_sizes", "answers"}
    assert set(doc["sites"][0]) >= {"line", "class", "function", "phase", "op", "kind", "async",
                                    "condition"}


HELPER = '''\
import torch.distributed as dist

def sync(t, flag):
    if self.world_size == 1:
        return t
    dist.all_reduce(t, group=self.group, async_op=flag)
    return t
'''

HOOK = '''\
import torch
from torch import distributed

class DDP(torch.nn.Module):
    def __init__(self, module, dp_group):
        super().__init__()
        for p in module.parameters():
            p.register_hook(self._make_hook(p))
        distributed.broadcast(p.data, src=0, group=dp_group)

    def _make_hook(self, p):
        def hook(grad):
            distributed.all_reduce(grad, group=self.dp_group)
            return grad
        p.register_hook(hook)

    def forward(self, x):
        return self.module(x)
'''


LOSS = '''\
import torch.distributed as dist

def reduce_loss(total, dp_group, main_grad):
    dist.all_reduce(total, group=dp_group)
    dist.all_reduce(main_grad, group=dp_group)
    return total
'''


def test_a_data_parallel_all_reduce_is_called_a_gradient_sync_only_when_it_is_one():
    """The loss or a token count summed over dp is not "parameter gradients" (it once was: every
    dp all-reduce was); a tensor named as gradients still is."""
    for lang, value, grads in (("en", "sums total across data-parallel replicas",
                                "syncs parameter gradients across data-parallel replicas: "
                                "main_grad"),
                               ("zh", "在数据并行副本之间对 total 求和",
                                "同步参数梯度：main_grad")):
        text = explain("-", stdin=io.StringIO(LOSS), lang=lang)["answers"]["all_reduce_phase"][
            "text"]
        assert value in text and grads in text, text
        assert "gradients across data-parallel replicas: total" not in text


def test_snippets_with_missing_context():
    f = explain("-", stdin=io.StringIO(HELPER))
    [s] = f["sites"]
    assert (s["line"], s["op"], s["phase"]) == (6, "all_reduce", UNKNOWN)
    assert s["async"].startswith(UNKNOWN) and "async_op=flag" in s["async"]
    # a group expression that names no parallel type gives kind "group"
    assert s["kind"] == "group" and s["condition"] == "self.world_size != 1"
    assert [a["text"] for a in f["answers"].values()][:2] == [UNKNOWN, UNKNOWN]
    assert f["answers"]["sp_forbids_async"]["text"] == UNKNOWN
    assert "all_reduce in needs more context" in f["answers"]["all_reduce_phase"]["text"]

    f = explain("-", stdin=io.StringIO(HOOK))
    by_op = {s["op"]: s for s in f["sites"]}
    assert by_op["all_reduce"]["phase"] == "backward" and by_op["all_reduce"]["kind"] == "dp"
    assert "gradient hook" in by_op["all_reduce"]["phase_basis"]
    assert (by_op["broadcast"]["phase"], by_op["broadcast"]["kind"]) == ("setup", "dp")
    assert "data-parallel" in f["answers"]["all_reduce_phase"]["text"]


def test_chinese_output_and_errors(capsys, tmp_path):
    src = tmp_path / "snip.py"
    src.write_text(HELPER)
    assert explain_main([str(src), "--lang", "zh"]) == 0
    out = capsys.readouterr().out
    assert "## 通信位置" in out and "需要更多上下文" in out and "并行类型" in out
    # the fixed words are Chinese; code names and conditions stay as written
    assert " | phase " not in out and " | kind " not in out and "[if " not in out, out
    assert "- line " not in out and "第 " in out and "| 阶段 " in out and "| 异步 " in out
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and " · " in ln]
    assert rows and all(r.split(" | ")[4].split(" · ")[0] in ("前向", "反向", "需要更多上下文")
                        for r in rows), rows
    for bad, named in [(f"{src}:5-99", "5-99"), (f"{src}:x-2", "x-2"),
                       (str(tmp_path / "missing.py"), "missing.py")]:
        assert explain_main([bad]) == 2
        assert named in capsys.readouterr().err
    src.write_text("def broken(:\n    pass\n")
    assert explain_main([str(src)]) == 2
    assert "does not parse" in capsys.readouterr().err


# ------------------------------------------------------------------ cross-check with the ledger
def mlp_ledger_pairs(sp: bool) -> set:
    """(op, phase) of every communication the ledger records for a tp=2 MLP block."""
    import torch
    import torch.nn.functional as F

    from paraloom.ledger import Ledger, recording
    from paraloom.mesh import ParallelMesh
    from paraloom.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    mesh = ParallelMesh(tp=2, dp=1)
    fc1 = ColumnParallelLinear(8, 32, sequence_parallel=sp, mesh=mesh, name="mlp.fc1")
    fc2 = RowParallelLinear(32, 8, input_is_parallel=True, sequence_parallel=sp, mesh=mesh,
                            name="mlp.fc2")
    x = torch.randn(4 // (2 if sp else 1), 2, 8, requires_grad=True)
    ledger = Ledger(rank=mesh.rank)
    with recording(ledger):
        h, _ = fc1(x)
        y, _ = fc2(F.gelu(h))
        y.sum().backward()
    return {(e["op"], e["phase"]) for e in ledger.events if e["op"] != "compute"}


def test_explain_finds_every_pair_the_ledger_records(world2):
    recorded = set()
    for sp in (False, True):
        pairs = world2.run(mlp_ledger_pairs, sp)[0]
        assert pairs, "the tp=2 MLP must communicate"
        recorded |= pairs
    assert recorded == {("all_reduce", "forward"), ("all_reduce", "backward"),
                        ("all_gather", "forward"), ("reduce_scatter", "forward"),
                        ("all_gather", "backward"), ("reduce_scatter", "backward")}
    lay = explain("paraloom/tensor_parallel/layers.py")
    maps = explain("paraloom/tensor_parallel/mappings.py")
    mlp = {"ColumnParallelLinear", "RowParallelLinear",
           "LinearWithGradAccumulationAndAsyncCommunication"}
    found = {(s["op"], s["phase"]) for s in lay["sites"] if s["class"] in mlp}
    assert recorded <= found, recorded - found
    assert recorded <= {(s["op"], s["phase"]) for s in maps["sites"]}
    # the places the ledger names: row output all-reduce, column input-grad all-reduce (region
    # or the async path), the sp re-gather and the row output-grad all-gather
    row = {(s["op"], s["phase"], s["via"][0] if s["via"] else None)
           for s in _sites(lay, **{"class": "RowParallelLinear"})}
    assert ("all_reduce", "forward", "reduce_from_tensor_model_parallel_region") in row
    assert ("all_gather", "backward", "reduce_scatter_to_sequence_parallel_region") in row
    col = {(s["op"], s["phase"], s["via"][0]) for s in lay["sites"]
           if s["class"] == "ColumnParallelLinear" and s["via"]}
    assert ("all_reduce", "backward", "copy_to_tensor_model_parallel_region") in col
    asy = _sites(explain("paraloom/tensor_parallel/linear.py"), function="backward",
                 **{"class": "LinearWithGradAccumulationAndAsyncCommunication"})
    assert {(s["op"], s["kind"], s["async"]) for s in asy} == {
        ("all_gather", "sp", True), ("reduce_scatter", "sp", True), ("all_reduce", "tp", True)}
