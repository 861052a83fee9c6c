"""Where the parallel linears' weight gradients go (tensor_parallel/weight_grad.py), one process.

Under a data-parallel wrapper an fp32 weight's gradient is written straight into ``main_grad``
(no ``.grad`` is made, the hook only marks it ready), and must equal what ``.grad`` plus the
wrapper's copy gives: bitwise for one microbatch at dp = 1, to float rounding when microbatches
accumulate inside the GEMM. A weight used twice (a tied embedding) gets both shares. On a torch
whose hooks do not fire for a missing gradient, the placeholder protocol must give the same.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paraloom.data_parallel import DistributedDataParallel
from paraloom.ledger import Ledger, recording
from paraloom.mesh import ParallelMesh
from paraloom.tensor_parallel import ColumnParallelLinear, RowParallelLinear, weight_grad
from paraloom.tensor_parallel.linear import linear_with_grad_accumulation_and_async_allreduce

H, FFN, V = 16, 64, 32


class Net(nn.Module):
    """Column -> GeLU -> Row, and an output layer tied to an embedding table."""

    def __init__(self, mesh, fusion: bool = False, own_backward: bool = False) -> None:
        super().__init__()
        self.emb = nn.Parameter(torch.randn(V, H) * 0.2)
        self.fc1 = ColumnParallelLinear(H, FFN, mesh=mesh, name="fc1",
                                        gradient_accumulation_fusion=fusion,
                                        own_backward=own_backward)
        self.fc2 = RowParallelLinear(FFN, H, input_is_parallel=True, mesh=mesh, name="fc2",
                                     gradient_accumulation_fusion=fusion,
                                     own_backward=own_backward)

    def forward(self, ids):  # [s, b]
        x = F.embedding(ids, self.emb)  # [s, b, h]
        x = x + self.fc2(F.gelu(self.fc1(x)[0]))[0]
        logits = linear_with_grad_accumulation_and_async_allreduce(x, self.emb)  # tied, [s, b, V]
        return logits.logsumexp(-1).mean()


def _pair(fusion: bool = False, before_wrapping=None):
    torch.manual_seed(0)
    ref = Net(ParallelMesh())
    model = Net(ParallelMesh(), fusion)
    model.load_state_dict(ref.state_dict())
    if before_wrapping is not None:
        before_wrapping(model)
    ddp = DistributedDataParallel(model, ParallelMesh(), bucket_size=10_000)
    return ref, model, ddp


def _ids(seed: int):
    return torch.randint(0, V, (8, 2), generator=torch.Generator().manual_seed(seed))


def _run(ref, model, ddp, microbatches: int):
    """``microbatches`` backwards of both; ``model``'s under a ledger, so that at tp = 1 its
    layers run their autograd function (as at tp > 1) rather than ``F.linear``."""
    ddp.zero_grad_buffer()
    for m in range(microbatches):
        ref(_ids(m)).backward()
        with recording(Ledger()), ddp.no_sync() if m < microbatches - 1 else nullcontext():
            ddp(_ids(m)).backward()
    ddp.finish_grad_sync()


def test_this_torch_runs_hooks_for_a_missing_gradient():
    """The fast protocol's premise (if a torch release changes it, the fallback takes over)."""
    assert weight_grad.hooks_fire_without_grad()


def test_fp32_weight_grads_go_straight_into_main_grad_bitwise_at_one_microbatch():
    at_hook = {}

    def spy(model):  # registered before the wrapper's hooks: sees what autograd left in .grad
        for name in ("fc1", "fc2"):
            getattr(model, name).weight.register_post_accumulate_grad_hook(
                lambda p, n=name: at_hook.setdefault(n, p.grad))

    ref, model, ddp = _pair(before_wrapping=spy)
    _run(ref, model, ddp, 1)
    for name in ("fc1", "fc2"):
        w = getattr(model, name).weight
        assert w.grad is None and at_hook[name] is None, f"{name}: a .grad was materialised"
        assert torch.equal(w.main_grad, getattr(ref, name).weight.grad), name
    torch.testing.assert_close(model.emb.main_grad, ref.emb.grad, rtol=0, atol=0)


@pytest.mark.parametrize("fusion", [False, True])
def test_accumulated_and_tied_weight_grads_equal_autograds(fusion):
    """Three microbatches accumulate (inside the GEMM for the linears); the tied table gets the
    lookup's share on top of its output-layer share."""
    ref, model, ddp = _pair(fusion)
    for _ in range(2):  # a second step: the first gradient overwrites, never adds to stale values
        for p in ref.parameters():
            p.grad = None
        _run(ref, model, ddp, 3)
        for (name, p), want in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert p.grad is None, name
            torch.testing.assert_close(p.main_grad, want.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("fusion", [False, True])
def test_without_hooks_for_missing_grads_the_placeholder_protocol_is_equal(monkeypatch, fusion):
    """The fallback: fp32 weights go through .grad; fused ones hand autograd a placeholder."""
    monkeypatch.setattr(weight_grad, "hooks_fire_without_grad", lambda: False)
    from paraloom.data_parallel import ddp as ddp_module
    monkeypatch.setattr(ddp_module, "hooks_fire_without_grad", lambda: False)
    ref, model, ddp = _pair(fusion)
    assert ddp._placeholders
    _run(ref, model, ddp, 2)
    for (name, p), want in zip(model.named_parameters(), ref.parameters(), strict=True):
        if name == "emb" and fusion:
            continue  # a placeholder cannot share a parameter with another use (documented)
        torch.testing.assert_close(p.main_grad, want.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_without_a_wrapper_the_gradient_stays_in_grad():
    torch.manual_seed(0)
    model = Net(ParallelMesh())
    model(_ids(0)).backward()
    assert model.fc1.weight.grad is not None and not hasattr(model.fc1.weight, "main_grad")


def test_a_zero_bubble_forward_builds_a_splittable_backward_at_tp1():
    """At tp = 1 the layers use F.linear, unless the backward may be split: a layer built for a
    zero-bubble schedule (``own_backward``) makes its weight gradient wait for the W step."""
    from paraloom.tensor_parallel.weight_grad import defer_weight_grads

    torch.manual_seed(0)
    model = Net(ParallelMesh(), own_backward=True)
    x = _ids(0)
    loss = model(x)
    with defer_weight_grads() as run_w:
        loss.backward()
    assert model.fc1.weight.grad is None and model.fc2.weight.grad is None  # deferred
    assert model.fc1.bias.grad is not None  # computed in B
    run_w()
    plain = Net(ParallelMesh())  # without own_backward: F.linear, nothing deferred
    plain.load_state_dict(model.state_dict())
    with defer_weight_grads():
        plain(x).backward()
    assert plain.fc1.weight.grad is not None
    ref = Net(ParallelMesh())
    ref.load_state_dict(model.state_dict())
    ref(x).backward()  # the plain path (F.linear)
    for (name, p), want in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, want.grad, rtol=0, atol=0, msg=name)
