"""ZB-H1 (zero-bubble) timetable as pure logic: bubble formula, memory bound, plans, picture."""

from __future__ import annotations

import itertools

import pytest

import paraloom.commands as cli
from paraloom.pipeline_parallel import plans as pl
from paraloom.pipeline_parallel import timetable as tt

PM = [(2, 4), (4, 8), (2, 2), (3, 3), (3, 7), (4, 4), (4, 16), (8, 8), (8, 16)]


@pytest.mark.parametrize("p,m", PM)
def test_zb_h1_bubble_is_p_minus_1_over_3m_plus_p_minus_1(p, m):
    slots = tt.timetable("zb-h1", p, m)
    assert len(slots) == 3 * m + p - 1
    assert tt.bubble_fraction(slots, p) == pytest.approx((p - 1) / (3 * m + p - 1))
    # 1F1B with the same unit costs (B + W = 2 slots) idles 3(p-1) slots per stage
    assert tt.bubble_fraction(slots, p) < (3 * (p - 1)) / (3 * m + 3 * (p - 1))
    for rank in range(p):
        order = tt.stage_order("zb-h1", p, m, rank)
        assert sorted(order) == sorted((k, i, 0) for k in "FBW" for i in range(m))
        # 1F1B's order of F and B is kept; each W follows its own B
        assert [s for s in order if s[0] != "W"] == tt.stage_order("1f1b", p, m, rank)
        assert all(order.index(("B", i, 0)) < order.index(("W", i, 0)) for i in range(m))
        # activations are held until W; never more than p (1F1B's stage-0 peak)
        assert tt.max_in_flight(slots, rank) <= p
    assert tt.max_in_flight(slots, 0) == min(p, m)


def test_zb_h1_fills_the_1f1b_bubble_with_w():
    slots = tt.timetable("zb-h1", 4, 8)
    # stage 0 idles only while its first backward travels (p - 1 slots), the tail is full of W
    busy0 = [t for t, slot in enumerate(slots) if any(s == 0 for s, *_ in slot)]
    assert len(slots) - len(busy0) == 3 and busy0[-1] == len(slots) - 1
    last = [(k, mb) for t in busy0[-3:] for s, k, mb, _ in slots[t] if s == 0]
    assert [k for k, _ in last] == ["W", "B", "W"]
    # the last stage runs W where 1F1B would wait on stage 0's cool-down
    assert slots[-1] == [(r, "W", 7, 0) for r in range(4)]


def test_zb_h1_p2p_plans_match_and_never_deadlock():
    for p, m in PM + [(p, m) for p, m in itertools.product([2, 3, 4], [1, 2, 3, 5])]:
        for forward_only, overlap in itertools.product((False, True), (False, True)):
            plans = [pl.p2p_plan("zb-h1", p, m, r, 1, forward_only, overlap) for r in range(p)]
            pl.check_plans(plans)
            # W steps communicate nothing: each rank sends and receives 1F1B's messages in
            # 1F1B's order
            ref = [pl.p2p_plan("1f1b", p, m, r, 1, forward_only, overlap) for r in range(p)]
            for what in ("send", "recv"):
                assert [[op for e in plan if e[0] in ("comm", "post") for op in e[1]
                         if op[0] == what] for plan in plans] == \
                    [[op for e in plan if e[0] in ("comm", "post") for op in e[1]
                      if op[0] == what] for plan in ref]


def test_zb_h1_validation():
    with pytest.raises(ValueError, match="vpp = 2 needs the interleaved schedule, not 'zb-h1'"):
        tt.timetable("zb-h1", 2, 4, 2)
    assert tt.stage_order("zb-h1", 2, 3, 1, forward_only=True) == [("F", i, 0) for i in range(3)]


def test_schedule_cli_draws_w_and_prints_bubble(tmp_path, capsys):
    out = tmp_path / "zb.png"
    assert cli.main(["schedule", "--schedule", "zb-h1", "--pp", "4", "--microbatches", "8",
                     "--out", str(out)]) == 0
    assert f"bubble fraction: {3 / 27:.4f}" in capsys.readouterr().out
    assert out.stat().st_size > 0
    assert cli.main(["schedule", "--schedule", "zb-h1", "--pp", "2", "--vpp", "2",
                     "--out", str(tmp_path / "x.png")]) == 2
    assert "vpp = 2 needs the interleaved schedule" in capsys.readouterr().err
