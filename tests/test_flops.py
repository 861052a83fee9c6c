"""Model FLOPs and hardware FLOPs against a FLOP count of one real forward + backward."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _flops_closed_form import (
    flops_per_iteration,
    hardware_flops_per_iteration,
    model_flops_per_iteration,
    recompute_flops_per_iteration,
)
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode


def _counted(recompute: str, *, s=32, b=2, h=64, a=4, layers=2, vocab=256, ffn=None,
             dropout=0.0) -> tuple[int, int]:
    """FLOPs ``torch.utils.flop_counter`` sees in one step of the single-process GPT."""
    from paraloom.config import ModelConfig
    from paraloom.mesh import ParallelMesh
    from paraloom.models.gpt import GPTModel, ParallelOptions
    from paraloom.tensor_parallel.random import MODEL_PARALLEL_RNG, get_rng_tracker

    tracker = get_rng_tracker()
    if MODEL_PARALLEL_RNG not in tracker.states:
        tracker.add(MODEL_PARALLEL_RNG, 7)
    cfg = ModelConfig(vocab_size=vocab, hidden_size=h, num_layers=layers, num_attention_heads=a,
                      seq_length=s, ffn_hidden_size=ffn, dropout=dropout)
    model = GPTModel(cfg, ParallelMesh(tp=1), options=ParallelOptions(recompute=recompute))
    tokens = torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model.train()(tokens[:, :-1], tokens[:, 1:]).mean().backward()
    return counter.get_total_flops(), cfg.padded_vocab(1)


@pytest.mark.parametrize("shape", [dict(), dict(s=16, h=96, a=6, layers=3, ffn=160, b=1),
                                   dict(s=64, h=32, a=2, layers=1, vocab=300, dropout=0.1)])
def test_model_and_hardware_flops_equal_a_counted_step(shape):
    s, b, h = shape.get("s", 32), shape.get("b", 2), shape.get("h", 64)
    layers, ffn = shape.get("layers", 2), shape.get("ffn")
    for recompute in ("none", "selective", "full"):
        counted, vocab = _counted(recompute, **shape)
        model = model_flops_per_iteration(b, s, layers, h, vocab, ffn)
        hardware = hardware_flops_per_iteration(b, s, layers, h, vocab, ffn, recompute)
        assert counted == hardware, (recompute, counted, hardware)
        if recompute == "none":
            assert counted == model
        else:
            assert counted > model


def test_flops_formulas_by_hand_gpt3():
    # 175B (B=1536, s=2048, l=96, h=12288, V=51200): model FLOPs 72 B s l h^2 (1 + s/6h +
    # V/12lh); full recomputation is Narayanan's eq. (3); selective adds 4 B s^2 h l (Megatron)
    args = (1536, 2048, 96, 12288, 51200)
    B, s, L, h, V = args
    model = model_flops_per_iteration(*args)
    assert model == pytest.approx(72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h)),
                                  rel=1e-12)
    assert model == pytest.approx(3.3862e18, rel=1e-4)
    assert hardware_flops_per_iteration(*args, recompute="full") == pytest.approx(
        flops_per_iteration(*args), rel=1e-12)
    assert hardware_flops_per_iteration(*args, recompute="none") == model
    megatron_sel = recompute_flops_per_iteration(B, s, L, h, recompute="selective")
    assert megatron_sel == 4 * B * s * s * h * L
    assert recompute_flops_per_iteration(B, s, L, h, recompute="selective",
                                         early_stop=True) == megatron_sel / 2
    with pytest.raises(ValueError, match="recompute"):
        recompute_flops_per_iteration(1, 1, 1, 1, recompute="partial")


def _counted_step(model_cfg: dict, recompute: str, b: int = 2):
    """FLOPs counted in one step of the single-process model of ``model_cfg``, and its config."""
    from paraloom.config import ModelConfig
    from paraloom.mesh import ParallelMesh
    from paraloom.models.gpt import GPTModel, ParallelOptions
    from paraloom.tensor_parallel.random import MODEL_PARALLEL_RNG, get_rng_tracker

    tracker = get_rng_tracker()
    if MODEL_PARALLEL_RNG not in tracker.states:
        tracker.add(MODEL_PARALLEL_RNG, 7)
    cfg = ModelConfig(**model_cfg)
    model = GPTModel(cfg, ParallelMesh(tp=1), options=ParallelOptions(recompute=recompute))
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length + 1),
                           generator=torch.Generator().manual_seed(0))
    # the math kernel of sdpa is counted GEMM by GEMM (the CPU's fused kernel is not counted)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.train()(tokens[:, :-1], tokens[:, 1:]).mean().backward()
    return counter.get_total_flops(), cfg


def _comm_config(cfg, recompute: str, b: int):
    from paraloom.analysis.arch import Architecture
    from paraloom.analysis.formulas import CommConfig
    from paraloom.analysis.moe_formulas import MoECommConfig

    arch = Architecture.from_model({k: getattr(cfg, k) for k in Architecture.__dataclass_fields__})
    moe = MoECommConfig(num_experts=cfg.num_experts, topk=cfg.moe_router_topk,
                        layer_freq=cfg.moe_layer_freq,
                        shared_ffn=cfg.moe_shared_expert_intermediate_size or 0,
                        shared_gate=cfg.moe_shared_expert_gate) if cfg.num_experts else None
    return CommConfig(layers=cfg.num_layers, hidden=cfg.hidden_size,
                      heads=cfg.num_attention_heads, seq_len=cfg.seq_length,
                      vocab=cfg.padded_vocab(1), ffn=cfg.ffn, micro_batch=b,
                      recompute=recompute, arch=arch, moe=moe)


LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
             num_query_groups=2, untie_embeddings_and_output_weights=True, add_bias_linear=False)


@pytest.mark.parametrize("model_cfg", [
    dict(LLAMA, attention="core"),                      # GQA 8 heads / 2 groups, SwiGLU, untied
    dict(LLAMA, attention="sdpa", num_query_groups=4),
    dict(num_experts=4, moe_router_topk=2),             # GPT-2 with MoE in every layer
    dict(num_query_groups=2, untie_embeddings_and_output_weights=True, num_experts=4,
         moe_router_topk=1, moe_layer_freq=2, num_layers=3),  # MoE every other layer, GQA
    dict(LLAMA, num_experts=4, moe_router_topk=2, moe_layer_freq=2),  # Mixtral: SwiGLU experts
    dict(LLAMA, num_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=48,
         moe_shared_expert_gate=True),                  # a gated shared expert beside them
])
def test_llama_and_moe_flops_equal_a_counted_step(model_cfg):
    from paraloom.analysis.flops import hardware_flops, model_flops

    shape = dict(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=8,
                 seq_length=32, ffn_hidden_size=96)
    for recompute in ("none", "selective", "full"):
        counted, cfg = _counted_step({**shape, **model_cfg}, recompute)
        c = _comm_config(cfg, recompute, 2)
        # the re-run is whole (no early stop), so sdpa and core count the same; only a
        # checkpoint that stopped early would re-run QK^T alone for written-out attention
        assert counted == hardware_flops(c), (recompute, counted, hardware_flops(c))
        if recompute == "selective":
            core = replace(c, arch=replace(c.arch, attention="core"))
            assert hardware_flops(core) - hardware_flops(core, early_stop=True) == \
                2 * 2 * 32 * 32 * 64 * cfg.num_layers  # b s^2 h per layer: attention x V
        assert (counted == model_flops(c)) == (recompute == "none")
    # the GPT-2 formulas are the special case
    gpt = _comm_config(_counted_step(shape, "none")[1], "none", 2)
    assert model_flops(gpt) == model_flops_per_iteration(2, 32, 2, 64, gpt.vocab, 96)
    if model_cfg.get("swiglu") and not model_cfg.get("num_experts"):
        # GQA's K/V are smaller, SwiGLU adds a third matrix
        g, n, d = model_cfg["num_query_groups"], 2 * 32, 64 // 8
        assert model_flops(c) - model_flops(gpt) == 3 * 2 * 2 * n * (64 * 96 - 2 * (8 - g) * d * 64)
