"""Pipeline schedules and layer splits as pure logic (no processes), and the schedule picture."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

import paraloom.commands as cli
from paraloom.pipeline_parallel import plans as pl
from paraloom.pipeline_parallel import runtime
from paraloom.pipeline_parallel import stage as st
from paraloom.pipeline_parallel import timetable as tt
from paraloom.report import plots

CONFIGS = [(p, m) for p, m in itertools.product([2, 3, 4, 8], [1, 2, 3, 4, 8, 16])]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", CONFIGS)
def test_bubble_and_in_flight(schedule, p, m):
    slots = tt.timetable(schedule, p, m)
    assert len(slots) == 2 * (m + p - 1)
    assert tt.bubble_fraction(slots, p) == pytest.approx((p - 1) / (m + p - 1))
    for rank in range(p):
        want = min(p - rank, m) if schedule == "1f1b" else m
        assert tt.max_in_flight(slots, rank) == want
        order = tt.stage_order(schedule, p, m, rank)
        assert sorted(order) == sorted([("F", i, 0) for i in range(m)]
                                       + [("B", i, 0) for i in range(m)])


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (2, 8, 3), (4, 4, 2), (4, 8, 2),
                                   (4, 8, 4), (3, 9, 2), (8, 16, 2)])
def test_interleaved_bubble(p, m, v):
    slots = tt.timetable("interleaved", p, m, v)
    assert tt.bubble_fraction(slots, p) == pytest.approx((p - 1) / (v * m + p - 1))
    one = tt.bubble_fraction(tt.timetable("1f1b", p, m), p)
    assert tt.bubble_fraction(slots, p) < one
    for rank in range(p):  # every (microbatch, chunk) goes forward and backward exactly once
        order = tt.stage_order("interleaved", p, m, rank, v)
        assert sorted(order) == sorted((k, i, c) for k in "FB" for i in range(m)
                                       for c in range(v))


def test_1f1b_phases():
    # p=4, m=8, stage 1: 2 warm-up forwards, steady F/B pairs, 2 cool-down backwards
    order = tt.stage_order("1f1b", 4, 8, 1)
    assert [k for k, _, _ in order[:3]] == ["F", "F", "F"] and order[3] == ("B", 0, 0)
    assert [k for k, _, _ in order[-2:]] == ["B", "B"]
    assert tt.warmup_count("1f1b", 4, 2, 0) == 2  # min(p - rank - 1, m)
    assert tt.stage_order("none", 1, 3, 0) == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0),
                                               ("B", 1, 0), ("F", 2, 0), ("B", 2, 0)]
    assert tt.stage_order("1f1b", 4, 3, 0, forward_only=True) == [("F", i, 0) for i in range(3)]


def test_validation_errors():
    with pytest.raises(ValueError, match="num_microbatches = 6, pp = 4"):
        tt.timetable("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        tt.timetable("zb", 2, 4)
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer, got 0"):
        tt.stage_order("1f1b", 2, 0, 0)
    with pytest.raises(ValueError, match="vpp = 2 needs the interleaved schedule"):
        tt.timetable("1f1b", 2, 4, 2)


@pytest.mark.parametrize("schedule,vs", [("gpipe", [1]), ("1f1b", [1]),
                                         ("interleaved", [2, 3])])
def test_p2p_plans_match_and_never_deadlock(schedule, vs):
    for (p, m), v in itertools.product(CONFIGS, vs):
        if schedule == "interleaved" and m % p:
            continue
        for forward_only, overlap in itertools.product((False, True), (False, True)):
            pl.check_plans([pl.p2p_plan(schedule, p, m, r, v, forward_only, overlap)
                            for r in range(p)])


def _calls(plan):
    """A blocking plan as Megatron's p2p calls: each batch's ops, then compute steps."""
    return [[(o[0], o[1], o[2][1]) for o in e[1]] if e[0] == "comm" else e[:2] for e in plan]


def test_blocking_1f1b_calls_as_megatron():
    """Megatron-Core's 1F1B: warm-up recv_forward, F, send_forward one by one (a middle stage
    posts recv, send, recv -- not a batched send+recv), one recv_forward before the steady state,
    send_forward_recv_backward / send_backward_recv_forward there, send_backward after the last
    steady backward, cool-down recv_backward, B, send_backward."""
    mid = _calls(pl.p2p_plan("1f1b", 3, 4, 1))
    assert mid[:6] == [[("recv", "prev", 0)], ("F", 0), [("send", "next", 0)],
                       [("recv", "prev", 1)], ("F", 1), [("send", "next", 1), ("recv", "next", 0)]]
    assert mid[6:9] == [("B", 0), [("send", "prev", 0), ("recv", "prev", 2)], ("F", 2)]
    assert mid[-5:] == [("B", 2), [("send", "prev", 2)], [("recv", "next", 3)], ("B", 3),
                        [("send", "prev", 3)]]
    first = _calls(pl.p2p_plan("1f1b", 4, 2, 0))  # warm-up covers every microbatch
    assert first == [("F", 0), [("send", "next", 0)], ("F", 1), [("send", "next", 1)],
                     [("recv", "next", 0)], ("B", 0), [("recv", "next", 1)], ("B", 1)]


def test_overlapped_plan_posts_ahead_and_waits_late():
    """Megatron's overlap_p2p_comm: a receive is posted before the compute step preceding the
    step that needs it, each send right after its producer, and its wait after the next step."""
    plan = pl.p2p_plan("1f1b", 2, 4, 0, overlap=True)
    at = {step: i for i, step in enumerate(plan) if step[0] in "FB"}
    for mb in range(4):
        recv = ("recv", "next", ("grad", mb, 1))
        posted = next(i for i, s in enumerate(plan) if s[0] == "post" and recv in s[1])
        waited = next(i for i, s in enumerate(plan) if s[0] == "wait" and recv in s[1])
        # at least one compute step runs while the gradient travels, and B waits just before
        assert any(s[0] in "FB" for s in plan[posted:waited]) and waited == at[("B", mb, 0)] - 1
        send = ("send", "next", ("act", mb, 0))
        assert plan[at[("F", mb, 0)] + 1] == ("post", [send])
        sent = next(i for i, s in enumerate(plan) if s[0] == "wait" and send in s[1])
        assert any(s[0] in "FB" for s in plan[at[("F", mb, 0)] + 1:sent]) or mb == 3
    assert not any(s[0] == "comm" for s in plan)
    # the same messages in the same per-peer order as the blocking plan
    for r in range(2):
        flat = [[op for s in pl.p2p_plan("1f1b", 2, 4, r, overlap=ov) if s[0] in ("comm", "post")
                 for op in s[1] if op[0] == what] for ov in (False, True) for what in ("send",
                                                                                      "recv")]
        assert flat[0] == flat[2] and flat[1] == flat[3]


def test_check_plans_catches_unwaited_and_unposted():
    send = ("send", "next", ("act", 0, 0))
    recv = ("recv", "prev", ("act", 0, 0))
    with pytest.raises(RuntimeError, match="never waits"):
        pl.check_plans([[("post", [send])], [("comm", [recv])]])
    with pytest.raises(RuntimeError, match="not posted"):
        pl.check_plans([[("wait", [send])], [("comm", [recv])]])
    with pytest.raises(RuntimeError, match="deadlock"):
        pl.check_plans([[], [("post", [recv]), ("wait", [recv])]])
    # async posts on both sides meet even when each waits before the other posts its receive
    pl.check_plans([[("post", [send]), ("wait", [send]), ("comm", [("recv", "next", ("g", 0))])],
                    [("post", [("send", "prev", ("g", 0))]), ("comm", [recv]),
                     ("wait", [("send", "prev", ("g", 0))])]])


def test_overlap_switch():
    cpu = torch.device("cpu")
    assert runtime._overlap(None, cpu, False) and not runtime._overlap(None, cpu, True)
    assert not runtime._overlap(False, cpu, False)
    with pytest.raises(ValueError, match="variable_seq_lengths=False"):
        runtime._overlap(True, cpu, True)
    with pytest.raises(ValueError, match="for gloo"):
        runtime._overlap(True, torch.device("cuda"), False)


def test_check_plans_catches_deadlock_and_swaps():
    # a send posted alone waits for a receive the peer posts only after its own send
    deadlock = [[("comm", [("send", "next", ("act", 0, 0))]), ("comm", [("recv", "next",
                                                                          ("grad", 0, 1))])],
                [("comm", [("send", "prev", ("grad", 0, 1))]), ("comm", [("recv", "prev",
                                                                          ("act", 0, 0))])]]
    with pytest.raises(RuntimeError, match="deadlock"):
        pl.check_plans(deadlock)
    swapped = [[("comm", [("send", "next", ("act", 0, 0)), ("send", "next", ("act", 1, 0))])],
               [("comm", [("recv", "prev", ("act", 1, 0)), ("recv", "prev", ("act", 0, 0))])]]
    with pytest.raises(RuntimeError, match="carries"):
        pl.check_plans(swapped)


def test_stage_split():
    assert st.stage_layers(8, 4, 1) == [range(2, 4)]
    # Megatron's interleaved assignment: chunk c of stage r holds piece c*p + r
    assert st.stage_layers(8, 2, 0, vpp=2) == [range(0, 2), range(4, 6)]
    assert st.stage_layers(8, 2, 1, vpp=2) == [range(2, 4), range(6, 8)]
    assert st.layer_names(8, 4, 3, vpp=2, chunk=1) == ["layers.7"]
    every = [i for r in range(4) for c in range(2) for i in st.layer_range(16, 4, r, 2, c)]
    assert sorted(every) == list(range(16))
    assert all(st.owner_of_layer(i, 16, 4, 2) == (r, c) for r in range(4) for c in range(2)
               for i in st.layer_range(16, 4, r, 2, c))
    first, last, mid = st.stage_role(8, 4, 0), st.stage_role(8, 4, 3), st.stage_role(8, 4, 1)
    assert first.has_embedding and not first.has_loss and last.has_loss and not mid.is_first
    assert not st.stage_role(8, 4, 3, vpp=2, chunk=0).has_loss
    assert st.stage_role(8, 4, 3, vpp=2, chunk=1).has_loss
    assert not st.stage_role(8, 4, 0, vpp=2, chunk=1).has_embedding


def test_stage_split_errors():
    with pytest.raises(ValueError, match=r"num_layers = 10 is not divisible by pp \* vpp = 2 \* "
                                         r"2 = 4"):
        st.layer_range(10, 2, 0, vpp=2)
    with pytest.raises(ValueError, match="pipeline rank 4 is outside 0..3"):
        st.layer_range(8, 4, 4)
    with pytest.raises(ValueError, match="chunk 2 is outside 0..1"):
        st.layer_range(8, 2, 0, vpp=2, chunk=2)


def test_cli_schedule_picture(tmp_path, capsys):
    out = tmp_path / "sched.png"
    assert cli.main(["schedule", "--pp", "4", "--microbatches", "8", "--vpp", "2",
                     "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"bubble fraction: {3 / 19:.4f}" in capsys.readouterr().out
    assert cli.main(["schedule", "--pp", "4", "--microbatches", "6", "--vpp", "2",
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("paraloom schedule: error:") and "num_microbatches = 6" in err
    assert err.rstrip().endswith("use 4 or 8"), err
    assert cli.main(["schedule", "--pp", "4", "--microbatches", "3", "--vpp", "2"]) == 2
    assert capsys.readouterr().err.rstrip().endswith("pp = 4; use 4")  # not "use 4 or 4"
    assert cli.main(["schedule", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["schedule", "--pp", "zero"])
    assert info.value.code == 2 and "'zero'" in capsys.readouterr().err
    # what train refuses is not drawn, and a size that would take minutes is refused at once
    for argv, message in ((["--schedule", "interleaved", "--pp", "4"], "needs --vpp >= 2"),
                          (["--schedule", "zb-h1", "--pp", "1"], "needs --pp >= 2, got --pp 1"),
                          (["--pp", "65"], "--pp 65: at most 64 stages"),
                          (["--pp", "64", "--microbatches", "65"], "= 4160 forward steps")):
        assert cli.main(["schedule", *argv, "--out", str(out)]) == 2
        assert message in capsys.readouterr().err


def test_cli_schedule_from_ledger(tmp_path, capsys):
    """A recorded ledger is drawn at its real times; the bubble is measured from the spans."""
    events = []
    for t, slot in enumerate(tt.timetable("1f1b", 2, 2)):  # a fake 2-rank run, 0.1 s per step
        for stage, kind, mb, c in slot:
            events.append(dict(rank=stage, seq=t, step=0, microbatch=mb, op="compute",
                               kind="compute", phase="forward" if kind == "F" else "backward",
                               site="pipeline." + ("forward" if kind == "F" else "backward"),
                               stage=stage, chunk=c, t_start=0.1 * t, t_end=0.1 * t + 0.1))
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    blocks, rows = plots.ledger_blocks(events)
    assert rows == ["stage 0 (rank 0)", "stage 1 (rank 1)"] and len(blocks) == 8
    assert plots.bubble_of(blocks, 2) == pytest.approx(1 / 3)  # (p-1)/(m+p-1)
    assert cli.main(["schedule", str(tmp_path), "--out", str(tmp_path / "run.png")]) == 0
    assert "bubble fraction: 0.3333" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "ledger.jsonl").write_text("")
    assert cli.main(["schedule", str(tmp_path / "empty")]) == 2
    assert "no pipeline compute spans" in capsys.readouterr().err


def test_interleaved_overlapped_plan_is_megatrons():
    """Interleaving with overlap_p2p_comm is Megatron-Core's own overlapped schedule: calls in
    ``_p2p_ops`` order (an even stage sends before it receives, an odd one receives first),
    blocking warm-up calls, the steady state's forward send and next receive posted right after
    F (its send waited for at once), the backward's right after B, and blocking cool-down calls.
    The record of ``paraloom train`` equals Megatron-LM's (tests/test_megatron_lm.py)."""
    p, m, v = 4, 8, 2
    for rank in range(p):
        plan = pl.p2p_plan("interleaved", p, m, rank, v, overlap=True)
        for step in plan:
            if step[0] in ("comm", "post") and len(step[1]) == 2:
                first = step[1][0][0]
                assert first == ("send" if rank % 2 == 0 else "recv"), (rank, step)
        computes = [i for i, s in enumerate(plan) if s[0] in "FB"]
        w = pl.warmup_count("interleaved", p, m, rank, v)
        steady = computes[w:w + 2 * (m * v - w)]
        if steady:
            assert all(s[0] != "comm" for s in plan[steady[0]:steady[-1]])  # posts only
            assert sum(1 for i in steady if plan[i + 1][0] == "post") >= len(steady) - 2
        for i in computes[:w] + computes[w + 2 * (m * v - w):]:  # warm-up, cool-down: blocking
            follow = plan[i + 1] if i + 1 < len(plan) else None
            # a blocking call (or nothing to send), never a post: but the first backward's
            # receive, posted after the last warm-up forward's blocking call
            assert follow is None or follow[0] != "post" or i == computes[w - 1]
    rank1 = pl.p2p_plan("interleaved", p, m, 1, v, overlap=True)
    assert rank1[0] == ("comm", [("recv", "prev", ("act", 0, 0))])  # recv_forward
    pl.check_plans([pl.p2p_plan("interleaved", p, m, r, v, overlap=True) for r in range(p)])
