"""Building blocks the Llama family adds to the GPT: norms, rotary positions, attention kernels,
SwiGLU's layout-independent initialisation.

* :func:`make_norm` -- ``LayerNorm`` (GPT-2) or :class:`RMSNorm` (Llama), replicated over tp and
  marked ``sequence_parallel`` when activations are split along the sequence.
* :class:`RotaryEmbedding` / :func:`apply_rotary` -- rotary positions (Su et al. 2021) in the
  "rotate half" convention Megatron-Core and ``transformers``' Llama share: the first and second
  halves of each head's dimensions form the rotated pairs, so checkpoints map without permuting.
  Angles are computed from *global* positions (``position_ids``), so a rank holding other chunks
  of the sequence (context parallelism) rotates by the right amounts.
* :class:`CoreAttention` (written out: saves the ``s x s`` scores and probabilities that
  Korthikanti et al. count) and :class:`SDPAttention` (``scaled_dot_product_attention``: flash or
  memory-efficient kernels, saves no ``s x s`` tensor). Both take ``q [b, a/tp, s, d]`` and
  ``k, v [b, g/tp, s, d]`` (grouped-query attention: ``a/g`` query heads share a key/value head).
* :class:`SwiGLUInit`, :func:`swiglu` -- from :mod:`paraloom.tensor_parallel.swiglu` (the MoE
  experts use them too).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel import get_rng_tracker
from ..tensor_parallel.swiglu import SwiGLUInit, swiglu

__all__ = ["RMSNorm", "make_norm", "RotaryEmbedding", "apply_rotary", "CoreAttention",
           "SDPAttention", "make_core_attention", "SwiGLUInit", "swiglu", "drop", "dropout"]


def drop(x, p: float):
    """``F.dropout`` in training, keeping a 1-byte mask for backward. On CPU ``F.dropout`` saves
    its scaled noise in the activation dtype (2-4 bytes per element); ``native_dropout`` (what it
    runs on CUDA) draws the same mask from the same generator, gives the same output and saves the
    mask as bool. fp32 gradients are bitwise the same; in bf16 on CPU its backward scales by
    ``1/(1-p)`` in fp32 where ``F.dropout`` used ``1/(1-p)`` rounded to bf16 (a last-bit change)."""
    return torch.native_dropout(x, p, True)[0]


def dropout(x, p: float, training: bool, split: bool):
    """Dropout on activations; ``split`` ones (sequence-parallel) use the tp-rank stream."""
    if not (p and training):
        return x
    if split:
        with get_rng_tracker().fork():
            return drop(x, p)
    return drop(x, p)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in fp32 (as ``transformers``' Llama)."""

    def __init__(self, h: int, eps: float, dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(h, dtype=dtype))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def make_norm(kind: str, h: int, eps: float, sp: bool, dtype) -> nn.Module:
    """A ``LayerNorm`` or ``RMSNorm`` of width ``h``; its parameters are replicated over tp, and
    with sequence parallelism each rank sees ``1/tp`` of the tokens (``sequence_parallel``)."""
    norm = nn.LayerNorm(h, eps=eps, dtype=dtype) if kind == "LayerNorm" else RMSNorm(h, eps, dtype)
    for p in norm.parameters():
        p.sequence_parallel = sp
    return norm


class RotaryEmbedding(nn.Module):
    """``(cos, sin)`` of the rotary angles ``position * base^(-2i/d)`` for global positions."""

    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.register_buffer("inv_freq", 1.0 / base ** exponent, persistent=False)

    def forward(self, position_ids: torch.Tensor):
        """``position_ids`` ``[s]`` or ``[b, s]`` -> cos, sin broadcastable to ``[b, a, s, d]``."""
        freqs = position_ids.float()[..., None] * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), -1)                  # [(b,) s, d]
        emb = emb[None, None] if emb.dim() == 2 else emb[:, None]
        return emb.cos(), emb.sin()


def _rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def apply_rotary(x, rope):
    """Rotate ``x`` ``[b, heads, s, d]`` by ``rope = (cos, sin)`` (angles in fp32)."""
    cos, sin = (t.to(x.dtype) for t in rope)
    return x * cos + _rotate_half(x) * sin


def _repeat_kv(x, n: int):
    """``[b, g, s, d] -> [b, g*n, s, d]``: each key/value head serves ``n`` consecutive query
    heads (its group)."""
    return x if n == 1 else x.repeat_interleave(n, dim=1)


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v over this rank's ``a/tp`` heads, written out."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v):                              # q [b, a/tp, s, d]; k, v [b, g/tp..]
        s, groups = q.shape[2], q.shape[1] // k.shape[1]
        k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])   # [b, a/tp, s, s]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        if self.dropout and self.training:
            with get_rng_tracker().fork():  # heads are split: a different mask per tp rank
                probs = drop(probs, self.dropout)
        return probs @ v                                     # [b, a/tp, s, d]


class SDPAttention(nn.Module):
    """The same function through ``F.scaled_dot_product_attention`` (fused kernels; no ``s x s``
    tensor is kept for backward)."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v):
        groups = q.shape[1] // k.shape[1]
        k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
        if self.dropout and self.training:
            with get_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout,
                                                      is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def make_core_attention(kind: str, dropout: float) -> nn.Module:
    """``core`` (written out) or ``sdpa`` (PyTorch's fused attention)."""
    return SDPAttention(dropout) if kind == "sdpa" else CoreAttention(dropout)
