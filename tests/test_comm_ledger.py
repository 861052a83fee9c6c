"""comm.py's collectives (values, dims, async, size-1 bypass) and the ledger they write."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from paraloom import comm, ledger
from paraloom.ledger import FIELDS, Ledger, merge, recording
from paraloom.mesh import Axis, ParallelMesh
from paraloom.run_folder import read_json_lines as load

KW = dict(phase="forward", kind="tp", site="test")


def collectives():
    mesh = ParallelMesh(tp=4)
    r = mesh.tp.rank
    led = Ledger(rank=dist.get_rank())
    out = {}
    with recording(led), led.at(step=3, microbatch=1):
        x = torch.full((2, 3), float(r))
        out["sum"] = comm.all_reduce(x.clone(), mesh.tp, **KW)
        out["max"] = comm.all_reduce(x.clone(), mesh.tp, op="max", **KW)
        out["ag0"] = comm.all_gather(torch.full((1, 2), float(r)), mesh.tp, **KW)
        out["ag1"] = comm.all_gather(torch.full((2, 1), float(r)), mesh.tp, dim=1, **KW)
        full = torch.arange(8.0).view(2, 4) * (r + 1)   # reduce-scatter on the last dim
        out["rs1"] = comm.reduce_scatter(full, mesh.tp, dim=1, **KW)
        out["rs0"] = comm.reduce_scatter(torch.ones(8, 2), mesh.tp, **KW)
        handle = comm.all_reduce(torch.ones(3), mesh.tp, async_op=True, **KW)
        out["async"] = handle.wait()
        out["bcast"] = comm.broadcast(torch.full((2,), float(r)), mesh.tp, src=2, **KW)
        peer = (dist.get_rank() + 1) % 4, (dist.get_rank() - 1) % 4
        recv = torch.empty(2)
        comm.batch_p2p([("send", torch.full((2,), float(r)), peer[0]), ("recv", recv, peer[1])],
                       mesh.tp, phase="forward", kind="pp", site="ring")
        out["p2p"] = recv
        single = Axis("tp", (dist.get_rank(),), 0)
        y = torch.ones(2)
        assert comm.all_reduce(y, single, **KW) is y  # size 1: no call
        assert comm.all_gather(y, single, **KW) is y
    out["events"] = led.events
    return out


def test_collectives_values_and_records(world4):
    res = world4.run(collectives)
    for r, o in enumerate(res):
        assert torch.equal(o["sum"], torch.full((2, 3), 6.0))
        assert torch.equal(o["max"], torch.full((2, 3), 3.0))
        assert torch.equal(o["ag0"], torch.arange(4.0).repeat_interleave(2).view(4, 2))
        assert torch.equal(o["ag1"], torch.arange(4.0).repeat(2, 1))
        assert torch.equal(o["rs1"], (torch.arange(8.0).view(2, 4) * 10)[:, r:r + 1])
        assert torch.equal(o["rs0"], torch.full((2, 2), 4.0))
        assert torch.equal(o["async"], torch.full((3,), 4.0))
        assert torch.equal(o["bcast"], torch.full((2,), 2.0))
        assert torch.equal(o["p2p"], torch.full((2,), float((r - 1) % 4)))
    events = res[1]["events"]
    ops = [e["op"] for e in events]
    assert ops == ["all_reduce", "all_reduce", "all_gather", "all_gather", "reduce_scatter",
                   "reduce_scatter", "all_reduce", "broadcast", "send", "recv"]  # size-1: none
    e = events[0]
    assert list(e)[:len(FIELDS)] == list(FIELDS)
    assert (e["rank"], e["step"], e["microbatch"], e["group"]) == (1, 3, 1, [0, 1, 2, 3])
    assert e["bytes"] == 2 * 3 * 4 and e["shape"] == [2, 3] and e["dtype"] == "float32"
    assert events[2]["bytes"] == 1 * 2 * 4      # all-gather: the local shard
    assert events[4]["bytes"] == 2 * 4 * 4      # reduce-scatter: the full local input
    assert events[6]["async"] and events[6]["t_start"] <= events[6]["t_wait"] <= events[6]["t_end"]
    assert [e["peer"] for e in events[8:]] == [2, 0]
    assert [e["seq"] for e in events] == list(range(len(events)))


def test_nothing_is_recorded_without_an_active_ledger():
    assert ledger.active() is None
    with ledger.span("x", phase="forward") as event:
        assert event is None
    led = Ledger()
    with recording(led):
        assert ledger.active() is led
        with ledger.span("gemm", phase="backward", module="m"):
            pass
    assert ledger.active() is None
    assert [(e["op"], e["site"], e["phase"]) for e in led.events] == [
        ("compute", "gemm", "backward")]


def test_dump_load_merge_roundtrip(tmp_path):
    a, b = Ledger(rank=1), Ledger(rank=0)
    for led in (a, b):
        led.record(op="all_reduce", phase="forward", kind="tp", site="s", tensor=torch.ones(4))
        led.record(op="send", phase="forward", kind="pp", site="p", nbytes=8, peer=1)
    a.dump(tmp_path / "a.jsonl")
    b.dump(tmp_path / "b.jsonl")
    merged = merge([load(tmp_path / "a.jsonl"), load(tmp_path / "b.jsonl")])
    assert [(e["rank"], e["seq"]) for e in merged] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert merged[0]["bytes"] == 16 and merged[1]["peer"] == 1
    line = (tmp_path / "a.jsonl").read_text().splitlines()[0]
    assert json.loads(line)["kind"] == "tp"


def bad_reduce_scatter():
    mesh = ParallelMesh(tp=4)
    with pytest.raises(ValueError,
                       match=r"dim 0 of shape \[6\] is not divisible by the group size 4"):
        comm.reduce_scatter(torch.ones(6), mesh.tp, **KW)
    return True


def test_bad_shapes_are_named(world4):
    assert all(world4.run(bad_reduce_scatter))
    with pytest.raises(ValueError, match="timeout must be positive"):
        comm.set_timeout(0)


class _DeviceClock:
    """A stand-in for a GPU stream: ``record`` enqueues at the device's time, which runs
    ``lag`` seconds behind the host (queued kernels), and ``synchronize`` is counted."""

    lag = 0.0
    now = 0.0
    syncs = 0

    def __init__(self) -> None:
        self.at = None

    def record(self) -> None:
        self.at = _DeviceClock.now + _DeviceClock.lag

    def synchronize(self) -> None:
        _DeviceClock.syncs += 1

    def elapsed_time(self, end: _DeviceClock) -> float:  # ms, like torch.cuda.Event
        return (end.at - self.at) * 1e3


def test_cuda_event_stamps_resolve_to_device_times(tmp_path):
    """With an event type (CUDA), every t_start/t_wait/t_end is an event on the stream, turned
    into anchor time + device elapsed time when the ledger is dumped: the recorded times are when
    the device got there, not when the host enqueued the work."""
    _DeviceClock.now, _DeviceClock.lag = 0.0, 0.0
    led = Ledger(rank=0, t0=0.0, event_type=_DeviceClock)
    anchor_host = led._anchor[1]
    with recording(led):
        _DeviceClock.now, _DeviceClock.lag = 1.0, 0.25  # the host runs ahead of the device
        with ledger.span("gemm", phase="forward"):
            _DeviceClock.now = 1.5
        event = led.record(op="all_reduce", phase="backward", kind="dp", site="s", nbytes=4)
        _DeviceClock.now = 2.0
        event["t_wait"] = led.stamp()
        _DeviceClock.now = 3.0
        event["t_end"] = led.stamp()
    assert not isinstance(led.events[0]["t_start"], float)  # unresolved until the step is done
    led.dump(tmp_path / "l.jsonl")
    span, comm_event = load(tmp_path / "l.jsonl")
    assert span["t_start"] == pytest.approx(anchor_host + 1.25)
    assert span["t_end"] == pytest.approx(anchor_host + 1.75)
    assert (comm_event["t_start"], comm_event["t_wait"], comm_event["t_end"]) == pytest.approx(
        (anchor_host + 1.75, anchor_host + 2.25, anchor_host + 3.25))
    assert _DeviceClock.syncs >= 5  # each event waited for (not the device as a whole)


def test_record_on_cuda_stamps_device_times_from_the_first_cuda_collective(tmp_path,
                                                                         monkeypatch):
    """``paraloom record``'s recorder: host seconds until the program's first collective on a
    CUDA tensor, then CUDA events on the stream (the fake device clock here), written
    provisionally with host times and rewritten at the step boundary as anchor + device time;
    no event says ``"clock": "host"`` any more."""
    from paraloom.record import recorder as rec_module
    from paraloom.record.recorder import Recorder
    _DeviceClock.now, _DeviceClock.lag = 0.0, 0.0
    led = Ledger(rank=0, t0=0.0)
    path = tmp_path / "rank_0.jsonl"
    sink = Recorder(led, steps=None, compute=False, path=path)
    cpu = led.record(op="all_reduce", phase="forward", kind="dp", site="a.py:1", nbytes=4)
    assert isinstance(cpu["t_start"], float)  # before any CUDA collective: the wall clock

    class _Cuda:  # what the recorder reads of a CUDA tensor
        is_cuda, device = True, "cuda:0"
    monkeypatch.setattr(rec_module, "timing_event_type", lambda device: _DeviceClock)
    sink._device_clock(_Cuda.device)
    anchor_host = led._anchor[1]
    _DeviceClock.now, _DeviceClock.lag = 1.0, 0.25  # the host runs ahead of the device
    event = led.record(op="all_reduce", phase="backward", kind="dp", site="a.py:2", nbytes=8)
    sink.file.launched(event, False)  # as launch() writes it: host time for a CUDA stamp
    provisional = load(path)  # a.py:1 was recorded without a launch: it has no such line
    assert [e["site"] for e in provisional] == ["a.py:2"]
    assert isinstance(provisional[0]["t_start"], float)
    _DeviceClock.now = 2.0
    event["t_wait"] = sink.now()
    _DeviceClock.now = 3.0
    event["t_end"] = sink.now()
    assert not isinstance(event["t_end"], float)
    sink.flush()
    lines = load(path)
    assert [e["site"] for e in lines] == ["a.py:1", "a.py:2"] and "clock" not in lines[1]
    assert (lines[1]["t_start"], lines[1]["t_wait"], lines[1]["t_end"]) == pytest.approx(
        (anchor_host + 1.25, anchor_host + 2.25, anchor_host + 3.25))
    sink.close()
    assert all(isinstance(e[k], float) for e in led.events for k in ("t_start", "t_end"))


def test_record_ledger_file_writes_new_operations_at_launch_and_repeats_from_its_thread(
        tmp_path):
    """``record_comms(out=...)``'s file: an operation not seen before gets its provisional line
    before it starts (a rank aborted inside it keeps it), a repeat (same site, op, bytes, dtype,
    group, phase) only when the writer looks a second time with it still unflushed (its thread
    looks every 0.1 s: steps shorter than that never encode a repeat twice), an all-to-all with
    splits always at once; a flush writes the final lines over all of them."""
    from paraloom.record.ledger_file import LedgerFile
    led = Ledger(rank=0, t0=0.0)
    path = tmp_path / "rank_0.jsonl"
    f = LedgerFile(led, path)

    def launch(site, nbytes=8, extra=None):
        event = led.record(op="all_reduce", phase="backward", kind="dp", site=site,
                           nbytes=nbytes, pg="0", **(extra or {}))
        f.launched(event, extra is not None)
        return event
    launch("a.py:1")
    launch("a.py:2")
    assert [e["site"] for e in load(path)] == ["a.py:1", "a.py:2"]
    assert all(e["pending"] for e in load(path))
    f.flush()  # a step ends
    again = launch("a.py:1")  # the next step: repeats, then one of another size, and splits
    launch("a.py:2")
    launch("a.py:2", nbytes=16)
    launch("a.py:3", extra={"input_splits": [1, 1]})
    launch("a.py:3", extra={"input_splits": [2, 0]})
    assert [(e["site"], e["bytes"]) for e in load(path)] == [
        ("a.py:1", 8), ("a.py:2", 8), ("a.py:2", 16), ("a.py:3", 8), ("a.py:3", 8)]
    led.completed(again)
    f.write_provisional()  # what the writer thread does: a first look only marks them
    assert [(e["site"], e["bytes"]) for e in load(path)] == [
        ("a.py:1", 8), ("a.py:2", 8), ("a.py:2", 16), ("a.py:3", 8), ("a.py:3", 8)]
    f.write_provisional()  # the next look: still not flushed, so written now
    lines = load(path)
    assert [e["seq"] for e in lines] == [0, 1, 4, 5, 6, 2, 3]  # the repeats after, by seq
    assert "pending" not in lines[5] and lines[6]["pending"]
    f.flush()
    assert [e["seq"] for e in load(path)] == list(range(7))
    f.write_provisional()
    launch("a.py:1")  # a repeat launched after a look and flushed before the next one
    f.flush()
    encoded = []
    f._line = lambda event: encoded.append(event["seq"]) or "{}"
    f.write_provisional()
    assert encoded == [] and [e["seq"] for e in load(path)] == list(range(8))
    f.close()


def test_record_ledger_file_lock_is_fresh_in_a_forked_child(tmp_path):
    """A program that forks while the writer thread holds the file's lock: the child does not
    wait for a lock no thread of its own will ever release."""
    import os
    import signal
    import threading
    import time

    from paraloom.record.ledger_file import LedgerFile
    f = LedgerFile(Ledger(rank=0, t0=0.0), tmp_path / "rank_0.jsonl").start()
    held, fork_done = threading.Event(), threading.Event()

    def writer() -> None:  # as the writer thread, in the middle of a write
        with f._lock:
            held.set()
            fork_done.wait(10)
    thread = threading.Thread(target=writer)
    thread.start()
    held.wait(10)
    pid = os.fork()
    if pid == 0:
        with f._lock:
            os._exit(0)
    fork_done.set()
    thread.join()
    deadline = time.monotonic() + 10
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    f.close()
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0
