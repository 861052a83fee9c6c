"""The mixture-of-experts fields of a :class:`~paraloom.config.model.ModelConfig`: Megatron's
rules, checked when the config is made (a bad value names itself and what is valid)."""

from __future__ import annotations

from .parallel import positive_int

__all__ = ["check_moe", "moe_stage_problems"]


def check_moe(m) -> None:
    """Every MoE rule; a dense model (``num_experts`` None) may not set a shared expert."""
    if m.num_experts is None:
        if m.moe_shared_expert_intermediate_size or m.moe_shared_expert_gate:
            raise ValueError(f"moe_shared_expert_intermediate_size = "
                             f"{m.moe_shared_expert_intermediate_size} and "
                             f"moe_shared_expert_gate = {m.moe_shared_expert_gate} need "
                             "num_experts (a shared expert belongs to a MoE layer)")
        return
    _check_moe(m)


def _check_moe(m) -> None:
    positive_int("num_experts", m.num_experts)
    positive_int("moe_router_topk", m.moe_router_topk)
    positive_int("moe_layer_freq", m.moe_layer_freq)
    if m.moe_router_topk > m.num_experts:
        raise ValueError(f"moe_router_topk = {m.moe_router_topk} is larger than num_experts = "
                         f"{m.num_experts}: a token cannot go to more experts than there are")
    if m.moe_aux_loss_coeff < 0 or (m.moe_z_loss_coeff or 0) < 0:
        raise ValueError(f"moe_aux_loss_coeff ({m.moe_aux_loss_coeff}) and moe_z_loss_coeff "
                         f"({m.moe_z_loss_coeff}) must be >= 0")
    cf = m.moe_expert_capacity_factor
    if cf is not None and not cf > 0:
        raise ValueError(f"moe_expert_capacity_factor must be positive (or None: dropless), "
                         f"got {cf}")
    if m.moe_pad_expert_input_to_capacity and cf is None:
        raise ValueError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor "
                         "(padding is to the capacity); give --moe-expert-capacity-factor")
    _check_shared_expert(m)
    if m.moe_token_dispatcher_type not in ("allgather", "alltoall"):
        raise ValueError(f"moe_token_dispatcher_type must be allgather or alltoall, got "
                         f"{m.moe_token_dispatcher_type!r}")
    if m.moe_shared_expert_overlap and m.moe_token_dispatcher_type != "alltoall":
        raise ValueError(f"moe_shared_expert_overlap runs the shared expert inside the alltoall "
                         f"dispatcher (Megatron: alltoall or flex only), got "
                         f"moe_token_dispatcher_type = {m.moe_token_dispatcher_type!r}: add "
                         f"--moe-token-dispatcher-type alltoall")
    if m.moe_pad_expert_input_to_capacity and m.moe_token_dispatcher_type != "alltoall":
        raise ValueError("moe_pad_expert_input_to_capacity pads the alltoall dispatcher's "
                         "rows (fixed split sizes); the allgather dispatcher moves whole "
                         "token sets and has none: add --moe-token-dispatcher-type alltoall")
    if m.moe_token_drop_policy not in ("probs", "position"):
        raise ValueError(f"moe_token_drop_policy must be probs or position, got "
                         f"{m.moe_token_drop_policy!r}")


def _check_shared_expert(m) -> None:
    """Megatron's shared-expert rules: a positive width, no biases, the gate only with one."""
    size = m.moe_shared_expert_intermediate_size
    if size is None:
        if m.moe_shared_expert_gate:
            raise ValueError("moe_shared_expert_gate needs moe_shared_expert_intermediate_size "
                             "(the gate scales the shared expert's output)")
        return
    positive_int("moe_shared_expert_intermediate_size", size)
    if m.add_bias_linear:
        raise ValueError(f"moe_shared_expert_intermediate_size = {size} with add_bias_linear = "
                         "True: shared experts have no biases (Megatron asserts it); add "
                         "--disable-bias-linear")


def moe_stage_problems(m, parallel) -> list[str]:
    """A pipeline stage without a MoE layer, named: Megatron builds the expert optimizer only
    on ranks with expert parameters, so the other stages' expert gradient-norm all-reduce over
    tp x ep x pp would wait for it forever (Megatron hangs there; paraloom refuses)."""
    pp, v = parallel.pp, parallel.vpp or 1
    if m.num_experts is None or pp == 1 or m.num_layers % (pp * v):
        return []
    per = m.num_layers // (pp * v)
    out = []
    for stage in range(pp):  # chunk c of stage p holds virtual stage c * pp + p
        layers = [i for c in range(v) for i in range((c * pp + stage) * per,
                                                     (c * pp + stage + 1) * per)]
        if not any(i % m.moe_layer_freq == 0 for i in layers):
            out.append(f"pipeline stage {stage} holds no MoE layer (layers {layers[0]}.."
                       f"{layers[-1]}{' and others' if v > 1 else ''}, moe_layer_freq = "
                       f"{m.moe_layer_freq}): the other stages' expert gradient norm is "
                       f"all-reduced over tp x ep x pp with it, and it has no expert optimizer "
                       f"to join (Megatron would hang); choose --moe-layer-freq, --pp or "
                       f"--num-layers so that every stage holds a MoE layer")
    return out
