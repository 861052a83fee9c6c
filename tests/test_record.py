"""``paraloom record`` on unmodified programs: torch DDP, FSDP2, DTensor, pipelining, failures.

One 2-rank run of one program (recorded with --compute) exercises DDP's C++ reducer, FSDP2's
``c10d::_allgather_base_`` / ``_reduce_scatter_base_``, DTensor's functional collectives and
pipelining's send/recv, each in its own function (an event's ``site`` names it). Expected counts
and bytes come from the models and DDP's own buckets, never from a record. Small runs, started
at the same time, check failures (raise, SIGKILL, exit 3 with --steps), no process group and
joining a torchrun world.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from paraloom.ledger import Ledger
from paraloom.run_folder import read_json_lines as load

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = textwrap.dedent('''
    import json, sys
    import torch, torch.distributed as dist
    from torch import nn

    FACTS = {}

    def ddp_part():
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        ddp = DDP(model, bucket_cap_mb=0.005)  # 5242 bytes: each Linear is one bucket
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for _ in range(2):  # DDP's first step uses one bucket; from the second on, the cap
            ddp(torch.randn(4, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
        FACTS["ddp_buckets"] = [b.buffer().numel() * b.buffer().element_size()
                                for b in ddp.reducer._get_zeros_like_grad_buckets()]
        FACTS["ddp_params"] = [[p.numel() * 4 for p in m.parameters()]
                               for m in (model[2], model[0])]

    def fsdp_part():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        FACTS["fsdp_layer_bytes"] = [sum(p.numel() * 4 for p in m.parameters()) for m in model]
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(4, 16)).sum().backward()
        opt.step()

    def dtensor_part():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
        x = torch.randn(4, 8, requires_grad=True)
        mlp(x).sum().backward()
        opt.step()

    def pipeline_part():
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        rank = dist.get_rank()
        stage = PipelineStage(nn.Linear(16, 16), rank, 2, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=4,
                                loss_fn=lambda out, target: ((out - target) ** 2).mean())
        x, target = torch.randn(8, 16), torch.randn(8, 16)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=target)

    dist.init_process_group("gloo")
    ddp_part()
    fsdp_part()
    dtensor_part()
    pipeline_part()
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(FACTS, f)
    dist.destroy_process_group()
''')


FAILING = '''
    import os, signal, sys, time
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    how = sys.argv[1]
    if how == "mesh":  # the group made by init_device_mesh (which never calls the patched name)
        dist.all_reduce(torch.ones(4), group=init_device_mesh("cpu", (2,)).get_group())
        sys.exit(0)
    dist.init_process_group("gloo")
    t = torch.ones(4)
    dist.all_reduce(t)
    if how in ("exit", "marked"):  # recorded with --steps 2 --compute: not the third step
        import paraloom.record
        p = torch.nn.Parameter(torch.ones(2))
        layer = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD([p], lr=0.1)
        for _ in range(3):
            if how == "marked":
                paraloom.record.mark_step()
            dist.all_reduce(t)
            layer(p).sum().backward()
            opt.step()
        sys.exit(3)
    if how == "inference":  # invisible to the recorder: counted, said, not in the ledger
        with torch.inference_mode():
            dist.all_reduce(torch.ones(4))
            dist.all_reduce(torch.ones(4))
        with torch.no_grad():
            dist.all_reduce(t)
        sys.exit(0)
    if how == "fine":
        time.sleep(2 * dist.get_rank())  # rank 0 ends first and must wait for rank 1's status
        sys.exit(0)
    if dist.get_rank() == 1:
        if how == "raise":
            raise ValueError("rank one is broken")
        if how == "quit":  # its own exit code, while rank 0 only sees its peer go away
            sys.exit(3)
        if how == "hang":
            time.sleep(600)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(t)  # rank 0 waits for a peer that is gone: the launcher stops it
'''

NO_GROUP = '''
    import multiprocessing
    print("no distributed here")
    if __name__ == "__main__":  # a worker of its own, which the record cannot see
        child = multiprocessing.get_context("fork").Process(target=print, args=("worker",))
        child.start()
        child.join()
'''


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(tmp: Path, program: str, *args: str, nproc: int = 2, name: str = "rec",
           options: tuple = (), torchrun: bool = False):
    """Start ``paraloom record`` on ``program`` (not waited: the module's runs overlap); with
    ``torchrun``, under ``torchrun --nproc-per-node 2`` (no --nproc: each rank joins)."""
    script = tmp / f"{name}.py"
    script.write_text(textwrap.dedent(program))
    out = tmp / name
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                str(_free_port())] if torchrun else []
    cmd = [sys.executable, *launcher, "-m", "paraloom", "record",
           *([] if torchrun else ["--nproc", str(nproc)]), "--out", str(out), *options, "--",
           str(script), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp, start_new_session=True)
    return proc, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every recorded run of this module, started together: name -> (code, stderr, out)."""
    tmp = tmp_path_factory.mktemp("record")
    old = tmp / "joined" / "ledger"  # an older 4-rank record in the joined run's folder
    old.mkdir(parents=True)
    for rank in range(4):
        (old / f"rank_{rank}.jsonl").write_text(json.dumps(Ledger(rank=rank).record(
            op="broadcast", phase="other", kind="dp", site="old.py:1", nbytes=4,
            group=[0, 1, 2, 3])) + "\n")
        (old / f"rank_{rank}.status.json").write_text(json.dumps(
            {"rank": rank, "exit": 5, "error": None, "init": True, "time": 0.0}))
    started = {"main": _start(tmp, PROGRAM, str(tmp / "facts.json"), options=("--compute",)),
               "raise": _start(tmp, FAILING, "raise", name="raise"),
               "kill": _start(tmp, FAILING, "kill", name="kill"),
               "exit": _start(tmp, FAILING, "exit", nproc=1, name="exit",
                              options=("--steps", "2", "--compute")),
               "marked": _start(tmp, FAILING, "marked", nproc=1, name="marked",
                                options=("--steps", "2")),
               "quit": _start(tmp, FAILING, "quit", name="quit"),
               # eleven records start at once on 2 cores: the hang gets time to reach its hang
               "hang": _start(tmp, FAILING, "hang", name="hang", options=("--timeout", "60")),
               "mesh": _start(tmp, FAILING, "mesh", name="mesh"),
               "inference": _start(tmp, FAILING, "inference", name="inference"),
               "torchrun": _start(tmp, FAILING, "fine", name="joined", torchrun=True),
               "plain": _start(tmp, NO_GROUP, nproc=1, name="plain")}
    done, stdout = {}, {}
    try:
        for name, (proc, out) in started.items():
            stdout[name], err = proc.communicate(timeout=180)
            done[name] = (proc.returncode, err, out)
    finally:
        for proc, _ in started.values():  # a run that timed out: its ranks too
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    done["facts"] = tmp / "facts.json"
    done["stdout"] = stdout
    return done


@pytest.fixture(scope="module")
def run(runs):
    code, err, out = runs["main"]
    assert code == 0, err
    return load(out / "ledger.jsonl"), json.loads(runs["facts"].read_text()), out


def _part(events, name, rank=0, step=None):
    chosen = [e for e in events if e["rank"] == rank and e["site"].endswith(" " + name)]
    return [e for e in chosen if step is None or e["step"] == step]


def test_ddp_bucket_all_reduces_in_backward(run):
    events, facts, _ = run
    part = _part(events, "ddp_part")
    assert part, "no DDP event recorded"
    second = [e for e in part if e["step"] == 2 and e["phase"] == "backward"]
    buckets = facts["ddp_buckets"]
    assert len(buckets) >= 2
    assert [e["op"] for e in second] == ["all_reduce"] * len(buckets)
    assert all(e["async"] for e in second)
    assert [e["bytes"] for e in second] == buckets
    assert buckets == [sum(sizes) for sizes in facts["ddp_params"]]  # last layer first
    assert all(e["group"] == [0, 1] and e["kind"] == "world" for e in second)  # the default
    assert all(e.get("param_grad") for e in second)  # fired by the gradients' hooks
    first = [e for e in part if e["step"] == 1 and e["phase"] == "backward"]
    assert [e["bytes"] for e in first] == [sum(buckets)]  # DDP's first step: one bucket
    assert all(e["t_start"] <= e["t_end"] for e in part)


def test_fsdp2_gathers_and_reduce_scatters(run):
    events, facts, _ = run
    part = [e for e in _part(events, "fsdp_part") if e["op"] in ("all_gather",
                                                                 "reduce_scatter")]
    layers = facts["fsdp_layer_bytes"]
    forward = [e for e in part if e["phase"] == "forward"]
    backward = [e for e in part if e["phase"] == "backward"]
    assert [e["op"] for e in forward] == ["all_gather"] * len(layers)
    assert [e["bytes"] for e in forward] == [b // 2 for b in layers]  # this rank's flat shard
    gathers = [e for e in backward if e["op"] == "all_gather"]
    scatters = [e for e in backward if e["op"] == "reduce_scatter"]
    assert sorted(e["bytes"] for e in gathers) == sorted(b // 2 for b in layers)  # re-gathers
    assert sorted(e["bytes"] for e in scatters) == sorted(layers)  # full grads reduced
    assert backward.index(scatters[0]) > backward.index(gathers[0])
    assert {e["kind"] for e in part} == {"dp"}  # the DeviceMesh's dimension name


def test_dtensor_mlp_all_reduces_forward_and_backward(run):
    events, _, _ = run
    part = [e for e in _part(events, "dtensor_part") if e["phase"] in ("forward", "backward")]
    assert [(e["phase"], e["op"]) for e in part] == [("forward", "all_reduce"),
                                                     ("backward", "all_reduce")]
    assert all(e["async"] and e["bytes"] == 4 * 8 * 4 and e["kind"] == "tp" for e in part)
    assert part[0]["module"] == "Sequential" or part[0]["module"].startswith("2")
    assert part[0]["t_end"] > part[0]["t_start"]  # the functional wait was observed


def test_pipeline_only_send_recv_with_the_right_peers(run):
    events, _, _ = run
    for rank, peer in ((0, 1), (1, 0)):
        part = _part(events, "pipeline_part", rank=rank)
        assert part and {e["op"] for e in part} <= {"send", "recv"}, part
        assert {e["peer"] for e in part} == {peer}
        # after the stages' shape exchange (phase "other"), the 4 microbatches' activations
        # [2, 16] go 0 -> 1 (phase forward) and their gradients 1 -> 0 (backward): pipelining
        # posts them outside module calls and autograd; the stage method that made each op
        # tells which it is
        data = [e for e in part if e["shape"] == [2, 16]]
        assert [e["bytes"] for e in data] == [2 * 16 * 4] * 8
        sends = [e for e in data if e["op"] == "send"]
        assert len(sends) == 4 and all(e["async"] for e in data)
        first = "send" if rank == 0 else "recv"
        assert data[0]["op"] == first
        forward = "send" if rank == 0 else "recv"
        assert [(e["op"], e["phase"]) for e in data if e["op"] == forward] == \
            [(forward, "forward")] * 4
        assert {e["phase"] for e in data if e["op"] != forward} == {"backward"}
        assert {e["phase"] for e in part if e not in data} == {"other"}


def test_ranks_merged_and_reports_work_on_the_folder(run):
    events, _, out = run
    assert {e["rank"] for e in events} == {0, 1}
    assert [(e["rank"], e["seq"]) for e in events] == sorted((e["rank"], e["seq"])
                                                             for e in events)
    comms = [e for e in events if e["op"] != "compute"]
    assert all(e["step"] >= 0 and e["microbatch"] == 0 and e["split"] is None for e in comms)
    spans = [e for e in events if e["op"] == "compute"]  # --compute: leaf modules, pipeline
    assert {"Linear.forward", "Linear.backward", "pipeline.forward", "pipeline.backward"} <= \
        {e["site"] for e in spans}
    assert all(e["t_start"] <= e["t_end"] for e in spans)
    table = (out / "comm_table.md").read_text()
    assert "| # | Parallel type |" in table and "并行类型" in table
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for cmd in (["table", str(out), "--step", "1"], ["trace", str(out)],
                ["schedule", str(out), "--out", str(out / "sched.png")]):
        proc = subprocess.run([sys.executable, "-m", "paraloom", *cmd], capture_output=True,
                              text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "trace.json").read_text())["traceEvents"]




@pytest.mark.parametrize("how, code, says", [
    ("raise", 1, "rank 1 exited with code 1 (ValueError: rank one is broken)"),
    ("kill", 128 + 9, "rank 1 was killed by SIGKILL"),
    ("exit", 3, "rank 0 exited with code 3"),
    ("quit", 3, "rank 1 exited with code 3;"),
    ("hang", 124, "the run was stopped after --timeout 60 s; ranks 0-1 still running got "
                  "SIGTERM"),
])
def test_failing_program_keeps_partial_ledger(runs, how, code, says):
    returncode, err, out = runs[how]
    assert returncode == code, err
    assert says in err and str(out) in err
    events = load(out / "ledger.jsonl")
    last = max(e["rank"] for e in events)
    assert [e["op"] for e in events if e["rank"] == last][:1] == ["all_reduce"]
    if how == "kill":  # no step ended, no Python ran at its death: the line written at launch
        assert [e["op"] for e in events if e["rank"] == 1] == ["all_reduce"]


def test_steps_stops_recording_and_torchrun_join(runs):
    _, _, out = runs["exit"]
    events = load(out / "ledger.jsonl")
    # an iteration runs from a forward to the next forward: what the loop communicates before
    # its first forward is setup, and later the collective before each forward belongs to the
    # step before it (the rule of paraloom.record.tracking); steps count from 1 (set-up is step
    # 0), and --steps 2 stops recording when step 3 begins
    assert [(e["op"], e["step"], e["phase"]) for e in events if e["op"] != "compute"] == \
        [("all_reduce", 0, "setup")] * 2 + [("all_reduce", 1, "other"),
                                            ("all_reduce", 2, "other")]
    # the same loop marking its iterations (paraloom.record.mark_step): each its own step
    code, err, marked = runs["marked"]
    assert code == 3, err
    assert [(e["step"], e["phase"]) for e in load(marked / "ledger.jsonl")] == \
        [(0, "setup"), (1, "other"), (2, "other")]
    spans = [e for e in events if e["op"] == "compute"]  # --compute: none from step 3 on
    assert spans and {e["step"] for e in spans} == {1, 2}, spans
    code, err, out = runs["torchrun"]
    assert code == 0, err  # not the older record's rank 1 status (exit 5)
    events = load(out / "ledger.jsonl")  # merged by rank 0 from both ranks' files, only
    assert [(e["rank"], e["op"]) for e in events] == [(0, "all_reduce"), (1, "all_reduce")]
    assert (out / "comm_table.md").is_file() and (out / "trace.json").is_file()
    # rank 0 says what it merged, as a local record does (the other rank prints nothing)
    assert runs["stdout"]["torchrun"].count(f"paraloom record: 2 events from 2 ranks -> {out}") \
        == 1, runs["stdout"]["torchrun"]


def test_joined_rank0_names_the_ranks_whose_files_never_came(tmp_path, monkeypatch, capsys):
    """Rank 0 of a torchrun-joined record on two nodes with their own --out: the other node's
    ranks never show up in its folder. It waits (bounded), merges what is there, and says which
    ranks are missing and why, instead of blaming them for exit code 1."""
    from paraloom.commands import record as command
    from paraloom.record import bootstrap, launcher

    def program(out, steps, compute, target, **_kw):  # rank 0's own recorded run: one event
        (tmp_path / "rec" / "ledger").mkdir(parents=True, exist_ok=True)
        event = Ledger(rank=0).record(op="all_reduce", phase="other", kind="dp",
                                      site="x.py:1", nbytes=64, group=[0, 1, 2, 3])
        (tmp_path / "rec" / "ledger" / "rank_0.jsonl").write_text(json.dumps(event) + "\n")
        (tmp_path / "rec" / "ledger" / "rank_0.status.json").write_text(json.dumps(
            {"rank": 0, "exit": 0, "error": None, "init": True, "time": 0.0}))
        return 0
    monkeypatch.setattr(bootstrap, "run_program", program)
    monkeypatch.setattr(launcher, "JOIN_WAIT_S", 0.3)
    from paraloom import launch
    monkeypatch.setattr(launch, "_WORLD_ENDED", False)  # restored: _join marks the end
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert command.main(["--out", str(tmp_path / "rec"), "--", __file__]) == 0
    out, err = capsys.readouterr()
    assert "3 of 4 ranks (1-3) left no status" in err and "every node shares" in err
    assert "exited with code" not in err
    assert "1 events from 1 ranks" in out
    assert len(load(tmp_path / "rec" / "ledger.jsonl")) == 1


def test_program_without_process_group(runs):
    code, err, _ = runs["plain"]
    assert code == 2
    assert "never created a torch.distributed process group" in err
    assert "started processes of its own" in err and "--nproc N" in err


def test_group_from_init_device_mesh_is_recorded(runs):
    code, err, out = runs["mesh"]
    assert code == 0, err
    events = load(out / "ledger.jsonl")
    assert [(e["rank"], e["op"]) for e in events] == [(0, "all_reduce"), (1, "all_reduce")]


def test_collectives_in_inference_mode_are_said_not_recorded(runs):
    code, err, out = runs["inference"]
    assert code == 0, err
    assert "called collectives inside torch.inference_mode (rank 0: all_reduce x2 at " \
        "inference.py:" in err and "so they are not in the ledger" in err, err
    status = json.loads((out / "ledger" / "rank_1.status.json").read_text())
    assert status["unrecorded"]["all_reduce"]["count"] == 2 and "not_covered" in status
    events = load(out / "ledger.jsonl")
    assert [(e["rank"], e["op"]) for e in events] == [(0, "all_reduce")] * 2 + [
        (1, "all_reduce")] * 2  # before, and under no_grad


def test_bad_arguments_are_named(tmp_path, capsys):
    from paraloom.commands.record import main as record_main
    assert record_main(["--nproc", "2", "--", str(tmp_path / "missing.py")]) == 2
    assert record_main(["--nproc", "0", "--", __file__]) == 2
    assert record_main(["--nproc", "2"]) == 2
    capsys.readouterr()
    (tmp_path / "afile").write_text("")
    for options, says in (
            (["--out", str(tmp_path / "afile")], "exists and is not a folder"),
            (["--out", "/proc/nope"], "'/proc/nope' cannot be created"),
            (["--timeout", "0"], "--timeout must be a positive number of seconds, got 0"),
            (["--timeout", "-5"], "got -5"), (["--timeout", "nan"], "got nan")):
        assert record_main(["--nproc", "2", *options, "--", __file__]) == 2, options
        assert says in capsys.readouterr().err
    assert not (tmp_path / "afile").is_dir()


def test_megatron_hierarchical_cp_levels_are_kind_cp(monkeypatch):
    """Megatron's hierarchical context-parallel groups (``--hierarchical-context-parallel-sizes``,
    a list of one group per level) are recorded as kind ``cp``, as paraloom's own levels are."""
    import sys
    import types

    from paraloom.record.kinds import KindResolver

    class Group:
        def __init__(self, name):
            self.group_name = name
    ps = types.ModuleType("megatron.core.parallel_state")
    ps.model_parallel_is_initialized = lambda: True
    ps.get_hierarchical_context_parallel_groups = \
        lambda check_initialized=True: [Group("L0"), Group("L1")]
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", ps)
    kinds = KindResolver()
    assert kinds.kind("L0", "", [0, 1]) == kinds.kind("L1", "", [0, 2]) == "cp"
    assert kinds.kind("other", "", [0, 3]) == "group[0,3]"
