"""The closed-form FLOP counts of the papers, the independent oracle of ``paraloom.analysis.flops``
(which counts per GEMM for any architecture) and of a real model's ``FlopCounterMode`` count.

Narayanan et al. 2021, eq. (3), and its model-FLOPs (no recomputation) and recomputation parts.
"""

from __future__ import annotations

__all__ = ["flops_per_iteration", "model_flops_per_iteration", "recompute_flops_per_iteration",
           "hardware_flops_per_iteration"]


def flops_per_iteration(batch: int, s: int, layers: int, h: int, vocab: int) -> float:
    """Narayanan et al. 2021, eq. (3): ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` — forward,
    backward and one forward recomputation of a GPT on a global batch of ``B`` samples."""
    return 96 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


def model_flops_per_iteration(batch: int, s: int, layers: int, h: int, vocab: int,
                              ffn: int | None = None) -> float:
    """The FLOPs the model needs per step, without any recomputation (what MFU divides):
    forward ``2 B s (4h^2 + 2hf) + 4 B s^2 h`` per layer (QKV, proj, fc1, fc2 GEMMs; QK^T and
    attention x V) plus the logits ``2 B s h V``; backward twice the forward. With ``f = 4h``:
    ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))`` (Narayanan et al.'s eq. (3) without its fourth,
    recomputed forward pass)."""
    f = ffn or 4 * h
    layer = 2 * batch * s * (4 * h * h + 2 * h * f) + 4 * batch * s * s * h
    return 3 * (layers * layer + 2 * batch * s * h * vocab)


def recompute_flops_per_iteration(batch: int, s: int, layers: int, h: int,
                                  ffn: int | None = None, recompute: str = "none", *,
                                  early_stop: bool = False) -> float:
    """FLOPs that recomputation adds per step. ``full``: every layer's forward again
    ``l (2 B s (4h^2 + 2hf) + 4 B s^2 h)`` (not the logits). ``selective``: the core attention
    again: Megatron's checkpoint and paraloom's re-run QK^T and attention x V, ``4 B s^2 h l``;
    one that stops once every saved tensor is rebuilt (``early_stop=True``) only QK^T (the
    softmax output is what attention x V saved): ``2 B s^2 h l``. Both counted against
    ``torch.utils.flop_counter`` in the tests."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    f = ffn or 4 * h
    if recompute == "full":
        return layers * (2 * batch * s * (4 * h * h + 2 * h * f) + 4 * batch * s * s * h)
    if recompute == "selective":
        return (2 if early_stop else 4) * batch * s * s * h * layers
    return 0.0


def hardware_flops_per_iteration(batch: int, s: int, layers: int, h: int, vocab: int,
                                 ffn: int | None = None, recompute: str = "none", *,
                                 early_stop: bool = False) -> float:
    """The FLOPs the GPUs execute per step (what HFU divides): model FLOPs plus the configured
    recomputation. Full recomputation with ``f = 4h`` is Narayanan's eq. (3),
    ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``."""
    return (model_flops_per_iteration(batch, s, layers, h, vocab, ffn)
            + recompute_flops_per_iteration(batch, s, layers, h, ffn, recompute,
                                            early_stop=early_stop))
