"""``paraloom diff``: equal sequences exit 0, the first divergence is named, bad input exits 2.

Synthetic ledgers check each rule; ledgers recorded by paraloom's own tensor-parallel MLP on a
2-rank gloo world check it on real sequences (same layout twice: equal; sequence parallelism or
the async input-grad all-reduce toggled: different, at the right position and field).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from paraloom.commands import main
from paraloom.record.diff import compare, sequences
from paraloom.run_folder import load_events as load_runs

S, B, H = 8, 2, 16


def ev(rank, seq, op="all_reduce", phase="forward", kind="tp", nbytes=1024, **extra):
    e = {"rank": rank, "seq": seq, "step": 0, "microbatch": 0, "phase": phase, "kind": kind,
         "op": op, "site": f"s{seq}", "module": None, "split": None, "async": False,
         "bytes": nbytes, "shape": [nbytes // 4], "dtype": "float32", "group": [0, 1],
         "t_start": 0.0, "t_wait": 0.0, "t_end": 0.0}
    e.update(extra)
    return e


def write(path, events):
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(path)


def base():
    return [ev(r, s, op=op, phase=ph) for r in (0, 1) for s, (op, ph) in enumerate(
        [("all_gather", "forward"), ("reduce_scatter", "forward"), ("all_gather", "backward"),
         ("reduce_scatter", "backward")])]


def run_diff(capsys, *argv):
    code = main(["diff", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_equal_ledgers_exit_0_and_compute_spans_are_ignored(tmp_path, capsys):
    a = write(tmp_path / "a.jsonl", base())
    spans = [ev(0, 10 + i, op="compute", kind="compute") for i in range(3)]
    b_events = sorted(base() + spans, key=lambda e: (e["rank"], e["seq"]))
    (tmp_path / "run").mkdir()
    write(tmp_path / "run" / "ledger.jsonl", b_events)
    code, out, _ = run_diff(capsys, a, tmp_path / "run")
    assert code == 0, out
    assert "rank 0: equal (4 communications)" in out and out.rstrip().endswith("equal")


@pytest.mark.parametrize("field,value", [("bytes", 2048), ("async", True), ("phase", "backward"),
                                         ("op", "all_reduce"), ("shape", [7])])
def test_first_divergence_names_position_and_field(tmp_path, capsys, field, value):
    events = base()
    events[1][field] = value  # rank 0, communication #1
    code, out, _ = run_diff(capsys, write(tmp_path / "a.jsonl", base()),
                            write(tmp_path / "b.jsonl", events))
    assert code == 1
    assert f"rank 0: first divergence at communication #1: {field}:" in out
    assert "rank 1: equal" in out
    assert "!1" in out and "!0" not in out  # the side-by-side table marks the diverging row


def test_names_compared_unless_ignored(tmp_path, capsys):
    events = base()
    events[2]["site"] = "elsewhere.py:12 f"
    a, b = write(tmp_path / "a.jsonl", base()), write(tmp_path / "b.jsonl", events)
    code, out, _ = run_diff(capsys, a, b)
    assert code == 1 and "#2: site: s2 vs elsewhere.py:12 f" in out
    assert run_diff(capsys, a, b, "--ignore-names")[0] == 0


def test_kinds_sp_is_tp_by_dimension_unnamed_groups_match(tmp_path, capsys):
    events = base()
    events[0]["kind"], events[1]["kind"] = "sp", "group[0,1]"
    a, b = write(tmp_path / "a.jsonl", base()), write(tmp_path / "b.jsonl", events)
    assert run_diff(capsys, a, b)[0] == 0
    code, out, _ = run_diff(capsys, a, b, "--kinds", "exact")
    assert code == 1 and "#0: kind: tp vs sp" in out
    events[2]["bytes"] = 1  # a later divergence: the table does not mark row 0 (sp = tp)
    code, out, _ = run_diff(capsys, a, write(tmp_path / "d.jsonl", events))
    assert code == 1 and "#2: bytes: 1024 vs 1" in out and "!2" in out and "!0" not in out
    events[0]["kind"] = "dp"  # a different dimension is always a difference
    code, out, _ = run_diff(capsys, a, write(tmp_path / "c.jsonl", events))
    assert code == 1 and "#0: kind: tp vs dp" in out


def test_length_and_missing_rank(tmp_path, capsys):
    short = [e for e in base() if not (e["rank"] == 1 and e["seq"] == 3)]
    code, out, _ = run_diff(capsys, write(tmp_path / "a.jsonl", base()),
                            write(tmp_path / "b.jsonl", short))
    assert code == 1 and "rank 1: first divergence at communication #3: A has 1 more" in out
    only0 = [e for e in base() if e["rank"] == 0]
    code, out, _ = run_diff(capsys, tmp_path / "a.jsonl", write(tmp_path / "c.jsonl", only0))
    assert code == 1 and "rank 1: first divergence at communication #0: A has 4 more" in out
    assert run_diff(capsys, tmp_path / "a.jsonl", tmp_path / "c.jsonl", "--rank", "0")[0] == 0


def test_partial_record_folder_and_fields_option(tmp_path, capsys):
    (tmp_path / "rec" / "ledger").mkdir(parents=True)
    for r in (0, 1):
        write(tmp_path / "rec" / "ledger" / f"rank_{r}.jsonl",
              [e for e in base() if e["rank"] == r])
    assert len(load_runs(tmp_path / "rec")) == 8
    events = base()
    events[0]["bytes"] = 1
    b = write(tmp_path / "b.jsonl", events)
    assert run_diff(capsys, tmp_path / "rec", b)[0] == 1
    assert run_diff(capsys, tmp_path / "rec", b, "--fields", "phase,op")[0] == 0


def test_bad_input_exits_2_with_a_clear_message(tmp_path, capsys):
    good = write(tmp_path / "a.jsonl", base())
    code, _, err = run_diff(capsys, good, tmp_path / "nope")
    assert code == 2 and "nope' does not exist" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run_diff(capsys, tmp_path / "empty", good)
    assert code == 2 and "without ledger.jsonl" in err
    (tmp_path / "junk.jsonl").write_text("not json\n")
    code, _, err = run_diff(capsys, good, tmp_path / "junk.jsonl")
    assert code == 2 and "not a JSON Lines file" in err
    code, _, err = run_diff(capsys, good, good, "--fields", "phase,colour")
    assert code == 2 and "['colour']" in err and "valid:" in err
    code, _, err = run_diff(capsys, good, good, "--rank", "5")
    assert code == 2 and "--rank 5" in err and "[0, 1]" in err


# ---------------------------------------------------------------- paraloom's own layers
def record_mlp(sp, async_ar):
    """One forward + backward of paraloom's tp=2 MLP block under a ledger on this rank."""
    import torch.distributed as dist

    from paraloom.ledger import Ledger, recording
    from paraloom.mesh import ParallelMesh
    from paraloom.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    mesh = ParallelMesh(tp=2)
    fc1 = ColumnParallelLinear(H, 4 * H, sequence_parallel=sp, async_grad_allreduce=async_ar,
                               mesh=mesh, name="mlp.fc1")
    fc2 = RowParallelLinear(4 * H, H, input_is_parallel=True, sequence_parallel=sp, mesh=mesh,
                            name="mlp.fc2")
    s = S // 2 if sp else S
    x = torch.randn(s, B, H, requires_grad=True)
    led = Ledger(rank=dist.get_rank())
    with recording(led):
        y, _ = fc2(F.gelu(fc1(x)[0]))
        y.backward(torch.ones_like(y))
    return led.events


def test_paraloom_layers(world2, tmp_path, capsys):
    runs = {}
    for name, sp, async_ar in [("sp", True, False), ("sp_again", True, False),
                               ("tp", False, False), ("tp_async", False, True)]:
        per_rank = world2.run(record_mlp, sp, async_ar)
        runs[name] = write(tmp_path / f"{name}.jsonl", [e for r in per_rank for e in r])
    assert len(sequences(load_runs(runs["sp"]))[0]) == 5
    code, out, _ = run_diff(capsys, runs["sp"], runs["sp_again"])
    assert code == 0 and "rank 1: equal (5 communications)" in out
    code, out, _ = run_diff(capsys, runs["tp"], runs["tp_async"])
    assert code == 1, out  # the input-grad all-reduce of fc1 (backward, #1) becomes async
    assert "rank 0: first divergence at communication #1: async: sync vs async" in out
    code, out, _ = run_diff(capsys, runs["tp"], runs["sp"], "--ignore-names")
    assert code == 1 and "#0: op: all_reduce vs all_gather" in out
    a, b = sequences(load_runs(runs["sp"])), sequences(load_runs(runs["sp_again"]))
    assert compare(a, b, ("kind",), kinds="exact") == {0: None, 1: None}
