"""The parameters an architecture implies (Llama family).

:class:`~.spec.Architecture` mirrors :class:`~paraloom.config.ModelConfig`'s architecture
fields; its default is the GPT-2 model, for which nothing here changes any formula. For another
architecture :func:`arch_chunk_params` lists a chunk's parameters the way
:class:`~paraloom.models.gpt.GPTModel` registers them (so the gradient buckets, the ZeRO
all-gathers and the sequence-parallel sums come out exact):

* grouped-query attention: QKV is ``(a + 2g) d`` rows, not ``3h`` (``d = h / a``);
* SwiGLU: fc1 is ``2f`` rows (gate and up);
* no biases (``add_bias_linear = False``): no QKV/proj/fc1/fc2 biases;
* RMSNorm: one weight, no bias;
* rope: no position-embedding table;
* mixture of experts: a MoE layer's router and experts in place of its MLP
  (:func:`~.moe_formulas.moe_layer_params`: SwiGLU experts have ``2f``-row fc1s, no biases);
* untied output layer: ``output_layer.weight`` on the last chunk, the word embedding only on the
  first; no embedding-group all-reduce (tied: the last chunk's copy of the word embedding comes
  after its final norm, where the output layer would be).
"""

from __future__ import annotations

from .moe_formulas import moe_layer_params
from .spec import Architecture

__all__ = ["Architecture", "arch_chunk_params", "layer_param_count"]




def layer_param_count(arch: Architecture, h: int, a: int, f: int) -> tuple[int, int]:
    """``(split over tp, replicated)`` parameters of one layer."""
    g = arch.num_query_groups or a
    qkv = (a + 2 * g) * (h // a)
    fc1 = arch.fc1(f)
    split = qkv * h + h * h + fc1 * h + f * h + (qkv + fc1 if arch.add_bias_linear else 0)
    norms = (1 if arch.normalization == "RMSNorm" else 2) * 2 * h
    return split, norms + (2 * h if arch.add_bias_linear else 0)


def arch_chunk_params(c, first: bool, last: bool, layer_ids, param_cls) -> list:
    """The parameters of a chunk (``first``/``last``: it holds the embedding / the head) of
    CommConfig ``c``, in registration order, as ``param_cls(name, numel, shared, sp, row)``
    (``row``: the elements of one row of a matrix, its size over the first dimension)."""
    arch, t, h, f, sp = c.arch, c.tp, c.hidden, c.f, c.sp
    vocab = -(-c.vocab // t) * t
    rms, bias = arch.normalization == "RMSNorm", arch.add_bias_linear
    qkv = (c.heads + 2 * (arch.num_query_groups or c.heads)) * (h // c.heads)
    fc1 = arch.fc1(f)
    out = []

    def norm(name):
        out.append(param_cls(name + ".weight", h, sp=sp))
        if not rms:
            out.append(param_cls(name + ".bias", h, sp=sp))

    word = param_cls("embedding.word_embeddings.weight", vocab // t * h,
                     shared=c.pp > 1 and arch.tied, row=h)
    if first:
        out.append(word)
    if first and arch.position_embedding_type == "learned_absolute":  # replicated, even with sp
        out.append(param_cls("embedding.position_embeddings.weight", c.seq_len * h, row=h))
    for i in layer_ids:
        p = f"layers.{i}."
        norm(p + "ln1")
        out.append(param_cls(p + "attention.proj.weight", h * (h // t), row=h // t))
        if bias:
            out.append(param_cls(p + "attention.proj.bias", h, sp=sp))
        out.append(param_cls(p + "attention.qkv.weight", qkv // t * h, row=h))
        if bias:
            out.append(param_cls(p + "attention.qkv.bias", qkv // t))
        norm(p + "ln2")
        if c.moe is not None and c.moe.is_moe_layer(i):  # router + this ep rank's experts
            out += moe_layer_params(c, p + "mlp.")
            continue
        out.append(param_cls(p + "mlp.fc1.weight", fc1 // t * h, row=h))
        if bias:
            out.append(param_cls(p + "mlp.fc1.bias", fc1 // t))
        out.append(param_cls(p + "mlp.fc2.weight", h * (f // t), row=f // t))
        if bias:
            out.append(param_cls(p + "mlp.fc2.bias", h, sp=sp))
    if last:
        norm("final_layernorm")
        if not arch.tied:
            out.append(param_cls("output_layer.weight", vocab // t * h, row=h))
        elif not first:  # the last stage's tied copy, registered as its output layer
            out.append(word)
    return out
