"""Data parallelism equals one process on the whole global batch; the ledger shows the buckets.

One 4-rank gloo world runs every case. dp = 2 uses a (tp = 2, dp = 2) mesh with real
tensor-parallel layers (so the dp groups are per tp rank); dp = 4 uses tp = 1. The oracle on each
rank is the same model class built with a size-1 tp axis, trained with ``torch.optim.AdamW`` on the
whole global batch.

Tolerances: fp32 reduction rtol 1e-5 / atol 1e-6 for gradients; parameters after Adam rtol 1e-5 /
atol 1e-3 * lr (Adam divides each gradient element by its own magnitude, so an element whose
gradient is ~1e-7 turns a last-bit summation-order difference into a visible one). bf16 reduction
rounds each rank's bucket to 8 significant bits before the sum: step-0 gradients within rtol 1e-2
+ 1e-2 * max|grad| of the tensor (5e-2 * max|grad| at later steps, whose parameters have already
drifted); parameters after Adam within 2.5 * lr (an element whose gradient is near zero can move
by up to lr either way after rounding).
"""

from __future__ import annotations

import itertools
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paraloom.data_parallel import (
    DistributedDataParallel,
    DistributedOptimizer,
    MainParamsOptimizer,
    finalize_model_grads,
)
from paraloom.ledger import Ledger, recording
from paraloom.mesh import Axis, ParallelMesh
from paraloom.tensor_parallel import ColumnParallelLinear, RowParallelLinear, counter_normal

S, H, G, LAYERS, STEPS = 4, 16, 16, 2, 2
FFN = 4 * H
BUCKET = 600  # elements: 4-6 buckets for this model
HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
FP32 = dict(rtol=1e-5, atol=1e-6)
ONE = SimpleNamespace(tp=Axis("tp", (0,), 0, None))  # a size-1 tp axis: the single-process model
_MESHES: dict = {}


def _mesh(tp: int, dp: int, pp: int = 1) -> ParallelMesh:
    """One mesh per layout per rank (every rank builds them in the same order)."""
    if (tp, pp, dp) not in _MESHES:
        _MESHES[tp, pp, dp] = ParallelMesh(tp=tp, pp=pp, dp=dp)
    return _MESHES[tp, pp, dp]


def _init_replicated(model: nn.Module) -> None:
    """Layout-independent values for the parameters the counter initializer does not set."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not getattr(p, "tensor_model_parallel", False):
                z = counter_normal(7, name, p.shape)
                p.copy_(1 + 0.1 * z if name.endswith("ln.weight") else 0.2 * z)


class Block(nn.Module):
    def __init__(self, i: int, mesh, fusion: bool) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.fc1 = ColumnParallelLinear(H, FFN, gradient_accumulation_fusion=fusion, mesh=mesh,
                                        name=f"blocks.{i}.fc1")
        self.fc2 = RowParallelLinear(FFN, H, input_is_parallel=True, mesh=mesh,
                                     gradient_accumulation_fusion=fusion, name=f"blocks.{i}.fc2")

    def forward(self, x):  # [s, b, h]
        h, _ = self.fc1(self.ln(x))  # [s, b, 4h/tp]
        y, _ = self.fc2(F.gelu(h))  # [s, b, h]
        return x + y


class Net(nn.Module):
    """Pre-LN residual MLP blocks (paraloom layers, fused wgrad) + LayerNorm + nn.Linear head."""

    def __init__(self, mesh, fusion: bool, unused: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(i, mesh, fusion) for i in range(LAYERS))
        self.ln_f = nn.LayerNorm(H)
        self.head = nn.Linear(H, H)
        self.extra = nn.Linear(H, H) if unused else None
        _init_replicated(self)

    def forward(self, x, target):
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(self.ln_f(x)), target)


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(S, G, H, generator=g), torch.randn(S, G, H, generator=g)


def _local(t: torch.Tensor, dp: Axis, mbs: int, m: int) -> torch.Tensor:
    mine = t.chunk(dp.size, 1)[dp.rank]  # this replica's share of the global batch (dim 1)
    return mine.chunk(mbs, 1)[m]


def _tp_shard(p: nn.Parameter, full: torch.Tensor, mesh) -> torch.Tensor:
    if getattr(p, "tensor_model_parallel", False):
        return full.chunk(mesh.tp.size, p.partition_dim)[mesh.tp.rank]
    return full


def _close(got, want, fp32: bool, what: str, lr: float | None = None, step: int = 0) -> None:
    if fp32:
        tol = FP32 if lr is None else dict(rtol=1e-5, atol=1e-3 * lr)
    elif lr is None:
        tol = dict(rtol=1e-2, atol=(1e-2 if step == 0 else 5e-2) * float(want.abs().max()))
    else:
        tol = dict(rtol=1e-2, atol=2.5 * lr)
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------- equivalence
def train_case(tp, dp, mbs, distributed, overlap, fp32, in_collective=False,
               disable_bucketing=False):
    mesh = _mesh(tp, dp)
    torch.manual_seed(0)
    model = Net(mesh, fusion=True)
    if disable_bucketing:  # a bucket of its own under the distributed optimizer (the tied
        model.blocks[0].ln.weight.shared_embedding = True  # embedding's rule)
    ddp = DistributedDataParallel(model, mesh, overlap_grad_reduce=overlap, bucket_size=BUCKET,
                                  grad_reduce_in_fp32=fp32, use_distributed_optimizer=distributed,
                                  average_in_collective=in_collective,
                                  disable_bucketing=disable_bucketing)
    opt = (DistributedOptimizer if distributed else MainParamsOptimizer)(ddp, **HP)
    ref = Net(ONE, fusion=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, foreach=False)
    refp = dict(ref.named_parameters())
    ledger = Ledger(rank=dist.get_rank())
    for step in range(STEPS):
        x, target = _batch(step)
        ref_opt.zero_grad()
        ref(x, target).backward()
        opt.zero_grad()
        with recording(ledger):
            for m in range(mbs):
                with ledger.at(step=step, microbatch=m):
                    with ddp.no_sync() if m < mbs - 1 else nullcontext():
                        loss = ddp(_local(x, mesh.dp, mbs, m), _local(target, mesh.dp, mbs, m))
                        (loss / mbs).backward()
            with ledger.at(step=step, microbatch=mbs - 1):
                finalize_model_grads([ddp], mesh)
                for name, p in ddp.named_main_params():
                    assert p.grad is None, f"{name}: .grad should be folded into main_grad"
                    want = _tp_shard(p, refp[name].grad, mesh).reshape(-1)
                    bucket, lo, hi = ddp.param_range(p)
                    a, b = lo, hi
                    if bucket.reduce_scatter:  # only this rank's shard is reduced
                        s_lo, s_hi = bucket.shard(mesh.dp.rank, mesh.dp.size)
                        a, b = max(lo, s_lo), min(hi, s_hi)
                    if a < b:
                        _close(p.main_grad.reshape(-1)[a - lo:b - lo], want[a - lo:b - lo], fp32,
                               f"step {step} main_grad {name}", step=step)
                opt.step()
        ref_opt.step()
        for name, p in model.named_parameters():
            _close(p.detach(), _tp_shard(p, refp[name].detach(), mesh), fp32,
                   f"step {step} param {name}", lr=HP["lr"])
    buckets = [dict(index=b.index, names=b.names, numel=b.numel) for b in ddp.buckets]
    n_params = sum(p.numel() for p in model.parameters())
    return dict(events=ledger.events, buckets=buckets, n_params=n_params,
                state_bytes=opt.state_bytes())


CASES = [(tp, dp, mbs, dist_opt, overlap, fp32)
         for (tp, dp), mbs, dist_opt, overlap, fp32 in itertools.product(
             [(2, 2), (1, 4)], [1, 4], [False, True], [True, False], [True, False])]
CASES += [(1, 4, 4, False, True, True, True), (1, 4, 4, True, True, False, True)]


def _ids(case):
    tp, dp, mbs, d, o, f, *aic = case
    return (f"dp{dp}-tp{tp}-mb{mbs}-{'distopt' if d else 'plain'}-{'overlap' if o else 'sync'}"
            f"-{'fp32' if f else 'bf16'}{'-avg_in_coll' if aic else ''}")


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_equivalence_and_ledger(world4, case):
    tp, dp, mbs, distributed, overlap, fp32, *_ = case
    for rank, out in enumerate(world4.run(train_case, *case)):
        buckets, width = out["buckets"], 4 if fp32 else 2
        padded = sum(b["numel"] for b in buckets)
        if distributed:  # padded to a multiple of dp for the reduce-scatter
            assert all(b["numel"] % dp == 0 for b in buckets) and padded >= out["n_params"]
        else:
            assert padded == out["n_params"]
        for step in range(STEPS):
            ev = [e for e in out["events"] if e["kind"] == "dp" and e["step"] == step]
            reductions = [e for e in ev if e["op"] in ("all_reduce", "reduce_scatter")]
            # exactly one reduction per bucket, only on the last microbatch, with its names
            assert sorted(e["bucket"] for e in reductions) == [b["index"] for b in buckets]
            assert {e["microbatch"] for e in ev} == {mbs - 1}, f"rank {rank} step {step}"
            if not overlap:  # Megatron: without overlap one bucket, reduced synchronously
                assert len(buckets) == 1 and not any(e["async"] for e in reductions)
            for e in reductions:
                assert e["params"] == buckets[e["bucket"]]["names"]
                assert e["group"] == [r for r in range(4) if r % tp == rank % tp]
                # Megatron's first step launches nothing from the hooks: all at finish
                assert e["phase"] == ("backward" if overlap and step > 0 else "optimizer")
                assert e["dtype"] == ("float32" if fp32 else "bfloat16")
            op = "reduce_scatter" if distributed else "all_reduce"
            assert {e["op"] for e in reductions} == {op}
            assert sum(e["bytes"] for e in reductions) == padded * width
            gathers = [e for e in ev if e["op"] == "all_gather"]
            if distributed:
                assert sorted(e["bucket"] for e in gathers) == [b["index"] for b in buckets]
                assert {e["phase"] for e in gathers} == {"optimizer"}
                assert sum(e["bytes"] for e in gathers) == padded * 4 // dp
                assert out["state_bytes"] == 2 * padded * 4 // dp  # Adam moments of the shard
            else:
                assert not gathers
                assert out["state_bytes"] == 2 * out["n_params"] * 4
            if overlap and step > 0:  # the first bucket's reduction overlaps backward compute
                first = min(reductions, key=lambda e: e["t_start"])
                spans = sorted((e for e in out["events"] if e["op"] == "compute"
                                and e["step"] == step and e["phase"] == "backward"
                                and e["microbatch"] == mbs - 1), key=lambda e: e["t_start"])
                assert first["bucket"] == 0 and len(spans) == 4 * LAYERS  # dgrad + wgrad x 2
                assert first["t_start"] < max(e["t_end"] for e in spans)
                # bucket 0 (head, ln_f, last fc2) is launched before the last fc1's dgrad starts
                assert first["t_start"] <= spans[2]["t_start"], "bucket 0 did not overlap"


@pytest.mark.parametrize("overlap", [True, False])
def test_a_bucket_group_is_one_coalesced_collective_each_way(world4, overlap):
    """``disable_bucketing`` (Megatron-LM's, for every model chunk but the first): a buffer's
    buckets (here a parameter with a bucket of its own, as the tied embedding has under the
    distributed optimizer, and the rest) are one group, reduce-scattered by one coalesced
    collective once both are complete and gathered by one: the model still equals one
    process (train_case checks every gradient and parameter)."""
    for out in world4.run(train_case, 1, 4, 2, True, overlap, True, False, True):
        buckets = out["buckets"]
        assert len(buckets) == 2 and buckets[1]["names"] == ["blocks.0.ln.weight"]
        for step in range(STEPS):
            ev = [e for e in out["events"] if e["kind"] == "dp" and e["step"] == step]
            assert [(e["op"], e["tensors"], e["bucket"], e["bytes"], e["shape"]) for e in ev] == [
                (op, 2, 0, sum(b["numel"] for b in buckets) * 4 // div, [buckets[0]["numel"]
                                                                         // div])
                for op, div in (("reduce_scatter", 1), ("all_gather", 4))]
            assert ev[0]["params"] == buckets[0]["names"] + buckets[1]["names"]
            assert ev[0]["async"] == overlap and not ev[1]["async"]  # the gather: in the step


# --------------------------------------------------------------------------- unused parameters
def unused_case(overlap, distributed):
    mesh = _mesh(1, 4)
    model = Net(mesh, fusion=True, unused=True)
    ddp = DistributedDataParallel(model, mesh, overlap_grad_reduce=overlap, bucket_size=BUCKET,
                                  use_distributed_optimizer=distributed)
    x, target = _batch(0)
    ddp(_local(x, mesh.dp, 1, 0), _local(target, mesh.dp, 1, 0)).backward()
    try:
        ddp.finish_grad_sync()
    except RuntimeError as err:
        message = str(err)
    else:
        message = None
    ddp.zero_grad_buffer()
    return message


@pytest.mark.parametrize("overlap,distributed", [(True, False), (False, False), (True, True)])
def test_unused_parameters_are_named_not_hung(world4, overlap, distributed):
    for message in world4.run(unused_case, overlap, distributed, timeout=60):
        assert message is not None, "finish_grad_sync accepted a parameter without gradient"
        assert "extra.weight" in message and "extra.bias" in message
        assert "blocks.0.fc1.weight" not in message


# --------------------------------------------------------------------------- finalize: sp
class SPNet(nn.Module):
    def __init__(self, mesh) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.fc1 = ColumnParallelLinear(H, FFN, sequence_parallel=True, mesh=mesh, name="fc1")
        self.fc2 = RowParallelLinear(FFN, H, input_is_parallel=True, sequence_parallel=True,
                                     mesh=mesh, name="fc2")
        _init_replicated(self)
        if mesh.tp.size > 1:
            self.ln.weight.sequence_parallel = self.ln.bias.sequence_parallel = True

    def forward(self, x):  # [s/tp, b, h]
        h, _ = self.fc1(self.ln(x))
        return self.fc2(F.gelu(h))[0]  # [s/tp, b, h]


def sp_case():
    mesh = _mesh(2, 2)
    ddp = DistributedDataParallel(SPNet(mesh), mesh, bucket_size=BUCKET)
    ref = SPNet(ONE)
    x, dy = _batch(5)
    (ref(x) * dy).sum().div(mesh.dp.size).backward()  # dp averages: the oracle divides too
    ledger = Ledger(rank=dist.get_rank())
    seq = lambda t: _local(t, mesh.dp, 1, 0).chunk(mesh.tp.size, 0)[mesh.tp.rank]  # noqa: E731
    with recording(ledger):
        (ddp(seq(x)) * seq(dy)).sum().backward()
        finalize_model_grads(ddp, mesh)
        ddp.finish_grad_sync()  # a second call is a no-op: no new events, no second division
    refp = dict(ref.named_parameters())
    for name, p in ddp.named_main_params():
        _close(p.main_grad, _tp_shard(p, refp[name].grad, mesh), True, name)
    return [e for e in ledger.events if e["site"].startswith("finalize_model_grads")]


def test_finalize_sums_sequence_parallel_grads_over_tp(world4):
    for rank, events in enumerate(world4.run(sp_case)):
        assert len(events) == 1, events
        (e,) = events
        assert (e["op"], e["kind"], e["phase"]) == ("all_reduce", "sp", "optimizer")
        assert e["group"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert sorted(e["params"]) == ["fc2.bias", "ln.bias", "ln.weight"]
        assert e["bytes"] == 3 * H * 4


# --------------------------------------------------------------------------- finalize: emb
V = 8


class Stage(nn.Module):
    """Stage 0: embedding lookup + proj; stage 1: proj + output projection with the same table."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage
        self.word_embeddings = nn.Parameter(counter_normal(3, "word_embeddings", (V, H)))
        self.word_embeddings.shared_embedding = True
        self.proj = nn.Linear(H, H)
        _init_replicated(self)

    def forward(self, ids, h):
        if self.stage == 0:
            return self.proj(F.embedding(ids, self.word_embeddings)).square().mean()
        return F.linear(self.proj(h), self.word_embeddings).square().mean()


def _stage_data(dp_rank: int):
    g = torch.Generator().manual_seed(50 + dp_rank)
    return torch.randint(0, V, (S, 4), generator=g), torch.randn(S, 4, H, generator=g)


def emb_case(distributed):
    mesh = _mesh(1, 2, pp=2)
    stage = Stage(mesh.pp.rank)
    ddp = DistributedDataParallel(stage, mesh, bucket_size=BUCKET,
                                  use_distributed_optimizer=distributed)
    opt = (DistributedOptimizer if distributed else MainParamsOptimizer)(ddp, **HP)
    table = nn.Parameter(stage.word_embeddings.detach().clone())
    ref_opt = torch.optim.AdamW([table], **HP, foreach=False)
    for d in range(mesh.dp.size):  # the oracle: both stages, every replica, averaged over dp
        for k in range(2):
            other = Stage(k)
            other.word_embeddings = table
            other(*_stage_data(d)).div(mesh.dp.size).backward()
    ledger = Ledger(rank=dist.get_rank())
    with recording(ledger):
        ddp(*_stage_data(mesh.dp.rank)).backward()
        finalize_model_grads([ddp], mesh)
        got, want = stage.word_embeddings.main_grad.reshape(-1), table.grad.reshape(-1)
        if distributed:  # reduce-scattered: this rank's shard of its bucket is the valid part
            bucket, lo, hi = ddp.param_range(stage.word_embeddings)
            s_lo, s_hi = bucket.shard(mesh.dp.rank, mesh.dp.size)
            got, want = got[max(lo, s_lo) - lo:min(hi, s_hi) - lo], \
                want[max(lo, s_lo) - lo:min(hi, s_hi) - lo]
        torch.testing.assert_close(got, want, **FP32)
        opt.step()
    ref_opt.step()
    torch.testing.assert_close(stage.word_embeddings.detach(), table.detach(), **FP32)
    return ledger.events, mesh.emb.ranks


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distopt"])
def test_finalize_sums_tied_embedding_grads_over_emb_group(world4, distributed):
    for rank, (events, emb_ranks) in enumerate(world4.run(emb_case, distributed)):
        emb = [e for e in events if e["kind"] == "emb"]
        assert len(emb) == 1 and emb[0]["op"] == "all_reduce"
        assert emb[0]["group"] == list(emb_ranks) == [rank % 2, rank % 2 + 2]
        assert emb[0]["bytes"] == V * H * 4 and emb[0]["params"] == ["word_embeddings"]
        assert emb[0]["shape"] == [V, H]  # Megatron reduces the [V/tp, h] gradient as it is
        # Megatron's buckets: the tied embedding gets its own only under ZeRO-1, which
        # reduce-scatters it like every bucket
        (bucket,) = [e for e in events if e["kind"] == "dp" and "word_embeddings" in e["params"]
                     and e["op"] != "all_gather"]
        if distributed:
            assert bucket["op"] == "reduce_scatter" and bucket["params"] == ["word_embeddings"]
        else:
            assert bucket["op"] == "all_reduce" and len(bucket["params"]) == 3


# --------------------------------------------------------------------------- pure logic
def test_bucket_layout_is_megatrons_and_the_tail_splits_are_an_option():
    from paraloom.data_parallel.grad_buffer import bucket_layout

    sizes = [(100, False)] * 12  # backward order; the last ones complete last
    sizes_of = lambda layout: [len(members) for _, _, members in layout]  # noqa: E731
    assert sizes_of(bucket_layout(sizes, 400)) == [4, 4, 4]  # Megatron: close at >= 400
    assert sizes_of(bucket_layout(sizes, None)) == [12]      # no size: one bucket
    # paraloom's option, from the end: limits 25, 25, 50, 100, 200, then 400 -> 1, 1, 1, 1, 2, 4
    groups = [[i for i, _, _ in m] for _, _, m in bucket_layout(sizes, 400, tail_splits=4)]
    assert [len(g) for g in groups] == [2, 4, 2, 1, 1, 1, 1]
    assert [i for g in groups for i in g] == list(range(12))  # launch order = backward order
    shared = [(10, False), (1000, True), (10, False)]
    assert sizes_of(bucket_layout(shared, None)) == [3]  # no own bucket without ZeRO-1 ...
    # ... with it (sharded over 2): its own bucket, parameters start at multiples of 64 and
    # buckets end at multiples of lcm(2, 128) = 128 (Megatron's DistributedOptimizer layout)
    layout = bucket_layout(shared, 400, shard_over=2, sharded=True)
    assert [(lo, hi) for lo, hi, _ in layout] == [(0, 128), (128, 1152), (1152, 1280)]
    assert [m for _, _, m in layout] == [[(0, 0, 10)], [(1, 128, 1128)], [(2, 1152, 1162)]]
    assert bucket_layout([(70, False), (5, False)], None, shard_over=4, sharded=True) == \
        [(0, 256, [(0, 0, 70), (1, 128, 133)])]


def test_bucket_layout_is_backward_ordered_and_padded():
    from paraloom.data_parallel import GradBuffer, default_bucket_size

    params = [(f"p{i}", nn.Parameter(torch.ones(n))) for i, n in enumerate([5, 7, 3, 10])]
    buf = GradBuffer(params, bucket_size=16, shard_over=4, hold_params=True)
    # backward order p3, p2, p1, p0; ZeRO-1: p2 starts at 64, so the bucket holds 67 >= 16
    # elements and closes, padded to 128; p1 at 128, p0 at 192
    assert [b.names for b in buf.buckets] == [["p3", "p2"], ["p1", "p0"]]
    assert [b.numel for b in buf.buckets] == [128, 128]
    assert [buf.param_range(p) for _, p in params] == [(192, 197), (128, 135), (64, 67), (0, 10)]
    buf = GradBuffer(params, bucket_size=80)  # no ZeRO-1: no padding at all
    assert [b.names for b in buf.buckets] == [["p3", "p2", "p1", "p0"]] and buf.numel == 25
    for _, p in params:
        assert p.main_grad.data_ptr() == buf.grad[buf.param_range(p)[0]:].data_ptr()
    assert default_bucket_size(8) == 40_000_000 and default_bucket_size(64) == 64_000_000
    with pytest.raises(ValueError, match="bucket_size"):
        GradBuffer(params, bucket_size=0)


def test_zero_grad_buffer_needs_no_pass_the_next_gradient_overwrites():
    """zero_grad_buffer() writes nothing: the first gradient of the next step replaces main_grad
    (copied, or the fused GEMM with beta=0), so stale values, even NaN, never leak in; later
    microbatches add. One rank (dp = 1, scale 1)."""
    mesh = ParallelMesh()
    torch.manual_seed(0)
    model = Net(mesh, fusion=True)
    ddp = DistributedDataParallel(model, mesh, bucket_size=BUCKET)
    ref = Net(ONE, fusion=False)
    x, target = _batch(0)
    ref(x, target).backward()
    ref(2 * x, target).backward()  # two microbatches: .grad sums them
    for _ in range(2):
        ddp.zero_grad_buffer()
        with ddp.no_sync():
            ddp(x, target).backward()
        ddp(2 * x, target).backward()
        ddp.finish_grad_sync()
        for (name, p), want in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.main_grad, want.grad, **FP32, msg=name)
            p.main_grad.fill_(float("nan"))  # what zeroing would have hidden


@pytest.mark.parametrize("decoupled", [True, False])
def test_fused_adam_step_equals_the_written_out_update_and_torch(decoupled):
    """adam_step_ runs torch's fused kernel (one pass) and must equal, element for element, the
    written-out formula it replaced and torch.optim.Adam(W) itself, over several steps."""
    from paraloom.data_parallel import adam_step_, adam_update_

    g = torch.Generator().manual_seed(3)
    shapes = [(7, 5), (13,), (3, 4, 2)]
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]
    hp = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=decoupled)
    fused, written = [p.clone() for p in params], [p.clone() for p in params]
    state = [[torch.zeros_like(p) for p in params] for _ in range(4)]
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)(
        ref, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for step, grad in enumerate(grads, start=1):
        adam_step_(fused, grad, state[0], state[1], step, **hp, fused=True)
        for p, gr, a, b in zip(written, grad, state[2], state[3], strict=True):
            adam_update_(p, gr, a, b, step, **hp)
        for p, gr in zip(ref, grad, strict=True):
            p.grad = gr.clone()
        opt.step()
    for f, w, r in zip(fused, written, ref, strict=True):
        torch.testing.assert_close(f, w, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(f, r.detach(), rtol=1e-6, atol=1e-8)
    before = [p.clone() for p in fused]
    adam_step_(fused, grads[0], state[0], state[1], 5, **hp, fused=False)  # the fallback runs
    assert all(not torch.equal(a, b) for a, b in zip(before, fused, strict=True))


# --------------------------------------------------------------------------- weight decay
def decay_case(distributed):
    """3 steps with a large weight decay that ``no_weight_decay_cond`` keeps off biases and
    LayerNorm weights; returns the largest difference from torch AdamW with the same two groups
    and from AdamW decaying everything (which must be large: the rule has to matter here)."""
    from paraloom.data_parallel import no_weight_decay_cond
    mesh = _mesh(1, 4)
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=1.0)
    model = Net(mesh, fusion=True)
    ddp = DistributedDataParallel(model, mesh, bucket_size=BUCKET,
                                  use_distributed_optimizer=distributed)
    opt = (DistributedOptimizer if distributed else MainParamsOptimizer)(
        ddp, **hp, no_weight_decay_cond=no_weight_decay_cond)
    refs, ref_opts = [], []
    for rule in (no_weight_decay_cond, lambda name, p: False):
        ref = Net(ONE, fusion=False)
        named = list(ref.named_parameters())
        groups = [{"params": [p for n, p in named if not rule(n, p)]},
                  {"params": [p for n, p in named if rule(n, p)], "weight_decay": 0.0}]
        refs.append(ref)
        ref_opts.append(torch.optim.AdamW(groups, **hp, foreach=False))
    for step in range(3):
        x, target = _batch(step)
        for ref, ref_opt in zip(refs, ref_opts, strict=True):
            ref_opt.zero_grad()
            ref(x, target).backward()
            ref_opt.step()
        opt.zero_grad()
        ddp(_local(x, mesh.dp, 1, 0), _local(target, mesh.dp, 1, 0)).backward()
        finalize_model_grads([ddp], mesh)
        opt.step()
    diffs = []
    for ref in refs:
        want = dict(ref.named_parameters())
        diffs.append(max(float((p.detach() - want[n].detach()).abs().max())
                         for n, p in model.named_parameters()))
    split = sorted({decayed for decayed, _ in opt.lists})
    return dict(diffs=diffs, split=split,
                undecayed=sorted(n for n, d in opt.decays.items() if not d))


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distopt"])
def test_no_weight_decay_on_biases_and_norms(world4, distributed):
    """Megatron-Core's rule, as ``paraloom train`` uses it: the update equals torch AdamW with a
    decayed group (matrices) and an undecayed one (biases, 1-D), also when a ZeRO-1 shard of a
    bucket cuts through parameters of both kinds; decaying everything would differ."""
    outs = world4.run(decay_case, distributed)
    # some rank's update runs both settings (a shard cutting through both kinds under ZeRO-1)
    assert any(out["split"] == [False, True] for out in outs)
    for out in outs:
        ours_vs_groups, ours_vs_all = out["diffs"]
        assert ours_vs_groups < 1e-5, out
        assert ours_vs_all > 1e-3, out
        assert out["undecayed"] == sorted(
            [f"blocks.{i}.{m}" for i in range(LAYERS) for m in
             ("ln.weight", "ln.bias", "fc1.bias", "fc2.bias")]
            + ["ln_f.weight", "ln_f.bias", "head.bias"])
