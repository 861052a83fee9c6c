"""The GPT trains the same model under tensor and sequence parallelism and recomputation.

The reference is the same GPTModel in this (non-distributed) process: with the counter-based
initializer it has exactly the weights every layout builds, so nothing is copied.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import real_rows

from paraloom import comm
from paraloom.config import ModelConfig
from paraloom.mesh import ParallelMesh
from paraloom.models.gpt import GPTModel, ParallelOptions

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                  seq_length=16)
B = 2


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (B, CFG.seq_length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def full_grads(model, mesh) -> dict:
    """Every parameter's gradient assembled to its full (tp=1) shape."""
    out = {}
    for name, p in model.named_parameters():
        g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
        if getattr(p, "sequence_parallel", False):
            g = comm.all_reduce(g.clone(), mesh.tp, phase="backward", kind="sp", site="test")
        if getattr(p, "tensor_model_parallel", False):
            g = comm.all_gather(g, mesh.tp, dim=p.partition_dim, phase="backward", kind="tp",
                                site="test")
        out[name] = real_rows(g, p)
    return out


def run_gpt(tp, sp, recompute, fusion):
    mesh = ParallelMesh(tp=tp, dp=4 // tp)
    opt = ParallelOptions(sequence_parallel=sp, recompute=recompute,
                          gradient_accumulation_fusion=fusion)
    model = GPTModel(CFG, mesh, options=opt)
    tokens, labels = _batch()
    loss = model(tokens, labels).mean()
    loss.backward()
    return loss.detach(), full_grads(model, mesh)


@pytest.fixture(scope="module")
def reference():
    model = GPTModel(CFG, ParallelMesh())
    tokens, labels = _batch()
    loss = model(tokens, labels).mean()
    loss.backward()
    return loss.detach(), {n: real_rows(p.grad, p) for n, p in model.named_parameters()}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpt_loss_and_grads_match_one_process(world4, reference, tp):
    ref_loss, ref_grads = reference
    for sp, recompute, fusion in itertools.product([False, True], ["none", "selective", "full"],
                                                   [False, True]):
        if tp == 1 and sp:
            continue
        loss, grads = world4.run(run_gpt, tp, sp, recompute, fusion)[0]
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            where = f"{name} (tp={tp} sp={sp} recompute={recompute} fusion={fusion})"
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, w=where: f"{w}: {m}")


def recompute_with_dropout(tp, sp):
    from dataclasses import replace

    from paraloom.tensor_parallel.random import model_parallel_seed
    mesh = ParallelMesh(tp=tp, dp=4 // tp)
    results = []
    for recompute in ("none", "selective", "full"):
        model_parallel_seed(99, mesh.tp.rank)
        model = GPTModel(replace(CFG, dropout=0.2), mesh,
                         options=ParallelOptions(sequence_parallel=sp, recompute=recompute))
        tokens, labels = _batch()
        loss = model(tokens, labels).mean()
        loss.backward()
        results.append((loss.detach(), full_grads(model, mesh)))
    return results


def test_recomputation_replays_the_same_dropout_masks(world4):
    for tp, sp in ((1, False), (2, True), (4, False)):
        (loss0, g0), *others = world4.run(recompute_with_dropout, tp, sp)[0]
        for loss, grads in others:
            torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=0)
            for name in g0:
                torch.testing.assert_close(grads[name], g0[name], rtol=1e-5, atol=1e-7)


PADDED = ModelConfig(vocab_size=100, make_vocab_size_divisible_by=16, hidden_size=32,
                     num_layers=2, num_attention_heads=4, seq_length=16)


def run_padded(tp, sp):
    mesh = ParallelMesh(tp=tp, dp=4 // tp)
    model = GPTModel(PADDED, mesh, options=ParallelOptions(sequence_parallel=sp))
    tokens, labels = (t % PADDED.vocab_size for t in _batch())
    loss = model(tokens, labels).mean()
    loss.backward()
    return loss.detach(), full_grads(model, mesh)


def test_padded_vocabulary_is_excluded_from_the_loss(world4):
    import torch.nn.functional as F
    assert [PADDED.padded_vocab(tp) for tp in (1, 2, 4)] == [112, 128, 128]  # 16 * tp
    model = GPTModel(PADDED, ParallelMesh())
    tokens, labels = (t % PADDED.vocab_size for t in _batch())
    logits = model(tokens)                                   # [s, b, 112]: 12 padding columns
    want = F.cross_entropy(logits[..., :100].reshape(-1, 100), labels.t().reshape(-1))
    loss = model(tokens, labels).mean()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    loss.backward()
    ref = {n: real_rows(p.grad, p) for n, p in model.named_parameters()}  # padding rows: 0
    for tp, sp in ((2, False), (4, True)):
        got_loss, grads = world4.run(run_padded, tp, sp)[0]
        torch.testing.assert_close(got_loss, loss.detach(), rtol=1e-5, atol=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref[name], rtol=1e-5, atol=1e-6)
