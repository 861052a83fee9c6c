"""The top-k softmax router, its auxiliary losses, and deterministic capacity dropping.

Megatron-Core's semantics (``TopKRouter`` with ``moe_router_pre_softmax=False``): logits
``x W_r^T`` (``W_r``: ``[E, h]``, fp32 math), the top-``k`` experts per token, and routing
weights ``softmax`` over those ``k`` logits. The load-balancing loss is Switch Transformer's,
as Megatron's ``switch_load_balancing_loss_func``::

    aux = coeff * E / (N^2 * k) * sum_e (sum_t p[t, e]) * n_e

with ``p = softmax(logits)`` over all experts, ``n_e`` the tokens routed to expert ``e`` (before
any dropping) and ``N`` the tokens of the microbatch. The z-loss (ST-MoE) is
``coeff * mean_t logsumexp(logits_t)^2``.

Layout independence: the probabilities may be a *slice* of the microbatch's tokens (sequence
parallelism), while ``n_e`` and ``N`` are always the whole microbatch's, so the slices' losses
sum, over the ranks that hold them, to the loss of the whole microbatch (as Megatron's
``sequence_partition_group``). Under context parallelism ``n_e`` and ``N`` are summed over cp
first (:class:`~paraloom.moe.moe_layer.MoELayer`). :class:`MoEAuxLossAutoScaler` adds the aux
loss's gradient in backward without touching the language-model loss (Megatron's name and
mechanism).
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["TopKRouter", "topk_routing", "switch_load_balancing_loss", "z_loss",
           "MoEAuxLossAutoScaler", "expert_capacity"]


class TopKRouter(nn.Module):
    """``[n, h] -> [n, E]`` fp32 logits; the weight (and with ``bias`` an ``[E]`` bias, as
    Megatron's router under ``add_bias_linear``, initialised like the weight) is replicated over
    tp (a gate per expert).

    ``sequence_parallel``: the rank sees only its slice of the tokens, so the gradients are
    partial and summed over tp when gradients are finalised (Megatron's attribute)."""

    def __init__(self, hidden: int, num_experts: int, init, name: str, *, dtype,
                 sequence_parallel: bool, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(init(f"{name}.weight", (num_experts, hidden), None,
                                        dtype=dtype))
        self.bias = nn.Parameter(init(f"{name}.bias", (num_experts,), None, dtype=dtype)) \
            if bias else None
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:    # [n, h]
        logits = x.float() @ self.weight.float().t()        # [n, E]
        return logits if self.bias is None else logits + self.bias.float()


def expert_capacity(num_tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Tokens one expert may take from a microbatch: ``ceil(N * k / E * factor)`` (Megatron's
    ``get_capacity``)."""
    return math.ceil(num_tokens * topk / num_experts * factor)


def topk_routing(logits: torch.Tensor, topk: int, capacity_factor: float | None = None,
                 drop_policy: str = "probs"):
    """Route every token of a microbatch: ``(probs, routing_map, tokens_per_expert)``.

    ``logits``: ``[N, E]`` for all ``N`` tokens of the microbatch (the same on every rank that
    holds a copy, so every rank routes alike). ``probs``: ``[N, E]`` routing weights (zero where
    not routed); ``routing_map``: ``[N, E]`` bool; ``tokens_per_expert``: ``[E]`` before
    dropping (what the aux loss counts). With a ``capacity_factor`` each expert keeps at most
    :func:`expert_capacity` tokens: those with the highest weight (``probs``, ties to the earlier
    token) or the earliest (``position``); the others are dropped for that expert (the token
    then passes the layer through the residual only). A pure function of the logits, so every
    layout drops the same tokens.
    """
    n, e = logits.shape
    top, idx = torch.topk(logits, topk, dim=-1)            # [N, k]
    weights = torch.softmax(top, dim=-1, dtype=torch.float32)
    probs = torch.zeros(n, e, dtype=weights.dtype, device=logits.device).scatter(1, idx, weights)
    routing_map = torch.zeros(n, e, dtype=torch.bool, device=logits.device).scatter(1, idx, True)
    tokens_per_expert = routing_map.sum(0)
    if capacity_factor is not None:
        cap = expert_capacity(n, topk, e, capacity_factor)
        if drop_policy == "position":
            keep = routing_map.long().cumsum(0) <= cap
        elif drop_policy == "probs":
            # stable sort by weight, descending: ties keep the earlier token
            order = torch.sort(probs.detach(), dim=0, descending=True, stable=True).indices
            rank = torch.empty_like(order).scatter_(
                0, order, torch.arange(n, device=logits.device).unsqueeze(1).expand(n, e))
            keep = rank < cap
        else:
            raise ValueError(f"drop_policy must be probs or position, got {drop_policy!r}")
        routing_map = routing_map & keep
        probs = probs * routing_map
    return probs, routing_map, tokens_per_expert


def switch_load_balancing_loss(probs_slice: torch.Tensor, tokens_per_expert: torch.Tensor,
                               num_tokens: int, topk: int, coeff: float) -> torch.Tensor:
    """This slice's share of the microbatch's load-balancing loss (see the module docstring).

    ``probs_slice``: ``softmax(logits)`` ``[n, E]`` of the tokens this rank holds;
    ``tokens_per_expert``: ``[E]`` of the whole microbatch; ``num_tokens``: ``N`` of the whole
    microbatch. The slices' values sum to the loss over all ``N`` tokens."""
    e = probs_slice.shape[1]
    return (probs_slice.sum(0) * tokens_per_expert.to(probs_slice.dtype)).sum() * (
        e * coeff / (num_tokens * num_tokens * topk))


def z_loss(logits_slice: torch.Tensor, num_tokens: int, coeff: float) -> torch.Tensor:
    """This slice's share of ``coeff * mean_t logsumexp(logits_t)^2`` over the ``num_tokens``
    tokens of the microbatch."""
    return torch.logsumexp(logits_slice, dim=-1).square().sum() * (coeff / num_tokens)


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Forward: return ``output`` unchanged. Backward: also give ``aux_loss`` the gradient
    ``loss_scale`` (``1 / num_microbatches``, as the schedule scales the main loss), so the
    auxiliary loss is trained without being added to the reported language-model loss."""

    main_loss_backward_scale = 1.0

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        return grad_output, torch.full_like(aux_loss, scale)

    @staticmethod
    def set_loss_scale(scale: float) -> None:
        """Megatron's hook: the scale of the main loss's gradient (``1 / num_microbatches``)."""
        MoEAuxLossAutoScaler.main_loss_backward_scale = float(scale)
