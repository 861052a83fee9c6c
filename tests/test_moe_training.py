"""``paraloom train --num-experts``: the run folder and record of an expert-parallel run, and bad
MoE flags (exit 2 naming the values, before any rank starts). Layout equivalence is proved in
test_moe.py (warm world, no files)."""

from __future__ import annotations

import re

import pytest

from paraloom.cli import main


@pytest.mark.parametrize("flags,message", [
    (["--dp", "4", "--ep", "4", "--num-experts", "6"],
     "num_experts = 6 is not divisible by ep = 4"),
    (["--num-experts", "4", "--moe-router-topk", "5"],
     "moe_router_topk = 5 is larger than num_experts = 4"),
    (["--dp", "2", "--ep", "4", "--num-experts", "4"], r"ep = 4 does not divide dp \* cp = 2"),
    (["--dp", "2", "--ep", "2"], "ep = 2 needs an MoE model"),
])
def test_bad_moe_flags_exit_2_naming_the_values(tmp_path, capsys, flags, message):
    out = tmp_path / "bad"
    code = main(["train", "--tp", "1", "--pp", "1", "--dp", "1", "--out", str(out), *flags])
    assert code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()
