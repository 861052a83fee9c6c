"""Batches that are the same for every parallel layout.

Global batch ``step`` is ``global_batch_size`` windows of ``seq_len + 1`` tokens at offsets drawn
from a generator seeded by ``(seed, step)``, so it depends on nothing about the layout. A
data-parallel rank takes a contiguous slice of the rows and cuts it into microbatches; the union
over ranks and microbatches is always the whole global batch, so the mean loss (every microbatch
has the same number of tokens) is layout-independent. Training never samples the last
:data:`~paraloom.data.corpus.HOLDOUT` fraction: :func:`eval_batches` reads it for the held-out
loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..utils import divide
from .corpus import HOLDOUT

__all__ = ["Corpus", "microbatches", "eval_batches"]

_SEED_STRIDE = 1_000_003
"""Batch ``step`` of seed ``s`` draws its offsets from generator ``s * stride + step``: a prime
larger than any run's steps, so two (seed, step) pairs never share a generator."""


@dataclass
class Corpus:
    """Samples fixed-length windows of a byte corpus, deterministically per step."""

    data: torch.Tensor
    seq_len: int
    seed: int = 1234
    holdout: float = HOLDOUT
    heldout_end: float = 1.0
    """Where the held-out part ends, as a fraction (Megatron's ``--split`` test part follows
    it, read by nothing)."""

    def __post_init__(self) -> None:
        self.split = int(len(self.data) * (1.0 - self.holdout))
        self.end = len(self.data) if self.heldout_end >= 1.0 else \
            int(len(self.data) * self.heldout_end)
        if len(self.data) < self.seq_len + 1:
            raise ValueError(f"the corpus has {len(self.data)} bytes; seq_len = {self.seq_len} "
                             f"needs at least one window of seq_len + 1 = {self.seq_len + 1}")

    def global_batch(self, step: int, global_batch_size: int) -> torch.Tensor:
        """``[global_batch_size, seq_len + 1]`` int64 tokens for ``step`` (the same for every
        layout)."""
        if self.split < self.seq_len + 1:  # check_data says so before ranks start
            raise ValueError(f"the corpus has {len(self.data)} bytes ({self.split} for training); "
                             f"training with seq_len = {self.seq_len} needs at least "
                             f"one window, seq_len + 1 = {self.seq_len + 1}, there")
        g = torch.Generator().manual_seed(self.seed * _SEED_STRIDE + step)
        # every window inside the training part: starts 0 .. split - seq_len - 1, inclusive
        starts = torch.randint(0, self.split - self.seq_len, (global_batch_size,), generator=g)
        return self._windows(starts)

    def _windows(self, starts: torch.Tensor) -> torch.Tensor:
        idx = starts.unsqueeze(1) + torch.arange(self.seq_len + 1)
        return self.data[idx].long()


def microbatches(batch: torch.Tensor, dp_rank: int, dp: int, num_microbatches: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This dp rank's ``(tokens, labels)`` microbatches, each ``[micro_batch_size, seq_len]``."""
    rows = divide(batch.shape[0], dp, "global_batch_size")
    mine = batch[dp_rank * rows:(dp_rank + 1) * rows]
    size = divide(rows, num_microbatches, "global_batch_size / dp")
    return [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(size)]


def eval_batches(corpus: Corpus, batch_size: int, num_batches: int, *, start: int | None = None
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Evenly spaced windows from byte ``start`` to the end (default: the held-out part, never
    seen in training, to its end), as ``(tokens, labels)`` batches of ``batch_size``."""
    start, end = (corpus.split, corpus.end) if start is None else (start, len(corpus.data))
    span = end - start - corpus.seq_len - 1
    if span < 0:  # span 0: exactly one window, every row reads it
        raise ValueError(f"the evaluated part ({end - start} bytes) is shorter "
                         f"than seq_len + 1 = {corpus.seq_len + 1}")
    count = batch_size * num_batches
    starts = start + (torch.arange(count) * span) // max(count, 1)
    windows = corpus._windows(starts)
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]
