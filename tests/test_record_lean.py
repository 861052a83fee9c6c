"""The recorder after its first step: no global module hooks, the same fields as while learning.

The tracker learns modules with global hooks during setup and step 1, then runs lean
(``paraloom.record.tracking``). One 2-rank program, run once for the module, records 5 steps of
a model that communicates the ways foreign programs do: DDP's bucket all-reduces (parameter
gradients, in backward), a module whose autograd Function all-reduces in backward (Megatron's
copy to the tensor-parallel region), one that all-reduces in forward (its reduction), a bare
all-reduce of the loss outside any module, and a module that begins to all-reduce in backward
only at step 3 (lean has not learnt it: the next step learns again), and two more outermost
modules whose submodules have the same paths.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as nn_module

from paraloom.launch import spawn
from paraloom.record import record_comms

STEPS = 5
LATE = 3  # the step from which the late module communicates in backward


class _AllReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class CopyToRegion(nn.Module):
    """Identity forward, all-reduce of the gradient in backward (when ``on``)."""

    def __init__(self, on: bool = True) -> None:
        super().__init__()
        self.on = on

    def forward(self, x):
        return _AllReduceGrad.apply(x) if self.on else x * 1.0


class Reduce(nn.Module):
    def forward(self, x):
        y = x.detach().clone()
        dist.all_reduce(y)
        return x + y


def _rank(rank: int, world: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8), CopyToRegion(), nn.Linear(8, 8), Reduce(),
                          CopyToRegion(on=False), nn.Linear(8, 4))
    model = DDP(inner, bucket_cap_mb=0.0001)  # about one bucket per parameter tensor
    # two more outermost modules that name their submodules alike: both all-reduce in
    # backward from a module whose path is "1"
    heads = [nn.Sequential(nn.Identity(), CopyToRegion()) for _ in range(2)]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hooks = []  # how many global module hooks the forward of each step meets
    inner[0].register_forward_pre_hook(
        lambda *_: hooks.append(len(nn_module._global_forward_pre_hooks)
                                + len(nn_module._global_forward_hooks)))

    def step() -> None:
        loss = heads[1](heads[0](model(torch.randn(2, 8)))).sum()
        dist.all_reduce(loss.detach().clone())
        loss.backward()
        opt.step()
        opt.zero_grad()
    step()  # DDP reduces one bucket at its first step and settles its buckets (a broadcast)
    step()  # at its second: the recorded steps are all alike
    hooks.clear()
    with record_comms() as ledger:
        for n in range(1, STEPS + 1):
            inner[4].on = n >= LATE
            step()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"events": ledger.events, "hooks": hooks}, f)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lean")
    spawn(_rank, 2, str(out), timeout_s=120)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _fields(events, step):
    return [(e["op"], e["phase"], e["module"], e["site"], e.get("param_grad", False),
             e["bytes"]) for e in events if e["step"] == step]


def test_lean_steps_record_what_learning_recorded(run):
    for rank in run:
        events = rank["events"]
        first = _fields(events, 1)
        ops = {(op, phase, module) for op, phase, module, *_ in first}
        assert ("all_reduce", "forward", "module.3") in ops  # Reduce, in the model's forward
        assert ("all_reduce", "backward", "module.1") in ops  # CopyToRegion's backward
        assert ("all_reduce", "other", None) in ops  # the loss, outside any module
        heads = [f for f in first if f[2] == "1"]  # each head's CopyToRegion, in backward
        assert [(op, phase) for op, phase, *_ in heads] == [("all_reduce", "backward")] * 2
        buckets = {m for op, phase, m, site, grad, _ in first if grad}
        assert buckets and buckets <= {"module.0", "module.2", "module.5"}  # DDP's, by owner
        assert _fields(events, 2) == first  # lean from step 2 on


def test_lean_runs_without_global_module_hooks(run):
    # step 1 learns (the tracker's global pre- and post-hook); lean has none in a forward (the
    # one-shot hook that begins an iteration removed itself); step 4 learns again
    assert run[0]["hooks"] == [2, 0, 0, 2, 0]


def test_a_module_that_starts_communicating_is_learnt_at_the_next_step(run):
    events = run[0]["events"]
    late = {s: [e["module"] for e in events if e["step"] == s and e["phase"] == "backward"
                and not e.get("param_grad") and e["module"] not in ("module.1", "1")]
            for s in range(1, STEPS + 1)}
    assert late[1] == late[2] == []
    assert late[LATE] == [None]  # lean met a node kind it had not learnt
    assert late[LATE + 1] == late[LATE + 2] == ["module.4"]  # learnt at step 4, lean at 5
    assert _fields(events, LATE + 2) == _fields(events, LATE + 1)
