"""The per-model switches that are not part of the shape: :class:`ParallelOptions`.

A model is built from a :class:`~paraloom.config.ModelConfig` (its shape), a mesh (its layout)
and these options (how its layers communicate, recompute and hold their parameters). A training
run takes them from its :class:`~paraloom.config.TrainConfig` (:meth:`ParallelOptions.of`), so
nothing copies settings by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import TrainConfig

__all__ = ["ParallelOptions"]


@dataclass(frozen=True, kw_only=True)
class ParallelOptions:
    """Megatron's meanings; the defaults are a plain fp32 model that communicates as
    Megatron-Core's (the column layers' input-gradient all-reduce async when tp > 1 and not
    sequence parallel)."""

    sequence_parallel: bool = False
    """Activations between tensor-parallel regions split along the sequence."""
    async_grad_allreduce: bool | None = None
    """Column layers overlap their input-gradient all-reduce with the weight-gradient GEMM;
    ``None``: Megatron-Core's rule, as :attr:`~paraloom.config.ParallelConfig.
    uses_async_grad_allreduce` (a training run passes that effective value)."""
    gradient_accumulation_fusion: bool = False
    """Weight gradients go straight into fp32 ``main_grad``."""
    recompute: str = "none"
    """``none``, ``selective`` (core attention) or ``full`` (per layer)."""
    split_backward: bool = False
    """A zero-bubble schedule splits each backward into B (input gradients) and W (weight
    gradients): the layers keep their own backward even at tp = 1."""
    seed: int = 1234
    """The counter-based initializer's seed."""
    params_dtype: torch.dtype = torch.float32
    """The parameters' dtype (bf16 runs keep fp32 master copies in the optimizer)."""

    def __post_init__(self) -> None:
        if self.async_grad_allreduce is None:  # Megatron-Core's rule (each layer adds tp > 1)
            object.__setattr__(self, "async_grad_allreduce", not self.sequence_parallel)
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be none, selective or full, got {self.recompute!r}")

    def uses_sequence_parallel(self, mesh) -> bool:
        """Sequence parallelism in effect on ``mesh``: asked for and ``tp > 1`` (the building
        blocks' reading of :attr:`~paraloom.config.ParallelConfig.uses_sequence_parallel`)."""
        return self.sequence_parallel and mesh.tp.size > 1

    @property
    def own_backward(self) -> bool:
        """Whether the layers need their own backward at tp = 1: a zero-bubble split."""
        return self.split_backward

    @classmethod
    def of(cls, cfg: TrainConfig) -> ParallelOptions:
        """The options of a training run."""
        p = cfg.parallel
        return cls(sequence_parallel=p.uses_sequence_parallel,
                   async_grad_allreduce=p.uses_async_grad_allreduce,
                   gradient_accumulation_fusion=p.gradient_accumulation_fusion,
                   recompute=cfg.recompute, split_backward=cfg.schedule == "zb-h1",
                   seed=cfg.seed,
                   params_dtype=torch.bfloat16 if cfg.dtype == "bf16" else torch.float32)
