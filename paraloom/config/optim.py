"""The optimiser and its schedule: :class:`OptimConfig` (AdamW, linear warm-up, then cosine, linear
or constant)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .fields import option
from .parallel import positive_int

__all__ = ["OptimConfig", "DEFAULT_MIN_LR"]

DEFAULT_MIN_LR = 3e-4
"""The cosine schedule's final learning rate when none is given (or ``lr`` if that is lower)."""


def _finite(name: str, value, *, low: float = 0.0, strict: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (strict and value == low):
        need = f"> {low:g}" if strict else f">= {low:g}"
        raise ValueError(f"{name} must be a number {need}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with Megatron's defaults, under a linear warm-up and cosine decay."""

    lr: float = option(3e-3, "--lr", help="peak learning rate (AdamW)")
    """Peak learning rate, reached after ``warmup_steps``, then cosine decay to ``min_lr``."""
    min_lr: float | None = option(None, "--min-lr", help=f"the cosine schedule's final learning "
                                  f"rate (default: {DEFAULT_MIN_LR:g}, or --lr if lower)")
    """Learning rate at the end of the cosine decay; ``None``: ``DEFAULT_MIN_LR`` or ``lr`` if
    that is lower (resolved on creation, so a saved config holds the number)."""
    warmup_steps: int | float | None = option(None, "--warmup-steps", "--lr-warmup-iters",
                                              help="linear warm-up steps (default 5)")
    """Linear warm-up steps (Megatron's ``--lr-warmup-iters``); ``None``: 5 (resolved on
    creation), or with ``warmup_fraction`` that fraction of the decay steps (:meth:`schedule`,
    fractional as Megatron's)."""
    warmup_fraction: float | None = option(
        None, "--lr-warmup-fraction", help="warm up for this fraction of the decay steps "
                                           "(Megatron's; instead of --lr-warmup-iters)")
    """Megatron's ``--lr-warmup-fraction``: warm-up over ``fraction x decay steps`` (not an
    integer number of steps in general, as in Megatron, which counts samples)."""
    warmup_init: float = option(0.0, "--lr-warmup-init",
                                help="the learning rate warm-up starts from (Megatron's)")
    """Megatron's ``--lr-warmup-init``: the rate the warm-up starts from."""
    decay_steps: int | None = option(None, "--lr-decay-steps", "--lr-decay-iters",
                                     help="steps the decay spans (default: the run's --steps)")
    """Megatron's ``--lr-decay-iters``: the decay ends there (``min_lr`` after); ``None``: the
    run's steps."""
    weight_decay: float = option(0.1, "--weight-decay",
                                 help="AdamW weight decay of matrices and embeddings; biases and "
                                      "norm weights get none (Megatron-Core's rule)")
    """AdamW weight decay (not applied to biases and norm weights, Megatron-Core's rule)."""
    clip_grad: float = option(1.0, "--clip-grad",
                              help="clip the global gradient norm to this (0: no clipping)")
    """Clip the global gradient norm (over tp, pp and dp) to this value; 0 disables."""
    adam_beta1: float = option(0.9, "--adam-beta1", help="Adam's first-moment decay")
    """Adam's ``beta1`` (Megatron's ``--adam-beta1``, default 0.9)."""
    adam_beta2: float = option(0.95, "--adam-beta2", help="Adam's second-moment decay")
    """Adam's ``beta2``: 0.95, GPT-3's and Megatron-LM's GPT examples' value (its flag's own
    default is 0.999)."""
    adam_eps: float = option(1e-8, "--adam-eps", help="Adam's epsilon")
    """Adam's ``eps`` (Megatron's ``--adam-eps``, default 1e-8)."""

    lr_decay_style: str = option("cosine", "--lr-decay-style",
                                 choices=("cosine", "linear", "constant"),
                                 help="the decay after warm-up: cosine (default) or linear to "
                                      "--min-lr, or constant")
    """The decay after warm-up (Megatron's ``--lr-decay-style``; Megatron-LM's default is
    ``linear``, paraloom's ``cosine``)."""
    megatron_lr_schedule: bool = option(
        False, "--megatron-lr-schedule", negatable=True,
        help="count steps as Megatron-LM's OptimizerParamScheduler (iteration k at num_steps "
             "k-1: warm-up from 0); on for a Megatron-LM command line")
    """Megatron-LM's step count: iteration ``k`` (from 1) gets the learning rate of
    ``num_steps = k - 1`` (warm-up ``lr * num_steps / W``, so 0 first; decay ratio
    ``(num_steps - W) / (T - W)``). Off: paraloom's (nanoGPT's) count, step ``s`` (from 0) at
    ``lr (s + 1) / W`` in warm-up and ``(s - W) / (T - W - 1)`` after, the last step at
    ``min_lr``."""

    def __post_init__(self) -> None:
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr (--lr) must be a positive number, got {self.lr}")
        if self.min_lr is None:
            object.__setattr__(self, "min_lr", min(DEFAULT_MIN_LR, self.lr))
        if not (isinstance(self.min_lr, (int, float)) and 0 <= self.min_lr <= self.lr):
            raise ValueError(f"min_lr (--min-lr) must be between 0 and lr = {self.lr} (the "
                             f"schedule decays from lr down to it), got {self.min_lr}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"weight_decay (--weight-decay) must be >= 0, got "
                             f"{self.weight_decay}")
        self._resolve_warmup()
        if (self.warmup_steps or 0) < 0 or not self.clip_grad >= 0:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) and clip_grad "
                             f"({self.clip_grad}) must be >= 0")
        if self.decay_steps is not None:
            positive_int("decay_steps (--lr-decay-iters)", self.decay_steps)
        _finite("warmup_init (--lr-warmup-init)", self.warmup_init)
        if self.warmup_init > self.lr:
            raise ValueError(f"warmup_init (--lr-warmup-init) must be at most lr = {self.lr}, "
                             f"got {self.warmup_init}")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be in [0, 1), got "
                                 f"{value}")
        _finite("adam_eps (--adam-eps)", self.adam_eps, strict=True)

    def schedule(self, total_steps: int) -> tuple[float, int]:
        """``(warm-up steps, decay steps)`` of a run of ``total_steps``."""
        decay = self.decay_steps or total_steps
        warmup = self.warmup_steps if self.warmup_steps is not None else \
            self.warmup_fraction * decay
        return warmup, decay

    def _resolve_warmup(self) -> None:
        fraction = self.warmup_fraction
        if fraction is None:
            if self.warmup_steps is None:
                object.__setattr__(self, "warmup_steps", 5)
            return
        if self.warmup_steps is not None:
            raise ValueError(f"--lr-warmup-fraction {fraction} and --lr-warmup-iters "
                             f"{self.warmup_steps} both set the warm-up (Megatron allows one): "
                             f"give one")
        _finite("warmup_fraction (--lr-warmup-fraction)", fraction)
        if fraction > 1:
            raise ValueError(f"warmup_fraction (--lr-warmup-fraction) must be in [0, 1], got "
                             f"{fraction}")
