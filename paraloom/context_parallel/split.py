"""Megatron's load-balanced causal split of a sequence over the context-parallel ranks.

With a causal mask the last tokens attend to the most keys. Cutting the sequence into ``cp``
contiguous pieces would give the last rank ``2cp - 1`` times the work of the first; cutting it
into ``2 * cp`` chunks and giving rank ``r`` chunks ``r`` and ``2cp - 1 - r`` (one early, one
late) gives every rank the same work. Tokens, labels and positions are split alike, so the
learned (or rotary) positions of a rank's tokens are their global positions.
"""

from __future__ import annotations

import torch

__all__ = ["chunk_ids", "split_sequence", "position_ids", "get_batch_on_this_cp_rank"]


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp``) that cp rank ``cp_rank`` holds: ``(r, 2cp - 1 - r)``.

    >>> chunk_ids(0, 2), chunk_ids(1, 2)
    ((0, 3), (1, 2))
    """
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp rank {cp_rank} is outside a cp group of size {cp}")
    return cp_rank, 2 * cp - 1 - cp_rank


def split_sequence(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of ``x`` along ``dim`` (its length divisible by ``2 * cp``),
    concatenated in chunk order."""
    if cp == 1:
        return x
    n = x.shape[dim]
    if n % (2 * cp):
        raise ValueError(f"sequence length {n} is not divisible by 2 * cp = {2 * cp}")
    chunks = x.chunk(2 * cp, dim)
    a, b = chunk_ids(cp_rank, cp)
    return torch.cat([chunks[a], chunks[b]], dim)


def position_ids(seq_len: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """Global positions ``[seq_len / cp]`` of this rank's tokens."""
    return split_sequence(torch.arange(seq_len, device=device), cp_rank, cp, dim=0)


def get_batch_on_this_cp_rank(tokens: torch.Tensor, labels: torch.Tensor, cp_rank: int,
                              cp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, labels, position_ids)`` of this cp rank from ``[b, s]`` tokens and labels;
    ``position_ids`` is ``[s / cp]`` (the same for every sample)."""
    return (split_sequence(tokens, cp_rank, cp), split_sequence(labels, cp_rank, cp),
            position_ids(tokens.shape[1], cp_rank, cp, tokens.device))
