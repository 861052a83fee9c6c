"""Mixture of experts in ``paraloom plan --table`` (:mod:`.order`): a MoE layer's MLP region,
forward and backward, as :mod:`paraloom.moe` issues it (its shared expert included).

The events are the recorded ones (kind, op, site, module, split) with the sizes the layout
decides; the all-to-alls' rows follow what the router chooses, so their shapes are those of
balanced routing (``n k`` rows of the ``n`` tokens a rank routes, ``k`` = top-k) and carry no
per-rank split sizes (the table says the rows follow the routing); padded to capacity
(``--moe-pad-expert-input-to-capacity``) they are every expert's capacity, exchanged without
counts. Derived for dropless or padded routing
with each tp rank routing its own sequence slice (tp = 1, or tp > 1 with sequence
parallelism), each cp rank its own (the aux loss's counts summed over tp x cp, kind cp); other
settings are refused (:func:`moe_unsupported`).
"""

from __future__ import annotations

from ..moe.router import expert_capacity

__all__ = ["moe_unsupported", "moe_forward", "moe_backward"]

_A2A, _AG = "MoEAlltoAllTokenDispatcher", "MoEAllGatherTokenDispatcher"
_COL, _ROW = "ColumnParallelLinear weight, output dim", "RowParallelLinear weight, input dim"
_SHARED_IN, _SHARED_OUT = ("shared expert input, sequence",
                           "shared expert output, partial sums over tp")
_TEXT = {  # alltoall: what -> split, as the dispatcher writes it
    "tokens_per_expert": "token counts per expert",
    "tokens": "tokens by expert (rows to each ep rank's experts)",
    "probs": "routing probabilities of the rows",
    "tokens_tp": "every tp rank's rows for these experts",
    "probs_tp": "their routing probabilities",
    "out_tp": "expert outputs summed over tp, each rank's rows",
    "out": "expert outputs back to their tokens' ranks"}


def moe_unsupported(cfg) -> str | None:
    """Why the order of this MoE configuration is not derived (``None``: it is)."""
    m, p = cfg.model, cfg.parallel
    if m.moe_expert_capacity_factor is not None and not (
            m.moe_pad_expert_input_to_capacity and p.tp == 1 and p.cp == 1):
        return "--moe-expert-capacity-factor (drops decided per microbatch; derived only " \
            "padded to capacity, --moe-pad-expert-input-to-capacity, at tp = cp = 1)"
    if p.tp > 1 and not p.uses_sequence_parallel:
        return "--num-experts with tp > 1 without --sequence-parallel"
    return None


def _sizes(r) -> dict:
    """Tokens this rank routes (``n``: its sequence slice of the microbatch), the rows each
    dispatch sends (``rows``: ``n k`` balanced, or every expert's capacity when padded to it,
    ``padded``) and the model's sizes."""
    m = r.cfg.model
    n, k, e = r.part[0] * r.b, m.moe_router_topk, m.num_experts
    padded = m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is not None
    rows = e * expert_capacity(n, k, e, m.moe_expert_capacity_factor) if padded else n * k
    return dict(n=n, k=k, e=e, h=m.hidden_size, ep=r.cfg.parallel.ep, rows=rows, padded=padded)


def _splits(z: dict) -> dict:
    """Padded to capacity, an all-to-all's rows to and from each ep rank are known: its
    experts' capacities (the table then says them, as a recorded run's)."""
    if not z["padded"]:
        return {}
    each = [z["rows"] // z["ep"]] * z["ep"]
    return {"input_splits": each, "output_splits": list(each)}


def _shared(r, i: int, emit, backward: bool, overlap: bool) -> None:
    """The shared expert computed first (its linears' own tp/sp traffic)."""
    if r.cfg.model.moe_shared_expert_intermediate_size is None or r.tp == 1 or overlap:
        return
    mod = f"layers.{i}.mlp.shared_experts"
    if not backward:
        emit(kind="sp", op="all_gather", site="ColumnParallelLinear.forward:input",
             module=f"{mod}.fc1", split=_COL, shape=r.part)
        emit(kind="sp", op="reduce_scatter", site="RowParallelLinear.forward:output",
             module=f"{mod}.fc2", split=_ROW, shape=r.full)
        return
    emit(kind="sp", op="all_gather", site="RowParallelLinear.backward:output_grad",
         module=f"{mod}.fc2", split=_ROW, shape=r.part)
    emit(kind="sp", op="all_gather", site="ColumnParallelLinear.backward:input (re-gather)",
         module=f"{mod}.fc1", split=_COL, shape=r.part, **{"async": True})
    emit(kind="sp", op="reduce_scatter", site="ColumnParallelLinear.backward:input_grad",
         module=f"{mod}.fc1", split=_COL, shape=r.full, **{"async": True})


def moe_forward(r, i: int, emit) -> None:
    """Layer ``i``'s MoE forward: ``emit(**fields)`` per event (kind, op, site, ...)."""
    m, z = r.cfg.model, _sizes(r)
    overlap = m.moe_shared_expert_overlap and m.moe_shared_expert_intermediate_size is not None
    mod = f"layers.{i}.mlp"
    _shared(r, i, emit, False, overlap)
    cp = r.cfg.parallel.cp
    if r.tp * cp > 1 and m.moe_aux_loss_coeff:  # the aux loss's counts (Megatron's tp_cp)
        emit(kind="cp" if cp > 1 else "sp", op="all_reduce",
             site="MoELayer.router:tokens_per_expert", module=mod,
             split="token counts per expert, summed over the microbatch's ranks",
             shape=[z["e"]], itemsize=8)
    if m.moe_token_dispatcher_type == "allgather":
        if r.tp * z["ep"] > 1:
            site = f"{_AG}.token_permutation.forward"
            emit(kind="ep", op="all_gather", site=f"{site}:routing_map", module=mod,
                 split="routing map [tokens, E] of every rank", shape=[z["n"], z["e"]],
                 itemsize=1)
            emit(kind="ep", op="all_gather", site=f"{site}:probs", module=mod, itemsize=4,
                 split="routing probabilities [tokens, E] of every rank", shape=[z["n"], z["e"]])
            emit(kind="ep", op="all_gather", site=f"{site}:tokens", module=mod,
                 split="tokens [tokens, h] of every rank", shape=[z["n"], z["h"]])
            emit(kind="ep", op="reduce_scatter", site=f"{_AG}.token_unpermutation.forward:tokens",
                 module=mod, split="expert outputs summed, each rank's tokens (fp32)",
                 shape=[r.tp * z["ep"] * z["n"], z["h"]], itemsize=4)
        return
    rows, fwd = z["rows"], f"{_A2A}.token_permutation.forward"
    a2a = dict(kind="ep", op="all_to_all", module=mod, **{"async": overlap}, **_splits(z))
    if r.tp * z["ep"] > 1 and not z["padded"]:  # padded: every split known, no counts
        emit(kind="ep", op="all_gather", site=f"{fwd}:tokens_per_expert", module=mod,
             split=_TEXT["tokens_per_expert"], shape=[z["e"]], itemsize=8)
    if overlap and r.tp > 1:
        emit(kind="sp", op="all_gather", site="SharedExpertMLP.pre_forward_comm.forward:input",
             module=mod, split=_SHARED_IN, shape=r.part)
    if z["ep"] > 1:
        emit(**a2a, site=f"{fwd}:tokens", split=_TEXT["tokens"], shape=[rows, z["h"]])
        emit(**a2a, site=f"{fwd}:probs", split=_TEXT["probs"], shape=[rows], itemsize=4)
    if r.tp > 1:
        emit(kind="ep", op="all_gather", site=f"{fwd}:tokens_tp", module=mod,
             split=_TEXT["tokens_tp"], shape=[rows, z["h"]])
        emit(kind="ep", op="all_gather", site=f"{fwd}:probs_tp", module=mod,
             split=_TEXT["probs_tp"], shape=[rows], itemsize=4)
        emit(kind="ep", op="reduce_scatter", site=f"{_A2A}.token_unpermutation.forward:tokens_tp",
             module=mod, split=_TEXT["out_tp"], shape=[r.tp * rows, z["h"]])
    if z["ep"] > 1:
        emit(**a2a, site=f"{_A2A}.token_unpermutation.forward:tokens", split=_TEXT["out"],
             shape=[rows, z["h"]])
    if overlap and r.tp > 1:
        emit(kind="sp", op="reduce_scatter", module=mod,
             site="SharedExpertMLP.post_forward_comm.forward:output", split=_SHARED_OUT,
             shape=r.full)


def moe_backward(r, i: int, emit, after_experts=lambda: None) -> None:
    """Layer ``i``'s MoE backward (the dispatcher's exchanges reversed, then the shared
    expert's; overlapped, the shared output's gather first and its input's reduce-scatter
    last); ``after_experts`` is called where the experts' own backward runs (between the
    unpermutation's exchanges and the permutation's)."""
    m, z = r.cfg.model, _sizes(r)
    overlap = m.moe_shared_expert_overlap and m.moe_shared_expert_intermediate_size is not None
    mod = f"layers.{i}.mlp"
    if overlap and r.tp > 1:
        emit(kind="sp", op="all_gather", module=mod, split=_SHARED_OUT, shape=r.part,
             site="SharedExpertMLP.post_forward_comm.backward:output_grad")
    if m.moe_token_dispatcher_type == "allgather":
        if r.tp * z["ep"] > 1:
            g, back = r.tp * z["ep"], f"{_AG}.token_permutation.backward"
            emit(kind="ep", op="all_gather", site=f"{_AG}.token_unpermutation.backward:"
                 "tokens_grad", module=mod, shape=[z["n"], z["h"]], itemsize=4,
                 split="expert outputs summed, each rank's tokens (fp32)")
            after_experts()
            emit(kind="ep", op="reduce_scatter", site=f"{back}:tokens_grad", module=mod,
                 split="tokens [tokens, h] of every rank", shape=[g * z["n"], z["h"]])
            emit(kind="ep", op="reduce_scatter", site=f"{back}:probs_grad", module=mod,
                 itemsize=4, split="routing probabilities [tokens, E] of every rank",
                 shape=[g * z["n"], z["e"]])
        else:
            after_experts()
    else:
        _alltoall_backward(r, z, mod, emit, overlap, after_experts)
    _shared(r, i, emit, True, overlap)
    if overlap and r.tp > 1:
        emit(kind="sp", op="reduce_scatter", module=mod, split=_SHARED_IN, shape=r.full,
             site="SharedExpertMLP.pre_forward_comm.backward:input_grad")


def _alltoall_backward(r, z: dict, mod: str, emit, overlap: bool, after_experts) -> None:
    rows, back = z["rows"], f"{_A2A}.token_permutation.backward"
    a2a = dict(kind="ep", op="all_to_all", module=mod, **{"async": overlap}, **_splits(z))
    if z["ep"] > 1:
        emit(**a2a, site=f"{_A2A}.token_unpermutation.backward:tokens_grad", split=_TEXT["out"],
             shape=[rows, z["h"]])
    if r.tp > 1:
        emit(kind="ep", op="all_gather", site=f"{_A2A}.token_unpermutation.backward:"
             "tokens_tp_grad", module=mod, split=_TEXT["out_tp"], shape=[rows, z["h"]])
    after_experts()
    if r.tp > 1:
        emit(kind="ep", op="reduce_scatter", site=f"{back}:probs_tp_grad", module=mod,
             split=_TEXT["probs_tp"], shape=[r.tp * rows], itemsize=4)
        emit(kind="ep", op="reduce_scatter", site=f"{back}:tokens_tp_grad", module=mod,
             split=_TEXT["tokens_tp"], shape=[r.tp * rows, z["h"]])
    if z["ep"] > 1:
        emit(**a2a, site=f"{back}:probs_grad", split=_TEXT["probs"], shape=[rows], itemsize=4)
        emit(**a2a, site=f"{back}:tokens_grad", split=_TEXT["tokens"], shape=[rows, z["h"]])
