"""Step time of one layout on described hardware, built from what the formulas count exactly.

Per pipeline stage and microbatch (``T = s b / cp`` tokens on a rank, ``t`` tp, ``e`` bytes per
activation element):

* **GEMMs**: every linear and attention GEMM with its shape — QKV ``(T, 3h/t, h)``, QK^T and
  attention x V (``b a/t`` batched ``(s/cp, s, d)``), proj ``(T, h, h/t)``, fc1 ``(T, f/t, h)``,
  fc2 ``(T, h, f/t)``, logits ``(T, V/t, h)`` on the last stage — each timed as
  ``2 M N K / (peak * eff(M, N))`` with ``eff = gemm_efficiency * M/(M+d0) * N/(N+d0)``
  (small GEMMs run far below peak; ``d0 = gemm_half_dim``). Backward is dgrad + wgrad: twice
  the forward. Recomputation adds the forward (full) or QK^T (selective; see
  :func:`~paraloom.analysis.flops.recompute_flops`).
* **Element-wise kernels** (LayerNorm, bias-dropout-add, GeLU, softmax, cross-entropy):
  bytes moved / achievable HBM bandwidth, plus ``op_overhead`` per kernel.
* **Collectives**, alpha-beta per algorithm over the link the group spans (mesh order tp, cp,
  dp, pp with tp fastest: a group of stride ``S`` and size ``n`` stays inside a node when
  ``S n`` divides ``gpus_per_node``): ring all-reduce ``2(n-1)(alpha + B/(n beta))``,
  all-gather / reduce-scatter ``(n-1)(alpha + B/(n beta))`` of the full tensor ``B``,
  all-to-all ``(n-1)(alpha + B/(n beta))``, p2p ``alpha + B/beta``. A ring that leaves the
  node with ``k`` of its ranks in each node runs ``k`` channels side by side, one NIC each: its
  ``beta`` is ``k`` NICs' (at most NVLink's), so dp at tp = 1 reduces over eight NICs a node and
  at tp = 8 over one.
* **Overlap**: tp forward reductions are exposed; in backward the column layers' input-grad
  all-reduce (async dgrad, or the sp reduce-scatter) hides under the wgrad GEMM and the sp
  re-gather under dgrad; pipeline p2p is exposed unless ``overlap_p2p``; the data-parallel bucket
  reductions hide under the last microbatch's backward (``overlap_grad_reduce``) except the last
  bucket — interleaved, each chunk's under the other chunks' backward of the last microbatch
  group but the first chunk's own; ZeRO's parameter all-gather hides likewise under forward with
  ``overlap_param_gather`` (else exposed); the tied-embedding reduction and the optimizer are not
  hidden; ``tp_comm_overlap`` pipelines the sp collectives with their GEMMs; the gradient norm,
  the step's agreements (over tp x pp) and the loss (over dp) are counted with the embedding's.
  The pipeline bubble is ``(p-1)/v`` microbatch-stage times (zero-bubble schedules:
  pass ``bubble_scale``).
* **Optimizer**: Adam over this rank's parameters (divided by dp under ZeRO) at
  :data:`ADAM_BYTES_PER_PARAM` (38) bytes per parameter through HBM (fp32 param, grad, m, v in
  and out; 16-bit param out; grad norm) and :data:`OPTIMIZER_KERNELS` launches.

Context parallelism (``c.cp``) shortens every rank's sequence to ``s/cp`` (its queries still
attend to all ``s`` keys) and adds the K/V exchange of :mod:`~paraloom.analysis.cp_formulas` over
the cp group (stride ``t``): the ring's ``cp - 1`` forward and ``2cp - 1`` backward p2p steps hide
under the attention of the chunk in hand (``overlap_efficiency``), the all-gather variant's
gather and reduce-scatter are exposed; recomputation repeats the forward exchange. Gradients
reduce over ``dp x cp``. Mixture of experts (``c.moe``): a MoE layer runs the router GEMM and
``E/ep`` local experts of ``N k ep / E`` rows each (balanced routing) instead of the dense MLP;
with ``ep > 1`` it adds the count, dispatch and combine all-to-alls forward and the two token
all-to-alls backward (``k N h`` elements each, :mod:`~paraloom.analysis.moe_formulas`) over the
ep group (stride ``t cp``; it leaves the node when ``t cp ep`` exceeds it), exposed. Expert
gradients reduce over their ``edp = dp/ep`` ranks. GQA's smaller QKV and SwiGLU's wider fc1
change the GEMM shapes; model and hardware FLOPs come from :mod:`~paraloom.analysis.flops`.
"""

from __future__ import annotations

from .costs import Options, collective_time, gemm_time, layer_time, node_lanes, spans_nodes
from .flops import hardware_flops, model_flops
from .fsdp_formulas import zero3_gather_events
from .hardware import Hardware
from .layout import bucket_size_of, chunk_params, layers_per_stage, params_per_rank
from .moe_formulas import moe_layers_on_rank, moe_plan
from .spec import CommConfig

__all__ = ["Options", "step_time", "render_step_time"]

ADAM_BYTES_PER_PARAM = 38
"""HBM traffic of the Adam update per parameter: fp32 parameter, gradient and both moments read
and written, the 16-bit parameter written, the gradient norm's read."""
OPTIMIZER_KERNELS = 60
"""Kernel launches of one optimizer step (each costs ``op_overhead``)."""


def step_time(c: CommConfig, hw: Hardware, o: Options | None = None) -> dict:
    """Predicted seconds per step, its breakdown, tokens/s, TFLOP/s per GPU, MFU and HFU."""
    o = o or Options()
    p, m, v = c.pp, c.num_microbatches, c.v
    gpus = c.tp * c.cp * c.dp * p
    per_node = min(hw.gpus_per_node, gpus)
    scale = min(1.0, hw.cores / per_node) if hw.cores else 1.0
    tokens = c.seq_len // c.cp * c.micro_batch  # on a rank, per microbatch
    parts = _layers(c, hw, o, per_node)
    logits = _output_layer(c, hw, tokens, scale)
    head = _head_tp_comm(c, hw, tokens)
    if p == 1:  # the one stage holds the output layer and the loss
        parts["gemm"] += logits
        parts["tp_comm"] += head
    params, experts = _busiest_params(c)
    accum = 0.0
    if not o.grad_accum_fusion:  # .grad written, then main_grad read and written
        accum = params * (c.dtype_bytes + 2 * c.grad_bytes) / _hbm(hw) / scale
    busiest = sum(parts.values()) + (logits + head if p > 1 else 0.0) + accum
    p2p = _p2p(c, hw, o, tokens)
    bubble = o.bubble_scale * (p - 1) / v * (busiest + p2p)
    reduce, gather = _dp_comm(c, hw, o, params, experts, parts["gemm"])
    out = {"compute": m * (parts["gemm"] + parts["elementwise"] + accum
                           + (logits if p > 1 else 0.0)),
           "recompute": m * parts["recompute"],
           "tp_comm": m * (parts["tp_comm"] + (head if p > 1 else 0.0)),
           "cp_comm": m * parts["cp_comm"],
           "ep_comm": m * parts["ep_comm"],
           "pp_comm": m * p2p, "bubble": bubble, "dp_comm": reduce + gather,
           "emb_comm": _step_reductions(c, hw),
           "optimizer": _optimizer(c, hw, params, experts, scale)}
    total = sum(out.values())
    gbs = c.micro_batch * m * c.dp
    model, hardware = model_flops(c), hardware_flops(c, early_stop=o.early_stop)
    return {"step_time_s": total, "breakdown_s": out, "gpus": gpus,
            "tokens_per_s": gbs * c.seq_len / total,
            "model_tflops_per_gpu": model / total / gpus / 1e12,
            "hardware_tflops_per_gpu": hardware / total / gpus / 1e12,
            "mfu": model / total / gpus / hw.peak_flops,
            "hfu": hardware / total / gpus / hw.peak_flops,
            "hardware": hw.name}


def _hbm(hw: Hardware) -> float:
    """Achievable HBM bytes per second."""
    return hw.hbm_bw * hw.mem_efficiency


def _layers(c: CommConfig, hw: Hardware, o: Options, per_node: int) -> dict:
    """One microbatch through this stage's transformer layers, per part (dense and MoE layers
    each at their own cost)."""
    n_layers = layers_per_stage(c)
    n_moe = moe_layers_on_rank(c, 0) if c.moe is not None else 0
    dense = layer_time(c, hw, o, per_node)
    moe = layer_time(c, hw, o, per_node, moe_layer=True) if n_moe else {}
    return {k: (n_layers - n_moe) * val + n_moe * moe.get(k, 0.0) for k, val in dense.items()}


def _output_layer(c: CommConfig, hw: Hardware, tokens: int, scale: float) -> float:
    """The last stage's logits GEMMs (tied output layer, forward and backward) and the
    cross-entropy's passes over the fp32 logits, per microbatch."""
    vt = -(-c.vocab // c.tp)
    gemms = 3 * gemm_time(hw, tokens, vt, c.hidden) / scale
    return gemms + 6 * tokens * vt * 4 / _hbm(hw) / scale


def _head_tp_comm(c: CommConfig, hw: Hardware, tokens: int) -> float:
    """tp communication outside the layers, per microbatch: the vocabulary-parallel
    embedding's sum (first stage), the output layer's input (gathered under sp, its gradient
    summed without) and the cross-entropy's max and two sums (last stage)."""
    t = c.tp
    if t == 1:
        return 0.0
    inter, act = spans_nodes(1, t, hw.gpus_per_node), tokens * c.hidden * c.dtype_bytes
    gather = 2 * collective_time("reduce_scatter", t, act, hw, inter) if c.sp else \
        collective_time("all_reduce", t, act, hw, inter)
    loss = collective_time("all_reduce", t, tokens * 4, hw, inter) + (
        collective_time("all_reduce", t, 2 * tokens * 4, hw, inter) if c.cross_entropy_fusion
        else 2 * collective_time("all_reduce", t, tokens * 4, hw, inter))
    return gather * (2 if c.pp == 1 else 1) + loss


def _p2p(c: CommConfig, hw: Hardware, o: Options, tokens: int) -> float:
    """Pipeline p2p per microbatch: activations forward, gradients backward, ``v`` times."""
    if c.pp == 1:
        return 0.0
    inter = spans_nodes(c.tp * c.cp * c.dp, c.pp, hw.gpus_per_node)
    nbytes = tokens * c.hidden * c.dtype_bytes / (
        c.tp if c.sp or (o.p2p_scatter_gather and inter) else 1)
    p2p = 2 * c.v * collective_time("p2p", 2, nbytes, hw, inter)
    return p2p * (1 - hw.overlap_efficiency) if o.overlap_p2p else p2p


def _busiest_params(c: CommConfig) -> tuple[int, int]:
    """Parameters of the busiest stage (first or last) and, of them, expert parameters."""
    extra = {r: moe_plan(c, r) if c.moe is not None else {"params": 0, "expert_params": 0}
             for r in {0, c.pp - 1}}
    params = max(params_per_rank(c, r) + extra[r]["params"] for r in {0, c.pp - 1})
    return params, max(x["expert_params"] for x in extra.values())


def _dp_comm(c: CommConfig, hw: Hardware, o: Options, params: int, experts: int,
             gemm: float) -> tuple[float, float]:
    """Exposed data-parallel time: the gradient reduction (all-reduce, or ZeRO's
    reduce-scatter) over dp x cp ranks (Megatron's data-parallel group with cp), the experts'
    over their ``edp = dp / ep`` ranks, and ZeRO's parameter all-gather (with ``instances``
    both within a block of ``1/instances`` of those ranks, plus the shard's all-reduce across
    the blocks). With
    ``overlap_grad_reduce`` the buckets hide under the last microbatch's backward (``gemm``:
    one microbatch's GEMM time on this stage) but the last; with ``overlap_param_gather`` the
    parameter all-gather hides under the first microbatch's forward but the first bucket.
    Interleaved (``vpp`` chunks), each chunk's reduction starts once its own last backward is
    done, under the other chunks' backward of the last group of ``min(pp, m)`` microbatches
    (Megatron's ``grad_sync_func``), the gathers symmetrically in the first group's forward."""
    reduce = gather = 0.0
    edp = c.dp // c.moe.ep if c.moe is not None else c.dp
    for n_par, n, stride in ((params - experts, c.dp * c.cp, c.tp),
                             (experts, edp, c.tp * c.cp * c.dp // edp)):
        if not n_par:  # a dense model has no expert buffers: nothing reduced, no latency
            continue
        if c.instances > 1:  # the shard across the instances' blocks, then within
            n //= c.instances
            across = stride * n, c.instances
            reduce += collective_time("all_reduce", c.instances, n_par / n * c.grad_bytes, hw,
                                      spans_nodes(*across, hw.gpus_per_node),
                                      node_lanes(*across, hw.gpus_per_node))
        inter = spans_nodes(stride, n, hw.gpus_per_node)
        lanes = node_lanes(stride, n, hw.gpus_per_node)
        if c.distributed_optimizer:
            reduce += collective_time("reduce_scatter", n, n_par * (c.dp_grad_bytes or
                                                                     c.grad_bytes), hw, inter,
                                      lanes)
            gather += collective_time("all_gather", n, n_par * c.dtype_bytes, hw, inter, lanes)
        else:
            reduce += collective_time("all_reduce", n, n_par * (c.dp_grad_bytes or c.grad_bytes),
                                      hw, inter, lanes)
    if c.megatron_fsdp:  # synchronous, once a backward completes every bucket: exposed,
        # after every microbatch under ZeRO-2 and 3; the optimizer step waits for its gathers;
        # ZeRO-3's gathers before each use are prefetched, hidden but for the first layer's
        many = c.megatron_fsdp in ("optim_grads", "optim_grads_params")
        if c.megatron_fsdp == "optim_grads_params" and c.dp > 1:
            n = c.dp * c.cp
            ahead = sum(e[3] for e in zero3_gather_events(c) if e[0] != "optimizer")
            ahead = collective_time("all_gather", n, ahead * n, hw, spans_nodes(c.tp, n,
                                    hw.gpus_per_node), node_lanes(c.tp, n, hw.gpus_per_node))
            gather += max(ahead / max(1, c.layers), ahead - hw.overlap_efficiency * gemm / 3)
        return reduce * (c.num_microbatches if many else 1), gather
    v, hide = c.v, hw.overlap_efficiency
    if v > 1:  # interleaved: a chunk's buckets go once its last backward is done (the gathers
        # as its first forward nears), under the other chunks' work of the last (first) group
        # of min(pp, m) microbatches; the last chunk's (first chunk's) share stays exposed
        group = (v - 1) / v * min(c.pp, c.num_microbatches) * gemm
        first = min(1.0, sum(q.numel for q in chunk_params(c, 0, 0)) / params)  # + embedding
        if c.overlap_grad_reduce and c.dp > 1:
            reduce = max(reduce * first, reduce - hide * group * 2 / 3)
        if o.overlap_param_gather and c.distributed_optimizer and c.dp > 1:
            gather = max(gather * first, gather - hide * group / 3)
        return reduce, gather
    if c.overlap_grad_reduce and c.dp > 1:
        buckets = -(-params // bucket_size_of(c))
        reduce = max(reduce / buckets, reduce - hide * gemm * 2 / 3)
    if o.overlap_param_gather and c.distributed_optimizer and c.dp > 1:
        buckets = -(-params // bucket_size_of(c))
        gather = max(gather / buckets, gather - hide * gemm / 3)
    return reduce, gather


def _step_reductions(c: CommConfig, hw: Hardware) -> float:
    """The step's small reductions, exposed: the tied embedding's gradient all-reduce between
    the first and last stage, the gradient norm and the update/norm agreements over tp x pp
    (the world under ZeRO), and the loss over dp x cp."""
    t, p = c.tp, c.pp
    gpus = t * c.cp * c.dp * p
    out = 0.0
    if p > 1 and c.arch.tied:
        vt = -(-c.vocab // t)
        out = collective_time("all_reduce", 2, vt * c.hidden * c.grad_bytes, hw,
                              spans_nodes(t * c.cp * c.dp * (p - 1), 2, hw.gpus_per_node))
    mp = t * p
    if c.distributed_optimizer and gpus // c.instances > 1:  # over one optimizer instance
        n = gpus // c.instances
        out += collective_time("all_reduce", n, 4, hw, n > hw.gpus_per_node)
    elif mp > 1:
        out += collective_time("all_reduce", mp, 4, hw, mp > hw.gpus_per_node)
    if mp > 1:
        out += 2 * collective_time("all_reduce", mp, 4, hw, mp > hw.gpus_per_node)
    if c.dp * c.cp > 1:
        out += collective_time("all_reduce", c.dp * c.cp, 8, hw, gpus > hw.gpus_per_node)
    return out


def _optimizer(c: CommConfig, hw: Hardware, params: int, experts: int, scale: float) -> float:
    """The Adam update over this rank's parameters (their ``1/(dp cp)`` shard under ZeRO, the
    experts' ``1/edp``; ``instances`` times that with several optimizer instances):
    :data:`ADAM_BYTES_PER_PARAM` through HBM and :data:`OPTIMIZER_KERNELS` launches."""
    if c.distributed_optimizer:
        edp = c.dp // c.moe.ep if c.moe is not None else c.dp
        n = c.instances  # sharded within one instance
        params = (params - experts) / (c.dp * c.cp // n) + experts / max(1, edp // n)
    return params * ADAM_BYTES_PER_PARAM / _hbm(hw) / scale + OPTIMIZER_KERNELS * hw.op_overhead


def render_step_time(r: dict) -> str:
    """The prediction as a breakdown table for people."""
    total = r["step_time_s"]
    lines = [f"predicted step time  {total:.4g} s on {r['gpus']} x {r['hardware']}",
             f"  tokens/s           {r['tokens_per_s']:,.0f}",
             f"  TFLOP/s per GPU    {r['model_tflops_per_gpu']:.1f} (model), "
             f"{r['hardware_tflops_per_gpu']:.1f} (hardware)",
             f"  MFU / HFU          {r['mfu']:.1%} / {r['hfu']:.1%}",
             "  breakdown          seconds   share"]
    names = {"compute": "compute", "recompute": "recompute", "tp_comm": "exposed tp/sp comm",
             "cp_comm": "exposed cp comm", "ep_comm": "ep dispatcher comm",
             "pp_comm": "exposed pp p2p", "bubble": "pipeline bubble",
             "dp_comm": "exposed dp comm", "emb_comm": "embedding, loss sums",
             "optimizer": "optimizer step"}
    lines += [f"    {names[k]:<20} {v:9.4f} {v / total:7.1%}"
              for k, v in r["breakdown_s"].items() if v > 0]
    return "\n".join(lines)
