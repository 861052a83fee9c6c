"""``paraloom diff``: equal sequences exit 0, every divergence is named where the alignment puts
it, ``--step``/setup/one-rank groups/phases/shapes choose what is compared, bad input exits 2.

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
from paraloom.record.diff import Options, compare, sequences
from paraloom.run_folder import load_events as load_runs

S, B, H = 8, 2, 16


def ev(rank, seq, op="all_reduce", phase="forward", kind="tp", nbytes=1024, **extra):
    e = {"rank": rank, "seq": seq, "step": 1, "microbatch": 0, "phase": phase, "kind": kind,
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
                                         ("op", "all_reduce"), ("shape", [7]),
                                         ("dtype", "bfloat16"), ("group", [0, 2])])
def test_a_changed_event_is_named_with_its_position_and_field(tmp_path, capsys, field, value):
    events = base()
    events[1][field] = value  # rank 0, communication #1
    code, out, _ = run_diff(capsys, write(tmp_path / "a.jsonl", base()),
                            write(tmp_path / "b.jsonl", events))
    assert code == 1
    assert "rank 0: different (4 vs 4 communications: 3 equal, 1 changed, 0 only in A, " \
           "0 only in B)" in out
    assert "changed: A #1, B #1" in out and f"A {field}" in out
    assert "rank 1: equal" in out
    assert "!1" in out and "!0" not in out  # the side-by-side table marks the diverging row


def test_every_divergence_is_listed_aligned(tmp_path, capsys):
    """An extra event and a missing one later: both found where they are, the rest aligned."""
    events = base()
    extra = ev(0, 10, op="broadcast", phase="forward")
    b = [events[0], extra, *events[1:3]] + events[4:]  # rank 0: +broadcast at #1, -#3
    for i, e in enumerate(x for x in b if x["rank"] == 0):
        e["seq"] = i
    code, out, _ = run_diff(capsys, write(tmp_path / "a.jsonl", base()),
                            write(tmp_path / "b.jsonl", b))
    assert code == 1
    assert "rank 0: different (4 vs 4 communications: 3 equal, 0 changed, 1 only in A, " \
           "1 only in B)" in out
    assert "only in B: A after #0, B #1" in out and "only in A: A #3, B after #3" in out


def test_names_compared_unless_ignored(tmp_path, capsys):
    events = base()
    events[2]["site"] = "elsewhere.py:12 f"
    a, b = write(tmp_path / "a.jsonl", base()), write(tmp_path / "b.jsonl", events)
    code, out, _ = run_diff(capsys, a, b)
    assert code == 1 and "changed: A #2, B #2" in out and "elsewhere.py:12 f" in out
    assert run_diff(capsys, a, b, "--ignore-names")[0] == 0


def test_kinds_sp_is_tp_and_a_groups_ranks_decide_its_kind(tmp_path, capsys):
    events = base()
    events[0]["kind"], events[1]["kind"] = "sp", "group[0,1]"  # ranks [0, 1]: tp's
    a, b = write(tmp_path / "a.jsonl", base()), write(tmp_path / "b.jsonl", events)
    assert run_diff(capsys, a, b)[0] == 0
    code, out, _ = run_diff(capsys, a, b, "--kinds", "exact")
    assert code == 1 and "2 changed" in out
    events[1]["group"] = [0, 3]  # an unnamed group of other ranks is not tp's
    code, out, _ = run_diff(capsys, a, write(tmp_path / "u.jsonl", events))
    assert code == 1 and "changed: A #1, B #1" in out and "A group" in out
    events = base()
    events[0]["kind"] = "dp"  # another name for tp's ranks: the ranks decide (one group)
    assert run_diff(capsys, a, write(tmp_path / "c.jsonl", events))[0] == 0
    code, out, _ = run_diff(capsys, a, write(tmp_path / "c.jsonl", events), "--kinds", "exact")
    assert code == 1 and "changed: A #0, B #0" in out and "A kind" in out
    plain = base()  # without ranks a different dimension is a difference
    for e in plain + events:
        e.pop("group")
    a2 = write(tmp_path / "a2.jsonl", plain)
    code, out, _ = run_diff(capsys, a2, write(tmp_path / "d.jsonl", events))
    assert code == 1 and "changed: A #0, B #0" in out and "A kind" in out


def test_steps_setup_one_rank_groups_phases_and_numel(tmp_path, capsys):
    a = base() + [ev(r, 10, phase="setup") for r in (0, 1)]  # setup: left out by default
    b = base() + [ev(r, 11, step=2) for r in (0, 1)]          # a second step
    b += [ev(r, 12, step=2, group=[r], kind="dp") for r in (0, 1)]  # a one-rank no-op
    pa, pb = write(tmp_path / "a.jsonl", a), write(tmp_path / "b.jsonl", b)
    assert run_diff(capsys, pa, pb, "--step", "1")[0] == 0
    code, out, _ = run_diff(capsys, pa, pb)  # every step: B's step 2 is only in B
    assert code == 1 and "1 only in B" in out
    code, out, _ = run_diff(capsys, pb, pb, "--step", "2", "--one-rank-groups")
    assert code == 0 and "equal (2 communications)" in out
    code, _, err = run_diff(capsys, pa, pb, "--step", "setup")  # B has none: named, not diffed
    assert code == 2 and "B" in err and "has no setup" in err
    code, _, err = run_diff(capsys, pa, pb, "--step", "7")
    assert code == 2 and "--step 7" in err and "setup, 1" in err and "1, 2" in err
    code, _, err = run_diff(capsys, pa, pb, "--step", "x-1")
    assert code == 2 and "'x-1'" in err
    assert run_diff(capsys, pa, pb, "--step", "1-2")[0] == 1
    code, _, err = run_diff(capsys, pa, pb, "--step", "0")  # steps count from 1
    assert code == 2 and "steps count from 1" in err
    c = base()  # a recorded program's "other" is paraloom's "optimizer"; same numel, other dims
    c[0]["phase"], c[0]["shape"] = "other", [2, 128]
    d = base()
    d[0]["phase"] = "optimizer"
    pc, pd = write(tmp_path / "c.jsonl", c), write(tmp_path / "d.jsonl", d)
    assert run_diff(capsys, pc, pd)[0] == 1  # the shapes differ
    assert run_diff(capsys, pc, pd, "--shapes", "numel")[0] == 0
    assert run_diff(capsys, pc, pd, "--shapes", "numel", "--phases", "exact")[0] == 1


def test_length_and_missing_rank(tmp_path, capsys):
    short = [e for e in base() if not (e["rank"] == 1 and e["seq"] == 3)]
    code, out, _ = run_diff(capsys, write(tmp_path / "a.jsonl", base()),
                            write(tmp_path / "b.jsonl", short))
    assert code == 1 and "rank 1: different (4 vs 3 communications: 3 equal, 0 changed, " \
                         "1 only in A, 0 only in B)" in out
    only0 = [e for e in base() if e["rank"] == 0]
    code, out, _ = run_diff(capsys, tmp_path / "a.jsonl", write(tmp_path / "c.jsonl", only0))
    assert code == 1 and "rank 1: different (4 vs 0 communications" in out
    assert "note: A has 2 ranks, B has 1: rank 1 only in A (the runs have different worlds" \
        in out, out
    assert "ranks" not in run_diff(capsys, tmp_path / "a.jsonl", tmp_path / "b.jsonl")[1].split(
        "A =")[0]  # the same ranks on both sides: no note
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
    code, _, err = run_diff(capsys, good, good, "--context", "-1")
    assert code == 2 and "--context -1: give the number of equal events" in err
    code, _, err = run_diff(capsys, good, good, "--rank", "5")
    assert code == 2 and "--rank 5" in err and "[0, 1]" in err


def test_a_field_set_that_compares_nothing_is_refused(tmp_path, capsys):
    """--fields site --ignore-names once compared no field and said 'equal'."""
    events = base()
    events[0]["op"] = "broadcast"
    a, b = write(tmp_path / "a.jsonl", base()), write(tmp_path / "b.jsonl", events)
    code, _, err = run_diff(capsys, a, b, "--step", "1", "--fields", "site,module",
                            "--ignore-names")
    assert code == 2 and "leaves no field to compare" in err and "'site,module'" in err


def test_context_rows_are_only_equal_pairs(tmp_path, capsys):
    """Two hunks one event apart: --context 3 shows one context row (the equal one), never the
    previous hunk's rows unmarked."""
    events = base()
    events[1]["bytes"] = 8  # rank 0 #1 changed
    events[3]["bytes"] = 8  # rank 0 #3 changed; #2 is the only equal row between them
    code, out, _ = run_diff(capsys, write(tmp_path / "a.jsonl", base()),
                            write(tmp_path / "b.jsonl", events), "--context", "3")
    assert code == 1
    rows = [line.split()[0] for line in out.splitlines() if line.startswith("    ")
            and not line.split()[0] == "#"]
    assert rows == [" 0".strip(), "!1", "2", "!3"], out


def test_a_side_without_the_chosen_step_is_named(tmp_path, capsys):
    two = [dict(e, step=s, seq=e["seq"] + 4 * (s - 1)) for s in (1, 2) for e in base()]
    one = write(tmp_path / "one.jsonl", base())  # step 1 only
    both = write(tmp_path / "two.jsonl", two)
    code, _, err = run_diff(capsys, both, one, "--step", "2")
    assert code == 2 and "B" in err and "has no step 2" in err and "its steps: 1" in err
    code, _, err = run_diff(capsys, both, one, "--step", "setup")
    assert code == 2 and "no communication in either run" in err
    setup = [dict(e, phase="setup") for e in base()[:1]] + [dict(e, seq=e["seq"] + 1)
                                                           for e in base()]
    code, _, err = run_diff(capsys, write(tmp_path / "s.jsonl", setup), one, "--step", "setup")
    assert code == 2 and "has no setup" in err and "its steps: 1" in err
    code, out, _ = run_diff(capsys, both, one, "--step", "1-2")
    assert code == 1 and "note: B has no 2 of --step 1-2 (its steps: 1)" in out
    (tmp_path / "empty.jsonl").write_text("")
    code, _, err = run_diff(capsys, both, tmp_path / "empty.jsonl")
    assert code == 2 and "holds no communication event" in err


def test_minimal_events_and_cut_last_line(tmp_path, capsys):
    """An event with only rank and op is read (no KeyError); a cut last line is said."""
    minimal = tmp_path / "min.jsonl"
    minimal.write_text('{"rank": 0, "op": "all_reduce"}\n')
    code, _, err = run_diff(capsys, minimal, minimal, "--step", "1")
    assert code == 2 and "Traceback" not in err and "no communication in either run" in err
    code, out, _ = run_diff(capsys, minimal, minimal)  # every step: it is compared
    assert code == 0 and "rank 0: equal (1 communications)" in out
    good = write(tmp_path / "a.jsonl", base())
    cut = tmp_path / "cut.jsonl"
    cut.write_text(open(good).read() + '{"rank": 1, "seq": 4, "op": "all_red')
    code, out, _ = run_diff(capsys, good, cut)
    assert code == 0 and "cut.jsonl': its last line was cut off" in out


def test_a_rerun_is_shown_as_the_phase_compared(tmp_path, capsys):
    events = base()
    events[2].update(phase="forward", recompute=True, bytes=8)  # re-run in backward
    code, out, _ = run_diff(capsys, write(tmp_path / "a.jsonl", base()),
                            write(tmp_path / "b.jsonl", events))
    assert code == 1 and "backward (re-run)" in out
    assert "forward (re-run)" not in out


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
    assert "changed: A #1, B #1" in out and "A async" in out and "1 changed" in out
    code, out, _ = run_diff(capsys, runs["tp"], runs["sp"], "--ignore-names")
    assert code == 1 and "changed: A #0" in out
    a, b = sequences(load_runs(runs["sp"])), sequences(load_runs(runs["sp_again"]))
    result = compare(a, b, Options(fields=("kind",), kinds="exact"))
    assert all(not r["hunks"] and r["equal"] == 5 for r in result.values())
