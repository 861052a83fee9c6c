"""``paraloom diagnose`` on PyTorch Flight Recorder dumps: raw gloo dumps of hung programs (no
patching by the user) name the culprit and its line; dumps are read in pickle or JSON, with
the default group's ``''``/``'0'`` quirk, completion from ``pg_status``, NCCL's ``send a->b``
names; a folder of no dumps, a truncated dump or a pickle that is not a dump exits 2 naming it.

The hung programs are ``tests/_diagnose_cases.py``'s (4 gloo ranks, three cases at once): every
rank dumps its Flight Recorder buffer after a few seconds, as a watchdog would, and is then
stopped.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _diagnose_cases import CULPRIT, marker

from paraloom.commands import main
from paraloom.diagnose.flight_recorder import event_of, load_any
from paraloom.diagnose.verdict import diagnose

CASES = Path(__file__).with_name("_diagnose_cases.py")
HUNG = ("skip", "order", "condition")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Each hung case run on 4 ranks with Flight Recorder on; the folder of its 4 dumps."""
    root = tmp_path_factory.mktemp("fr")
    procs, folders = [], {}
    for case in HUNG:
        folders[case], port = root / case, _port()
        for rank in range(4):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       TORCH_FR_BUFFER_SIZE="2000", CASE_DUMP_AFTER="4")
            procs.append(subprocess.Popen(
                [sys.executable, str(CASES), case, "--fr", str(folders[case])], env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
    deadline = time.time() + 120
    try:
        while time.time() < deadline and not all(
                len(list(f.glob("fr_*"))) == 4 for f in folders.values()):
            time.sleep(0.5)
        time.sleep(0.5)  # the last file's write
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return folders


@pytest.mark.parametrize("case", HUNG)
def test_raw_gloo_dumps_name_the_culprit(dumps, case, capsys):
    folder = dumps[case]
    assert len(list(folder.glob("fr_*"))) == 4, f"{case}: not every rank dumped"
    d = diagnose(load_any(folder))
    assert d.verdict in ("mismatch", "hang") and d.culprits == [CULPRIT[case]], d.explanation
    line = f"_diagnose_cases.py:{marker(case)} "
    sites = [row.get("site") or "" for row in d.divergence["ranks"].values()]
    assert any(line in s for s in sites) or line in d.explanation, (sites, d.explanation)
    assert main(["diagnose", str(folder), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["culprits"] == [CULPRIT[case]]


def _entry(seq, name="gloo:all_reduce", pg=("0", "default_pg"), sizes=((4,),), dtype="Float",
           state="scheduled", **extra):
    return {"record_id": seq, "pg_id": 0, "process_group": pg, "collective_seq_id": seq,
            "p2p_seq_id": 0, "profiling_name": name, "input_sizes": [list(s) for s in sizes],
            "input_dtypes": [dtype], "state": state, "is_p2p": False,
            "frames": [{"name": "all_reduce", "filename": "/x/torch/distributed/c10d.py",
                        "line": 1}, {"name": "step", "filename": "/job/train.py", "line": 88}],
            **extra}


def _dump(entries, completed=None):
    status = {"0": {"last_enqueued_collective": len(entries), "last_started_collective": -1,
                    "last_completed_collective": completed}} if completed is not None else {}
    return {"version": "2.10", "pg_config": {"": {"name": "", "desc": "", "ranks":
                                                   "[0, 1, 2, 3]"}},
            "pg_status": status, "entries": entries}


def test_entries_read_as_ledger_events():
    """The default group '' in pg_config is the entries' '0'; sizes, dtype, bytes, the frame
    outside torch; completion from pg_status; NCCL's p2p names give the peer."""
    config = _dump([])["pg_config"]
    status = {"0": {"last_completed_collective": 1}}
    e, known = event_of(2, 0, _entry(1, dtype="Double", sizes=((3, 5),)), config, status)
    assert known and "pending" not in e
    assert (e["op"], e["shape"], e["dtype"], e["bytes"], e["group"], e["gseq"], e["site"]) == \
        ("all_reduce", [3, 5], "float64", 120, [0, 1, 2, 3], 0, "/job/train.py:88 step")
    e, known = event_of(2, 1, _entry(2, name="gloo:_allgather_base"), config, status)
    assert known and e["pending"] and e["op"] == "all_gather" and e["kind"] == "world"
    e, known = event_of(2, 2, _entry(3), config, {})
    assert not known and e["pending"]  # gloo without a status: completion unknown
    e, _ = event_of(1, 0, _entry(1, name="nccl:send 1->2", is_p2p=True, state="completed"),
                    config, {})
    assert (e["op"], e["peer"]) == ("send", 2) and "pending" not in e


def test_pickle_and_json_dumps(tmp_path):
    """Two ranks launched a second all_reduce, a third its barrier: a mismatch at #1, found
    the same from pickled and JSON dumps (completion known from pg_status)."""
    for fmt in ("pickle", "json"):
        folder = tmp_path / fmt
        folder.mkdir()
        for rank in range(4):
            second = _entry(2, name="gloo:barrier", sizes=((1,),)) if rank == 3 else _entry(2)
            dump = _dump([_entry(1), second], completed=1)
            name = folder / f"nccl_trace_rank_{rank}{'.json' if fmt == 'json' else ''}"
            name.write_bytes(pickle.dumps(dump) if fmt == "pickle" else
                             json.dumps(dump).encode())
        d = diagnose(load_any(folder))
        assert d.verdict == "mismatch" and d.culprits == [3], (fmt, d.explanation)


def test_bad_input_exits_2_naming_the_file(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["diagnose", str(empty)]) == 2
    assert "holds no ledger and no Flight Recorder dump" in capsys.readouterr().err
    for name, data in (("truncated", pickle.dumps(_dump([_entry(1)]))[:40]),
                       ("not_a_dump", pickle.dumps({"a": 1})), ("text", b"{not json")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "fr_0").write_bytes(data)
        assert main(["diagnose", str(folder)]) == 2
        err = capsys.readouterr().err
        assert str(folder / "fr_0") in err and "Traceback" not in err, err


def test_a_damaged_ledger_exits_2_naming_it(tmp_path, capsys):
    """A run folder whose ledger has a line that is not JSON (other than a last line cut off by
    a killed rank), or no event at all: exit 2 naming the file, not a verdict on nothing."""
    event = {"rank": 0, "seq": 0, "step": 0, "phase": "forward", "kind": "world",
             "op": "all_reduce", "group": [0, 1], "shape": [4], "dtype": "float32", "bytes": 16}
    cut = tmp_path / "cut" / "ledger"
    cut.mkdir(parents=True)
    (cut / "rank_0.jsonl").write_text(json.dumps(event) + "\n" + json.dumps(event)[:20])
    (cut / "rank_1.jsonl").write_text(json.dumps({**event, "rank": 1}) + "\n")
    assert main(["diagnose", str(tmp_path / "cut")]) == 0  # a cut last line is left out
    capsys.readouterr()
    bad = tmp_path / "bad" / "ledger"
    bad.mkdir(parents=True)
    (bad / "rank_0.jsonl").write_text('{"rank": 0, "seq": 0, "op": "all_re\n' + json.dumps(event)
                                      + "\n")
    assert main(["diagnose", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert str(bad / "rank_0.jsonl") in err and "line 1 is not JSON" in err, err
    empty = tmp_path / "empty" / "ledger"
    empty.mkdir(parents=True)
    (empty / "rank_0.jsonl").write_text("")
    assert main(["diagnose", str(tmp_path / "empty")]) == 2
    assert "hold no event" in capsys.readouterr().err


def test_import_turns_dumps_into_a_run_folder(tmp_path, capsys):
    """``paraloom import`` of FR dumps: a ledger that table and diagnose read like a run's."""
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    for rank in range(4):
        second = _entry(2, name="gloo:barrier", sizes=((1,),)) if rank == 3 else _entry(2)
        (dumps / f"fr_{rank}").write_bytes(pickle.dumps(_dump([_entry(1), second], completed=1)))
    out = tmp_path / "run"
    assert main(["import", str(dumps), "--out", str(out)]) == 0
    assert "8 communications from 4 ranks" in capsys.readouterr().out
    assert main(["table", str(out), "--rank", "0", "--step", "1"]) == 0
    assert "train.py:88 step" in capsys.readouterr().out
    assert main(["diagnose", str(out), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["culprits"] == [3]
