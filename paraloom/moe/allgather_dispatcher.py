"""Megatron-Core's "allgather" token dispatcher (its default): every rank sees every token of its
group and keeps the rows routed to its own experts.

The group is ``tp x ep`` (Megatron's ``tp_ep``) when each tp rank routes its own sequence slice,
``ep`` when every tp rank already holds the whole microbatch. For the ``N`` tokens this rank
routed (``[N, h]``) and the router's decision (``routing_map`` / ``probs`` ``[N, E]``),
:meth:`~MoEAllGatherTokenDispatcher.token_permutation` does, in Megatron's order:

1. **all-gather of the routing map** (bool ``[N, E]``, no gradient), **of the probabilities**
   (fp32 ``[N, E]``) and **of the tokens** (``[N, h]``) over the group: ``G N`` tokens;
2. **permute** locally: the rows routed to this rank's experts, sorted by expert, with their
   probabilities.

The experts run (tp shards: partial sums) and their outputs are scaled by the probabilities;
:meth:`~MoEAllGatherTokenDispatcher.token_unpermutation` sums each row into its token's place
among the ``G N`` and **reduce-scatters** them over the group in fp32 (Megatron casts to the
probabilities' dtype first): each rank gets its own ``N`` tokens, summed over every expert and
tp shard. Backward: the reduce-scatter's gradient all-gathered (fp32), the tokens' and the
probabilities' gradients reduce-scattered. Kind ``ep``; every size is fixed by the layout, so
``paraloom check`` predicts each event's bytes exactly.
"""

from __future__ import annotations

import torch

from .. import comm
from .token_dispatcher import gather_rows, scatter_rows

__all__ = ["MoEAllGatherTokenDispatcher"]

_SITE = "MoEAllGatherTokenDispatcher"


class MoEAllGatherTokenDispatcher:
    """Dispatch and combine for one MoE layer (state lives between the two calls of a forward).

    Args:
        num_experts: ``E``.
        ep: the expert-parallel :class:`~paraloom.mesh.Axis` (rank ``r`` holds experts
            ``[r * E / ep, (r + 1) * E / ep)``).
        axis: the group the tokens are gathered over (``tp_ep``, or ``ep``).
        module: the layer's name for the ledger.
    """

    def __init__(self, num_experts: int, ep, axis, module: str | None = None) -> None:
        self.num_experts, self.axis, self.module = num_experts, axis, module
        self.num_local = num_experts // ep.size
        self.first = ep.rank * self.num_local

    def token_permutation(self, tokens: torch.Tensor, probs: torch.Tensor,
                          routing_map: torch.Tensor, pad_to: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """``[N, h]`` tokens -> ``(rows`` routed to this rank's experts, by expert, their
        probabilities, rows per local expert``)``."""
        if pad_to is not None:
            raise ValueError("the allgather dispatcher does not pad to capacity")
        kw = dict(site=f"{_SITE}.token_permutation", module=self.module)
        if self.axis.size > 1:
            routing_map = comm.all_gather(routing_map.contiguous(), self.axis, phase="forward",
                                          kind="ep", site=f"{kw['site']}.forward:routing_map",
                                          module=self.module,
                                          split="routing map [tokens, E] of every rank")
            probs = gather_rows(probs, self.axis, None, what="probs",
                                split="routing probabilities [tokens, E] of every rank", **kw)
            tokens = gather_rows(tokens, self.axis, None, what="tokens",
                                 split="tokens [tokens, h] of every rank", **kw)
        lo, hi = self.first, self.first + self.num_local
        local = routing_map[:, lo:hi]                       # [G N, local] bool
        pairs = local.t().nonzero()                         # (local expert, token), by expert
        self.token_ids, self.n_tokens = pairs[:, 1], tokens.shape[0]
        rows = tokens.index_select(0, self.token_ids)
        row_probs = probs[:, lo:hi].t()[local.t()]
        return rows, row_probs, local.sum(0).tolist()

    def token_unpermutation(self, expert_output: torch.Tensor) -> torch.Tensor:
        """``[R, h]`` expert outputs (scaled by their probabilities; partial over tp) ->
        ``[N, h]`` this rank's tokens, summed over every expert and tp shard."""
        y = expert_output
        out = torch.zeros(self.n_tokens, y.shape[1], dtype=y.dtype, device=y.device)
        out = out.index_add(0, self.token_ids, y)           # [G N, h]
        if self.axis.size == 1:
            return out
        summed = scatter_rows(out.float(), self.axis, None,
                              site=f"{_SITE}.token_unpermutation", what="tokens",
                              module=self.module,
                              split="expert outputs summed, each rank's tokens (fp32)")
        return summed.to(y.dtype)
