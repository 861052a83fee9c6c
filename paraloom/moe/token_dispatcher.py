"""Megatron-Core's "alltoall" token dispatcher: tokens travel to their experts' ranks and back.

The experts of a layer are divided over ep (``E / ep`` per rank) and each expert is split over
tp (expert tensor parallelism = tp, Megatron's default). For the ``N`` tokens this rank routed
(``tokens`` ``[N, h]``: its sequence slice under sp) and the router's decision (``routing_map``
/ ``probs`` ``[N, E]``), :meth:`~MoEAlltoAllTokenDispatcher.token_permutation` does, in this
order (Megatron's):

1. **permute**: copy each token once per chosen expert into rows sorted by expert (within an
   expert, in token order) -- ``[M, h]``, ``M = sum of tokens per expert`` (``N * k`` dropless),
   with each row's routing probability beside it (``[M]`` fp32);
2. **all-gather of the counts** over ``tp_ep`` (``[E]`` int64 from each of the ``tp x ep``
   ranks, forward only): every rank learns how many rows each rank sends to each expert; with
   rows padded to a known capacity nothing is exchanged;
3. **all-to-all of the tokens**, then **of the probabilities**, over ep with those split sizes
   (``input_splits`` = rows for each ep rank's experts, ``output_splits`` = rows from each);
4. tp > 1: **all-gather of the tokens**, then **of the probabilities**, over tp with uneven
   sizes (each tp rank brings the rows its own tokens sent): every tp rank's shard of an
   expert sees every row routed to it;
5. **sort the rows by local expert** (they arrive grouped by tp rank, then ep source).

The experts run and their outputs are scaled by the rows' probabilities (Megatron multiplies
inside the expert, before fc2 and its bias: the same product), then
:meth:`~MoEAlltoAllTokenDispatcher.token_unpermutation` reverses it: rows back to source order, a
**reduce-scatter over tp** with uneven sizes (each tp rank's partial sums, each rank keeping its
own tokens' rows), the **reverse all-to-all** over ep, and **unpermute**: each row summed into
its token's position. Backward runs every exchange reversed (an all-to-all with the splits
swapped, a reduce-scatter for an all-gather and the other way round); the counts are not
exchanged again. Every exchange goes through :mod:`paraloom.comm`, kind ``ep``, and its event
carries its split sizes (rows), so the bytes can be checked against them.

The capacity-factor path of :class:`~paraloom.moe.moe_layer.MoELayer` routes the whole
microbatch on every tp rank and passes a size-1 ``tp``: steps 2-5 then run over ep alone.
"""

from __future__ import annotations

import torch

from .. import comm

__all__ = ["MoEAlltoAllTokenDispatcher", "all_to_all", "gather_rows", "scatter_rows"]

_SITE = "MoEAlltoAllTokenDispatcher"


def _a2a(x, axis, splits, async_op=False, **kw):
    """``async_op``: launched asynchronously and waited for at once (Megatron's
    ``use_nccl_stream`` under the shared-expert overlap)."""
    out = comm.all_to_all(x, axis, input_splits=splits[0], output_splits=splits[1],
                          async_op=async_op, **kw)
    return out.wait() if async_op else out


def _a2a_back(x, axis, splits, **kw):
    return _a2a(x, axis, splits[::-1], **kw)


def _gather(x, axis, splits, **kw):
    return comm.all_gather(x, axis, output_splits=splits, **kw)


def _scatter(x, axis, splits, **kw):
    return comm.reduce_scatter(x, axis, input_splits=splits, **kw)


class _Exchange(torch.autograd.Function):
    """Forward: ``there`` moves rows over an axis with ``splits``; backward: ``back`` moves
    the gradient the other way (an all-to-all with the splits swapped; a reduce-scatter for
    an all-gather, and the other way round). Kind ``ep``; sites ``site.forward:what`` and
    ``site.backward:what_grad``."""

    @staticmethod
    def forward(ctx, x, there, back, axis, splits, site, what, kw):
        ctx.meta = (back, axis, splits, site, what, kw)
        return there(x.contiguous(), axis, splits, phase="forward", kind="ep",
                     site=f"{site}.forward:{what}", **kw)

    @staticmethod
    def backward(ctx, grad):
        back, axis, splits, site, what, kw = ctx.meta
        out = back(grad.contiguous(), axis, splits, phase="backward", kind="ep",
                   site=f"{site}.backward:{what}_grad", **kw)
        return (out,) + (None,) * 7


def all_to_all(x: torch.Tensor, axis, input_splits: list[int], output_splits: list[int], *,
               site: str, what: str = "tokens", module: str | None = None,
               split: str | None = None, async_op: bool = False) -> torch.Tensor:
    """Differentiable all-to-all of rows over ``axis`` (identity on a size-1 axis); with
    ``async_op`` both ways launched asynchronously and waited for at once."""
    if axis.size == 1:
        return x
    return _Exchange.apply(x, _a2a, _a2a_back, axis, (list(input_splits), list(output_splits)),
                           site, what, dict(module=module, split=split, async_op=async_op))


def gather_rows(x: torch.Tensor, axis, splits: list[int] | None, *, site: str, what: str,
                module: str | None = None, split: str | None = None) -> torch.Tensor:
    """Differentiable all-gather of ``splits[r]`` rows from each rank ``r`` of ``axis``
    (``None``: as many from each); backward a reduce-scatter with the same counts."""
    if axis.size == 1:
        return x
    return _Exchange.apply(x, _gather, _scatter, axis, None if splits is None else list(splits),
                           site, what, dict(module=module, split=split))


def scatter_rows(x: torch.Tensor, axis, splits: list[int] | None, *, site: str, what: str,
                 module: str | None = None, split: str | None = None) -> torch.Tensor:
    """Differentiable reduce-scatter: rank ``r`` keeps the sum of rows ``splits[r]``
    (``None``: equal parts); backward an all-gather."""
    if axis.size == 1:
        return x
    return _Exchange.apply(x, _scatter, _gather, axis, None if splits is None else list(splits),
                           site, what, dict(module=module, split=split))


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
        tp: the experts' tensor-parallel axis (size 1: every tp rank holds the same tokens).
        counts_axis: where the counts are gathered (``tp x ep``, ep-major as Megatron's
            ``tp_ep`` group; ``ep`` when ``tp`` has size 1).
        module: the layer's name for the ledger (``layers.3.mlp``).
    """

    def __init__(self, num_experts: int, ep, tp, counts_axis, module: str | None = None,
                 shared=None) -> None:
        self.num_experts, self.ep, self.tp, self.module = num_experts, ep, tp, module
        self.counts_axis, self.shared = counts_axis, shared
        self.num_local = num_experts // ep.size

    def token_permutation(self, tokens: torch.Tensor, probs: torch.Tensor,
                          routing_map: torch.Tensor, pad_to: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """``[N, h]`` tokens -> ``(rows [R, h]`` grouped by local expert, their probabilities
        ``[R]``, rows per local expert``)``. ``pad_to``: every expert gets exactly that many
        rows from this rank (Megatron's ``moe_pad_expert_input_to_capacity``): the splits are
        known, the counts not exchanged."""
        n_tok, e = routing_map.shape
        ep, tp, local = self.ep.size, self.tp.size, self.num_local
        pairs = routing_map.t().nonzero()                   # [M, 2] (expert, token), by expert
        self.token_ids = pairs[:, 1]
        row_probs = probs.t()[routing_map.t()]              # [M] same order as ``pairs``
        self.n_tokens = n_tok
        counts = routing_map.sum(0)                         # [E] rows per expert (after drops)
        if pad_to is not None:                              # [E * C] rows, C per expert
            self.token_ids, row_probs = _pad_to_capacity(self.token_ids, row_probs, counts,
                                                         pad_to)
            counts = torch.full_like(counts, pad_to)
        if ep == 1 and tp == 1:
            self.grid = counts.view(1, local)
            if self.shared is not None:  # nothing travels: the pieces in their order
                self.shared.pre_forward_comm()
                self.shared.fc1()
            return tokens.index_select(0, self.token_ids), row_probs, counts.tolist()
        if pad_to is not None:  # every rank sends every expert ``pad_to`` rows: nothing to ask
            every = counts.new_full((ep, tp, e), pad_to)
        else:
            every = comm.all_gather(counts, self.counts_axis, phase="forward", kind="ep",
                                    site=f"{_SITE}.token_permutation.forward:tokens_per_expert",
                                    module=self.module, split="token counts per expert")
            every = every.view(ep, tp, e)                   # [ep source, tp source, expert]
        if self.shared is not None:  # Megatron: after the counts, before the permutation
            self.shared.pre_forward_comm()
        permuted = tokens.index_select(0, self.token_ids)   # [M, h]
        lo = self.ep.rank * local
        mine = every[:, :, lo:lo + local]                   # rows for my experts [ep, tp, local]
        self.send_splits = counts.view(ep, local).sum(1).tolist()
        self.recv_splits = mine[:, self.tp.rank].sum(1).tolist()
        self.tp_splits = mine.sum((0, 2)).tolist()          # rows each tp rank brings
        self.grid = mine.transpose(0, 1).reshape(tp * ep, local)  # arrival order: tp, ep
        kw = dict(module=self.module, async_op=self.shared is not None)  # Megatron's nccl stream
        x = all_to_all(permuted, self.ep, self.send_splits, self.recv_splits,
                       site=f"{_SITE}.token_permutation", what="tokens",
                       split="tokens by expert (rows to each ep rank's experts)", **kw)
        if self.shared is not None:  # between the tokens' and the probabilities' all-to-alls
            self.shared.fc1(x)
        p = all_to_all(row_probs, self.ep, self.send_splits, self.recv_splits,
                       site=f"{_SITE}.token_permutation", what="probs",
                       split="routing probabilities of the rows", **kw)
        kw.pop("async_op")
        x = gather_rows(x, self.tp, self.tp_splits, site=f"{_SITE}.token_permutation",
                        what="tokens_tp", split="every tp rank's rows for these experts", **kw)
        p = gather_rows(p, self.tp, self.tp_splits, site=f"{_SITE}.token_permutation",
                        what="probs_tp", split="their routing probabilities", **kw)
        return _regroup(x, self.grid), _regroup(p, self.grid), self.grid.sum(0).tolist()

    def token_unpermutation(self, expert_output: torch.Tensor) -> torch.Tensor:
        """``[R, h]`` expert outputs (local-expert order, already scaled by their rows'
        probabilities; partial sums over tp) -> ``[N, h]`` sums per token."""
        y = expert_output
        if self.ep.size > 1 or self.tp.size > 1:
            y = _regroup(y, self.grid.t())                  # back to tp, ep source, expert
            y = scatter_rows(y, self.tp, self.tp_splits, site=f"{_SITE}.token_unpermutation",
                             what="tokens_tp", module=self.module,
                             split="expert outputs summed over tp, each rank's rows")
            y = all_to_all(y, self.ep, self.recv_splits, self.send_splits,
                           site=f"{_SITE}.token_unpermutation", module=self.module,
                           split="expert outputs back to their tokens' ranks",
                           async_op=self.shared is not None)
        if self.shared is not None:  # right after the combine all-to-all
            self.shared.fc2(y)
            self.shared.post_forward_comm()
        out = torch.zeros(self.n_tokens, y.shape[1], dtype=y.dtype, device=y.device)
        return out.index_add(0, self.token_ids, y)          # [N, h]
