"""Megatron-Core's own tensor-parallel MLP under ``paraloom record`` equals paraloom's layers.

``paraloom record --nproc 2 -- tests/_megatron_shim.py`` runs an ordinary torchrun-style program
(it initialises its own gloo process group) that builds megatron-core 0.19.2's
``ColumnParallelLinear(h -> 4h, gather_output=False) -> GeLU -> RowParallelLinear(
input_is_parallel=True)`` through the test-side shim and runs one forward + backward with
sequence parallelism off, then on; each output is checked against plain PyTorch with the full
weights (so the shim runs Megatron's real computation). Then:

* rank 0's communication sequence (phase, op, async, bytes) equals what paraloom's own
  ColumnParallelLinear / RowParallelLinear record for the same block and flags (sp off:
  Megatron's default async all-reduce of the input grad; sp on: async re-gather and
  reduce-scatter), in Megatron's order, and ``paraloom diff`` reports the two ledgers equal;
* ``paraloom explain megatron/core/tensor_parallel/layers.py --run`` marks the backward
  re-gather and reduce-scatter sites with their recorded events and misses none;
* the static reading agrees with the record: ``explain layers.py --preset megatron:tp=2,sp=...``
  (with the block's own settings) lists exactly the recorded communications of
  ``ColumnParallelLinear.forward`` and ``RowParallelLinear.forward`` (op, phase, async; nothing
  invented, nothing missed, nothing left open), sp off and on; the same for paraloom's own
  ``tensor_parallel/layers.py`` with its attributes set as in ``paraloom_case``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch.nn.functional as F
from _megatron_shim import block_inputs
from _megatron_source import megatron_file

from paraloom.commands import main
from paraloom.explain import explain
from paraloom.explain.conditions import parse_settings
from paraloom.explain.presets import expand
from paraloom.explain.run import annotate
from paraloom.report.explain_text import render_run
from paraloom.run_folder import read_json_lines as load

ROOT = Path(__file__).resolve().parents[1]
S, B, H = 8, 2, 16
TP_ORDER = [("forward", "all_reduce", False), ("backward", "all_reduce", True)]
"""sp off: the output all-reduce, then the async all-reduce of fc1's input grad."""
SP_ORDER = [("forward", "all_gather", False), ("forward", "reduce_scatter", False),
            ("backward", "all_gather", False), ("backward", "all_gather", True),
            ("backward", "reduce_scatter", True)]
"""sp on, Megatron-Core's order (DESIGN.md "The ledger")."""


def paraloom_case(sp: bool):
    """paraloom's layers for the same block and flags, one forward + backward, on this rank."""
    import torch.distributed as dist

    from paraloom.ledger import Ledger, recording
    from paraloom.mesh import ParallelMesh
    from paraloom.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    mesh = ParallelMesh(tp=2)
    fc1 = ColumnParallelLinear(H, 4 * H, sequence_parallel=sp, async_grad_allreduce=not sp,
                               mesh=mesh, name="mlp.fc1")
    fc2 = RowParallelLinear(4 * H, H, input_is_parallel=True, sequence_parallel=sp, mesh=mesh,
                            name="mlp.fc2")
    x, dy = block_inputs(S, B, H, sequence_parallel=sp, rank=dist.get_rank())
    led = Ledger(rank=dist.get_rank())
    with recording(led):
        y, _ = fc2(F.gelu(fc1(x)[0]))
        y.backward(dy)
    return led.events


def _seq(events, rank=0):
    return [(e["phase"], e["op"], e["async"], e["bytes"]) for e in events
            if e["rank"] == rank and e["op"] != "compute"]


def _static(path, settings: dict) -> list[tuple]:
    """(op, phase, async) of the two layers' forward under ``settings``, each site decided."""
    facts = explain(str(path), settings=settings)
    mine = [x for x in facts["sites"] if x["function"] == "forward"
            and x["class"] in ("ColumnParallelLinear", "RowParallelLinear")]
    assert all(x["active"] is True and x["open"] == [] for x in mine), mine  # nothing open
    return sorted((x["op"], x["phase"], x["async"]) for x in mine)


def _megatron_settings(sp: bool) -> dict:
    out = expand(f"megatron:tp=2,sp={'on' if sp else 'off'}")
    out.update(parse_settings(["self.gather_output=False", "runtime_gather_output=None",
                               "self.input_is_parallel=True"]))  # the shim's block
    return out


def _paraloom_settings(sp: bool) -> dict:  # paraloom_case's layers
    return {"self.sequence_parallel": sp, "self.async_grad_allreduce": not sp,
            "self.gather_output": False, "self.input_is_parallel": True, "tp": 2,
            "self.mesh.tp.size": 2, "ctx.needs_input_grad[0]": True}


def _record_megatron(out: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    proc = subprocess.run([sys.executable, "-m", "paraloom", "record", "--nproc", "2", "--out",
                           str(out), "--", str(ROOT / "tests" / "_megatron_shim.py"), str(S),
                           str(B), str(H)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.count("megatron-core block ok") == 2, proc.stdout
    return load(out / "ledger.jsonl")


def test_megatron_block_under_paraloom_record(world2, tmp_path, capsys):
    out = tmp_path / "megatron"
    megatron = _record_megatron(out)
    ours = [world2.run(paraloom_case, sp) for sp in (False, True)]  # per setting, per rank
    n_tp = len(TP_ORDER)
    for rank in (0, 1):
        got = _seq(megatron, rank)
        assert [s[:3] for s in got] == TP_ORDER + SP_ORDER, got
        assert got[:n_tp] == _seq(ours[0][rank], rank), (got, _seq(ours[0][rank], rank))
        assert got[n_tp:] == _seq(ours[1][rank], rank), (got, _seq(ours[1][rank], rank))
    assert {(e["kind"], tuple(e["group"])) for e in megatron} == {("tp", (0, 1))}

    # paraloom's ledger of the same program: sp off, then on, numbered as one sequence per rank
    mine = []
    for rank in (0, 1):
        events = [e for part in ours for e in part[rank] if e["op"] != "compute"]
        mine += [dict(e, seq=i) for i, e in enumerate(events)]
    theirs = tmp_path / "paraloom.jsonl"
    theirs.write_text("".join(json.dumps(e) + "\n" for e in mine))
    code = main(["diff", str(out), str(theirs), "--ignore-names"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "rank 0: equal (7 communications)" in text and "rank 1: equal" in text
    assert main(["diff", str(out), str(theirs)]) == 1  # the sites differ: names are compared
    assert main(["diff", str(out), str(theirs), "--ignore-names", "--kinds", "exact"]) == 1
    text = capsys.readouterr().out  # paraloom labels sp calls "sp", Megatron's group is tp's
    assert "changed: A #2-6, B #2-6" in text and "A kind" in text

    layers = str(megatron_file("tensor_parallel/layers.py"))
    facts = explain(layers)
    run = annotate(facts, str(out), rank=0)
    sites = facts["sites"]
    marked = {(sites[m["site"]]["function"], sites[m["site"]]["op"]): m["events"]
              for m in run["sites"]
              if sites[m["site"]]["class"] == "LinearWithGradAccumulationAndAsyncCommunication"}
    want = {("forward", "all_gather"): [("forward", False, 512, n_tp)],
            ("backward", "all_gather"): [("backward", True, 512, n_tp + 3)],  # async re-gather
            ("backward", "reduce_scatter"): [("backward", True, 1024, n_tp + 4)],
            ("backward", "all_reduce"): [("backward", True, 1024, 1)]}  # sp off: input grad
    for key, rows in want.items():
        events = marked.get(key)
        assert [(e["phase"], e["async"], e["bytes"], e["index"]) for e in events or []] == rows, \
            (key, events, [e["site"] for e in megatron if e["rank"] == 0])
    assert run["missed"] == []  # the static reading found every call recorded in layers.py

    # the static reading under the run's settings lists exactly what was recorded
    own = ROOT / "paraloom" / "tensor_parallel" / "layers.py"
    for sp, recorded in ((False, _seq(megatron)[:n_tp]), (True, _seq(megatron)[n_tp:])):
        want = sorted((op, phase, asynchronous) for phase, op, asynchronous, _b in recorded)
        assert _static(layers, _megatron_settings(sp)) == want, sp
        assert _static(own, _paraloom_settings(sp)) == sorted(
            (op, phase, a) for phase, op, a, _b in _seq(ours[sp][0])), sp
    text = render_run(facts, run)
    assert ": reduce_scatter (static: backward, async True) -> recorded: rank 0: 1x " \
           "reduce_scatter backward async 1024 B at #6" in text, text


def fused_cross_entropy_case() -> dict:
    """Megatron-Core's ``fused_vocab_parallel_cross_entropy`` and paraloom's fused cross entropy
    on the same bf16 vocabulary shards of this rank (tp = the 2-rank world), each recorded."""
    import _megatron_shim
    import torch
    import torch.distributed as dist

    from paraloom.ledger import Ledger, recording
    from paraloom.mesh import ParallelMesh
    from paraloom.record import record_comms
    from paraloom.tensor_parallel import vocab_parallel_cross_entropy
    _megatron_shim.install()  # megatron-core imports on CPU (the last test of this world)
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    mesh = ParallelMesh(tp=2, dp=1)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 2, 32, generator=g) * 3
    target = torch.randint(0, 32, (8, 2), generator=g)
    out = {}
    for name in ("megatron", "paraloom"):
        x = logits.chunk(2, -1)[dist.get_rank()].clone().bfloat16().requires_grad_()
        if name == "megatron":  # recorded from outside, as paraloom record does
            with record_comms() as recorded:
                loss = fused_vocab_parallel_cross_entropy(x, target, dist.group.WORLD)
            events = recorded.events
        else:  # paraloom's own ledger (its comm waits with a time-out: async under record)
            led = Ledger(rank=dist.get_rank())
            with recording(led):
                loss = vocab_parallel_cross_entropy(x, target, mesh.tp, fused=True)
            events = led.events
        (loss * torch.arange(16.0).view(8, 2)).sum().backward()
        out[name] = (loss.detach(), x.grad, [(e["op"], e["async"], e["shape"], e["dtype"],
                                              e["group"]) for e in events])
    # compared here: a tensor pickled where megatron.core is imported needs it to unpickle
    (m_loss, m_grad, m_events), (p_loss, p_grad, p_events) = out["megatron"], out["paraloom"]
    return {"events": (m_events, p_events), "loss": m_loss.equal(p_loss),
            "grad": m_grad.equal(p_grad), "dtypes": (str(m_grad.dtype), str(p_grad.dtype))}


def test_fused_cross_entropy_records_as_megatron_cores(world2):
    """``--cross-entropy-loss-fusion``: megatron-core 0.19.2's native fused cross entropy run on
    CPU communicates exactly as paraloom's (the max, then one all-reduce of the target logits
    and exponential sums, ``[2s, b]`` fp32), with the same loss and bf16 gradient, bitwise."""
    for got in world2.run(fused_cross_entropy_case):
        megatron, paraloom = got["events"]
        assert megatron == paraloom == [("all_reduce", False, [8, 2], "float32", [0, 1]),
                                        ("all_reduce", False, [16, 2], "float32", [0, 1])]
        assert got["loss"] and got["grad"] and got["dtypes"] == ("torch.bfloat16",) * 2
