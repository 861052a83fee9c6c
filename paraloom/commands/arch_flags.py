"""Megatron's architecture flags (shared by ``train``, ``eval`` and ``plan``) and ``--arch``.

``--arch llama`` is shorthand for ``--normalization RMSNorm --swiglu --position-embedding-type
rope --untie-embeddings-and-output-weights --disable-bias-linear`` (add ``--group-query-attention
--num-query-groups G`` for grouped-query attention); an explicit flag still wins. The default
(``--arch gpt2``) is the GPT-2 model, unchanged. The flags themselves come from
:class:`~paraloom.config.ModelConfig`'s field metadata.
"""

from __future__ import annotations

import dataclasses

from ..config import LLAMA, ModelConfig, TrainConfig
from .flags import add_flags, given

__all__ = ["ARCH_PATHS", "add_architecture_flags", "architecture_from_args", "apply_architecture",
           "LLAMA", "preset"]

ARCH_PATHS = tuple(f"model.{name}" for name in (
    "normalization", "norm_epsilon", "swiglu", "position_embedding_type", "rotary_base",
    "num_query_groups", "untie_embeddings_and_output_weights", "add_bias_linear", "attention"))
"""The architecture fields (not the shape): what ``--arch`` presets."""


def preset(arch: str | None) -> dict:
    """The ModelConfig fields ``--arch ARCH`` sets (``{}`` when not given): Llama's, or GPT-2's
    (the defaults), so that either one can contradict a checkpoint."""
    if arch == "llama":
        return dict(LLAMA)
    default = ModelConfig()
    return {k: getattr(default, k) for k in LLAMA} if arch == "gpt2" else {}


def add_architecture_flags(parser) -> None:
    """Add ``--arch``, ``--group-query-attention`` and the architecture fields' flags."""
    g = parser.add_argument_group("architecture (Megatron's flags)")
    g.add_argument("--arch", choices=["gpt2", "llama"], default=None,
                   help="preset: gpt2 (default: LayerNorm, learned positions, GeLU, tied, "
                        "biases) or llama (RMSNorm, rope, SwiGLU, untied, no biases)")
    g.add_argument("--group-query-attention", action="store_true", default=None,
                   help="grouped-query attention with --num-query-groups key/value heads")
    add_flags(g, ARCH_PATHS, TrainConfig())


def architecture_from_args(args) -> dict:
    """The ModelConfig fields the flags set (only those given or implied by ``--arch``);
    ``ValueError`` for inconsistent ones."""
    out = preset(getattr(args, "arch", None))
    out.update({path[len("model."):]: value for path, value in given(args, ARCH_PATHS).items()})
    gqa = getattr(args, "group_query_attention", None)
    groups = out.get("num_query_groups")
    if gqa and groups is None:
        raise ValueError("--group-query-attention needs --num-query-groups G")
    if groups is not None and not gqa:
        raise ValueError(f"--num-query-groups {groups} needs --group-query-attention "
                         f"(Megatron's pairing)")
    return out


def apply_architecture(model, args, source: str):
    """``model`` (whose shape came from ``source``, e.g. a checkpoint) with ``--attention``
    applied; ``ValueError`` if another architecture flag contradicts it."""
    arch = architecture_from_args(args)
    clash = [f"{k} = {v!r} (it has {getattr(model, k)!r})" for k, v in arch.items()
             if k != "attention" and getattr(model, k) != v]
    if clash:
        raise ValueError(f"{source} fixes the architecture; drop or correct the flags giving "
                         + ", ".join(clash))
    return dataclasses.replace(model, attention=arch["attention"]) if "attention" in arch \
        else model
