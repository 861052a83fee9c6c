"""Two ``torchrun`` agents on loopback, as two nodes of 2 ranks each (tp 2, dp 2).

* One run folder path seen by both nodes (a shared filesystem): both agents exit 0, the folder
  is complete (reports, every rank's ledger, whole checkpoints), and resuming its mid-run
  checkpoint on one node gives the uninterrupted run's losses.
* A different folder per node (no shared filesystem, the usual case) and default flags: both
  agents exit 0, without checkpoints (rank 0 says why), node 0 has the reports with every rank's
  events, node 1 its ranks' raw ledgers and a note; asking for checkpoints there (--save-every
  given) is refused with a message that says why (checked without agents).
* A ``--tokenizer`` folder only node 0 has: the ranks of node 1 find it missing while reading
  their flags, before the world exists, and still join it to say so: both nodes stop at once
  (exit code 2 in every rank), each node's log says why, instead of node 0 waiting for node 1
  until the timeout and ending without a reason. A problem every rank has (a bad flag) is said
  once per node, as it is.

Each agent is a real ``python -m torch.distributed.run`` process with a timeout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import paraloom
from paraloom.commands import main

ROOT = Path(paraloom.__file__).resolve().parent.parent
MODEL = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--vocab", "256"]
FLAGS = ["--tp", "2", "--dp", "2", "--pp", "1", *MODEL, "--global-batch-size", "4",
         "--micro-batch-size", "1", "--ledger-steps", "1", "--timeout", "60"]
TIMEOUT_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(out0: Path, out1: Path, *flags: str, cwds: tuple = (None, None),
               base: list[str] = FLAGS) -> list[tuple[int, str]]:
    """Start node 0 and node 1 (2 ranks each), in ``cwds`` (default: this one);
    ``[(exit code, output)]`` per node."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]), "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo0" if sys.platform == "darwin" else "lo"}
    procs = []
    for node, (out, cwd) in enumerate(zip((out0, out1), cwds, strict=True)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
               str(node), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port), "-m", "paraloom", "train", *base, "--out", str(out),
               *flags]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, cwd=cwd,
                                      stderr=subprocess.STDOUT, text=True))
    results = []
    try:
        for proc in procs:
            text, _ = proc.communicate(timeout=TIMEOUT_S)
            results.append((proc.returncode, text))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def _metrics(folder: Path) -> dict[int, dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m for m in map(json.loads, lines)}


def test_shared_folder_complete_then_resumed_on_one_node(tmp_path):
    run = tmp_path / "run"
    (rc0, log0), (rc1, log1) = _two_nodes(run, run, "--steps", "4", "--save-every", "2")
    assert (rc0, rc1) == (0, 0), log0[-3000:] + log1[-3000:]
    for name in ("config.json", "metrics.jsonl", "ledger.jsonl", "trace.json", "comm_table.md",
                 "summary.json", "loss.png"):
        assert (run / name).is_file(), name
    assert sorted(p.name for p in (run / "ledger").iterdir()) == [
        f"rank_{r}.jsonl" for r in range(4)]
    events = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    assert {e["rank"] for e in events} == {0, 1, 2, 3}
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_4"]
    assert not list(run.glob(".paraloom-folder-token*"))
    two_nodes = _metrics(run)
    assert sorted(two_nodes) == [1, 2, 3, 4]

    resumed = tmp_path / "resumed"  # one node (4 local ranks) from the step-2 checkpoint
    assert main(["train", *FLAGS, "--steps", "4", "--save-every", "0",
                 "--resume", str(run / "checkpoints" / "step_2"), "--out", str(resumed)]) == 0
    again = _metrics(resumed)
    for step in (3, 4):
        assert again[step]["loss"] == pytest.approx(two_nodes[step]["loss"], rel=1e-6, abs=0)
        assert again[step]["grad_norm"] == pytest.approx(two_nodes[step]["grad_norm"], rel=1e-6)


def test_node_local_folders(tmp_path):
    out0, out1 = tmp_path / "node0", tmp_path / "node1"
    # default flags (no --save-every): the run trains, without checkpoints, and says why
    (rc0, log0), (rc1, log1) = _two_nodes(out0, out1, "--steps", "2")
    assert (rc0, rc1) == (0, 0), log0[-3000:] + log1[-3000:]
    assert "note: no checkpoints: not every node sees the run folder" in log0, log0[-3000:]
    assert not (out0 / "checkpoints").exists() and not (out1 / "checkpoints").exists()
    assert sorted(_metrics(out0)) == [1, 2]
    events = [json.loads(x) for x in (out0 / "ledger.jsonl").read_text().splitlines()]
    assert {e["rank"] for e in events} == {0, 1, 2, 3}  # gathered over the network
    assert "ranks 2, 3 on" in log0 and "do not see this run folder" in log0
    assert sorted(p.name for p in (out1 / "ledger").iterdir()) == ["rank_2.jsonl", "rank_3.jsonl"]
    assert json.loads((out1 / "node.json").read_text())["folder"] == str(out1.resolve())
    assert json.loads((out0 / "summary.json").read_text())["ranks_elsewhere"] == [2, 3]


def test_checkpoints_refuse_a_folder_not_every_rank_sees(tmp_path):
    """What ranks 2, 3 on node 1 would hit above with ``--save-every 1`` (the same function,
    without paying for two more agents): a SetupError naming the flag, the folder, the ranks
    and both ways out; nothing when every rank shares the folder or nothing is saved."""
    from paraloom.training.multinode import RunFolder, SetupError, needs_shared_folder
    split = RunFolder(tmp_path, [True, True, False, False], hosts=["a", "a", "b", "b"])
    with pytest.raises(SetupError) as err:
        needs_shared_folder(split, 1)
    text = str(err.value)
    assert "--save-every 1" in text and str(tmp_path) in text and "ranks 2, 3 on b" in text
    assert "shared filesystem" in text and "--save-every 0" in text
    needs_shared_folder(split, 0)
    needs_shared_folder(RunFolder(tmp_path, [True] * 4), 1)
    from paraloom.training.multinode import checkpoint_interval
    assert checkpoint_interval(RunFolder(tmp_path, [True] * 4), None) == (50, None)
    every, note = checkpoint_interval(split, None)
    assert every == 0 and "no checkpoints: not every node sees the run folder" in note
    with pytest.raises(SetupError):
        checkpoint_interval(split, 5)


def test_a_folder_only_some_nodes_have_stops_every_node_with_the_reason(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    (node0 / "tok").mkdir(parents=True)
    node1.mkdir()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 4, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(node0 / "tok" / "tokenizer.json"))
    flags = [f for f in FLAGS if f not in ("--vocab", "256")]  # the tokenizer's vocabulary
    assert len(flags) == len(FLAGS) - 2
    (rc0, log0), (rc1, log1) = _two_nodes(
        Path("out"), Path("out"), "--steps", "1", "--save-every", "0", "--tokenizer", "tok",
        cwds=(node0, node1), base=flags)
    assert rc0 != 0 and rc1 != 0, log0[-3000:] + log1[-3000:]
    assert "exitcode  : 2" in log0 and "exitcode  : 2" in log1  # refused, not crashed
    assert "wait timeout" not in log0 + log1 and "timed out" not in log0 + log1
    missing = "--tokenizer 'tok' is not a folder"
    assert "the inputs are not readable on every rank" in log0
    assert f"ranks 2, 3 on {socket.gethostname()}: {missing}" in log0
    assert f"ranks 0, 1 on {socket.gethostname()} had no problem" in log0
    assert f"rank 2: {missing}" in log1
    assert not (node0 / "out" / "metrics.jsonl").exists()
    # the same problem on every rank (a bad flag): each node's log just says it
    (rc0, log0), (rc1, log1) = _two_nodes(Path("out"), Path("out"), "--heads", "3",
                                          cwds=(node0, node1))
    bad = "paraloom train: error: hidden_size = 32 is not divisible by num_attention_heads = 3\n"
    assert rc0 != 0 and rc1 != 0 and log0.count(bad) == 1 and log1.count(bad) == 1, log0 + log1
