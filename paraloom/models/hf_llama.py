"""Hugging Face ``LlamaForCausalLM`` checkpoints <-> paraloom's Llama-shaped GPT.

Linear weights are ``[out, in]`` in both (no transposes). Names and layouts (``i`` = global layer)::

    embed_tokens [V, h]         -> embedding.word_embeddings.weight [Vp, h]  (zero padding rows)
    lm_head [V, h]              -> output_layer.weight [Vp, h]   (untied; tied: no lm_head)
    layers.i.input_layernorm    -> layers.i.ln1          post_attention_layernorm -> ln2
    q_proj [a d, h], k_proj, v_proj [g d, h]
                                -> layers.i.attention.qkv [(a + 2g) d, h], rows per key/value
                                   group [g][q x a/g, k, v][d]; a tp rank takes g/tp whole groups
    o_proj [h, a d]             -> attention.proj (input columns split over tp)
    gate_proj, up_proj [f, h]   -> mlp.fc1 [2f, h] = [gate; up]; rank r holds [gate_r; up_r]
    down_proj [h, f]            -> mlp.fc2
    norm                        -> final_layernorm

Rotary positions use the same "rotate half" convention on both sides (``transformers`` keeps
Meta's checkpoints permuted into it when converting), so q and k rows map unpermuted.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig

__all__ = ["is_llama", "llama_model_config", "llama_hf_config", "llama_expected", "llama_local",
           "llama_to_hf"]


def is_llama(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` has the shape of a ``LlamaForCausalLM``."""
    return (cfg.normalization == "RMSNorm" and cfg.swiglu and not cfg.add_bias_linear
            and cfg.position_embedding_type == "rope")


def _rope_theta(hf: dict) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"rope_type = {kind!r} (paraloom implements only the default rotary "
                         f"embedding, no scaling)")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def llama_model_config(hf: dict, *, seq_length: int | None = None,
                       dropout: float = 0.0) -> ModelConfig:
    """The :class:`ModelConfig` of an HF Llama ``config.json``; ``ValueError`` naming every
    setting paraloom does not implement."""
    problems = []
    h, a = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {hf['hidden_act']!r} (paraloom's SwiGLU uses silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False):
            problems.append(f"{key} = true (paraloom's Llama has no biases)")
    if hf.get("head_dim") not in (None, h // a):
        problems.append(f"head_dim = {hf['head_dim']} (paraloom needs hidden_size / "
                        f"num_attention_heads = {h // a})")
    try:
        theta = _rope_theta(hf)
    except ValueError as err:
        problems.append(str(err))
        theta = 10000.0
    if theta != int(theta):
        problems.append(f"rope_theta = {theta} (paraloom's rotary base is an integer)")
    if problems:
        raise ValueError("unsupported Llama configuration: " + "; ".join(problems))
    positions = int(hf.get("max_position_embeddings", 2048))
    seq = positions if seq_length is None else seq_length
    if seq > positions:
        raise ValueError(f"seq_length = {seq} exceeds the checkpoint's max_position_embeddings "
                         f"= {positions}")
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]), hidden_size=h, num_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=a, ffn_hidden_size=int(hf["intermediate_size"]), seq_length=seq,
        dropout=dropout, init_std=float(hf.get("initializer_range", 0.02)),
        normalization="RMSNorm", norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), swiglu=True,
        position_embedding_type="rope", rotary_base=int(theta),
        num_query_groups=int(hf.get("num_key_value_heads") or a),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        add_bias_linear=False)


def llama_hf_config(cfg: ModelConfig) -> dict:
    """A ``config.json`` for ``transformers.LlamaForCausalLM`` with ``cfg``'s shape."""
    if not is_llama(cfg):
        raise ValueError("only a Llama-shaped model (RMSNorm, swiglu, rope, no biases) exports "
                         "as LlamaForCausalLM")
    tied = not cfg.untie_embeddings_and_output_weights
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.query_groups, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "max_position_embeddings": cfg.seq_length,
            "rms_norm_eps": cfg.norm_epsilon, "initializer_range": cfg.init_std,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rotary_base)},
            "rope_theta": float(cfg.rotary_base), "tie_word_embeddings": tied,
            "attention_bias": False, "mlp_bias": False, "attention_dropout": cfg.dropout,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def llama_expected(cfg: ModelConfig) -> set[str]:
    """The tensor names (``model.`` prefix removed) of a Llama checkpoint shaped ``cfg``."""
    names = {"embed_tokens.weight", "norm.weight"}
    if cfg.untie_embeddings_and_output_weights:
        names.add("lm_head.weight")
    for i in range(cfg.num_layers):
        names |= {f"layers.{i}.{m}.weight" for m in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
            "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")}
    return names


def _vocab_rows(reader, name: str, shape, dtype, part: slice, cfg: ModelConfig):
    out = torch.zeros(shape, dtype=dtype)                    # padding rows stay zero
    if part.start < cfg.vocab_size:
        real = reader.get(name, slice(part.start, min(part.stop, cfg.vocab_size)))
        out[: real.shape[0]] = real
    return out


def llama_local(reader, name: str, param, cfg: ModelConfig, rank: int) -> torch.Tensor:
    """This tp rank's part of paraloom parameter ``name`` (shape of ``param``), from HF Llama."""
    shape = tuple(param.shape)
    pdim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
    n = shape[pdim] if pdim is not None else 0
    part = slice(rank * n, (rank + 1) * n)
    if name == "embedding.word_embeddings.weight":
        return _vocab_rows(reader, "embed_tokens.weight", shape, param.dtype, part, cfg)
    if name == "output_layer.weight":
        return _vocab_rows(reader, "lm_head.weight", shape, param.dtype, part, cfg)
    if name == "final_layernorm.weight":
        return reader.get("norm.weight")
    parts = name.split(".")
    i, module = parts[1], ".".join(parts[2:-1])
    pre = f"layers.{i}."
    if module in ("ln1", "ln2"):
        return reader.get(pre + ("input_layernorm" if module == "ln1"
                                 else "post_attention_layernorm") + ".weight")
    if module == "attention.qkv":
        d, per = cfg.head_dim, cfg.num_attention_heads // cfg.query_groups
        rows_per_group = (per + 2) * d
        g0, g1 = part.start // rows_per_group, part.stop // rows_per_group
        blocks = []
        for g in range(g0, g1):
            blocks += [reader.get(pre + "self_attn.q_proj.weight",
                                  slice(g * per * d, (g + 1) * per * d)),
                       reader.get(pre + "self_attn.k_proj.weight", slice(g * d, (g + 1) * d)),
                       reader.get(pre + "self_attn.v_proj.weight", slice(g * d, (g + 1) * d))]
        return torch.cat(blocks, 0)
    if module == "attention.proj":
        return reader.get(pre + "self_attn.o_proj.weight", slice(None), part)
    if module == "mlp.fc1":
        half = n // 2
        rows = slice(rank * half, (rank + 1) * half)
        return torch.cat([reader.get(pre + "mlp.gate_proj.weight", rows),
                          reader.get(pre + "mlp.up_proj.weight", rows)], 0)
    if module == "mlp.fc2":
        return reader.get(pre + "mlp.down_proj.weight", slice(None), part)
    raise ValueError(f"no Hugging Face Llama tensor maps to paraloom parameter {name!r}")


def llama_to_hf(params: dict[str, torch.Tensor], cfg: ModelConfig) -> dict:
    """Full paraloom parameters -> an HF ``LlamaForCausalLM`` state dict. ``mlp.fc1.weight``
    may come as ``[2f, h]`` or as the checkpoint's ``[2, f, h]`` (gate, up)."""
    a, g, d, h = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim, cfg.hidden_size
    per = a // g
    out = {"model.embed_tokens.weight": params["embedding.word_embeddings.weight"][
        : cfg.vocab_size], "model.norm.weight": params["final_layernorm.weight"]}
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = params["output_layer.weight"][: cfg.vocab_size]
    for i in range(cfg.num_layers):
        p, t = f"layers.{i}.", f"model.layers.{i}."
        qkv = params[p + "attention.qkv.weight"].reshape(g, per + 2, d, h)
        gate, up = params[p + "mlp.fc1.weight"].reshape(2, cfg.ffn, h)
        out |= {t + "input_layernorm.weight": params[p + "ln1.weight"],
                t + "post_attention_layernorm.weight": params[p + "ln2.weight"],
                t + "self_attn.q_proj.weight": qkv[:, :per].reshape(a * d, h),
                t + "self_attn.k_proj.weight": qkv[:, per].reshape(g * d, h),
                t + "self_attn.v_proj.weight": qkv[:, per + 1].reshape(g * d, h),
                t + "self_attn.o_proj.weight": params[p + "attention.proj.weight"],
                t + "mlp.gate_proj.weight": gate, t + "mlp.up_proj.weight": up,
                t + "mlp.down_proj.weight": params[p + "mlp.fc2.weight"]}
    return {k: v.detach().to(torch.float32, copy=True).contiguous() for k, v in out.items()}
