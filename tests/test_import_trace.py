"""``paraloom import``: per-rank PyTorch profiler traces read as a run folder.

``tests/_profiled.py`` (2 gloo ranks: all-reduce, all-gather, an fp64 broadcast, send/recv, a
reduce-scatter, an int64 all-reduce, a barrier) profiles itself and is recorded by ``paraloom
record`` at the same time; its imported traces give the same communication sequence as the
record (op, dtype, shape, peer, group), rank by rank. A trace in NCCL's form (its
``record_param_comms`` fields), bad folders and bad files are checked too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paraloom.commands import main
from paraloom.record.kineto import events_of
from paraloom.run_folder import load_events

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profiled")
    traces = tmp / "traces"
    traces.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "paraloom", "record", "--nproc", "2", "--out", str(tmp / "rec"),
         "--timeout", "120", "--", str(ROOT / "tests" / "_profiled.py"), str(traces)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        raise
    assert proc.returncode == 0, text[-3000:]
    return tmp


def test_import_gives_the_record_of_the_same_program(profiled, capsys):
    out = profiled / "imported"
    assert main(["import", str(profiled / "traces"), "--out", str(out)]) == 0
    assert "14 communications from 2 ranks" in capsys.readouterr().out
    assert main(["diff", str(profiled / "rec"), str(out), "--step", "setup,1",
                 "--fields", "op,dtype,shape,peer,group"]) == 0, capsys.readouterr().out
    capsys.readouterr()
    ops = [(e["op"], e["dtype"], e["shape"]) for e in load_events(out) if e["rank"] == 1]
    assert ops == [("all_reduce", "float32", [8]), ("all_gather", "float32", [8]),
                   ("broadcast", "float64", [5]), ("recv", "float32", [3]),
                   ("reduce_scatter", "float32", [8]), ("all_reduce", "int64", [2, 3]),
                   ("barrier", None, None)]
    assert main(["diagnose", str(out)]) == 0  # the same folder serves diagnose
    assert main(["table", str(out), "--rank", "0", "--step", "1"]) == 0
    assert "float64 [5]" in capsys.readouterr().out


def test_nccl_record_param_comms_fields():
    """NCCL's events, by their documented field names: the collective, element count, dtype
    and the group's ranks; the phase from the autograd annotation around the op."""
    trace = {"distributedInfo": {"backend": "nccl", "rank": 1, "world_size": 4},
             "traceEvents": [
                 {"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: "
                  "MmBackward0", "ts": 100, "dur": 50, "tid": 7},
                 {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": 120, "dur": 5,
                  "tid": 7, "args": {"Collective name": "allreduce", "In msg nelems": 4096,
                                     "Out msg nelems": 4096, "dtype": "BFloat16",
                                     "Process Group Name": "3",
                                     "Process Group Ranks": "[1, 3]", "Group size": 2}},
                 {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": 300, "dur": 5,
                  "tid": 7, "args": {"Collective name": "_allgather_base", "In msg nelems": 8,
                                     "dtype": "Float", "Process Group Ranks": [0, 1, 2, 3]}}]}
    events, notes = events_of(trace, 1)
    assert [(e["op"], e["dtype"], e["shape"], e["bytes"], e["group"], e["phase"])
            for e in events] == [("all_reduce", "bfloat16", [4096], 8192, [1, 3], "backward"),
                                 ("all_gather", "float32", [8], 32, [0, 1, 2, 3], "unknown")]
    assert any("phase unknown" in n for n in notes)


def test_bad_input_exits_2_naming_it(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["import", str(empty), "--out", str(tmp_path / "o")]) == 2
    assert "holds no profiler trace" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "trace_rank0.json").write_text('{"traceEvents": [')
    (bad / "trace_rank1.json").write_text(json.dumps({"traceEvents": []}))
    assert main(["import", str(bad), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert str(bad / "trace_rank0.json") in err and "Traceback" not in err
    assert main(["import", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o3")]) == 2
