"""Megatron-Core's "alltoall" token dispatcher: tokens travel to their experts' ep ranks and back.

For the ``N`` tokens of a microbatch on this rank (``tokens`` ``[N, h]``) and the router's
decision (``routing_map`` / ``probs`` ``[N, E]``), :meth:`~MoEAlltoAllTokenDispatcher.
token_permutation` does, in this order:

1. **permute**: copy each token once per chosen expert into rows sorted by expert (within an
   expert, in token order) -- ``[M, h]``, ``M = sum of tokens per expert`` (``N * k`` dropless);
2. **all-to-all of the counts** over ep: every rank learns how many rows it will receive for
   each of its local experts from each ep rank (``[E]`` int64 in, ``[E]`` out; forward only);
3. **all-to-all of the tokens** over ep with those split sizes (``input_splits`` = rows for
   each ep rank's experts, ``output_splits`` = rows from each ep rank);
4. **sort the received chunks by local expert** (they arrive grouped by source rank), so each
   local expert's rows are contiguous.

The experts run, then :meth:`~MoEAlltoAllTokenDispatcher.token_unpermutation` reverses it: chunks
back to source order, the **reverse all-to-all**, and **unpermute**: each row times its routing
weight, summed into its token's position. Backward runs the same two all-to-alls with the split
sizes swapped (phase ``backward``); the counts are not exchanged again. Every exchange goes
through :func:`paraloom.comm.all_to_all`, kind ``ep``, and its ledger event carries the split
sizes (rows), so the bytes can be checked against them.
"""

from __future__ import annotations

import torch

from .. import comm

__all__ = ["MoEAlltoAllTokenDispatcher", "all_to_all"]

_SITE = "MoEAlltoAllTokenDispatcher"


class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all rows with ``(input_splits, output_splits)``. Backward: the reverse
    all-to-all of the gradient (splits swapped)."""

    @staticmethod
    def forward(ctx, x, axis, ins, outs, site, module, split):
        ctx.meta = (axis, ins, outs, site, module, split)
        return comm.all_to_all(x, axis, input_splits=ins, output_splits=outs, phase="forward",
                               kind="ep", site=f"{site}.forward:tokens", module=module,
                               split=split)

    @staticmethod
    def backward(ctx, grad):
        axis, ins, outs, site, module, split = ctx.meta
        out = comm.all_to_all(grad, axis, input_splits=outs, output_splits=ins,
                              phase="backward", kind="ep", site=f"{site}.backward:tokens_grad",
                              module=module, split=split)
        return out, None, None, None, None, None, None


def all_to_all(x: torch.Tensor, axis, input_splits: list[int], output_splits: list[int], *,
               site: str, module: str | None = None, split: str | None = None) -> torch.Tensor:
    """Differentiable all-to-all of rows over ``axis`` (identity on a size-1 axis)."""
    if axis.size == 1:
        return x
    return _AllToAll.apply(x, axis, list(input_splits), list(output_splits), site, module, split)


def _pad_to_capacity(token_ids: torch.Tensor, row_probs: torch.Tensor, counts: torch.Tensor,
                     capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by expert -> every expert's group padded to ``capacity`` rows. A padded row
    is token 0 with weight 0: the expert computes it, the combine multiplies it by 0, and no
    gradient reaches a token, a weight or the router through it."""
    e = counts.numel()
    slot = torch.arange(capacity, device=counts.device).expand(e, capacity)     # [E, C]
    keep = slot < counts[:, None]
    if token_ids.numel() == 0:
        zeros = torch.zeros(e * capacity, dtype=token_ids.dtype, device=token_ids.device)
        return zeros, row_probs.new_zeros(e * capacity)
    start = (torch.cumsum(counts, 0) - counts)[:, None]
    idx = (start + slot).clamp(max=token_ids.numel() - 1)
    ids = torch.where(keep, token_ids[idx], torch.zeros_like(idx))
    probs = torch.where(keep, row_probs[idx], torch.zeros_like(row_probs[idx]))
    return ids.flatten(), probs.flatten()


def _regroup(x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Rows in chunks ``sizes[i, j]`` (row-major) -> the same chunks in column-major order."""
    chunks = torch.split(x, sizes.flatten().tolist())
    a, b = sizes.shape
    return torch.cat([chunks[i * b + j] for j in range(b) for i in range(a)])


class MoEAlltoAllTokenDispatcher:
    """Dispatch and combine for one MoE layer (state lives between the two calls of a forward).

    Args:
        num_experts: ``E``.
        ep: the expert-parallel :class:`~paraloom.mesh.Axis`; rank ``r`` holds experts
            ``[r * E / ep, (r + 1) * E / ep)``.
        module: the layer's name for the ledger (``layers.3.mlp``).
    """

    def __init__(self, num_experts: int, ep, module: str | None = None) -> None:
        self.num_experts, self.ep, self.module = num_experts, ep, module
        self.num_local = num_experts // ep.size

    def token_permutation(self, tokens: torch.Tensor, probs: torch.Tensor,
                          routing_map: torch.Tensor, pad_to: int | None = None
                          ) -> tuple[torch.Tensor, list[int]]:
        """``[N, h]`` tokens -> ``([rows, h]`` grouped by local expert, rows per local expert).
        ``pad_to``: every expert gets exactly that many rows (Megatron's
        ``moe_pad_expert_input_to_capacity``): the splits are known, the counts not exchanged."""
        n_tok, e = routing_map.shape
        ep, local = self.ep.size, self.num_local
        pairs = routing_map.t().nonzero()                   # [M, 2] (expert, token), by expert
        self.token_ids = pairs[:, 1]
        self.row_probs = probs.t()[routing_map.t()]         # [M] same order as ``pairs``
        self.n_tokens = n_tok
        counts = routing_map.sum(0)                         # [E] rows per expert (after drops)
        if pad_to is not None:                              # [E * C] rows, C per expert
            self.token_ids, self.row_probs = _pad_to_capacity(self.token_ids, self.row_probs,
                                                              counts, pad_to)
            counts = torch.full_like(counts, pad_to)
        permuted = tokens.index_select(0, self.token_ids)   # [M, h]
        split = "tokens by expert (rows to each ep rank's experts)"
        if ep == 1:
            self.recv = counts.view(1, local)
            return permuted, counts.tolist()
        if pad_to is not None:  # every rank sends every expert ``pad_to`` rows: nothing to ask
            recv = counts.view(ep, local)  # the same [ep, local] grid of pad_to as we send
        else:
            recv = comm.all_to_all(counts, self.ep, phase="forward", kind="ep",
                                   site=f"{_SITE}.token_permutation.forward:tokens_per_expert",
                                   module=self.module, split="token counts per expert")
        self.recv = recv.view(ep, local)                    # [source rank, local expert]
        self.send_splits = counts.view(ep, local).sum(1).tolist()
        self.recv_splits = self.recv.sum(1).tolist()
        x = all_to_all(permuted, self.ep, self.send_splits, self.recv_splits,
                       site=f"{_SITE}.token_permutation", module=self.module, split=split)
        x = _regroup(x, self.recv)                          # by local expert, then source
        return x, self.recv.sum(0).tolist()

    def token_unpermutation(self, expert_output: torch.Tensor) -> torch.Tensor:
        """``[rows, h]`` expert outputs (local-expert order) -> ``[N, h]`` weighted sums."""
        y = expert_output
        if self.ep.size > 1:
            y = _regroup(y, self.recv.t())                  # back to source, then expert
            y = all_to_all(y, self.ep, self.recv_splits, self.send_splits,
                           site=f"{_SITE}.token_unpermutation", module=self.module,
                           split="expert outputs back to their tokens' ranks")
        weighted = y * self.row_probs.unsqueeze(1).to(y.dtype)
        out = torch.zeros(self.n_tokens, y.shape[1], dtype=y.dtype, device=y.device)
        return out.index_add(0, self.token_ids, weighted)   # [N, h]
