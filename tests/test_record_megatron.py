"""Megatron-Core's own tensor-parallel MLP under the recorder equals paraloom's layers' ledger.

megatron-core 0.19.2's ``ColumnParallelLinear(h -> 4h, gather_output=False) -> GeLU ->
RowParallelLinear(input_is_parallel=True)`` runs on 2 gloo CPU ranks through the test-side
shim (tests/_megatron_shim.py), one forward + backward under ``paraloom.record.record_comms``,
sequence parallelism off and on. Its outputs equal a single-process reference (so the shim runs
Megatron's real computation), rank 0's communication sequence (phase, op, async, bytes) equals
what paraloom's ColumnParallelLinear/RowParallelLinear record for the same block, ``paraloom
diff`` reports the two ledgers equal, and ``paraloom explain layers.py --run`` marks Megatron's
backward re-gather and reduce-scatter sites with the recorded events.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from _megatron_source import megatron_file

from paraloom.cli import main
from paraloom.explain import explain
from paraloom.explain.run import annotate, render_run

S, B, H = 8, 2, 16
SP_ORDER = [("forward", "all_gather", False), ("forward", "reduce_scatter", False),
            ("backward", "all_gather", False), ("backward", "all_gather", True),
            ("backward", "reduce_scatter", True)]
"""Megatron-Core's order with sequence parallelism (DESIGN.md "The ledger")."""
TP_ORDER = [("forward", "all_reduce", False), ("backward", "all_reduce", True)]
"""Without it: the output all-reduce, then the async all-reduce of fc1's input grad."""


def _inputs(sp: bool, rank: int):
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
    if sp:
        x, dy = x.chunk(2, 0)[rank], dy.chunk(2, 0)[rank]
    return x.clone().requires_grad_(), dy


def _full(weight, dim):
    import torch.distributed as dist

    parts = [torch.empty_like(weight) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, weight.detach().contiguous())
    return torch.cat(parts, dim)


def megatron_case(sp: bool, out: str):
    """Megatron-Core's block on this rank under the recorder; checked against one process."""
    import _megatron_shim as shim
    import torch.distributed as dist

    from paraloom.record import record_comms

    shim.install()
    rank = dist.get_rank()
    fc1, fc2 = shim.mlp_block(H, sequence_parallel=sp)
    x, dy = _inputs(sp, rank)
    with record_comms(out=out) as rec:
        y = shim.forward_backward(fc1, fc2, x, dy)
    w1, w2 = _full(fc1.weight, 0), _full(fc2.weight, 1)
    b1 = _full(fc1.bias, 0)
    x_ref = _inputs(False, rank)[0]
    y_ref = F.linear(F.gelu(F.linear(x_ref, w1, b1)), w2, fc2.bias.detach())
    torch.testing.assert_close(y, y_ref.chunk(2, 0)[rank] if sp else y_ref,
                               rtol=1e-5, atol=1e-5)
    return rec.events


def paraloom_case(sp: bool):
    """paraloom's layers for the same block and flags (sp off: Megatron's default async
    all-reduce of the input grad; sp on: async re-gather and reduce-scatter)."""
    import torch.distributed as dist

    from paraloom.ledger import Ledger, recording
    from paraloom.mesh import ParallelMesh
    from paraloom.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    mesh = ParallelMesh(tp=2)
    fc1 = ColumnParallelLinear(H, 4 * H, sequence_parallel=sp, async_grad_allreduce=not sp,
                               mesh=mesh, name="mlp.fc1")
    fc2 = RowParallelLinear(4 * H, H, input_is_parallel=True, sequence_parallel=sp, mesh=mesh,
                            name="mlp.fc2")
    x, dy = _inputs(sp, dist.get_rank())
    led = Ledger(rank=dist.get_rank())
    with recording(led):
        y, _ = fc2(F.gelu(fc1(x)[0]))
        y.backward(dy)
    return led.events


def _seq(events):
    return [(e["phase"], e["op"], e["async"], e["bytes"]) for e in events if e["op"] != "compute"]


def _write(path, per_rank):
    path.write_text("".join(json.dumps(e) + "\n" for events in per_rank for e in events))
    return str(path)


def test_megatron_block_records_like_paraloom(world2, tmp_path, capsys):
    import _megatron_shim

    _megatron_shim.preload()  # before the ranks fork: they inherit the import (~9 s CPU each)
    runs = {}
    for sp, order in ((False, TP_ORDER), (True, SP_ORDER)):
        out = tmp_path / f"megatron_sp{int(sp)}"
        megatron = world2.run(megatron_case, sp, str(out))
        ours = world2.run(paraloom_case, sp)
        got = _seq(megatron[0])
        assert [s[:3] for s in got] == order, got
        assert got == _seq(ours[0]), (got, _seq(ours[0]))
        assert all(e["kind"] == "tp" and e["group"] == [0, 1] for e in megatron[0])
        assert sorted((out / "ledger").glob("rank*.jsonl")) != []
        mine = _write(tmp_path / f"paraloom_sp{int(sp)}.jsonl", ours)
        code = main(["diff", str(out), mine, "--ignore-names"])
        text = capsys.readouterr().out
        assert code == 0, text
        assert f"rank 0: equal ({len(order)} communications)" in text
        assert main(["diff", str(out), mine]) == 1  # sites differ: names are compared
        capsys.readouterr()
        runs[sp] = (str(out), mine)
    # sequence parallelism on vs off is a difference at the first communication
    assert main(["diff", runs[True][0], runs[False][1], "--ignore-names"]) == 1
    assert "#0: op: all_gather vs all_reduce" in capsys.readouterr().out

    layers = str(megatron_file("tensor_parallel/layers.py"))
    facts = explain(layers)
    run = annotate(facts, runs[True][0], rank=0)
    sites = facts["sites"]
    marked = {(sites[m["site"]]["function"], sites[m["site"]]["op"]): m["events"]
              for m in run["sites"]
              if sites[m["site"]]["class"] == "LinearWithGradAccumulationAndAsyncCommunication"}
    want = {("forward", "all_gather"): ("forward", False, 512, 0),
            ("backward", "all_gather"): ("backward", True, 512, 3),  # the async re-gather
            ("backward", "reduce_scatter"): ("backward", True, 1024, 4)}
    for key, (phase, asy, nbytes, index) in want.items():
        events = marked.get(key)
        assert events and [(e["phase"], e["async"], e["bytes"], e["index"]) for e in events] \
            == [(phase, asy, nbytes, index)], (key, events, [e["site"] for e in megatron[0]])
    assert run["missed"] == []  # the static reading found every call recorded in layers.py
    tp_run = annotate(facts, runs[False][0], rank=0)  # sp off: fc1's async input-grad all-reduce
    got = [(sites[m["site"]]["class"], sites[m["site"]]["function"], e["op"], e["async"],
            e["index"]) for m in tp_run["sites"] for e in m["events"]]
    assert got == [("LinearWithGradAccumulationAndAsyncCommunication", "backward", "all_reduce",
                    True, 1)], got
    text = render_run(facts, run)
    assert ": reduce_scatter (static: backward, async True) -> recorded: rank 0: 1x " \
           "reduce_scatter backward async 1024 B at #4" in text, text
