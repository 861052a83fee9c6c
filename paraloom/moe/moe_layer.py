"""MoELayer: the MLP of an MoE transformer layer (router, token dispatcher, local experts).

Same constructor and return as ``models/gpt.py``'s ``MLP`` (``[s(/tp), b, h] -> [s(/tp), b, h]``),
so ``TransformerLayer`` swaps it in for MoE layers. One forward, dropless under sequence
parallelism (Megatron's order; Megatron-LM refuses MoE with tp > 1 without sp in training)::

    shared expert (``moe_shared_expert_intermediate_size``): a dense tp MLP every token runs,
         computed first (Megatron's order), its output added to the routed experts'
         (``moe_shared_expert_overlap``: in pieces inside the dispatcher, :mod:`.shared_overlap`)
    logits = router(x)                 # this rank's tokens: its sequence slice
    aux    = load-balancing (+ z) loss of this slice: tokens per expert summed over tp x cp
    probs, routing_map = topk_routing(logits)
    dispatcher: permute -> counts all-gathered over tp x ep -> tokens and probabilities
                all-to-all'd over ep, then all-gathered over tp -> local experts (tp shards,
                outputs scaled by the probabilities) -> reduce-scatter over tp -> reverse
                all-to-all -> unpermute (sum per token)

Otherwise (tp without sp, or a capacity factor) every tp rank routes the whole microbatch, as
one process does, so capacity drops are the same in every layout (Megatron drops per rank):
the router logits and the tokens are gathered over tp (sp: all-gather; else the tp "copy"
region), the dispatcher moves rows over ep alone, and the experts' partial sums are reduced
over tp after it (sp: reduce-scatter; else all-reduce).

With context parallelism a rank holds only its cp chunks of each sequence: the counts the aux
loss needs (tokens per expert) are summed over tp x cp or cp (one all-reduce, kind ``cp``), and the
slice's aux/z share is multiplied by cp, because gradients are averaged over dp x cp and the
cp shares sum (not average) to the microbatch's loss. With a capacity factor the router logits
are all-gathered over cp instead and every cp rank routes the whole microbatch in token order,
so the same tokens are dropped as in one process.

Statistics for the run's metrics (aux and z loss values, tokens per expert after drops, dropped
assignments) accumulate in :attr:`MoELayer.stats` over a step's microbatches, counted so that a
sum over every rank gives each microbatch's value once (:func:`moe_step_stats`).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import comm
from ..context_parallel.split import position_ids
from ..mesh import Axis
from ..tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from .allgather_dispatcher import MoEAllGatherTokenDispatcher
from .experts import Expert, GroupedExperts, local_expert_ids
from .router import (
    MoEAuxLossAutoScaler,
    TopKRouter,
    expert_capacity,
    switch_load_balancing_loss,
    topk_routing,
    z_loss,
)
from .shared_overlap import SharedExpertOverlap
from .token_dispatcher import MoEAlltoAllTokenDispatcher

__all__ = ["MoELayer", "is_moe_layer", "moe_step_stats", "reset_moe_stats"]


def _one(ep: Axis) -> Axis:
    """A size-1 tp axis of this rank: the dispatcher then moves tokens over ep alone."""
    return Axis("tp", (ep.ranks[ep.rank],), 0)


def is_moe_layer(cfg, index: int) -> bool:
    """Whether global layer ``index`` is an MoE layer (``moe_layer_freq``: every N-th, from 0)."""
    return bool(getattr(cfg, "num_experts", None)) and index % cfg.moe_layer_freq == 0


def _in_backward() -> bool:
    """True while autograd runs a backward (an activation-recomputation re-run of the forward):
    its statistics were already counted by the first forward."""
    return torch._C._current_graph_task_id() != -1


class MoELayer(nn.Module):
    """Top-k routed experts in place of the dense MLP (see the module docstring)."""

    def __init__(self, cfg, mesh, name: str, opt, init, out_init, *,
                 shared_experts: nn.Module | None = None) -> None:
        super().__init__()
        self.cfg, self.mesh, self.name = cfg, mesh, name
        self.sp = opt.uses_sequence_parallel(mesh)
        self.cp = getattr(mesh, "cp", None)  # None: a mesh without cp (tests' stand-ins)
        e, dtype = cfg.num_experts, opt.params_dtype
        self.router = TopKRouter(cfg.hidden_size, e, init, f"{name}.router", dtype=dtype,
                                 sequence_parallel=opt.sequence_parallel,
                                 bias=cfg.add_bias_linear)
        self.local_ids = local_expert_ids(e, mesh.ep.size, mesh.ep.rank)
        experts = GroupedExperts if cfg.moe_grouped_gemm else nn.ModuleDict
        self.experts = experts({
            str(g): Expert(cfg.hidden_size, cfg.ffn, mesh, f"{name}.experts.{g}", init, out_init,
                           dtype, swiglu=cfg.swiglu, bias=cfg.add_bias_linear)
            for g in self.local_ids})
        self.shared_experts = shared_experts  # registered after the experts, as Megatron's
        # --moe-shared-expert-overlap: the shared expert in pieces inside the dispatcher
        self.overlap = SharedExpertOverlap(shared_experts, mesh.tp, self.sp, name) \
            if shared_experts is not None and cfg.moe_shared_expert_overlap else None
        # dropless under sp: each tp rank routes and dispatches its own tokens (Megatron's
        # order); else every tp rank routes the whole microbatch (capacity drops as one process)
        self.split_tp = self.sp and cfg.moe_expert_capacity_factor is None
        tp, group = (mesh.tp, mesh.tp_ep) if self.split_tp else (_one(mesh.ep), mesh.ep)
        self.dispatcher = MoEAlltoAllTokenDispatcher(e, mesh.ep, tp, group, module=name,
                                                     shared=self.overlap) \
            if cfg.moe_token_dispatcher_type == "alltoall" else \
            MoEAllGatherTokenDispatcher(e, mesh.ep, group, module=name)
        self.layer = int(name.split(".")[1]) if name.startswith("layers.") else 0
        self.stats: dict = {}
        reset_moe_stats([self])

    def _tp(self, t: torch.Tensor, what: str, split: str) -> torch.Tensor:
        """Every tp rank gets all tokens (forward), partial gradients summed (backward)."""
        tp = self.mesh.tp
        if tp.size == 1 or self.split_tp:
            return t
        site, kw = f"MoELayer.{what}", dict(module=self.name, split=split)
        if self.sp:
            return gather_from_sequence_parallel_region(t, tp, True, site=site, **kw)
        return copy_to_tensor_model_parallel_region(t, tp, site=site, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [s(/tp), b, h]
        cfg, tp = self.cfg, self.mesh.tp
        s_local, b, h = x.shape
        # Megatron computes the shared expert first (its own tp/sp traffic), then routes;
        # overlapped, inside the dispatcher (its output taken after the combine)
        shared = self.shared_experts(x) if self.shared_experts is not None \
            and self.overlap is None else None
        if self.overlap is not None:
            self.overlap.start(x)
        logits_slice = self.router(x.reshape(-1, h))        # [n_local, E] fp32
        logits = self._tp(logits_slice, "router_logits", "router logits [tokens, E], sequence")
        n = logits.shape[0]                                 # tokens this rank routes
        cp, capacity = self.cp.size if self.cp else 1, cfg.moe_expert_capacity_factor
        probs, routing_map, per_expert = topk_routing(
            logits, cfg.moe_router_topk, capacity if cp == 1 else None, cfg.moe_token_drop_policy)
        local_per_expert = per_expert
        if cp > 1 and capacity is not None:  # drops decided over the whole microbatch
            routing_map, per_expert, n = self._cp_capacity(logits, b)
            probs = probs * routing_map
        else:  # the aux loss counts the whole microbatch: every tp (sp) and cp rank's tokens
            per_expert, n = self._aux_counts(per_expert, n)
        aux = switch_load_balancing_loss(torch.softmax(logits_slice, -1), per_expert, n,
                                         cfg.moe_router_topk, cfg.moe_aux_loss_coeff)
        zl = z_loss(logits_slice, n, cfg.moe_z_loss_coeff) if cfg.moe_z_loss_coeff else None
        if cp > 1:  # a slice's share, weighted as the LM loss: one of dp x cp averaged replicas
            aux, zl = aux * cp, (zl * cp if zl is not None else None)
        tokens = self._tp(x, "tokens", "tokens [s, b, h], sequence").reshape(-1, h)
        pad = expert_capacity(n, cfg.moe_router_topk, cfg.num_experts, capacity) \
            if cfg.moe_pad_expert_input_to_capacity else None  # n: the tokens capacity counts
        rows, row_probs, per_local = self.dispatcher.token_permutation(tokens, probs,
                                                                       routing_map, pad)
        outs = [self.experts[str(g)](chunk) for g, chunk in
                zip(self.local_ids, torch.split(rows, per_local), strict=True)]
        y = torch.cat(outs) * row_probs.unsqueeze(1).to(rows.dtype)  # Megatron: inside the expert
        y = self.dispatcher.token_unpermutation(y).view(-1, b, h)    # [s(/tp), b, h]
        if tp.size > 1 and not self.split_tp:  # partial sums over tp of every token
            kw = dict(site="MoELayer.output", module=self.name, split="expert outputs")
            y = reduce_scatter_to_sequence_parallel_region(y, tp, **kw) if self.sp else \
                reduce_from_tensor_model_parallel_region(y, tp, **kw)
        if self.overlap is not None:
            shared = self.overlap.output()
        if shared is not None:
            y = y + shared
        if self.training:
            y = MoEAuxLossAutoScaler.apply(y, aux if zl is None else aux + zl)
        if not _in_backward():
            self._count(aux, zl, routing_map, local_per_expert)
        return y

    def _aux_counts(self, per_expert: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
        """Tokens per expert (before drops) and tokens of the whole microbatch for the aux
        loss: this rank's counts summed over the ranks that routed the microbatch's other
        tokens (one all-reduce of ``E`` int64 over ``tp x cp`` when tp ranks route their own
        slices, over ``cp`` otherwise: Megatron's ``tp_cp`` group; kind ``cp``, or ``sp``
        without cp; none without an aux loss). Every rank routes as many tokens, so the
        microbatch has ``n x`` group size."""
        axis = self.mesh.tp_cp if self.split_tp else self.cp
        if axis is None or axis.size == 1:
            return per_expert, n
        if not self.cfg.moe_aux_loss_coeff:  # no aux loss: nothing to count (Megatron's)
            return per_expert, n * axis.size
        counts = per_expert.long().clone()
        comm.all_reduce(counts, axis, phase="forward", kind="cp" if self.cp.size > 1 else "sp",
                        site="MoELayer.router:tokens_per_expert", module=self.name,
                        split="token counts per expert, summed over the microbatch's ranks")
        return counts, n * axis.size

    @torch.no_grad()
    def _cp_capacity(self, logits: torch.Tensor, b: int):
        """With a capacity factor under cp: all-gather the (detached) router logits over cp
        (kind ``cp``), put the rows in the microbatch's token order (``[s, b]``, global
        positions), route them all with the capacity, and keep this rank's rows: ``(routing
        map [n_local, E] after drops, tokens per expert before drops, tokens)`` -- the same
        drops as one process."""
        cp, cfg = self.cp, self.cfg
        whole = comm.all_gather(logits.detach(), cp, dim=0, phase="forward", kind="cp",
                                site="MoELayer.router:logits", module=self.name,
                                split="router logits [tokens, E] of every cp rank")
        s = logits.shape[0] // b * cp.size

        def rows(r: int) -> torch.Tensor:  # global token index (s-major, as [s, b]) of r's rows
            pos = position_ids(s, r, cp.size, logits.device)
            return (pos[:, None] * b + torch.arange(b, device=logits.device)).flatten()

        order = torch.cat([rows(r) for r in range(cp.size)])
        ordered = torch.empty_like(whole).index_copy_(0, order, whole)
        _, keep, per_expert = topk_routing(ordered, cfg.moe_router_topk,
                                           cfg.moe_expert_capacity_factor,
                                           cfg.moe_token_drop_policy)
        return keep[rows(cp.rank)], per_expert, s * b

    @torch.no_grad()
    def _count(self, aux, zl, routing_map, per_expert) -> None:
        # aux/z of a slice: summed over tp under sp; replicated over tp otherwise (rank 0 counts)
        part = 1.0 if self.sp or self.mesh.tp.rank == 0 else 0.0
        # routing: of this rank's own tokens (split_tp), else replicated over tp
        whole = 1.0 if self.split_tp or self.mesh.tp.rank == 0 else 0.0
        st = self.stats
        st["aux_loss"] += aux.detach().double() * part
        if zl is not None:
            st["z_loss"] += zl.detach().double() * part
        kept = routing_map.sum(0).double()
        st["tokens_per_expert"] += kept * whole
        st["dropped"] += (per_expert.double().sum() - kept.sum()) * whole


def reset_moe_stats(modules) -> None:
    """Zero the step statistics of every :class:`MoELayer` in ``modules`` (any modules)."""
    for m in modules:
        for layer in (x for x in m.modules() if isinstance(x, MoELayer)):
            dev = layer.router.weight.device
            zero = torch.zeros((), dtype=torch.float64, device=dev)
            layer.stats = {"aux_loss": zero.clone(), "z_loss": zero.clone(),
                           "dropped": zero.clone(),
                           "tokens_per_expert": torch.zeros(layer.cfg.num_experts,
                                                            dtype=torch.float64, device=dev)}


def moe_step_stats(modules, num_layers: int, num_experts: int, device) -> torch.Tensor:
    """This rank's share of the step's statistics as one flat float64 tensor,
    ``[aux, z, dropped, tokens_per_expert (num_layers x E)]``, to be summed over every rank."""
    out = torch.zeros(3 + num_layers * num_experts, dtype=torch.float64, device=device)
    table = out[3:].view(num_layers, num_experts)
    for m in modules:
        for layer in (x for x in m.modules() if isinstance(x, MoELayer)):
            st = layer.stats
            out[0] += st["aux_loss"]
            out[1] += st["z_loss"]
            out[2] += st["dropped"]
            table[layer.layer] += st["tokens_per_expert"]
    return out
