"""Mixture of experts in the analytical model: parameters, tp/sp traffic, all-to-all (kind ep).

What one MoE layer communicates, per microbatch (``N = s b`` tokens, ``k`` = top-k, ``E``
experts, ``h`` hidden, ``B`` bytes per element; every tp rank routes all ``N`` tokens):

* ep > 1, forward: an all-to-all of the per-expert counts (``E`` int64: ``8E`` bytes), the
  dispatch all-to-all (rows this rank sends: ``N k`` without drops, ``sum(input_splits)`` with a
  capacity factor) and the combine all-to-all (the rows its experts received); backward: the
  same two token all-to-alls reversed. A token all-to-all moves ``rows x h x B`` bytes, so the
  dispatch totals are ``tokens x topk x h x dtype``. The received rows depend on the routing:
  :func:`check_all_to_all` verifies every event's bytes against its own recorded split sizes,
  the split sizes against the peers' (rank ``i``'s ``input_splits[j]`` is rank ``j``'s
  ``output_splits[i]``) and the dispatch totals against ``N k`` (dropless).
* tp > 1 differs from the dense MLP: the router logits (``N x E`` fp32) are gathered with the
  tokens (sp: one more all-gather forward, a reduce-scatter of their gradient backward, and no
  re-gather of a saved input; without sp: one more all-reduce backward).
* a shared expert (``moe_shared_expert_intermediate_size``) adds one dense MLP's tp/sp
  traffic (sp: its fc1's all-gather and fc2's reduce-scatter forward, two all-gathers and a
  reduce-scatter backward; without sp an all-reduce each way); its gate's gradient joins the
  sequence-parallel sums.
* cp > 1: ``N = (s / cp) b`` tokens per rank, and one all-reduce over cp of the router's
  counts (``E + 1`` int64: tokens per expert and tokens) so the aux loss counts the whole
  microbatch (repeated by full recomputation); with a capacity factor instead one all-gather
  over cp of the router logits (``N E`` fp32 per rank), so every rank routes the microbatch.
* Gradients: expert parameters sit in their own buffer, reduced (ZeRO: sharded) over edp
  (``dp cp / ep`` ranks); the experts' fc2 biases (added by tp rank 0) are summed over tp with the
  sequence-parallel gradients; the step's statistics add ``3 + L E`` float64 to the loss
  all-reduce.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from ..moe.router import expert_capacity
from .spec import MoECommConfig, Param

__all__ = ["MoECommConfig", "moe_layer_params", "moe_comm", "moe_layers_on_rank",
           "check_all_to_all", "moe_from_run", "expert_mlp_params", "shared_expert_params",
           "moe_plan", "split_bytes"]




def moe_from_run(model: dict, parallel: dict, micro_batch: int = 1) -> MoECommConfig | None:
    """The :class:`MoECommConfig` of a run's ``config.json`` (``None`` for a dense model)."""
    if not model.get("num_experts"):
        return None
    return MoECommConfig(num_experts=model["num_experts"], topk=model.get("moe_router_topk", 2),
                         ep=parallel.get("ep", 1), layer_freq=model.get("moe_layer_freq", 1),
                         capacity=model.get("moe_expert_capacity_factor") is not None,
                         padded_rows=_padded_rows(model, micro_batch),
                         shared_ffn=model.get("moe_shared_expert_intermediate_size") or 0,
                         shared_gate=bool(model.get("moe_shared_expert_gate")))


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
    ``add_bias_linear``."""
    t, h, f, m = c.tp, c.hidden, c.f, c.moe
    fc1, bias = c.arch.fc1(f), c.arch.add_bias_linear
    out = [Param(prefix + "router.weight", m.num_experts * h, sp=c.sp)]
    for g in range(m.num_experts // m.ep):
        e = f"{prefix}experts.{g}."
        out.append(Param(e + "fc1.weight", fc1 // t * h, expert=True))
        if bias:
            out.append(Param(e + "fc1.bias", fc1 // t, expert=True))
        out.append(Param(e + "fc2.weight", h * (f // t), expert=True))
        if bias:
            out.append(Param(e + "fc2.bias", h, sp=t > 1, expert=True))
    if m.shared_ffn:  # the shared expert: its gate (a direct parameter) first, then fc1, fc2
        e, sf = prefix + "shared_experts.", m.shared_ffn
        if m.shared_gate:
            out.append(Param(e + "gate_weight", h, sp=c.sp))
        out += [Param(e + "fc1.weight", c.arch.fc1(sf) // t * h),
                Param(e + "fc2.weight", h * (sf // t))]
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


def moe_comm(c, pp_rank: int, add) -> None:
    """Correct :func:`~paraloom.analysis.formulas.expected_comm` for the MoE layers of this rank:
    their tp/sp traffic instead of the dense MLP's, and the count of all-to-alls (the token
    all-to-alls' bytes come from the recorded splits, see :func:`check_all_to_all`)."""
    m, t = c.moe, c.tp
    mm = c.num_microbatches * moe_layers_on_rank(c, pp_rank)
    n_tok = _local_tokens(c)
    logits = n_tok * m.num_experts * 4                      # [N, E] fp32
    act = n_tok * c.hidden * c.dtype_bytes                  # [s, b, h]
    # full recomputation re-runs the whole MoE forward (its output feeds the saved residual)
    again = mm if c.recompute == "full" else 0
    if t > 1 and c.sp:
        add("sp", "all_gather", "forward", mm, logits // t)   # the logits' gather
        add("sp", "all_gather", "backward", -mm, act // t)    # no saved-input re-gather
        add("sp", "reduce_scatter", "backward", mm, logits)   # the logits' gradient
        add("sp", "all_gather", "recompute", again, logits // t)
        add("sp", "reduce_scatter", "recompute", again, act)  # the output's reduce-scatter
    elif t > 1:
        add("tp", "all_reduce", "backward", mm, logits)       # the logits' copy region
        add("tp", "all_reduce", "recompute", again, act)      # the output's all-reduce
    if t > 1 and m.shared_ffn:  # the shared expert: one more dense MLP's tp/sp traffic
        shard = act // t
        if c.sp:  # fc1 gathers its input, fc2 reduce-scatters; backward as a dense MLP's
            add("sp", "all_gather", "forward", mm, shard)
            add("sp", "reduce_scatter", "forward", mm, act)
            add("sp", "all_gather", "backward", 2 * mm, shard)
            add("sp", "reduce_scatter", "backward", mm, act)
            add("sp", "all_gather", "recompute", again, shard)
            add("sp", "reduce_scatter", "recompute", again, act)
        else:
            add("tp", "all_reduce", "forward", mm, act)
            add("tp", "all_reduce", "backward", mm, act)
            add("tp", "all_reduce", "recompute", again, act)
    if getattr(c, "cp", 1) > 1 and m.capacity:  # the router logits, gathered over cp
        add("cp", "all_gather", "forward", mm, logits)
        add("cp", "all_gather", "recompute", again, logits)
    elif getattr(c, "cp", 1) > 1:  # the router's counts (E) and tokens (1), int64, over cp
        add("cp", "all_reduce", "forward", mm, (m.num_experts + 1) * 8)
        add("cp", "all_reduce", "recompute", again, (m.num_experts + 1) * 8)
    if m.ep > 1:
        for phase, n in (("forward", mm), ("recompute", again)):
            if not m.padded_rows:  # padded: every split is known, no counts exchanged
                add("ep", "all_to_all", phase, n, m.num_experts * 8)  # counts
            add("ep", "all_to_all", phase, 2 * n, 0)          # dispatch, combine: see splits
        add("ep", "all_to_all", "backward", 2 * mm, 0)


def _local_tokens(c) -> int:
    """Tokens of a microbatch on one rank: ``(s / cp) b`` (cp holds a slice of each sequence)."""
    return c.seq_len // getattr(c, "cp", 1) * c.micro_batch


def _tokens(e: dict) -> bool:
    return e["kind"] == "ep" and e["op"] == "all_to_all" and e.get("dtype") != "int64"


def split_bytes(c, events: list[dict], rank: int, step: int | None) -> dict:
    """``{(kind, op, phase): {"count": 0, "bytes"}}``: the token all-to-alls' bytes as their
    recorded split sizes say (``sum(input_splits) x h x B``), for this rank and step."""
    out: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
    row = c.hidden * c.dtype_bytes
    for e in events:
        if _tokens(e) and e["rank"] == rank and (step is None or e["step"] == step):
            phase = "recompute" if e.get("recompute") else e["phase"]
            out["ep", "all_to_all", phase]["bytes"] += sum(e["input_splits"]) * row
    return out


def check_all_to_all(c, events: list[dict], *, step: int | None = None) -> list[dict]:
    """Rows (the check's format) for what the per-key totals cannot see: for every rank, that
    each token all-to-all's split sizes match its peers' (``phase`` ``splits``), and without
    drops that the dispatch sends ``tokens x topk`` rows (``phase`` ``tokens x topk``)."""
    if c.moe is None or c.moe.ep == 1:
        return []
    chosen = [e for e in events if _tokens(e) and (step is None or e["step"] == step)]
    key = lambda e: (e["step"], e["microbatch"], e["module"], e["site"], e["phase"],  # noqa
                     bool(e.get("recompute")))
    by_rank = {(e["rank"], key(e)): e for e in chosen}
    rows = []
    row_bytes = c.hidden * c.dtype_bytes
    per_mb = _local_tokens(c) * c.moe.topk
    for rank in sorted({e["rank"] for e in chosen}):
        mine = [e for e in chosen if e["rank"] == rank]
        good = 0
        for e in mine:
            i = e["group"].index(rank)
            peers = [by_rank.get((r, key(e))) for r in e["group"]]
            good += all(p is not None and p["output_splits"][i] == e["input_splits"][j]
                        for j, p in enumerate(peers))
        rows.append(_row(rank, "splits", len(mine), good, 0, 0))
        if not c.moe.capacity or c.moe.padded_rows:
            sent = [e for e in mine if e["phase"] == "forward" and ".token_permutation." in
                    e["site"]]
            rows_per_mb = c.moe.padded_rows or per_mb
            want = [rows_per_mb * row_bytes] * len(sent)
            rows.append(_row(rank, "E x capacity" if c.moe.padded_rows else "tokens x topk",
                             len(sent), len(sent), sum(want), sum(e["bytes"] for e in sent)))
    return rows


def _row(rank, phase, exp_n, rec_n, exp_b, rec_b) -> dict:
    return {"rank": rank, "kind": "ep", "op": "all_to_all", "phase": phase,
            "expected_count": exp_n, "recorded_count": rec_n, "expected_bytes": exp_b,
            "recorded_bytes": rec_b, "ok": exp_n == rec_n and exp_b == rec_b}


def moe_plan(c, pp_rank: int) -> dict:
    """What MoE adds to ``paraloom plan`` for one pipeline rank (estimates for balanced routing):

    * ``params``: router ``E h`` plus ``E / ep`` tp-split experts (and the shared expert) instead
      of one dense MLP, per MoE layer;
    * ``activation_bytes``: per microbatch in flight, the ``k - 1`` extra copies of each token's
      MLP activations (input ``h``, fc1 and GeLU outputs ``2 f / t``; SwiGLU: fc1's ``2 f / t``,
      silu's and the product's ``f / t`` each; 16-bit units) and the combine's ``k h`` rows,
      scaled to the dtype;
    * ``expert_params`` (sharded over ``edp`` by ZeRO) and ``total_params`` (what MoE adds to
      the whole model's count);
    * ``ep_bytes`` / ``ep_ops``: the all-to-alls of a step, each token all-to-all moving
      ``N k h B`` per rank when every rank receives as much as it sends."""
    m, t, h, f = c.moe, c.tp, c.hidden, c.f
    layers = moe_layers_on_rank(c, pp_rank)
    expert = dense = expert_mlp_params(c.arch, h, f, t)  # an expert is the dense MLP's shape
    params = layers * (m.num_experts * h + m.num_experts // m.ep * expert - dense
                       + shared_expert_params(c, t))
    all_layers = sum(1 for i in range(c.layers) if m.is_moe_layer(i))
    total = all_layers * (m.num_experts * h + shared_expert_params(c, 1)
                          + (m.num_experts - 1) * expert_mlp_params(c.arch, h, f))
    n_tok = c.seq_len * c.micro_batch  # activations: plan applies the cp factor itself
    def mlp_act(width: float) -> float:  # input h; fc1 and GeLU (SwiGLU: fc1 2f, silu, product)
        return 2 * h + 4 * c.arch.fc1(width) / t

    shared_act = mlp_act(m.shared_ffn) if m.shared_ffn else 0  # the shared expert: every token
    act = layers * n_tok * ((m.topk - 1) * mlp_act(f) + 2 * m.topk * h + shared_act) \
        * c.dtype_bytes / 2
    mm = layers * c.num_microbatches
    ep_ops = 5 * mm if m.ep > 1 else 0
    ep_bytes = mm * (8 * m.num_experts + 4 * _local_tokens(c) * m.topk * h * c.dtype_bytes) \
        if m.ep > 1 else 0
    edp = c.dp * getattr(c, "cp", 1) // m.ep
    return {"params": params, "activation_bytes": act, "ep_bytes": ep_bytes, "ep_ops": ep_ops,
            "expert_params": layers * m.num_experts // m.ep * expert, "edp": edp,
            "total_params": total}
