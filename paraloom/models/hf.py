"""Hugging Face GPT-2 checkpoints <-> paraloom's GPT: configs, shard-local import, export.

The architecture is read from ``config.json``'s ``model_type``: ``gpt2`` (below) or ``llama``
(``LlamaForCausalLM``, mapped in :mod:`paraloom.models.hf_llama`); every function here
dispatches on it.

A ``transformers`` GPT-2 folder (``config.json`` + ``model.safetensors``, a sharded
``model.safetensors.index.json`` or ``pytorch_model.bin``) maps onto :class:`GPTModel` like this
(HF ``Conv1D`` weights are ``[in, out]``: every linear weight is transposed)::

    wte [V, h]            -> embedding.word_embeddings.weight [Vp, h], zero padding rows, tp rows
    wpe [n_positions, h]  -> embedding.position_embeddings.weight: the first seq_length rows
    h.i.ln_1 / ln_2       -> layers.i.ln1 / ln2                       (global layer index i)
    h.i.attn.c_attn       -> layers.i.attention.qkv: HF columns [q | k | v] (each h wide) become
                             per-head rows [head][q, k, v][d]; a rank takes its own heads
    h.i.attn.c_proj       -> layers.i.attention.proj  (input columns split over tp)
    h.i.mlp.c_fc / c_proj -> layers.i.mlp.fc1 / fc2
    ln_f                  -> final_layernorm;  lm_head is tied to wte (required)

Positions: ``seq_length`` defaults to ``n_positions``; a shorter one keeps the first rows of
``wpe`` (the rest can never be used), and an export then writes ``n_positions = seq_length``.

Each rank reads only its own slices: safetensors through ``safe_open(...).get_slice`` (a memory
map), ``.bin`` through ``torch.load(weights_only=True, mmap=True)``; no checkpoint code is ever
executed. ``safetensors`` is imported lazily, and ``transformers`` never: paraloom itself does
not need either unless these functions are called.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..config import ModelConfig
from .hf_llama import (
    is_llama,
    llama_expected,
    llama_hf_config,
    llama_local,
    llama_model_config,
    llama_to_hf,
)

__all__ = ["read_hf_config", "model_config_from_hf", "hf_config_from_model", "HFReader",
           "check_hf_checkpoint", "load_hf_weights", "to_hf_state_dict"]

_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
_IGNORED = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in old GPT-2 files
_GPT2_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                "ffn_hidden_size", "seq_length", "dropout", "init_std",
                "make_vocab_size_divisible_by", "attention")


def read_hf_config(directory: str | Path) -> dict:
    """The ``config.json`` of a GPT-2 or Llama checkpoint folder (``ValueError`` if it is not
    one)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ValueError(f"{str(directory)!r} is not a Hugging Face checkpoint folder "
                         f"(no config.json)")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{str(path)!r} is not valid JSON: {err}") from None
    if not isinstance(hf, dict) or "model_type" not in hf:
        run = " (it is a paraloom run's config: did you mean --resume?)" \
            if isinstance(hf, dict) and {"model", "parallel"} <= set(hf) else ""
        raise ValueError(f"{str(path)!r} is not a Hugging Face config (no model_type){run}")
    kind = hf["model_type"]
    if kind not in _REQUIRED:
        raise ValueError(f"{str(path)!r}: model_type {kind!r} is not supported "
                         f"(gpt2: GPT2LMHeadModel, llama: LlamaForCausalLM)")
    missing = [key for key in _REQUIRED[kind] if key not in hf]
    if missing:
        raise ValueError(f"{str(path)!r}: a {kind} config without {', '.join(missing)}")
    return hf


_REQUIRED = {"gpt2": ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"),  # no default
             "llama": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                       "intermediate_size")}


def model_config_from_hf(hf: dict, *, seq_length: int | None = None,
                         dropout: float = 0.0) -> ModelConfig:
    """The :class:`ModelConfig` of an HF GPT-2 config; ``ValueError`` naming every setting
    paraloom's GPT does not implement. ``seq_length`` defaults to ``n_positions``."""
    if hf.get("model_type") == "llama":
        return llama_model_config(hf, seq_length=seq_length, dropout=dropout)
    problems = []
    act = hf.get("activation_function", "gelu_new")
    if act not in _TANH_GELU:
        problems.append(f"activation_function = {act!r} (paraloom uses the tanh GeLU: "
                        f"{' or '.join(_TANH_GELU)})")
    eps = hf.get("layer_norm_epsilon", 1e-5)
    if not math.isclose(eps, 1e-5, rel_tol=1e-6):
        problems.append(f"layer_norm_epsilon = {eps} (paraloom's LayerNorm uses 1e-5)")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("reorder_and_upcast_attn", False), ("add_cross_attention", False),
                      ("tie_word_embeddings", True)):
        if bool(hf.get(key, want)) != want:
            problems.append(f"{key} = {hf[key]} (paraloom supports only {want})")
    if problems:
        raise ValueError("unsupported GPT-2 configuration: " + "; ".join(problems))
    positions = int(hf["n_positions"])
    seq = positions if seq_length is None else seq_length
    if seq > positions:
        raise ValueError(f"seq_length = {seq} exceeds the checkpoint's n_positions = "
                         f"{positions} (it has no position embeddings beyond that)")
    return ModelConfig(vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["n_embd"]),
                       num_layers=int(hf["n_layer"]), num_attention_heads=int(hf["n_head"]),
                       ffn_hidden_size=hf.get("n_inner"), seq_length=seq, dropout=dropout,
                       init_std=float(hf.get("initializer_range", 0.02)))


def hf_config_from_model(cfg: ModelConfig) -> dict:
    """A ``config.json`` for ``transformers.GPT2LMHeadModel`` (a Llama-shaped ``cfg``:
    ``LlamaForCausalLM``) with ``cfg``'s shape."""
    if cfg.num_experts:
        raise ValueError(f"this is a mixture-of-experts model (num_experts = "
                         f"{cfg.num_experts}): GPT-2 and Llama, the Hugging Face architectures "
                         f"paraloom exports to, have dense MLPs; there is no export for it")
    if is_llama(cfg):
        return llama_hf_config(cfg)
    if cfg != ModelConfig(**{k: getattr(cfg, k) for k in _GPT2_FIELDS}):
        raise ValueError("this model is neither GPT-2 shaped (LayerNorm, learned positions, "
                         "GeLU, tied, biases, no query groups) nor Llama shaped (RMSNorm, rope, "
                         "swiglu, no biases): no Hugging Face architecture to export it as")
    big = cfg.vocab_size >= 50257  # GPT-2's own <|endoftext|> id; none for other vocabularies
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_length,
            "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
            "n_head": cfg.num_attention_heads,
            "n_inner": None if cfg.ffn == 4 * cfg.hidden_size else cfg.ffn,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "initializer_range": cfg.init_std, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": True, "bos_token_id": 50256 if big else None,
            "eos_token_id": 50256 if big else None}


class HFReader:
    """Reads slices of a checkpoint's tensors by their GPT-2 name (``h.0.attn.c_attn.weight``;
    a ``transformer.`` prefix in the file is accepted) or Llama name (``layers.0.mlp.up_proj
    .weight``; the file's ``model.`` prefix removed)."""

    def __init__(self, directory: str | Path) -> None:
        d = Path(directory)
        self._files, self._where, self._state = {}, {}, None
        index = d / "model.safetensors.index.json"
        if (d / "model.safetensors").is_file() or index.is_file():
            from safetensors import safe_open
            weight_map = (json.loads(index.read_text())["weight_map"] if index.is_file()
                          else None)
            for name in sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]:
                if not (d / name).is_file():
                    raise ValueError(f"{str(d / name)!r} (named by {index.name}) is missing")
                f = self._files[name] = safe_open(str(d / name), framework="pt")
                for key in f.keys():
                    self._where[key] = name
        elif (d / "pytorch_model.bin").is_file():
            try:
                self._state = torch.load(d / "pytorch_model.bin", map_location="cpu",
                                         weights_only=True, mmap=True)
            except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped
                self._state = torch.load(d / "pytorch_model.bin", map_location="cpu",
                                         weights_only=True)
            self._where = dict.fromkeys(self._state)
        else:
            raise ValueError(f"{str(d)!r} holds no model.safetensors, "
                             f"model.safetensors.index.json or pytorch_model.bin")
        self._key = {k.removeprefix("transformer.").removeprefix("model."): k
                     for k in self._where}

    def names(self) -> set[str]:
        return set(self._key)

    def get(self, name: str, rows: slice = slice(None), cols: slice | None = None):
        """``tensor[rows]`` or ``tensor[rows, cols]``, reading only that part where it can."""
        if name not in self._key:
            raise ValueError(f"the checkpoint has no tensor {name!r}")
        key = self._key[name]
        index = (rows,) if cols is None else (rows, cols)
        if self._state is not None:
            return self._state[key][index].clone()
        return self._files[self._where[key]].get_slice(key)[index]


def _expected(cfg: ModelConfig) -> set[str]:
    names = {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"}
    for i in range(cfg.num_layers):
        for m in ("ln_1", "ln_2", "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            names |= {f"h.{i}.{m}.weight", f"h.{i}.{m}.bias"}
    return names


def _check_names(reader: HFReader, cfg: ModelConfig) -> None:
    have, want = reader.names(), (llama_expected if is_llama(cfg) else _expected)(cfg)
    extra = {n for n in have - want if not n.endswith(_IGNORED) and n != "lm_head.weight"}
    if want - have or extra:
        arch = "Llama" if is_llama(cfg) else "GPT-2"
        raise ValueError(f"checkpoint tensors do not match a {arch} with {cfg.num_layers} layers: "
                         f"missing {sorted(want - have)[:8]}, unexpected {sorted(extra)[:8]}")


def check_hf_checkpoint(directory: str | Path, cfg: ModelConfig) -> None:
    """``ValueError`` unless ``directory`` holds exactly the tensors of a GPT-2 shaped ``cfg``
    (names only: cheap enough to run before any rank starts)."""
    _check_names(HFReader(directory), cfg)


def _local(reader: HFReader, name: str, param, cfg: ModelConfig, rank: int) -> torch.Tensor:
    """This tp rank's part of paraloom parameter ``name`` (shape of ``param``), from HF."""
    if is_llama(cfg):
        return llama_local(reader, name, param, cfg, rank)
    shape = tuple(param.shape)
    pdim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
    n = shape[pdim] if pdim is not None else 0
    part = slice(rank * n, (rank + 1) * n)                        # this rank's range on pdim
    parts = name.split(".")
    if name == "embedding.word_embeddings.weight":                # [Vp/tp, h], rows split
        out = torch.zeros(shape, dtype=param.dtype)               # padding rows stay zero
        if part.start < cfg.vocab_size:
            real = reader.get("wte.weight", slice(part.start, min(part.stop, cfg.vocab_size)))
            out[: real.shape[0]] = real
        return out
    if name == "embedding.position_embeddings.weight":
        return reader.get("wpe.weight", slice(0, cfg.seq_length))
    if parts[0] == "final_layernorm":
        return reader.get(f"ln_f.{parts[1]}")
    i, module, kind = parts[1], ".".join(parts[2:-1]), parts[-1]
    if module in ("ln1", "ln2"):
        return reader.get(f"h.{i}.ln_{module[-1]}.{kind}")
    if module == "attention.qkv":                                 # rows [a/tp][q,k,v][d]
        h, d = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
        heads = slice(part.start // 3, part.stop // 3)            # columns of this rank's heads
        w = f"h.{i}.attn.c_attn.{kind}"
        if kind == "bias":
            qkv = [reader.get(w, slice(p * h + heads.start, p * h + heads.stop)) for p in range(3)]
            return torch.stack(qkv, 0).view(3, -1, d).transpose(0, 1).reshape(shape)
        qkv = [reader.get(w, slice(None), slice(p * h + heads.start, p * h + heads.stop))
               for p in range(3)]                                 # 3 x [h, a/tp*d]
        return torch.stack(qkv, 0).view(3, h, -1, d).permute(2, 0, 3, 1).reshape(shape)
    src = {"attention.proj": "attn.c_proj", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
    if module not in src:
        raise ValueError(f"no Hugging Face GPT-2 tensor maps to paraloom parameter {name!r}")
    w = f"h.{i}.{src[module]}.{kind}"
    if kind == "bias":
        return reader.get(w, part if pdim is not None else slice(None))
    if pdim == 0:                                                 # column-parallel: HF columns
        return reader.get(w, slice(None), part).t()
    return reader.get(w, part if pdim == 1 else slice(None)).t()  # row-parallel: HF rows


@torch.no_grad()
def load_hf_weights(chunks, directory: str | Path, cfg: ModelConfig, tp_rank: int) -> None:
    """Overwrite every parameter of this rank's model ``chunks`` with its shard of the HF
    checkpoint in ``directory`` (read shard-locally)."""
    reader = HFReader(directory)
    _check_names(reader, cfg)
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            value = _local(reader, name, param, cfg, tp_rank)
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"{name}: the checkpoint gives shape {tuple(value.shape)}, the "
                                 f"model has {tuple(param.shape)} on this rank")
            param.copy_(value)


def to_hf_state_dict(params: dict[str, torch.Tensor], cfg: ModelConfig) -> dict:
    """Full (unsharded) paraloom parameters -> an HF ``GPT2LMHeadModel`` state dict
    (``transformer.*``; ``lm_head`` is tied, so not stored), or a ``LlamaForCausalLM`` one for
    a Llama-shaped ``cfg``. Vocabulary padding is dropped."""
    if is_llama(cfg):
        return llama_to_hf(params, cfg)
    h, a = cfg.hidden_size, cfg.num_attention_heads
    out = {"transformer.wte.weight": params["embedding.word_embeddings.weight"][: cfg.vocab_size],
           "transformer.wpe.weight": params["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": params["final_layernorm.weight"],
           "transformer.ln_f.bias": params["final_layernorm.bias"]}
    for i in range(cfg.num_layers):
        p, t = f"layers.{i}.", f"transformer.h.{i}."
        qkv_w = params[p + "attention.qkv.weight"].view(a, 3, h // a, h)  # [a][q,k,v][d] x h
        qkv_b = params[p + "attention.qkv.bias"].view(a, 3, h // a)
        out |= {t + f"ln_{j}.{k}": params[p + f"ln{j}.{k}"] for j in (1, 2)
                for k in ("weight", "bias")}
        out |= {t + "attn.c_attn.weight": qkv_w.permute(1, 0, 2, 3).reshape(3 * h, h).t(),
                t + "attn.c_attn.bias": qkv_b.permute(1, 0, 2).reshape(3 * h),
                t + "attn.c_proj.weight": params[p + "attention.proj.weight"].t(),
                t + "attn.c_proj.bias": params[p + "attention.proj.bias"],
                t + "mlp.c_fc.weight": params[p + "mlp.fc1.weight"].t(),
                t + "mlp.c_fc.bias": params[p + "mlp.fc1.bias"],
                t + "mlp.c_proj.weight": params[p + "mlp.fc2.weight"].t(),
                t + "mlp.c_proj.bias": params[p + "mlp.fc2.bias"]}
    return {k: v.detach().to(torch.float32, copy=True).contiguous() for k, v in out.items()}
