"""A GPT-2-architecture model built from paraloom's parallel layers (reads like nanoGPT's).

Learned positions, pre-LayerNorm blocks, causal self-attention written out (so its activations
can be counted), tanh-GeLU MLP, biases everywhere, word embeddings tied to the output layer.
Activations are sequence-first ``[s, b, h]``; with sequence parallelism ``[s/tp, b, h]`` between
the tensor-parallel regions. One :class:`GPTModel` is one pipeline chunk: it holds the global
layers ``layer_ids`` (named ``layers.<global index>``), the embedding if ``pre_process`` and the
final LayerNorm, output layer and loss if ``post_process``.

Where it communicates (all through the layers, see ``tensor_parallel/``): the embedding's
all-reduce (sp: reduce-scatter); per layer two column/row pairs (QKV/proj, fc1/fc2); the output
layer's input copy (its backward all-reduce async with ``async_grad_allreduce``, as Megatron-Core's
ColumnParallelLinear output layer; sp: all-gather) and the vocab-parallel cross-entropy's two
all-reduces.

    mesh = ParallelMesh(tp=2); model = GPTModel(ModelConfig(), mesh)
    loss = model(tokens, labels)          # tokens, labels: [b, s] -> per-token loss [b, s]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..mesh import ParallelMesh
from ..tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rng_tracker,
    vocab_parallel_cross_entropy,
)
from ..tensor_parallel.init import CounterInit
from ..tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce
from ..tensor_parallel.mappings import (
    Where,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from ..tensor_parallel.random import checkpoint
from ..utils import divide

__all__ = ["GPTModel", "TransformerLayer", "SelfAttention", "MLP", "Embedding", "ParallelOptions"]


class ParallelOptions:
    """Per-model switches that are not part of the shape (Megatron's meanings)."""

    def __init__(self, *, sequence_parallel: bool = False, async_grad_allreduce: bool = False,
                 gradient_accumulation_fusion: bool = False, recompute: str = "none",
                 seed: int = 1234, params_dtype: torch.dtype = torch.float32) -> None:
        if recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
        self.sequence_parallel, self.async_grad_allreduce = sequence_parallel, async_grad_allreduce
        self.gradient_accumulation_fusion, self.recompute = gradient_accumulation_fusion, recompute
        self.seed, self.params_dtype = seed, params_dtype


def _layer_norm(h: int, sp: bool, dtype) -> nn.LayerNorm:
    ln = nn.LayerNorm(h, eps=1e-5, dtype=dtype)
    for p in ln.parameters():  # replicated over tp; with sp each rank sees 1/tp of the tokens
        p.sequence_parallel = sp
    return ln


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v over this rank's ``a/tp`` heads."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v):                              # each [b, a/tp, s, d]
        s = q.shape[2]
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])   # [b, a/tp, s, s]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        if self.dropout and self.training:
            with get_rng_tracker().fork():  # heads are split: a different mask per tp rank
                probs = _drop(probs, self.dropout)
        return probs @ v                                     # [b, a/tp, s, d]


class SelfAttention(nn.Module):
    """QKV column-parallel (local heads, per-head ``[q, k, v]`` rows), core attention, row proj."""

    def __init__(self, cfg: ModelConfig, mesh: ParallelMesh, name: str, opt: ParallelOptions,
                 init, out_init) -> None:
        super().__init__()
        h, sp, common = cfg.hidden_size, opt.sequence_parallel, _common(mesh, opt)
        self.heads_local = divide(cfg.num_attention_heads, mesh.tp.size, "num_attention_heads")
        self.selective = opt.recompute == "selective"
        self.qkv = ColumnParallelLinear(h, 3 * h, init_method=init, name=f"{name}.qkv",
                                        async_grad_allreduce=opt.async_grad_allreduce,
                                        sequence_parallel=sp, **common)
        self.core = CoreAttention(cfg.dropout)
        self.proj = RowParallelLinear(h, h, input_is_parallel=True, sequence_parallel=sp,
                                      init_method=out_init, name=f"{name}.proj", **common)

    def forward(self, x):                                    # [s(/tp), b, h]
        qkv, _ = self.qkv(x)                                 # [s, b, 3h/tp]
        s, b, _ = qkv.shape
        q, k, v = qkv.view(s, b, self.heads_local, 3, -1).unbind(3)   # [s, b, a/tp, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))          # [b, a/tp, s, d]
        ctx = checkpoint(self.core, q, k, v) if self.selective else self.core(q, k, v)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, -1)      # [s, b, h/tp]
        out, _ = self.proj(ctx)                              # [s(/tp), b, h]
        return out


class MLP(nn.Module):
    """fc1 column-parallel (``4h/tp`` per rank), tanh-GeLU, fc2 row-parallel."""

    def __init__(self, cfg: ModelConfig, mesh: ParallelMesh, name: str, opt: ParallelOptions,
                 init, out_init) -> None:
        super().__init__()
        h, sp, common = cfg.hidden_size, opt.sequence_parallel, _common(mesh, opt)
        self.fc1 = ColumnParallelLinear(h, cfg.ffn, init_method=init, name=f"{name}.fc1",
                                        async_grad_allreduce=opt.async_grad_allreduce,
                                        sequence_parallel=sp, **common)
        self.fc2 = RowParallelLinear(cfg.ffn, h, input_is_parallel=True, sequence_parallel=sp,
                                     init_method=out_init, name=f"{name}.fc2", **common)

    def forward(self, x):
        h, _ = self.fc1(x)                                   # [s, b, 4h/tp]
        out, _ = self.fc2(F.gelu(h, approximate="tanh"))     # [s(/tp), b, h]
        return out


def _common(mesh: ParallelMesh, opt: ParallelOptions) -> dict:
    return dict(mesh=mesh, gradient_accumulation_fusion=opt.gradient_accumulation_fusion,
                params_dtype=opt.params_dtype)


def _drop(x, p: float):
    """``F.dropout`` in training, keeping a 1-byte mask for backward. On CPU ``F.dropout`` saves
    its scaled noise in the activation dtype (2-4 bytes per element); ``native_dropout`` (what it
    runs on CUDA) draws the same mask from the same generator, gives the same output and saves the
    mask as bool. fp32 gradients are bitwise the same; in bf16 on CPU its backward scales by
    ``1/(1-p)`` in fp32 where ``F.dropout`` used ``1/(1-p)`` rounded to bf16 (a last-bit change)."""
    return torch.native_dropout(x, p, True)[0]


def _dropout(x, p: float, training: bool, split: bool):
    """Dropout on activations; ``split`` ones (sequence-parallel) use the tp-rank stream."""
    if not (p and training):
        return x
    if split:
        with get_rng_tracker().fork():
            return _drop(x, p)
    return _drop(x, p)


class TransformerLayer(nn.Module):
    """Pre-LN block: ``x + attention(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: ModelConfig, mesh: ParallelMesh, index: int, opt: ParallelOptions):
        super().__init__()
        h, sp, name = cfg.hidden_size, opt.sequence_parallel, f"layers.{index}"
        self.dropout, self.sp = cfg.dropout, sp and mesh.tp.size > 1
        self.full_recompute = opt.recompute == "full"
        init = CounterInit(opt.seed, cfg.init_std)
        out_init = CounterInit(opt.seed, cfg.init_std / math.sqrt(2 * cfg.num_layers))
        self.ln1 = _layer_norm(h, sp, opt.params_dtype)
        self.attention = SelfAttention(cfg, mesh, f"{name}.attention", opt, init, out_init)
        self.ln2 = _layer_norm(h, sp, opt.params_dtype)
        from ..moe import MoELayer, is_moe_layer  # MoE layers route to experts (issue 14)
        mlp = MoELayer if is_moe_layer(cfg, index) else MLP
        self.mlp = mlp(cfg, mesh, f"{name}.mlp", opt, init, out_init)

    def _forward(self, x):                                   # [s(/tp), b, h]
        x = x + _dropout(self.attention(self.ln1(x)), self.dropout, self.training, self.sp)
        return x + _dropout(self.mlp(self.ln2(x)), self.dropout, self.training, self.sp)

    def forward(self, x):
        return checkpoint(self._forward, x) if self.full_recompute else self._forward(x)


class Embedding(nn.Module):
    """Word embeddings (vocabulary split over tp) plus learned positions (replicated).

    On the last pipeline stage (``positions=False``) it holds only the word embeddings: the copy
    tied to the output layer, initialised identically (same global name) and kept in sync by
    all-reducing its gradient over the embedding group (``shared_embedding``).
    """

    def __init__(self, cfg: ModelConfig, mesh: ParallelMesh, opt: ParallelOptions, *,
                 positions: bool = True) -> None:
        super().__init__()
        init = CounterInit(opt.seed, cfg.init_std)
        self.mesh, self.dropout = mesh, cfg.dropout
        self.sp = opt.sequence_parallel and mesh.tp.size > 1
        self.word_embeddings = VocabParallelEmbedding(
            cfg.padded_vocab_size, cfg.hidden_size, init_method=init,
            reduce_scatter_embeddings=self.sp,
            mesh=mesh, name="embedding.word_embeddings", params_dtype=opt.params_dtype)
        if mesh.pp.size > 1:
            self.word_embeddings.weight.shared_embedding = True
        self.position_embeddings = None
        if positions:
            self.position_embeddings = nn.Module()
            self.position_embeddings.weight = nn.Parameter(init(
                "embedding.position_embeddings.weight", (cfg.seq_length, cfg.hidden_size), None,
                dtype=opt.params_dtype))
            # with sp each rank adds only its slice: the grad is summed over tp when finalised
            self.position_embeddings.weight.sequence_parallel = self.sp

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.t()                                     # [s, b]
        x = self.word_embeddings(ids)                        # [s(/tp), b, h]
        pos = self.position_embeddings.weight[: ids.shape[0]]  # [s, h]
        if self.sp:
            pos = pos.chunk(self.mesh.tp.size, 0)[self.mesh.tp.rank]  # [s/tp, h]
        x = x + pos.unsqueeze(1)
        return _dropout(x, self.dropout, self.training, self.sp)


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
        self.sp = opt.sequence_parallel and mesh.tp.size > 1
        layer_ids = range(cfg.num_layers) if layer_ids is None else layer_ids
        self.input_tensor = None
        if pre_process or post_process:
            self.embedding = Embedding(cfg, mesh, opt, positions=pre_process)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, mesh, i, opt)
                                     for i in layer_ids})
        if post_process:
            self.final_layernorm = _layer_norm(cfg.hidden_size, opt.sequence_parallel,
                                               opt.params_dtype)

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """The activation received from the previous pipeline stage (Megatron's hook)."""
        self.input_tensor = tensor

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[s(/tp), b, h] -> [s, b, Vp/tp]``: the tied output layer, vocabulary split over tp
        (``Vp`` is the padded vocabulary; columns past ``vocab_size`` are padding)."""
        axis = self.mesh.tp
        if self.sp:
            x = gather_from_sequence_parallel_region(x, axis, True, site="GPTModel.output",
                                                     module="output", split="vocabulary")
        elif axis.size > 1 and self.opt.async_grad_allreduce:
            # Megatron-Core's output layer is a ColumnParallelLinear: the same async all-reduce
            # of the input gradient, overlapping the (tied) weight-gradient GEMM
            where = Where(axis, "GPTModel.output", module="output", split="vocabulary")
            return linear_with_grad_accumulation_and_async_allreduce(
                x, self.embedding.word_embeddings.weight, None, where, False, True, False)
        elif axis.size > 1:
            x = copy_to_tensor_model_parallel_region(x, axis, site="GPTModel.output",
                                                     module="output", split="vocabulary")
        return F.linear(x, self.embedding.word_embeddings.weight)

    def forward(self, tokens: torch.Tensor | None, labels: torch.Tensor | None = None):
        """``tokens``/``labels``: ``[b, s]``. Returns the per-token loss ``[b, s]`` on the last
        stage when ``labels`` is given, the logits ``[s, b, V/tp]`` without labels, and the
        hidden state ``[s(/tp), b, h]`` on other stages."""
        x = self.embedding(tokens) if self.pre_process else self.input_tensor
        for layer in self.layers.values():
            x = layer(x)
        if not self.post_process:
            return x
        logits = self.logits(self.final_layernorm(x))
        if labels is None:
            return logits
        real = self.cfg.vocab_size if self.cfg.padded_vocab_size != self.cfg.vocab_size else None
        return vocab_parallel_cross_entropy(logits, labels.t(), self.mesh.tp, vocab_size=real).t()
