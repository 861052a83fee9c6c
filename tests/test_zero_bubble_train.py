"""``paraloom train --schedule zb-h1`` trains the same model as one process, and its ledger shows
the zero-bubble order: per stage exactly the timetable's F, B and W steps, every wgrad GEMM
inside a W step (``pipeline.weight_grad``), none inside a backward step.

The single-process reference is a one-rank run of the same training loop; the zero-bubble runs
share one warm 4-rank world (pp = 4; pp = 2 x dp = 2; tp = 2 x pp = 2).
"""

from __future__ import annotations

import json
import time

import pytest
from conftest import assert_same_metrics, metrics, run_training, train_rank

from paraloom import commands as cli
from paraloom.config import ModelConfig, ParallelConfig, TrainConfig
from paraloom.pipeline_parallel import timetable as tt

MODEL = ModelConfig(vocab_size=256, hidden_size=32, num_layers=4, num_attention_heads=4,
                    seq_length=16)
BASE = TrainConfig().replace(parallel=ParallelConfig(), model=MODEL,
                             global_batch_size=8, micro_batch_size=1, steps=2, lr=3e-3,
                   warmup_steps=1, save_every=0, ledger_steps=1, timeout_s=60)


def _cfg(out, *, schedule="none", **parallel):
    return BASE.replace(parallel=ParallelConfig(**parallel), schedule=schedule, out=str(out))


def _in_world(cfg):
    train_rank(0, 0, cfg, time.time())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "single"
    return run_training(_cfg(out))


@pytest.mark.parametrize("layout,m", [
    (dict(pp=4), 8), (dict(pp=2, dp=2), 4),
    (dict(tp=2, pp=2, sequence_parallel=True, gradient_accumulation_fusion=True), 8)],
    ids=["pp4-m8", "pp2-dp2-m4", "tp2-sp-fusion-pp2-m8"])
def test_zb_h1_trains_the_same_model(world4, tmp_path, reference, layout, m):
    out = tmp_path / "zb"
    world4.run(_in_world, _cfg(out, schedule="zb-h1", **layout))
    assert_same_metrics(metrics(out), reference)
    events = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    p = layout["pp"]
    for rank in range(4):
        mine = [e for e in events if e["rank"] == rank and e["step"] == 1
                and e["op"] == "compute"]
        steps = [e for e in mine if e["site"].startswith("pipeline.")]
        stage = steps[0]["stage"]
        kinds = {"pipeline.forward": "F", "pipeline.backward": "B", "pipeline.weight_grad": "W"}
        # the recorded order is the timetable's, W steps included
        assert [(kinds[e["site"]], e["microbatch"], 0) for e in steps] == \
            tt.stage_order("zb-h1", p, m, stage)
        wspans = [e for e in steps if e["site"] == "pipeline.weight_grad"]
        bspans = [e for e in steps if e["site"] == "pipeline.backward"]
        wgrads = [e for e in mine if e["site"].endswith(":wgrad")]
        assert wgrads and len(wspans) == m
        for g in wgrads:  # every wgrad GEMM ran inside its microbatch's W step, none in B
            assert any(w["t_start"] <= g["t_start"] and g["t_end"] <= w["t_end"]
                       and w["microbatch"] == g["microbatch"] for w in wspans), g
            assert not any(b["t_start"] <= g["t_start"] <= b["t_end"] for b in bspans), g
        if stage == 0:  # stage 0's tail, 1F1B's cool-down bubble, is filled with W steps
            assert steps[-1]["site"] == "pipeline.weight_grad"
    # W steps communicate nothing: the recorded messages agree with the formulas as for 1F1B
    assert cli.main(["check", str(out)]) == 0
