"""Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr`` at the last step."""

from __future__ import annotations

import math

__all__ = ["learning_rate"]


def learning_rate(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int
                  ) -> float:
    """LR for optimizer step ``step`` (0-based): ``lr * (step + 1) / warmup`` during warm-up,
    then ``min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
