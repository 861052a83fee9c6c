"""A GPT-2-architecture model built from paraloom's parallel layers (reads like nanoGPT's).

Learned positions, pre-LayerNorm blocks, causal self-attention written out (so its activations
can be counted), tanh-GeLU MLP, biases everywhere, word embeddings tied to the output layer.
The Llama family swaps parts through :class:`~paraloom.config.ModelConfig` (blocks in
``layers.py``): RMSNorm, rotary positions, SwiGLU, grouped-query attention, an untied output
layer (``output_layer.weight``), no biases, and ``sdpa`` attention.
Activations are sequence-first ``[s, b, h]``; with sequence parallelism ``[s/tp, b, h]`` between
the tensor-parallel regions. One :class:`GPTModel` is one pipeline chunk: it holds the global
layers ``layer_ids`` (named ``layers.<global index>``), the embedding if ``pre_process`` and the
final LayerNorm, output layer and loss if ``post_process``.

Where it communicates (all through the layers, see ``tensor_parallel/``): the embedding's
all-reduce (sp with learned positions: then a local split, whose backward all-gathers; sp with
rotary: a reduce-scatter); per layer two column/row pairs (QKV/proj, fc1/fc2); the output
layer's input copy (its backward all-reduce async with ``async_grad_allreduce``, as Megatron-Core's
ColumnParallelLinear output layer; sp: all-gather, and in backward the async re-gather and
reduce-scatter) and the vocab-parallel cross-entropy's three all-reduces.

    mesh = ParallelMesh(tp=2); model = GPTModel(ModelConfig(), mesh)
    loss = model(tokens, labels)          # tokens, labels: [b, s] -> per-token loss [b, s]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from ..config import ModelConfig
from ..context_parallel import ContextParallelAttention
from ..mesh import ParallelMesh
from ..moe import MoELayer, is_moe_layer
from ..tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    parallel_lm_logits,
    set_tensor_model_parallel_attributes,
    vocab_parallel_cross_entropy,
)
from ..tensor_parallel.init import CounterInit, shard_range
from ..tensor_parallel.random import checkpoint
from ..utils import divide
from .embedding import Embedding
from .layers import (
    CoreAttention,
    RotaryEmbedding,
    SwiGLUInit,
    apply_rotary,
    dropout,
    make_core_attention,
    make_norm,
    swiglu,
)
from .options import ParallelOptions

__all__ = ["GPTModel", "TransformerLayer", "SelfAttention", "MLP", "Embedding", "ParallelOptions",
           "CoreAttention"]


class SelfAttention(nn.Module):
    """QKV column-parallel, core attention, row proj. QKV rows are per key/value group
    ``[g][q x a/g, k, v][d]`` (Megatron's layout; for ``g = a`` per head ``[q, k, v]``), so a
    rank holds whole groups: ``a/tp`` query and ``g/tp`` key/value heads."""

    def __init__(self, cfg: ModelConfig, mesh: ParallelMesh, name: str, opt: ParallelOptions,
                 init, out_init) -> None:
        super().__init__()
        h, sp, common = cfg.hidden_size, opt.sequence_parallel, _common(mesh, opt)
        bias, d = cfg.add_bias_linear, cfg.head_dim
        self.heads_local = divide(cfg.num_attention_heads, mesh.tp.size, "num_attention_heads")
        self.groups_local = divide(cfg.query_groups, mesh.tp.size, "num_query_groups")
        self.selective = opt.recompute == "selective"
        qkv_size = (cfg.num_attention_heads + 2 * cfg.query_groups) * d
        # registered core, proj, qkv as in Megatron-Core's SelfAttention: the order decides
        # where the gradient buckets are cut
        self.core = make_core_attention(cfg.attention, cfg.dropout) if mesh.cp.size == 1 else \
            ContextParallelAttention(mesh.cp, mesh.config.cp_comm_type, f"{name}.core",
                                     make_core_attention(cfg.attention, cfg.dropout),
                                     mesh.cp_levels)
        self.proj = RowParallelLinear(h, h, bias=bias, input_is_parallel=True,
                                      sequence_parallel=sp, init_method=out_init,
                                      name=f"{name}.proj", **common)
        self.qkv = ColumnParallelLinear(h, qkv_size, bias=bias, init_method=init,
                                        name=f"{name}.qkv",
                                        async_grad_allreduce=opt.async_grad_allreduce,
                                        sequence_parallel=sp, **common)

    def _split_qkv(self, qkv):                               # [s, b, (a+2g)d/tp]
        s, b, _ = qkv.shape
        g, per = self.groups_local, self.heads_local // self.groups_local
        if per == 1:
            q, k, v = qkv.view(s, b, g, 3, -1).unbind(3)     # [s, b, a/tp, d]
        else:
            qkv = qkv.view(s, b, g, per + 2, -1)
            q = qkv[:, :, :, :per].reshape(s, b, self.heads_local, -1)
            k, v = qkv[:, :, :, per], qkv[:, :, :, per + 1]  # [s, b, g/tp, d]
        return (t.permute(1, 2, 0, 3) for t in (q, k, v))    # [b, heads, s, d]

    def forward(self, x, rope=None):                         # [s(/tp), b, h]
        qkv, _ = self.qkv(x)                                 # [s, b, (a+2g)d/tp]
        s, b, _ = qkv.shape
        q, k, v = self._split_qkv(qkv)                       # q [b, a/tp, s, d]; k, v [b, g/tp..]
        if rope is not None:                                 # rotary before the core attention
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        ctx = checkpoint(self.core, q, k, v) if self.selective else self.core(q, k, v)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, -1)      # [s, b, h/tp]
        out, _ = self.proj(ctx)                              # [s(/tp), b, h]
        return out


class MLP(nn.Module):
    """fc1 column-parallel (``4h/tp`` per rank), tanh-GeLU, fc2 row-parallel. With ``swiglu``
    fc1 is ``2f`` wide, ``[gate_r; up_r]`` on rank ``r`` (``partition_stride = 2``).

    As a MoE layer's shared expert (Megatron's ``SharedExpertMLP``): ``ffn`` is
    ``moe_shared_expert_intermediate_size``, and with ``gate`` the output is scaled per token by
    ``sigmoid(x @ gate_weight)`` (``gate_weight [1, h]``, replicated, ``sequence_parallel`` under
    sp: its gradient is a partial sum over the sequence slices)."""

    def __init__(self, cfg: ModelConfig, mesh: ParallelMesh, name: str, opt: ParallelOptions,
                 init, out_init, *, ffn: int | None = None, gate: bool = False) -> None:
        super().__init__()
        if ffn is not None:
            cfg = replace(cfg, ffn_hidden_size=ffn)
        h, sp, common = cfg.hidden_size, opt.sequence_parallel, _common(mesh, opt)
        bias, self.swiglu = cfg.add_bias_linear, cfg.swiglu
        width, fc1_init = (2 * cfg.ffn, SwiGLUInit(init)) if cfg.swiglu else (cfg.ffn, init)
        self.fc1 = ColumnParallelLinear(h, width, bias=bias, init_method=fc1_init,
                                        name=f"{name}.fc1", skip_bias_add=True,
                                        async_grad_allreduce=opt.async_grad_allreduce,
                                        sequence_parallel=sp, **common)
        if cfg.swiglu:
            for p in self.fc1.parameters():
                set_tensor_model_parallel_attributes(p, True, 0, stride=2)
        self.fc2 = RowParallelLinear(cfg.ffn, h, bias=bias, input_is_parallel=True,
                                     sequence_parallel=sp, init_method=out_init,
                                     name=f"{name}.fc2", **common)
        self.gate_weight = None
        if gate:
            self.gate_weight = nn.Parameter(init(f"{name}.gate_weight", (1, h), None,
                                                 dtype=opt.params_dtype))
            self.gate_weight.sequence_parallel = sp and mesh.tp.size > 1

    def forward(self, x):
        h, b = self.fc1(x)                                   # [s, b, 4h/tp]
        if b is not None:  # Megatron's MLP adds fc1's bias outside the linear (skip_bias_add):
            h = h + b      # its gradient comes before fc1's backward, as the buckets see it
        act = swiglu(h) if self.swiglu else F.gelu(h, approximate="tanh")
        out, _ = self.fc2(act)                               # [s(/tp), b, h]
        if self.gate_weight is not None:                     # a shared expert's gate
            out = out * torch.sigmoid(F.linear(x, self.gate_weight))
        return out


def _common(mesh: ParallelMesh, opt: ParallelOptions) -> dict:
    return dict(mesh=mesh, gradient_accumulation_fusion=opt.gradient_accumulation_fusion,
                own_backward=opt.own_backward, params_dtype=opt.params_dtype)


class TransformerLayer(nn.Module):
    """Pre-LN block: ``x + attention(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: ModelConfig, mesh: ParallelMesh, index: int, opt: ParallelOptions):
        super().__init__()
        h, sp, name = cfg.hidden_size, opt.sequence_parallel, f"layers.{index}"
        self.dropout, self.sp = cfg.dropout, sp and mesh.tp.size > 1
        self.full_recompute = opt.recompute == "full"
        init = CounterInit(opt.seed, cfg.init_std)
        out_init = CounterInit(opt.seed, cfg.init_std / math.sqrt(2 * cfg.num_layers))
        norm = (cfg.normalization, h, cfg.norm_epsilon, sp, opt.params_dtype)
        self.ln1 = make_norm(*norm)
        self.attention = SelfAttention(cfg, mesh, f"{name}.attention", opt, init, out_init)
        self.ln2 = make_norm(*norm)
        if is_moe_layer(cfg, index):
            shared = cfg.moe_shared_expert_intermediate_size
            self.mlp = MoELayer(cfg, mesh, f"{name}.mlp", opt, init, out_init, shared_experts=(
                MLP(cfg, mesh, f"{name}.mlp.shared_experts", opt, init, out_init, ffn=shared,
                    gate=cfg.moe_shared_expert_gate) if shared else None))
        else:
            self.mlp = MLP(cfg, mesh, f"{name}.mlp", opt, init, out_init)

    def _forward(self, x, rope=None):                        # [s(/tp), b, h]
        x = x + dropout(self.attention(self.ln1(x), rope), self.dropout, self.training, self.sp)
        return x + dropout(self.mlp(self.ln2(x)), self.dropout, self.training, self.sp)

    def forward(self, x, rope=None):
        if self.full_recompute:
            return checkpoint(self._forward, x, rope)
        return self._forward(x, rope)


class GPTModel(nn.Module):
    """One pipeline chunk of the GPT: optional embedding, ``layer_ids``, optional head + loss.

    Parameter names are global (``embedding.word_embeddings.weight``, ``layers.7.mlp.fc1.weight``,
    ``final_layernorm.weight``) whatever the pipeline split; they key the initializer.
    """

    def __init__(self, cfg: ModelConfig, mesh: ParallelMesh, *,
                 layer_ids: Sequence[int] | None = None, pre_process: bool = True,
                 post_process: bool = True, options: ParallelOptions | None = None) -> None:
        super().__init__()
        opt = options or ParallelOptions()
        self.cfg, self.mesh, self.opt = cfg, mesh, opt
        self.pre_process, self.post_process = pre_process, post_process
        self.sp = opt.uses_sequence_parallel(mesh)
        layer_ids = range(cfg.num_layers) if layer_ids is None else layer_ids
        self.input_tensor, tied = None, not cfg.untie_embeddings_and_output_weights
        self.output_weight_hooks: list = []  # called with the output weight before its use
        learned = cfg.position_embedding_type == "learned_absolute"
        if pre_process:
            self.embedding = Embedding(cfg, mesh, opt, positions=learned)
        self.rotary = (RotaryEmbedding(cfg.head_dim, cfg.rotary_base)
                       if cfg.position_embedding_type == "rope" else None)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, mesh, i, opt)
                                     for i in layer_ids})
        if post_process:
            self.final_layernorm = make_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon,
                                             opt.sequence_parallel, opt.params_dtype)
        if post_process and tied and not pre_process:
            # the last stage's copy of the tied word embeddings is its output layer, registered
            # after the layers as Megatron's output_layer (so its gradient bucket comes first)
            self.embedding = Embedding(cfg, mesh, opt, positions=False)
        if post_process and not tied:                        # [Vp/tp, h], vocabulary split
            self.output_layer = nn.Module()
            shape = (cfg.padded_vocab(mesh.tp.size), cfg.hidden_size)
            ranges = shard_range(shape, 0, mesh.tp.rank, mesh.tp.size)
            self.output_layer.weight = nn.Parameter(CounterInit(opt.seed, cfg.init_std)(
                "output_layer.weight", shape, ranges, dtype=opt.params_dtype))
            set_tensor_model_parallel_attributes(self.output_layer.weight, True, 0)
            self.output_layer.weight.vocab_rows = cfg.vocab_size  # the rest is padding

    def setup_embeddings_and_output_layer(self) -> None:
        """Megatron's start of word embeddings tied across pipeline stages: the last stage's
        copy (its output layer) is zeroed and one all-reduce over the embedding group (first and
        last stage, phase ``setup``, kind ``emb``) gives it the first stage's values. Both
        copies already start equal here (counter-based initialisation by global name); the
        all-reduce is Megatron's, and it keeps them equal whatever initialised them. Nothing at
        pp = 1, untied, or on a chunk without the embeddings."""
        if self.cfg.untie_embeddings_and_output_weights or self.mesh.emb.size < 2 \
                or self.mesh.emb.rank < 0 or not hasattr(self, "embedding"):
            return
        weight = self.embedding.word_embeddings.weight
        if not self.pre_process:
            weight.data.zero_()
        comm.all_reduce(weight.data, self.mesh.emb, phase="setup", kind="emb",
                        site="GPTModel.setup_embeddings_and_output_layer",
                        module="embedding.word_embeddings.weight",
                        split="the tied word embeddings' first values")

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """The activation received from the previous pipeline stage (Megatron's hook)."""
        self.input_tensor = tensor

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[s(/tp), b, h] -> [s, b, Vp/tp]``: the output layer (tied: the word embeddings),
        vocabulary split over tp (``Vp`` is the padded vocabulary; columns past ``vocab_size``
        are padding)."""
        weight = (self.output_layer.weight if hasattr(self, "output_layer")
                  else self.embedding.word_embeddings.weight)
        for hook in self.output_weight_hooks:  # the output layer is no module call here: what
            hook(weight)                       # Megatron's output_layer pre-hook does, done now
        return parallel_lm_logits(x, weight, self.mesh.tp, sequence_parallel=self.sp,
                                  async_grad_allreduce=self.opt.async_grad_allreduce)

    def _rope(self, x: torch.Tensor, position_ids: torch.Tensor | None):
        """Rotary ``(cos, sin)`` for ``position_ids`` (default ``arange(s)``) in the activation
        dtype (angles computed in fp32), or ``None``."""
        if self.rotary is None:
            return None
        if position_ids is None:
            s = x.shape[0] * (self.mesh.tp.size if self.sp else 1)  # the full local sequence
            position_ids = torch.arange(s, device=x.device)
        return tuple(t.to(x.dtype) for t in self.rotary(position_ids))  # one copy, all layers

    def forward(self, tokens: torch.Tensor | None, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None):
        """``tokens``/``labels``: ``[b, s]``; ``position_ids``: global positions ``[b, s]`` or
        ``[s]`` (default ``arange(s)``). Returns the per-token loss ``[b, s]`` on the last
        stage when ``labels`` is given, the logits ``[s, b, V/tp]`` without labels, and the
        hidden state ``[s(/tp), b, h]`` on other stages."""
        x = self.embedding(tokens, position_ids) if self.pre_process else self.input_tensor
        rope = self._rope(x, position_ids)
        for layer in self.layers.values():
            x = layer(x, rope)
        if not self.post_process:
            return x
        logits = self.logits(self.final_layernorm(x))
        if labels is None:
            return logits
        padded = self.cfg.padded_vocab(self.mesh.tp.size)
        real = self.cfg.vocab_size if padded != self.cfg.vocab_size else None
        return vocab_parallel_cross_entropy(logits, labels.t(), self.mesh.tp, vocab_size=real,
                                            fused=self.cfg.cross_entropy_loss_fusion).t()
