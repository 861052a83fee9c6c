"""Megatron's architecture flags (shared by ``train``, ``eval`` and ``plan``) and ``--arch``.

``--arch llama`` is shorthand for ``--normalization RMSNorm --swiglu --position-embedding-type
rope --untie-embeddings-and-output-weights --disable-bias-linear`` (add ``--group-query-attention
--num-query-groups G`` for grouped-query attention); an explicit flag still wins. The default
(``--arch gpt2``) is the GPT-2 model, unchanged.
"""

from __future__ import annotations

import argparse

__all__ = ["add_architecture_flags", "architecture_from_args", "apply_architecture",
           "flags_of_model", "LLAMA"]

LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
             untie_embeddings_and_output_weights=True, add_bias_linear=False)
"""What ``--arch llama`` sets (ModelConfig field names)."""


def add_architecture_flags(parser: argparse.ArgumentParser) -> None:
    """Add the flags; each defaults to ``None`` (= not given) so ``--arch`` can fill it."""
    g = parser.add_argument_group("architecture (Megatron's flags)")
    a = g.add_argument
    a("--arch", choices=["gpt2", "llama"], default=None,
      help="preset: gpt2 (default: LayerNorm, learned positions, GeLU, tied, biases) or llama "
           "(RMSNorm, rope, SwiGLU, untied, no biases)")
    a("--normalization", choices=["LayerNorm", "RMSNorm"], default=None)
    a("--norm-epsilon", type=float, default=None, help="epsilon of every norm (default 1e-5)")
    a("--swiglu", action="store_true", default=None, help="SwiGLU MLP (fc1 holds gate and up)")
    a("--position-embedding-type", choices=["learned_absolute", "rope"], default=None)
    a("--rotary-base", type=int, default=None, help="rotary theta (default 10000)")
    a("--group-query-attention", action="store_true", default=None,
      help="grouped-query attention with --num-query-groups key/value heads")
    a("--num-query-groups", type=int, default=None,
      help="key/value heads G (divisible by --tp: each rank holds G/tp groups)")
    a("--untie-embeddings-and-output-weights", action="store_true", default=None)
    a("--disable-bias-linear", action="store_true", default=None)
    a("--attention", choices=["core", "sdpa"], default=None,
      help="core: written-out attention (saves the s x s scores; default); sdpa: "
           "torch's scaled_dot_product_attention (flash on GPUs)")


def architecture_from_args(args) -> dict:
    """The ModelConfig fields the flags set (only those given or implied by ``--arch``);
    ``ValueError`` for inconsistent ones."""
    out = dict(LLAMA) if args.arch == "llama" else {}
    for field, flag in (("normalization", "normalization"), ("norm_epsilon", "norm_epsilon"),
                        ("position_embedding_type", "position_embedding_type"),
                        ("rotary_base", "rotary_base"), ("attention", "attention")):
        if getattr(args, flag) is not None:
            out[field] = getattr(args, flag)
    if args.swiglu:
        out["swiglu"] = True
    if args.untie_embeddings_and_output_weights:
        out["untie_embeddings_and_output_weights"] = True
    if args.disable_bias_linear:
        out["add_bias_linear"] = False
    if args.group_query_attention and args.num_query_groups is None:
        raise ValueError("--group-query-attention needs --num-query-groups G")
    if args.num_query_groups is not None:
        if not args.group_query_attention:
            raise ValueError(f"--num-query-groups {args.num_query_groups} needs "
                             f"--group-query-attention (Megatron's pairing)")
        out["num_query_groups"] = args.num_query_groups
    return out


def apply_architecture(model, args, source: str):
    """``model`` (whose shape came from ``source``, e.g. a checkpoint) with ``--attention``
    applied; ``ValueError`` if another architecture flag contradicts it."""
    from dataclasses import replace
    arch = architecture_from_args(args)
    clash = [f"{k} = {v!r} (it has {getattr(model, k)!r})" for k, v in arch.items()
             if k != "attention" and getattr(model, k) != v]
    if clash:
        raise ValueError(f"{source} fixes the architecture; drop or correct the flags giving "
                         + ", ".join(clash))
    return replace(model, attention=arch["attention"]) if "attention" in arch else model


def flags_of_model(model: dict) -> dict:
    """``{argparse dest: value}`` that reproduce a saved ``config.json`` model's architecture
    (for ``train --resume``; keys missing in older run folders mean GPT-2)."""
    groups = model.get("num_query_groups")
    return {"arch": None, "normalization": model.get("normalization"),
            "norm_epsilon": model.get("norm_epsilon"), "swiglu": model.get("swiglu") or None,
            "position_embedding_type": model.get("position_embedding_type"),
            "rotary_base": model.get("rotary_base"), "num_query_groups": groups,
            "group_query_attention": True if groups else None,
            "untie_embeddings_and_output_weights":
                model.get("untie_embeddings_and_output_weights") or None,
            "disable_bias_linear": True if model.get("add_bias_linear") is False else None,
            "attention": model.get("attention")}
