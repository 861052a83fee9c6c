"""``paraloom explain`` follows constants along the paths the code takes: through keyword,
positional and ``**kwargs`` arguments, into an autograd Function's ``forward`` (``apply``) and on
to its ``backward`` (``ctx.NAME``, ``ctx.save_for_backward``); a branch the constants decide
against is dropped with its sites, one they decide for loses its condition; ``--set`` /
``--preset`` decide what the code leaves open, and the conditions read as a user writes them.

Each snippet is read from stdin (nothing is imported or run). On the reader before this change
every assertion on a dropped site or a decided condition fails: the sites were listed with the
condition as the walk met it.
"""

from __future__ import annotations

import io
import json

import pytest
from _megatron_source import megatron_file

from paraloom.commands import main
from paraloom.explain import explain
from paraloom.explain.conditions import parse_settings
from paraloom.explain.presets import expand


def _read(code: str, **settings):
    return explain("-", stdin=io.StringIO(code), settings=settings or None)


def _at(facts, line):
    return sorted((s["op"], s["phase"], s["condition"]) for s in facts["sites"]
                  if s["line"] == line)


HELPERS = '''\
import torch.distributed as dist
FUSED = False


def reduce(x, group, flag=True):
    if flag:
        dist.all_reduce(x, group=group)


def passes_on(x, group, **kwargs):
    reduce(x, group, **kwargs)


def caller(x, group, mode):
    reduce(x, group, flag=False)
    reduce(x, group, False)
    passes_on(x, group, flag=False)
    passes_on(x, group)
    off = False
    reduce(x, group, flag=off)
    reduce(x, group, flag=True)
    if FUSED:
        dist.all_gather(x, group=group)
    if not (not mode):
        dist.broadcast(x, 0, group=group)
    for i in range(2):
        off = i
    reduce(x, group, flag=off)
    reduce(x, group, flag=mode == "a" and mode == "a")
'''


@pytest.fixture(scope="module")
def helpers():
    return _read(HELPERS)


def test_constant_keyword_positional_and_kwargs(helpers):
    assert _at(helpers, 15) == []  # flag=False by keyword: the all-reduce never runs
    assert _at(helpers, 16) == []  # ... by position
    assert _at(helpers, 17) == []  # ... through passes_on's **kwargs
    # not passed: reduce's default flag=True decides it, so it runs unconditionally
    assert [(op, cond) for op, _p, cond in _at(helpers, 18)] == [("all_reduce", None)]
    assert all(s["active"] is True for s in helpers["sites"] if s["line"] == 18)


def test_local_constant_and_decided_true(helpers):
    assert _at(helpers, 20) == []  # off = False three lines up
    [s] = [s for s in helpers["sites"] if s["line"] == 21]
    assert (s["condition"], s["active"], s["open"]) == (None, True, [])
    # a name a loop changes is no longer the constant: the site stays, its condition open
    [s] = [s for s in helpers["sites"] if s["line"] == 28]
    assert (s["active"], s["condition"]) == (None, "off (read as flag in reduce)")
    # passes_on's own call: the parameter travels in its **kwargs
    [s] = [s for s in helpers["sites"] if s["line"] == 11]
    assert s["condition"] == "kwargs['flag'] (read as flag in reduce)"


def test_dead_branch_and_simplified_condition(helpers):
    assert _at(helpers, 23) == []  # if FUSED: a module constant False
    [s] = [s for s in helpers["sites"] if s["line"] == 25]
    assert s["condition"] == "mode"  # not (not mode) -> mode
    [s] = [s for s in helpers["sites"] if s["line"] == 29]
    assert s["condition"] == "mode == 'a' (read as flag in reduce)"  # duplicates merged
    # inside the helper itself its parameter stays open
    [s] = [s for s in helpers["sites"] if s["line"] == 7]
    assert (s["condition"], s["active"], s["open"]) == ("flag", None, ["flag"])


FUNCTION = '''\
import torch
import torch.distributed as dist


class Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, sp, group):
        ctx.save_for_backward(x, weight)
        ctx.sp = sp
        ctx.group = group
        if sp:
            dist.all_gather_into_tensor(x, x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        if ctx.sp:
            dist.reduce_scatter_tensor(grad, grad, group=ctx.group)
        if weight.requires_grad:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None, None


class Layer(torch.nn.Module):
    def forward(self, x):
        Gather.apply(x, self.weight, False, self.tp_group)
        args = [x, self.weight, self.sequence_parallel, self.tp_group]
        return Gather.apply(*args)
'''


@pytest.fixture(scope="module")
def function():
    return _read(FUNCTION)


def test_apply_carries_constants_into_forward_and_ctx_into_backward(function):
    # sp=False: neither the forward all-gather nor the backward reduce-scatter (ctx.sp)
    got = _at(function, 27)
    assert [op for op, _p, _c in got] == ["all_reduce"], got
    # the saved weight's flag is the caller's self.weight.requires_grad
    assert got[0][1:] == ("backward", "self.weight.requires_grad (read as weight.requires_grad"
                                      " in Gather.backward)")


def test_apply_through_a_list_built_in_the_caller(function):
    got = {(op, phase): cond for op, phase, cond in _at(function, 29)}
    assert got[("all_gather", "forward")] == "self.sequence_parallel (read as sp in Gather.forward)"
    assert got[("reduce_scatter", "backward")] == \
        "self.sequence_parallel (read as ctx.sp in Gather.backward)"


def test_set_decides_by_any_spelling():
    for name in ("self.sequence_parallel", "sequence_parallel", "sp"):
        facts = _read(FUNCTION, **{name: True, "weight.requires_grad": True})
        got = {(s["op"], s["phase"], s["active"]) for s in facts["sites"] if s["line"] == 29}
        assert got == {("all_gather", "forward", True), ("reduce_scatter", "backward", True),
                       ("all_reduce", "backward", True)}, (name, got)
    # ctx.sp names the backward's reading only; the forward's sp stays open
    facts = _read(FUNCTION, **{"ctx.sp": True})
    got = {(s["op"], s["active"]) for s in facts["sites"] if s["line"] == 29}
    assert got == {("all_gather", None), ("reduce_scatter", True), ("all_reduce", None)}
    facts = _read(FUNCTION, sp=False)
    assert {(s["op"], s["active"]) for s in facts["inactive"] if s["line"] == 29} == {
        ("all_gather", False), ("reduce_scatter", False)}
    assert all(s["line"] != 29 or s["op"] == "all_reduce" for s in facts["sites"])
    [ar] = [s for s in facts["sites"] if s["line"] == 29]
    assert ar["active"] is None and ar["open"] == [
        "self.weight.requires_grad (read as weight.requires_grad in Gather.backward)"]


def test_settings_suffix_and_chinese():
    code = ("import torch.distributed as dist\n\nclass M:\n    def forward(self, x):\n"
            "        if self.config.sequence_parallel:\n            dist.all_gather(x, x)\n")
    assert _read(code, **{"config.sequence_parallel": True})["sites"][0]["active"] is True
    assert _read(code, **{"config.sequence_parallel": False})["sites"] == []
    facts = _read(FUNCTION)
    [s] = [s for s in facts["sites"] if s["line"] == 29 and s["op"] == "reduce_scatter"]
    from paraloom.explain.conditions import phrases
    assert phrases(s["parts"], "zh") == "self.sequence_parallel (即 Gather.backward 中的 ctx.sp)"


def test_cli_set_preset_and_bad_input(capsys, tmp_path):
    src = tmp_path / "f.py"
    src.write_text(FUNCTION)
    assert main(["explain", str(src), "--set", "sp=True", "--set", "weight.requires_grad=False",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"] == {"sp": True, "weight.requires_grad": False}
    states = {(s["line"], s["op"]): s["active"] for s in doc["sites"]}
    assert states[(29, "all_gather")] is True and states[(29, "all_reduce")] is False
    assert main(["explain", str(src), "--set", "sp"]) == 2
    assert "--set 'sp': expected NAME=VALUE" in capsys.readouterr().err
    assert main(["explain", str(src), "--preset", "megatron:tp=0"]) == 2
    assert "tp=0: expected >= 1" in capsys.readouterr().err
    assert main(["explain", str(src), "--preset", "deepspeed:tp=2"]) == 2
    assert "unknown framework 'deepspeed'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="KEY one of tp, sp"):
        expand("megatron:pp=2")
    assert parse_settings(["a.b=2", "c=None", "d=word"]) == {"a.b": 2, "c": None, "d": "word"}


MEGATRON_BLOCK = {  # (sp) -> the communication of the two layers' forward, as Megatron runs it
    False: {("ColumnParallelLinear", "all_reduce", "backward", True),
            ("RowParallelLinear", "all_reduce", "forward", False)},
    True: {("ColumnParallelLinear", "all_gather", "forward", False),
           ("ColumnParallelLinear", "all_gather", "backward", True),
           ("ColumnParallelLinear", "reduce_scatter", "backward", True),
           ("RowParallelLinear", "reduce_scatter", "forward", False),
           ("RowParallelLinear", "all_gather", "backward", False)},
}
BLOCK_SETTINGS = ["self.gather_output=False", "runtime_gather_output=None",
                  "self.input_is_parallel=True"]


@pytest.mark.parametrize("sp", [False, True])
def test_megatron_layers_under_the_preset(sp):
    """RowParallelLinear.forward passes sequence_parallel=False and a local allreduce_dgrad =
    False to its matmul, so the matmul communicates nothing (it was listed with an
    unconditional all-gather); under the preset nothing of the two forwards is left open."""
    settings = expand(f"megatron:tp=2,sp={'on' if sp else 'off'}")
    settings.update(parse_settings(BLOCK_SETTINGS))
    facts = explain(str(megatron_file("tensor_parallel/layers.py")), settings=settings)
    mine = [s for s in facts["sites"] if s["function"] == "forward"
            and s["class"] in ("ColumnParallelLinear", "RowParallelLinear")]
    assert {(s["class"], s["op"], s["phase"], s["async"]) for s in mine} == MEGATRON_BLOCK[sp]
    assert all(s["active"] is True and s["open"] == [] for s in mine), mine
    plain = explain(str(megatron_file("tensor_parallel/layers.py")))
    row_matmul = [s for s in plain["sites"] if s["class"] == "RowParallelLinear"
                  and "_forward_impl" in s["via"][:1] and s["function"] == "forward"]
    assert row_matmul == []  # with no settings at all: the constants alone decide it
