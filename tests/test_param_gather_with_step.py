"""``--overlap-param-gather-with-optimizer-step`` (Megatron-LM's, interleaved pipelines only): the
first model chunk's parameter all-gather is launched by its own optimizer step, right after its
update, asynchronously, while the other chunks' optimizers step; the schedule's launch skips that
chunk and its forward pre-hook only waits (``paraloom.data_parallel.param_gather``).

pp 2 x vpp 2 x dp 2 with the distributed optimizer and ``--overlap-param-gather``, trained 4
steps with and without the flag (the run with it saves after step 2): the same model; the
ledgers differ by exactly chunk 0's gathers, which leave the next forward (and step 1, where the
hooks are off, gains them) for the optimizer phase, async, in every step, chunk 0's two buckets on
the first stage (the tied embedding's and the layer's) reduce-scattered and gathered as one
coalesced group (bucketing is off with the flag, as Megatron-LM builds it), and step 1 has one
more ``has_grad_norm_group`` agreement (Megatron chains two dense optimizers then); ``paraloom
check`` is exact on every step; ``plan --table`` is the recorded step 1
(``tests/test_plan_table.py``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from conftest import assert_same_metrics

from paraloom.commands import main
from paraloom.run_folder import load_events, read_metrics

FLAGS = ["--layers", "4", "--hidden", "32", "--heads", "2", "--seq-len", "16",
         "--micro-batch-size", "1", "--steps", "4", "--ledger-steps", "4", "--timeout", "120",
         "--tp", "1", "--pp", "2", "--dp", "2", "--vpp", "2", "--global-batch-size", "8",
         "--distributed-optimizer", "--overlap-param-gather"]
WITH_STEP = "--overlap-param-gather-with-optimizer-step"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("with_step")
    off, on = root / "off", root / "on"
    assert main(["train", *FLAGS, "--save-every", "0", "--out", str(off)]) == 0
    assert main(["train", *FLAGS, WITH_STEP, "--save-every", "2", "--out", str(on)]) == 0
    return off, on


def _comms(folder: Path, step: int) -> list[dict]:
    return [e for e in load_events(folder) if e["step"] == step and e["op"] != "compute"]


def _key(e: dict) -> tuple:
    return (e["rank"], e["kind"], e["op"], e["phase"], e["bytes"], bool(e.get("async")))


def _gathers(events: list[dict]) -> list[dict]:
    return [e for e in events if e["kind"] == "dp" and e["op"] == "all_gather"]


def test_the_flag_trains_the_same_model(runs):
    off, on = runs
    assert_same_metrics(read_metrics(on / "metrics.jsonl"), read_metrics(off / "metrics.jsonl"),
                        rtol=1e-6)


def _scatters(events: list[dict]) -> list[dict]:
    return [e for e in events if e["kind"] == "dp" and e["op"] == "reduce_scatter"]


def test_chunk_zero_is_gathered_by_its_own_optimizer_step(runs):
    off, on = runs
    for step in range(1, 5):
        was, now = _comms(off, step), _comms(on, step)
        moved = [e for e in _gathers(now) if e["phase"] == "optimizer" and e.get("async")]
        # chunk 0's buckets, every step: layers 0 (first stage) and 1 (second), never 2 or 3;
        # bucketing is off (Megatron-LM's rule), so on the first stage the tied embedding's
        # bucket and the layer's are one group, one coalesced gather of two
        assert Counter(e["rank"] for e in moved) == {0: 1, 1: 1, 2: 1, 3: 1}, step
        assert [e.get("tensors", 1) for e in moved if e["rank"] < 2] == [2, 2]
        chunk0 = {e["rank"]: set(e["params"]) for e in moved}
        assert not any(n.startswith(("layers.2.", "layers.3.")) for ns in chunk0.values()
                       for n in ns)
        before = [e for e in _gathers(was) if set(e["params"]) <= chunk0.get(e["rank"], set())]
        if step == 1:  # the hooks are off in step 1: without the flag nobody gathers then
            assert before == [] and not _gathers(was)
        else:  # the same gathers, moved out of this step's forward (and coalesced)
            assert sum(e["bytes"] for e in before) == sum(e["bytes"] for e in moved)
            assert Counter(e["rank"] for e in before) == {0: 2, 1: 2, 2: 1, 3: 1}
            assert {e["phase"] for e in before} == {"forward"}
        # the same gradients reduce-scattered, chunk 0's pair on the first stage coalesced
        for rank in range(4):
            mine = [[e for e in _scatters(events) if e["rank"] == rank] for events in (was, now)]
            assert sum(e["bytes"] for e in mine[0]) == sum(e["bytes"] for e in mine[1])
            assert len(mine[0]) - len(mine[1]) == (1 if rank < 2 else 0), (step, rank)
        # the save after step 2 gathers off the record (chunk 0's in flight is only waited for);
        # with interleaving the schedule launches chunk 1's gathers in step 3 all the same, as
        # Megatron's schedule does after its force_param_sync
        assert not [e for e in _gathers(now) if e["phase"] == "optimizer" and not e.get("async")]
        rest_now = Counter(_key(e) for e in now if e not in moved and e not in _scatters(now))
        rest_was = Counter(_key(e) for e in was if e not in before and e not in _scatters(was))
        if step == 1:  # Megatron chains two dense optimizers: two has_grad_norm_group flags
            flags = Counter((r, "distopt", "all_reduce", "optimizer", 4, False) for r in range(4))
            assert rest_now - rest_was == flags and rest_was - rest_now == Counter()
        else:
            assert rest_now == rest_was, step  # nothing else changes


def test_check_is_exact_with_the_flag(runs, capsys):
    _, on = runs
    capsys.readouterr()
    assert main(["check", str(on)]) == 0, capsys.readouterr().out
    assert "rows agree" in capsys.readouterr().out


def test_refused_without_interleaving_or_the_overlap(capsys, no_ranks):
    base = ["train", "--layers", "4", "--hidden", "32", "--heads", "2", "--seq-len", "16",
            "--global-batch-size", "8", "--micro-batch-size", "1", "--steps", "1", "--tp", "1",
            "--dp", "2", WITH_STEP]
    for extra in (["--pp", "2", "--distributed-optimizer", "--overlap-param-gather"],
                  ["--pp", "2", "--vpp", "2", "--distributed-optimizer"]):
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert "--overlap-param-gather-with-optimizer-step needs --distributed-optimizer, " \
            "--overlap-param-gather and --vpp > 1" in err, err
