"""Learning-rate schedule: linear warm-up, then cosine or linear decay to ``min_lr`` (or constant),
counted as paraloom does or as Megatron-LM's ``OptimizerParamScheduler`` does."""

from __future__ import annotations

import math

__all__ = ["learning_rate", "run_learning_rate"]


def learning_rate(step: int, *, lr: float, min_lr: float, warmup_steps: float, total_steps: int,
                  style: str = "cosine", megatron: bool = False, warmup_init: float = 0.0
                  ) -> float:
    """LR for optimizer step ``step`` (0-based); the decay spans ``total_steps`` (Megatron's
    ``--lr-decay-iters``, else the run's steps; ``min_lr`` after), the warm-up rises from
    ``warmup_init``.

    paraloom's count: ``lr * (step + 1) / warmup`` during warm-up, then the decay over
    ``progress = (step - warmup) / (total - warmup - 1)`` (the last step at ``min_lr``).
    Megatron-LM's (``megatron``): ``num_steps = step`` (its scheduler steps after the update),
    ``lr * num_steps / warmup`` while ``num_steps <= warmup``, then the decay over
    ``(num_steps - warmup) / (total - warmup)``. Decay: cosine ``(1 + cos(pi p)) / 2``, linear
    ``1 - p``, or constant ``lr``."""
    if megatron:
        if warmup_steps > 0 and step <= warmup_steps:
            return warmup_init + (lr - warmup_init) * step / warmup_steps
        if style == "constant":
            return lr
        if step > total_steps:
            return min_lr
        progress = (step - warmup_steps) / (total_steps - warmup_steps)
    else:
        if step + 1 <= warmup_steps:
            return warmup_init + (lr - warmup_init) * (step + 1) / warmup_steps
        if style == "constant":
            return lr
        decay_steps = max(1, total_steps - warmup_steps - 1)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
    coeff = 1.0 - progress if style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr + (lr - min_lr) * coeff


def run_learning_rate(o, step: int, steps: int) -> float:
    """The rate of step ``step`` (0-based) of a run of ``steps`` under ``OptimConfig`` ``o``."""
    warmup, decay = o.schedule(steps)
    return learning_rate(step, lr=o.lr, min_lr=o.min_lr, warmup_steps=warmup, total_steps=decay,
                         style=o.lr_decay_style, megatron=o.megatron_lr_schedule,
                         warmup_init=o.warmup_init)
