"""Mixture of experts in the analytical model: parameters, tp/sp traffic, the dispatcher (ep).

What one MoE layer communicates, per microbatch (``N = (s / cp) b`` tokens per rank, ``k`` =
top-k, ``E`` experts, ``h`` hidden, ``B`` bytes per element). Dropless under sp (Megatron's
order) each tp rank routes and dispatches its own ``N / tp`` tokens; otherwise (tp = 1, tp
without sp, or a capacity factor) every tp rank routes all ``N``:

* the dispatcher (kind ``ep``), forward: an all-gather of the per-expert counts over
  ``tp x ep`` (``E`` int64 each; none when rows are padded to capacity); ep > 1: all-to-alls
  of the tokens, of their routing probabilities (fp32) and, after the experts, of the outputs;
  tp > 1 (own tokens): all-gathers of the received rows and of their probabilities over tp
  (uneven sizes) and a reduce-scatter of the outputs. Backward: each of those exchanges
  reversed once (the counts are not exchanged again). The rows depend on the routing, so the
  bytes come from the recorded split sizes (:mod:`~paraloom.analysis.moe_splits`).
* tp/sp: own tokens, the layer has no dense MLP region (the dispatcher's tp exchanges replace
  it); every tp rank routing all tokens, the router logits (``N x E`` fp32) are gathered with
  the tokens (sp: one more all-gather forward, a reduce-scatter of their gradient backward, and
  no re-gather of a saved input; without sp: one more all-reduce backward).
* a shared expert (``moe_shared_expert_intermediate_size``) adds one dense MLP's tp/sp
  traffic (sp: its fc1's all-gather and fc2's reduce-scatter forward, two all-gathers and a
  reduce-scatter backward; without sp an all-reduce each way); its gate's gradient joins the
  sequence-parallel sums.
* the aux loss (when its coefficient is not 0) counts the whole microbatch: one all-reduce of
  the router's counts (``E`` int64) over tp x cp (own tokens; kind ``sp`` without cp) or over
  cp (kind ``cp``); with a capacity factor under cp instead one all-gather over cp of the
  router logits (``N E`` fp32 per rank), so every rank routes the microbatch. Full
  recomputation repeats the forward's.
* Gradients: expert parameters sit in their own buffer, reduced (ZeRO: sharded) over edp
  (``dp cp / ep`` ranks); the experts' fc2 biases (added by tp rank 0) are summed over tp with the
  sequence-parallel gradients; the step's statistics add ``3 + L E`` float64 to the loss
  all-reduce.
"""

from __future__ import annotations

from dataclasses import replace

from ..moe.router import expert_capacity
from .spec import MoECommConfig, Param

__all__ = ["MoECommConfig", "moe_layer_params", "moe_comm", "moe_layers_on_rank",
           "moe_from_run", "expert_mlp_params", "shared_expert_params", "moe_plan", "split_tp",
           "dispatcher_traffic", "local_tokens"]




def moe_from_run(model: dict, parallel: dict, micro_batch: int = 1) -> MoECommConfig | None:
    """The :class:`MoECommConfig` of a run's ``config.json`` (``None`` for a dense model)."""
    if not model.get("num_experts"):
        return None
    return MoECommConfig(num_experts=model["num_experts"], topk=model.get("moe_router_topk", 2),
                         ep=parallel.get("ep", 1), layer_freq=model.get("moe_layer_freq", 1),
                         capacity=model.get("moe_expert_capacity_factor") is not None,
                         padded_rows=_padded_rows(model, micro_batch),
                         shared_ffn=model.get("moe_shared_expert_intermediate_size") or 0,
                         shared_gate=bool(model.get("moe_shared_expert_gate")),
                         shared_overlap=bool(model.get("moe_shared_expert_overlap")),
                         dispatcher=model.get("moe_token_dispatcher_type", "allgather"),
                         grouped_gemm=bool(model.get("moe_grouped_gemm")),
                         aux_loss=model.get("moe_aux_loss_coeff", 1e-2) > 0)


def _padded_rows(model: dict, micro_batch: int) -> int:
    """``E x capacity`` when the run pads expert inputs to capacity (the capacity counts every
    token of a microbatch, ``s x b``; under cp too), else 0."""
    if not model.get("moe_pad_expert_input_to_capacity"):
        return 0
    return model["num_experts"] * expert_capacity(
        model["seq_length"] * micro_batch, model.get("moe_router_topk", 2),
        model["num_experts"], model["moe_expert_capacity_factor"])


def moe_layer_params(c, prefix: str) -> list[Param]:
    """One MoE layer's parameters on one rank, in registration order: the router, then this ep
    rank's ``E / ep`` experts (named by local index here; sizes are the same on every rank).
    An expert is the architecture's MLP: fc1 ``2f`` rows with SwiGLU, biases only with
    ``add_bias_linear``; each expert's fc1 then fc2, or (grouped GEMM) every fc1, then every
    fc2."""
    t, h, f, m = c.tp, c.hidden, c.f, c.moe
    fc1, bias = c.arch.fc1(f), c.arch.add_bias_linear
    out = [Param(prefix + "router.weight", m.num_experts * h, sp=c.sp, row=h)]
    if bias:  # Megatron's router takes a bias under add_bias_linear too
        out.append(Param(prefix + "router.bias", m.num_experts, sp=c.sp))
    local = range(m.num_experts // m.ep)
    parts = [[("fc1", g), ("fc2", g)] for g in local]
    if m.grouped_gemm:
        parts = [[(fc, g) for g in local] for fc in ("fc1", "fc2")]
    for fc, g in (part for group in parts for part in group):
        e = f"{prefix}experts.{g}.{fc}."
        rows, cols = (fc1 // t, h) if fc == "fc1" else (h, f // t)
        out.append(Param(e + "weight", rows * cols, expert=True, row=cols))
        if bias:
            out.append(Param(e + "bias", rows, sp=fc == "fc2" and t > 1, expert=True))
    if m.shared_ffn:  # the shared expert: its gate (a direct parameter) first, then fc1, fc2
        e, sf = prefix + "shared_experts.", m.shared_ffn
        if m.shared_gate:
            out.append(Param(e + "gate_weight", h, sp=c.sp, row=h))
        out += [Param(e + "fc1.weight", c.arch.fc1(sf) // t * h, row=h),
                Param(e + "fc2.weight", h * (sf // t), row=sf // t)]
    return out


def shared_expert_params(c, tp: int) -> int:
    """The shared expert's parameters on one tp rank (0 without one): an MLP of width
    ``shared_ffn`` without biases, plus the gate's ``h``."""
    m = c.moe
    if not m.shared_ffn:
        return 0
    mlp = expert_mlp_params(replace(c.arch, add_bias_linear=False), c.hidden, m.shared_ffn, tp)
    return mlp + (c.hidden if m.shared_gate else 0)


def expert_mlp_params(arch, hidden: int, ffn: int, tp: int = 1) -> int:
    """Parameters of one MLP (an expert, or the dense MLP it replaces) on one tp rank: fc1
    (``2f`` rows with SwiGLU) and fc2, plus their biases with ``add_bias_linear`` (fc2's bias
    whole on every rank)."""
    fc1 = arch.fc1(ffn)
    weights = (fc1 + ffn) * hidden // tp
    return weights + (fc1 // tp + hidden if arch.add_bias_linear else 0)


def moe_layers_on_rank(c, pp_rank: int) -> int:
    """MoE layers held by one pipeline rank (all of its virtual chunks)."""
    per_chunk = c.layers // (c.pp * c.v)
    ids = [i for chunk in range(c.v)
           for i in range((chunk * c.pp + pp_rank) * per_chunk,
                          (chunk * c.pp + pp_rank + 1) * per_chunk)]
    return sum(1 for i in ids if c.moe.is_moe_layer(i))


def split_tp(c) -> bool:
    """Whether each tp rank routes and dispatches its own tokens (Megatron's order: dropless
    under sp); otherwise every tp rank routes the whole microbatch."""
    return c.tp > 1 and c.sp and not c.moe.capacity


def moe_comm(c, pp_rank: int, add) -> None:
    """Correct :func:`~paraloom.analysis.formulas.expected_comm` for the MoE layers of this rank:
    their tp/sp traffic instead of the dense MLP's, and the count of the dispatcher's exchanges
    (the rows' bytes come from the recorded splits, see :func:`split_bytes`)."""
    m, t = c.moe, c.tp
    mm = c.num_microbatches * moe_layers_on_rank(c, pp_rank)
    n_tok = local_tokens(c)
    logits = n_tok * m.num_experts * 4                      # [N, E] fp32
    act = n_tok * c.hidden * c.dtype_bytes                  # [s, b, h]
    # full recomputation re-runs the whole MoE forward (its output feeds the saved residual)
    again = mm if c.recompute == "full" else 0
    split = split_tp(c)
    if split:  # no dense MLP region: the dispatcher gathers and scatters rows over tp itself
        for phase, n in (("forward", mm), ("recompute", again)):
            add("sp", "all_gather", phase, -n, act // t)
            add("sp", "reduce_scatter", phase, -n, act)
        add("sp", "all_gather", "backward", -2 * mm, act // t)
        add("sp", "reduce_scatter", "backward", -mm, act)
    elif t > 1 and c.sp:
        add("sp", "all_gather", "forward", mm, logits // t)   # the logits' gather
        add("sp", "all_gather", "backward", -mm, act // t)    # no saved-input re-gather
        add("sp", "reduce_scatter", "backward", mm, logits)   # the logits' gradient
        add("sp", "all_gather", "recompute", again, logits // t)
        add("sp", "reduce_scatter", "recompute", again, act)  # the output's reduce-scatter
    elif t > 1:
        add("tp", "all_reduce", "backward", mm, logits)       # the logits' copy region
        add("tp", "all_reduce", "recompute", again, act)      # the output's all-reduce
    if t > 1 and m.shared_ffn:
        _shared_expert(c, mm, again, act, add)
    cp = getattr(c, "cp", 1)
    if cp > 1 and m.capacity:  # the router logits, gathered over cp
        add("cp", "all_gather", "forward", mm, logits)
        add("cp", "all_gather", "recompute", again, logits)
    elif (cp > 1 or split) and m.aux_loss:  # the aux loss's counts (E int64), tp x cp or cp
        kind = "cp" if cp > 1 else "sp"
        add(kind, "all_reduce", "forward", mm, m.num_experts * 8)
        add(kind, "all_reduce", "recompute", again, m.num_experts * 8)
    _dispatcher(c, split, mm, again, add)


def _allgather(c, group: int, n: int, mm: int, again: int, add) -> None:
    """The allgather dispatcher over ``group`` ranks for ``n`` routed tokens per rank: the
    routing map (bool), probabilities (fp32) and tokens of every rank gathered, the outputs
    reduce-scattered in fp32 (``group n`` rows in); backward the output grads gathered (fp32),
    the tokens' and probabilities' grads reduce-scattered. Every size is the layout's."""
    e, h, b = c.moe.num_experts, c.hidden, c.dtype_bytes
    for phase, k in (("forward", mm), ("recompute", again)):
        for nbytes in (n * e, n * e * 4, n * h * b):
            add("ep", "all_gather", phase, k, nbytes)
        add("ep", "reduce_scatter", phase, k, group * n * h * 4)
    add("ep", "all_gather", "backward", mm, n * h * 4)
    add("ep", "reduce_scatter", "backward", mm, group * n * h * b)
    add("ep", "reduce_scatter", "backward", mm, group * n * e * 4)


def _shared_expert(c, mm: int, again: int, act: int, add) -> None:
    """A shared expert: one more dense MLP's tp/sp traffic (overlapped: its input's gather
    kept for backward, as the dispatcher's explicit gather, not gathered again)."""
    shard = act // c.tp
    if c.sp:  # fc1 gathers its input, fc2 reduce-scatters; backward as a dense MLP's
        add("sp", "all_gather", "forward", mm, shard)
        add("sp", "reduce_scatter", "forward", mm, act)
        add("sp", "all_gather", "backward", (1 if c.moe.shared_overlap else 2) * mm, shard)
        add("sp", "reduce_scatter", "backward", mm, act)
        add("sp", "all_gather", "recompute", again, shard)
        add("sp", "reduce_scatter", "recompute", again, act)
    else:
        add("tp", "all_reduce", "forward", mm, act)
        add("tp", "all_reduce", "backward", mm, act)
        add("tp", "all_reduce", "recompute", again, act)


def _dispatcher(c, split: bool, mm: int, again: int, add) -> None:
    """The token dispatcher's exchanges, kind ``ep`` (alltoall: the rows' bytes come from the
    splits)."""
    m = c.moe
    tp = c.tp if split else 1
    if m.ep * tp == 1:
        return
    if m.dispatcher == "allgather":
        _allgather(c, m.ep * tp, local_tokens(c) // tp, mm, again, add)
        return
    for phase, n in (("forward", mm), ("recompute", again)):
        if not m.padded_rows:  # padded: every split is known, no counts exchanged
            add("ep", "all_gather", phase, n, m.num_experts * 8)   # counts, over tp x ep
        if m.ep > 1:  # tokens and probabilities there, outputs back
            add("ep", "all_to_all", phase, 3 * n, 0)
        if tp > 1:  # tokens and probabilities gathered over tp, outputs reduce-scattered
            add("ep", "all_gather", phase, 2 * n, 0)
            add("ep", "reduce_scatter", phase, n, 0)
    if m.ep > 1:
        add("ep", "all_to_all", "backward", 3 * mm, 0)
    if tp > 1:
        add("ep", "all_gather", "backward", mm, 0)
        add("ep", "reduce_scatter", "backward", 2 * mm, 0)


def local_tokens(c) -> int:
    """Tokens of a microbatch on one rank: ``(s / cp) b`` (cp holds a slice of each sequence)."""
    return c.seq_len // getattr(c, "cp", 1) * c.micro_batch


def dispatcher_traffic(c) -> tuple[int, int]:
    """``(ops, bytes)`` of the token dispatcher for one MoE layer and microbatch on one rank,
    under balanced routing (every rank receives as many rows as it sends): ``R = N k`` rows
    (``N / tp`` tokens when tp ranks dispatch their own), an all-to-all of ``R`` token rows,
    one of ``R`` probabilities (fp32) and one of ``R`` outputs forward, each reversed backward;
    with tp: an all-gather of ``R`` rows and of ``R`` probabilities and a reduce-scatter of the
    ``tp R`` gathered rows forward, reversed backward; and the counts' all-gather (``8 E``).
    The allgather dispatcher: its seven exchanges (:func:`_allgather`)."""
    m, tp = c.moe, (c.tp if split_tp(c) else 1)
    if m.ep * tp == 1:
        return 0, 0
    if m.dispatcher == "allgather":  # every size the layout's (see _allgather)
        calls: list[tuple[int, int]] = []
        _allgather(c, m.ep * tp, local_tokens(c) // tp, 1, 0,
                   lambda _kind, _op, _phase, n, b: calls.append((n, n * b)))
        return sum(n for n, _ in calls), sum(b for _, b in calls)
    rows = local_tokens(c) // tp * m.topk
    row, prob = c.hidden * c.dtype_bytes, 4
    ops, nbytes = (0, 0) if m.padded_rows else (1, 8 * m.num_experts)
    if m.ep > 1:
        ops, nbytes = ops + 6, nbytes + 2 * rows * (2 * row + prob)
    if tp > 1:
        ops, nbytes = ops + 6, nbytes + 2 * rows * (row + prob) + tp * rows * (2 * row + prob)
    return ops, nbytes


def moe_plan(c, pp_rank: int) -> dict:
    """What MoE adds to ``paraloom plan`` for one pipeline rank (estimates for balanced routing):

    * ``params``: router ``E h`` (``E (h + 1)`` with biases) plus ``E / ep`` tp-split experts
      (and the shared expert) instead of one dense MLP, per MoE layer;
    * ``activation_bytes``: per microbatch in flight, the ``k - 1`` extra copies of each token's
      MLP activations (input ``h``, fc1 and GeLU outputs ``2 f / t``; SwiGLU: fc1's ``2 f / t``,
      silu's and the product's ``f / t`` each; 16-bit units) and the combine's ``k h`` rows,
      scaled to the dtype;
    * ``expert_params`` (sharded over ``edp`` by ZeRO) and ``total_params`` (what MoE adds to
      the whole model's count);
    * ``ep_bytes`` / ``ep_ops``: the dispatcher's exchanges of a step
      (:func:`dispatcher_traffic`)."""
    m, t, h, f = c.moe, c.tp, c.hidden, c.f
    layers = moe_layers_on_rank(c, pp_rank)
    expert = dense = expert_mlp_params(c.arch, h, f, t)  # an expert is the dense MLP's shape
    router = m.num_experts * (h + c.arch.add_bias_linear)  # its weight and bias
    params = layers * (router + m.num_experts // m.ep * expert - dense
                       + shared_expert_params(c, t))
    all_layers = sum(1 for i in range(c.layers) if m.is_moe_layer(i))
    total = all_layers * (router + shared_expert_params(c, 1)
                          + (m.num_experts - 1) * expert_mlp_params(c.arch, h, f))
    n_tok = c.seq_len * c.micro_batch  # activations: plan applies the cp factor itself
    def mlp_act(width: float) -> float:  # input h; fc1 and GeLU (SwiGLU: fc1 2f, silu, product)
        return 2 * h + 4 * c.arch.fc1(width) / t

    shared_act = mlp_act(m.shared_ffn) if m.shared_ffn else 0  # the shared expert: every token
    act = layers * n_tok * ((m.topk - 1) * mlp_act(f) + 2 * m.topk * h + shared_act) \
        * c.dtype_bytes / 2
    ops, nbytes = dispatcher_traffic(c)
    mm = layers * c.num_microbatches
    edp = c.dp * getattr(c, "cp", 1) // m.ep
    return {"params": params, "activation_bytes": act, "ep_bytes": mm * nbytes, "ep_ops": mm * ops,
            "expert_params": layers * m.num_experts // m.ep * expert, "edp": edp,
            "total_params": total}
