"""The architecture switches the formulas need (Llama family), and the parameters they imply.

:class:`Architecture` mirrors :class:`~paraloom.config.ModelConfig`'s architecture fields; its
default is the GPT-2 model, for which nothing here changes any formula. For another architecture
:func:`arch_chunk_params` lists a chunk's parameters the way
:class:`~paraloom.models.gpt.GPTModel` registers them (so the gradient buckets, the ZeRO
all-gathers and the sequence-parallel sums come out exact):

* grouped-query attention: QKV is ``(a + 2g) d`` rows, not ``3h`` (``d = h / a``);
* SwiGLU: fc1 is ``2f`` rows (gate and up);
* no biases (``add_bias_linear = False``): no QKV/proj/fc1/fc2 biases;
* RMSNorm: one weight, no bias;
* rope: no position-embedding table;
* untied output layer: ``output_layer.weight`` on the last chunk, the word embedding only on the
  first; no embedding-group all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

__all__ = ["Architecture", "arch_chunk_params", "layer_param_count", "arch_params_per_rank",
           "arch_param_count"]


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """ModelConfig's architecture fields (same names and defaults: GPT-2)."""

    normalization: str = "LayerNorm"
    swiglu: bool = False
    position_embedding_type: str = "learned_absolute"
    num_query_groups: int | None = None
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    attention: str = "core"

    @classmethod
    def from_model(cls, model: dict) -> Architecture:
        """From a ``config.json``'s ``model`` dict (absent keys: GPT-2's values)."""
        return cls(**{f.name: model[f.name] for f in fields(cls) if f.name in model})

    @cached_property  # asked for every layout the search tries; the instance is frozen
    def is_gpt2(self) -> bool:
        """Every parameter as in GPT-2 (``attention`` changes no parameter)."""
        return self == Architecture(attention=self.attention)

    @property
    def tied(self) -> bool:
        return not self.untie_embeddings_and_output_weights


def layer_param_count(arch: Architecture, h: int, a: int, f: int) -> tuple[int, int]:
    """``(split over tp, replicated)`` parameters of one layer."""
    g = arch.num_query_groups or a
    qkv = (a + 2 * g) * (h // a)
    fc1 = 2 * f if arch.swiglu else f
    split = qkv * h + h * h + fc1 * h + f * h + (qkv + fc1 if arch.add_bias_linear else 0)
    norms = (1 if arch.normalization == "RMSNorm" else 2) * 2 * h
    return split, norms + (2 * h if arch.add_bias_linear else 0)


def arch_chunk_params(c, first: bool, last: bool, layer_ids, param_cls) -> list:
    """The parameters of a chunk (``first``/``last``: it holds the embedding / the head) of
    CommConfig ``c``, in registration order, as ``param_cls(name, numel, shared, sp)``."""
    arch, t, h, f, sp = c.arch, c.tp, c.hidden, c.f, c.sp
    vocab = -(-c.vocab // t) * t
    rms, bias = arch.normalization == "RMSNorm", arch.add_bias_linear
    qkv = (c.heads + 2 * (arch.num_query_groups or c.heads)) * (h // c.heads)
    fc1 = 2 * f if arch.swiglu else f
    out = []

    def norm(name):
        out.append(param_cls(name + ".weight", h, sp=sp))
        if not rms:
            out.append(param_cls(name + ".bias", h, sp=sp))

    if first or (last and arch.tied):
        out.append(param_cls("embedding.word_embeddings.weight", vocab // t * h,
                             shared=c.pp > 1 and arch.tied))
    if first and arch.position_embedding_type == "learned_absolute":
        out.append(param_cls("embedding.position_embeddings.weight", c.seq_len * h, sp=sp))
    for i in layer_ids:
        p = f"layers.{i}."
        norm(p + "ln1")
        out.append(param_cls(p + "attention.qkv.weight", qkv // t * h))
        if bias:
            out.append(param_cls(p + "attention.qkv.bias", qkv // t))
        out.append(param_cls(p + "attention.proj.weight", h * (h // t)))
        if bias:
            out.append(param_cls(p + "attention.proj.bias", h, sp=sp))
        norm(p + "ln2")
        out.append(param_cls(p + "mlp.fc1.weight", fc1 // t * h))
        if bias:
            out.append(param_cls(p + "mlp.fc1.bias", fc1 // t))
        out.append(param_cls(p + "mlp.fc2.weight", h * (f // t)))
        if bias:
            out.append(param_cls(p + "mlp.fc2.bias", h, sp=sp))
    if last:
        norm("final_layernorm")
        if not arch.tied:
            out.append(param_cls("output_layer.weight", vocab // t * h))
    return out


_COUNTS: dict = {}
"""Counts already made, by what they depend on (``plan --search`` asks for many layouts)."""


def arch_params_per_rank(c, pp_rank: int) -> int:
    """Parameters one rank of pipeline stage ``pp_rank`` stores (all of its chunks)."""
    key = (c.arch, c.layers, c.hidden, c.heads, c.f, c.seq_len, c.vocab, c.tp, c.pp, c.v, c.sp,
           c.moe, pp_rank)
    if key not in _COUNTS:
        from .layout import chunk_params
        _COUNTS[key] = sum(p.numel for k in range(c.v) for p in chunk_params(c, pp_rank, k))
    return _COUNTS[key]


def arch_param_count(c) -> int:
    """Parameters of the whole model (one copy: tp = pp = 1)."""
    from dataclasses import replace
    return arch_params_per_rank(replace(c, tp=1, pp=1, vpp=None, sequence_parallel=False), 0)
