"""Tensor/sequence-parallel layers equal plain PyTorch with the full weights (fp32, rtol 1e-5).

One 4-rank gloo world runs every case: tp in {1, 2, 4} uses a (tp, dp = 4 / tp) mesh, so the
dp replicas also check that groups are built per (pp, dp) column.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from paraloom import comm
from paraloom.ledger import Ledger, recording
from paraloom.mesh import ParallelMesh
from paraloom.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

S, B, H, HEADS = 8, 2, 16, 4
TOL = dict(rtol=1e-5, atol=1e-6)
VALID = [(sp, a, f) for sp, a, f in itertools.product([False, True], repeat=3) if not (sp and a)]


def shard(t: torch.Tensor, dim: int, mesh: ParallelMesh) -> torch.Tensor:
    return t.chunk(mesh.tp.size, dim)[mesh.tp.rank]


def _full_params(seed: int, shapes: dict) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*v, generator=g) * 0.3 for k, v in shapes.items()}


def _load(layer, weight, bias, dim, mesh):
    with torch.no_grad():
        layer.weight.copy_(shard(weight, dim, mesh))
        if layer.bias is not None:
            layer.bias.copy_(shard(bias, 0, mesh) if dim == 0 else bias)


def _grad(p):
    return p.main_grad if getattr(p, "main_grad", None) is not None else p.grad


def _finish_sp_bias(layer, mesh):
    """What finalize_model_grads does: sum a sequence-parallel bias's partial grads over tp."""
    if getattr(layer.bias, "sequence_parallel", False):
        comm.all_reduce(layer.bias.grad, mesh.tp, phase="backward", kind="sp", site="test")


def _check_grads(checks):
    for name, got, want in checks:
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, n=name: f"{n}: {m}")


# --------------------------------------------------------------------------- MLP block
def mlp_case(tp, sp, async_ar, fusion):
    mesh = ParallelMesh(tp=tp, dp=4 // tp)
    p = _full_params(0, {"w1": (4 * H, H), "b1": (4 * H,), "w2": (H, 4 * H), "b2": (H,),
                         "x": (S, B, H), "dy": (S, B, H)})
    x_ref = p["x"].clone().requires_grad_()
    ref = [t.clone().requires_grad_() for t in (p["w1"], p["b1"], p["w2"], p["b2"])]
    y_ref = F.linear(F.gelu(F.linear(x_ref, ref[0], ref[1])), ref[2], ref[3])
    y_ref.backward(p["dy"])

    fc1 = ColumnParallelLinear(H, 4 * H, sequence_parallel=sp, async_grad_allreduce=async_ar,
                               gradient_accumulation_fusion=fusion, mesh=mesh, name="mlp.fc1")
    fc2 = RowParallelLinear(4 * H, H, input_is_parallel=True, sequence_parallel=sp,
                            gradient_accumulation_fusion=fusion, mesh=mesh, name="mlp.fc2")
    _load(fc1, p["w1"], p["b1"], 0, mesh)
    _load(fc2, p["w2"], p["b2"], 1, mesh)
    seq = (lambda t: shard(t, 0, mesh)) if sp else (lambda t: t)
    x = seq(p["x"]).clone().requires_grad_()
    ledger = Ledger(rank=dist.get_rank())
    with recording(ledger):
        h, _ = fc1(x)
        y, _ = fc2(F.gelu(h))
        y.backward(seq(p["dy"]))
    _finish_sp_bias(fc2, mesh)
    torch.testing.assert_close(y, seq(y_ref.detach()), **TOL)
    checks = [("x.grad", x.grad, seq(x_ref.grad)),
              ("fc1.weight", _grad(fc1.weight), shard(ref[0].grad, 0, mesh)),
              ("fc1.bias", fc1.bias.grad, shard(ref[1].grad, 0, mesh)),
              ("fc2.weight", _grad(fc2.weight), shard(ref[2].grad, 1, mesh)),
              ("fc2.bias", fc2.bias.grad, ref[3].grad)]
    _check_grads(checks)
    if fusion:
        assert fc1.weight.grad is None and fc2.weight.grad is None
        assert fc1.weight.main_grad.dtype == torch.float32
    return ledger.events


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mlp_block_matches_single_process(world4, tp):
    for sp, async_ar, fusion in VALID:
        events = world4.run(mlp_case, tp, sp, async_ar, fusion)
        comms = [e for e in events[0] if e["op"] != "compute"]
        if tp == 1:
            assert comms == [], "tp=1 must not communicate"
            continue
        fwd = [(e["op"], e["site"]) for e in comms if e["phase"] == "forward"]
        bwd = [(e["op"], e["site"]) for e in comms if e["phase"] == "backward"]
        if not sp:
            assert fwd == [("all_reduce", "RowParallelLinear.forward:output")]
            assert bwd == [("all_reduce", "ColumnParallelLinear.backward:input_grad")]
            assert comms[0]["bytes"] == S * B * H * 4
            assert comms[0]["group"] == list(range(tp))
        else:
            assert fwd == [("all_gather", "ColumnParallelLinear.forward:input"),
                           ("reduce_scatter", "RowParallelLinear.forward:output")]
            assert sorted(bwd) == sorted([
                ("all_gather", "RowParallelLinear.backward:output_grad"),
                ("all_gather", "ColumnParallelLinear.backward:input (re-gather)"),
                ("reduce_scatter", "ColumnParallelLinear.backward:input_grad")])
            assert all(e["kind"] == "sp" for e in comms)
        if async_ar or sp:
            _assert_overlaps_wgrad(events[0])


def _assert_overlaps_wgrad(events):
    """The input-grad reduction starts before fc1's wgrad GEMM and completes after it starts."""
    wgrad = next(e for e in events if e["site"] == "ColumnParallelLinear.backward:wgrad")
    dgrad = next(e for e in events if e["site"] == "ColumnParallelLinear.backward:dgrad")
    red = next(e for e in events if e["site"] == "ColumnParallelLinear.backward:input_grad")
    assert red["async"] is True
    assert red["t_start"] <= wgrad["t_start"] <= red["t_end"], (red, wgrad)
    assert dgrad["t_end"] <= red["t_start"]
    regather = [e for e in events if "re-gather" in e["site"]]
    for e in regather:  # launched before the dgrad GEMM, waited after it
        assert e["t_start"] <= dgrad["t_start"] and e["t_wait"] >= dgrad["t_end"]


# --------------------------------------------------------------------------- attention block
def _attention(qkv, heads_local):
    s, b, _ = qkv.shape
    q, k, v = qkv.view(s, b, heads_local, 3, -1).unbind(3)  # each [s, b, a/tp, d]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))    # [b, a/tp, s, d]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    ctx = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
    return ctx.permute(2, 0, 1, 3).reshape(s, b, -1)         # [s, b, h/tp]


def attention_case(tp, sp, async_ar, fusion):
    mesh = ParallelMesh(tp=tp, dp=4 // tp)
    p = _full_params(1, {"wqkv": (3 * H, H), "bqkv": (3 * H,), "wo": (H, H), "bo": (H,),
                         "x": (S, B, H), "dy": (S, B, H)})
    x_ref = p["x"].clone().requires_grad_()
    ref = [t.clone().requires_grad_() for t in (p["wqkv"], p["bqkv"], p["wo"], p["bo"])]
    y_ref = F.linear(_attention(F.linear(x_ref, ref[0], ref[1]), HEADS), ref[2], ref[3])
    y_ref.backward(p["dy"])

    qkv = ColumnParallelLinear(H, 3 * H, sequence_parallel=sp, async_grad_allreduce=async_ar,
                               gradient_accumulation_fusion=fusion, mesh=mesh, name="attn.qkv")
    out = RowParallelLinear(H, H, input_is_parallel=True, sequence_parallel=sp,
                            gradient_accumulation_fusion=fusion, mesh=mesh, name="attn.proj")
    _load(qkv, p["wqkv"], p["bqkv"], 0, mesh)  # rows are per head: [head][q,k,v][d]
    _load(out, p["wo"], p["bo"], 1, mesh)
    seq = (lambda t: shard(t, 0, mesh)) if sp else (lambda t: t)
    x = seq(p["x"]).clone().requires_grad_()
    h, _ = qkv(x)
    y, _ = out(_attention(h, HEADS // tp))
    y.backward(seq(p["dy"]))
    _finish_sp_bias(out, mesh)
    torch.testing.assert_close(y, seq(y_ref.detach()), **TOL)
    _check_grads([("x.grad", x.grad, seq(x_ref.grad)),
                  ("qkv.weight", _grad(qkv.weight), shard(ref[0].grad, 0, mesh)),
                  ("qkv.bias", qkv.bias.grad, shard(ref[1].grad, 0, mesh)),
                  ("proj.weight", _grad(out.weight), shard(ref[2].grad, 1, mesh)),
                  ("proj.bias", out.bias.grad, ref[3].grad)])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_attention_block_matches_single_process(world4, tp):
    for case in VALID:
        world4.run(attention_case, tp, *case)


# --------------------------------------------------------------------------- other paths
def gather_and_scatter_paths(tp):
    mesh = ParallelMesh(tp=tp, dp=4 // tp)
    p = _full_params(2, {"w1": (2 * H, H), "b1": (2 * H,), "w2": (H, 2 * H), "b2": (H,),
                         "x": (S, B, H), "dy": (S, B, H)})
    x_ref = p["x"].clone().requires_grad_()
    ref = [t.clone().requires_grad_() for t in (p["w1"], p["b1"], p["w2"], p["b2"])]
    y_ref = F.linear(torch.tanh(F.linear(x_ref, ref[0], ref[1])), ref[2], ref[3])
    y_ref.backward(p["dy"])
    fc1 = ColumnParallelLinear(H, 2 * H, gather_output=True, mesh=mesh, name="a")
    fc2 = RowParallelLinear(2 * H, H, input_is_parallel=False, skip_bias_add=True, mesh=mesh,
                            name="b")
    _load(fc1, p["w1"], p["b1"], 0, mesh)
    _load(fc2, p["w2"], p["b2"], 1, mesh)
    x = p["x"].clone().requires_grad_()
    h, none = fc1(x)
    assert none is None and h.shape == (S, B, 2 * H)  # gathered: full width on every rank
    y, bias = fc2(torch.tanh(h))
    assert bias is fc2.bias
    (y + bias).backward(p["dy"])
    torch.testing.assert_close(y + bias, y_ref.detach(), **TOL)
    _check_grads([("x.grad", x.grad, x_ref.grad),
                  ("a.weight", fc1.weight.grad, shard(ref[0].grad, 0, mesh)),
                  ("a.bias", fc1.bias.grad, shard(ref[1].grad, 0, mesh)),
                  ("b.weight", fc2.weight.grad, shard(ref[2].grad, 1, mesh)),
                  ("b.bias", fc2.bias.grad, ref[3].grad)])


def embedding_case(tp, reduce_scatter):
    """Megatron's contract: ids ``[b, s]``; all-reduce gives ``[b, s, h]``, reduce-scatter the
    sequence-first ``[s/tp, b, h]``."""
    mesh = ParallelMesh(tp=tp, dp=4 // tp)
    vocab = 24
    g = torch.Generator().manual_seed(3)
    table = torch.randn(vocab, H, generator=g)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    dy = torch.randn(B, S, H, generator=g)
    ref = torch.nn.Embedding(vocab, H)
    with torch.no_grad():
        ref.weight.copy_(table)
    ref(ids).backward(dy)
    emb = VocabParallelEmbedding(vocab, H, reduce_scatter_embeddings=reduce_scatter, mesh=mesh)
    with torch.no_grad():
        emb.weight.copy_(shard(table, 0, mesh))
    out = emb(ids)
    seq = (lambda t: shard(t.transpose(0, 1), 0, mesh)) if reduce_scatter else (lambda t: t)
    torch.testing.assert_close(out, seq(ref(ids).detach()), **TOL)
    out.backward(seq(dy))
    torch.testing.assert_close(emb.weight.grad, shard(ref.weight.grad, 0, mesh), **TOL)


def cross_entropy_case(tp, label_smoothing, real_vocab=32):
    """``real_vocab`` < 32: the last columns are vocabulary padding (junk values, never a class)."""
    mesh = ParallelMesh(tp=tp, dp=4 // tp)
    vocab = 32
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(S, B, vocab, generator=g) * 3).requires_grad_()
    target = torch.randint(0, real_vocab, (S, B), generator=g)
    ref = F.cross_entropy(logits[..., :real_vocab].reshape(-1, real_vocab), target.view(-1),
                          reduction="none", label_smoothing=label_smoothing).view(S, B)
    weights = torch.rand(S, B, generator=g)
    (ref * weights).sum().backward()
    local = shard(logits.detach(), -1, mesh).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, mesh.tp, label_smoothing=label_smoothing,
                                        vocab_size=real_vocab if real_vocab < vocab else None)
    torch.testing.assert_close(loss, ref.detach(), **TOL)
    (loss * weights).sum().backward()
    full_grad = logits.grad if logits.grad is not None else torch.zeros_like(logits)
    torch.testing.assert_close(local.grad, shard(full_grad, -1, mesh), **TOL)


def fused_cross_entropy_case(tp):
    """Megatron's fused cross entropy: the unfused loss, the unfused gradient rounded to bf16,
    and one all-reduce of ``[2s, b]`` (target logits, then exponential sums) after the max."""
    mesh = ParallelMesh(tp=tp, dp=4 // tp)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(S, B, 32, generator=g) * 3
    target = torch.randint(0, 32, (S, B), generator=g)
    weights = torch.rand(S, B, generator=g)
    got = {}
    for fused in (False, True):
        local = shard(logits, -1, mesh).clone().requires_grad_()
        ledger = Ledger(rank=dist.get_rank())
        with recording(ledger):
            loss = vocab_parallel_cross_entropy(local, target, mesh.tp, fused=fused)
        (loss * weights).sum().backward()
        got[fused] = loss.detach(), local.grad, [(e["site"].split(":")[1], e["shape"])
                                                 for e in ledger.events if e["kind"] == "tp"]
    torch.testing.assert_close(got[True][0], got[False][0], **TOL)
    grad = got[True][1]
    assert torch.equal(grad, grad.bfloat16().float())  # rounded to bf16, as Megatron's
    torch.testing.assert_close(grad, got[False][1], rtol=2 ** -8, atol=1e-6)
    if tp > 1:
        assert got[False][2] == [("max", [S, B]), ("target_logit", [S, B]), ("sum_exp", [S, B])]
        assert got[True][2] == [("max", [S, B]), ("target_logit_sum_exp", [2 * S, B])]


def test_fused_cross_entropy_is_megatrons(world4):
    for tp in (1, 2, 4):
        world4.run(fused_cross_entropy_case, tp)
    with pytest.raises(ValueError, match="fused cross entropy has no label smoothing"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long),
                                     label_smoothing=0.1, fused=True)


def test_gather_output_and_scatter_input_paths(world4):
    for tp in (1, 2, 4):
        world4.run(gather_and_scatter_paths, tp)


def test_vocab_parallel_embedding_matches_nn_embedding(world4):
    for tp, rs in itertools.product((1, 2, 4), (False, True)):
        world4.run(embedding_case, tp, rs)


def test_vocab_parallel_cross_entropy_matches_f_cross_entropy(world4):
    for tp, ls in itertools.product((1, 2, 4), (0.0, 0.1, 0.3)):
        world4.run(cross_entropy_case, tp, ls)
    for tp, ls in itertools.product((1, 4), (0.0, 0.2)):  # padded vocabulary: 27 real of 32
        world4.run(cross_entropy_case, tp, ls, 27)


# --------------------------------------------------------------------------- init, errors
def init_shards(tp):
    mesh = ParallelMesh(tp=tp, dp=4 // tp)
    col = ColumnParallelLinear(12, 8, mesh=mesh, name="layers.3.mlp.fc1")
    row = RowParallelLinear(8, 12, input_is_parallel=True, mesh=mesh, name="layers.3.mlp.fc2")
    emb = VocabParallelEmbedding(16, 12, mesh=mesh, name="embedding.word")
    attrs = [(p.tensor_model_parallel, p.partition_dim, p.partition_stride)
             for p in (col.weight, row.weight, emb.weight)]
    return col.weight.detach(), row.weight.detach(), emb.weight.detach(), attrs


def test_same_init_whatever_the_layout(world4):
    col = ColumnParallelLinear(12, 8, name="layers.3.mlp.fc1")  # one process, no distributed
    row = RowParallelLinear(8, 12, input_is_parallel=True, name="layers.3.mlp.fc2")
    emb = VocabParallelEmbedding(16, 12, name="embedding.word")
    for tp in (2, 4):
        shards = world4.run(init_shards, tp)[:tp]
        assert torch.equal(torch.cat([s[0] for s in shards], 0), col.weight.detach())
        assert torch.equal(torch.cat([s[1] for s in shards], 1), row.weight.detach())
        assert torch.equal(torch.cat([s[2] for s in shards], 0), emb.weight.detach())
        assert shards[0][3] == [(True, 0, 1), (True, 1, 1), (True, 0, 1)]
    assert 0.015 < col.weight.std().item() < 0.025  # N(0, 0.02) by default
    other = ColumnParallelLinear(12, 8, name="layers.4.mlp.fc1")
    assert not torch.equal(other.weight, col.weight)  # the name keys the values


def mesh_mismatch():
    with pytest.raises(ValueError,
                       match=r"tp\*cp\*pp\*dp = 2\*1\*1\*1 = 2 does not match the world size 4"):
        ParallelMesh(tp=2)
    mesh = ParallelMesh(tp=2, dp=2)
    with pytest.raises(ValueError, match="output_size = 5 is not divisible by 2"):
        ColumnParallelLinear(4, 5, mesh=mesh)
    # the building blocks follow Megatron-Core's rule by default: async unless sp (and tp > 1)
    assert ColumnParallelLinear(4, 4, mesh=mesh).async_grad_allreduce is True
    assert ColumnParallelLinear(4, 4, mesh=mesh, sequence_parallel=True).async_grad_allreduce \
        is False
    assert ColumnParallelLinear(4, 4, mesh=mesh, async_grad_allreduce=False) \
        .async_grad_allreduce is False
    return True


def test_clear_errors(world4):
    from paraloom.config import ParallelConfig
    from paraloom.models.options import ParallelOptions
    assert ParallelOptions().async_grad_allreduce is True  # Megatron-Core's rule, as train
    assert ParallelOptions(sequence_parallel=True).async_grad_allreduce is False
    assert ParallelOptions(async_grad_allreduce=False).async_grad_allreduce is False
    assert ColumnParallelLinear(4, 4).async_grad_allreduce is False  # one rank: nothing to wait
    from paraloom.utils import divide
    with pytest.raises(ValueError, match="sequence_parallel=True cannot be combined"):
        ParallelConfig(tp=2, sequence_parallel=True, async_grad_allreduce=True)
    with pytest.raises(ValueError, match="sequence_parallel=True with async_grad_allreduce"):
        ColumnParallelLinear(4, 4, sequence_parallel=True, async_grad_allreduce=True)
    with pytest.raises(ValueError, match="hidden_size = 10 is not divisible by 4"):
        divide(10, 4, "hidden_size")
    with pytest.raises(ValueError, match="does not match the world size 1"):
        ParallelMesh(tp=2)
    world4.run(mesh_mismatch)
