"""Step time of one layout on described hardware, built from what the formulas count exactly.

Per pipeline stage and microbatch (``T = s b / cp`` tokens on a rank, ``t`` tp, ``e`` bytes per
activation element):

* **GEMMs**: every linear and attention GEMM with its shape — QKV ``(T, 3h/t, h)``, QK^T and
  attention x V (``b a/t`` batched ``(s/cp, s, d)``), proj ``(T, h, h/t)``, fc1 ``(T, f/t, h)``,
  fc2 ``(T, h, f/t)``, logits ``(T, V/t, h)`` on the last stage — each timed as
  ``2 M N K / (peak * eff(M, N))`` with ``eff = gemm_efficiency * M/(M+d0) * N/(N+d0)``
  (small GEMMs run far below peak; ``d0 = gemm_half_dim``). Backward is dgrad + wgrad: twice
  the forward. Recomputation adds the forward (full) or QK^T (selective; see
  :func:`~paraloom.analysis.formulas.recompute_flops_per_iteration`).
* **Element-wise kernels** (LayerNorm, bias-dropout-add, GeLU, softmax, cross-entropy):
  bytes moved / achievable HBM bandwidth, plus ``op_overhead`` per kernel.
* **Collectives**, alpha-beta per algorithm over the link the group spans (mesh order tp, cp,
  dp, pp with tp fastest: a group of stride ``S`` and size ``n`` stays inside a node when
  ``S n`` divides ``gpus_per_node``): ring all-reduce ``2(n-1)(alpha + B/(n beta))``,
  all-gather / reduce-scatter ``(n-1)(alpha + B/(n beta))`` of the full tensor ``B``,
  all-to-all ``(n-1)(alpha + B/(n beta))``, p2p ``alpha + B/beta``.
* **Overlap**: tp forward reductions are exposed; in backward the column layers' input-grad
  all-reduce (async dgrad, or the sp reduce-scatter) hides under the wgrad GEMM and the sp
  re-gather under dgrad; pipeline p2p is exposed unless ``overlap_p2p``; the data-parallel bucket
  reductions hide under the last microbatch's backward (``overlap_grad_reduce``) except the last
  bucket; ZeRO's parameter all-gather, the tied-embedding reduction and the optimizer are not
  hidden; the loss + gradient-norm reduction over all ranks is counted with the embedding's.
  The pipeline bubble is ``(p-1)/v`` microbatch-stage times (zero-bubble schedules:
  pass ``bubble_scale``).
* **Optimizer**: Adam over this rank's parameters (divided by dp under ZeRO) at ~38 bytes per
  parameter through HBM (fp32 param, grad, m, v in and out; 16-bit param out; grad norm).

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

from dataclasses import dataclass

from .cp_formulas import cp_kv_bytes
from .flops import hardware_flops, model_flops
from .formulas import CommConfig, params_per_rank, stage_layers
from .hardware import Hardware
from .layout import bucket_size_of
from .moe_formulas import moe_layers_on_rank, moe_plan

__all__ = ["Options", "elementwise_bytes", "spans_nodes", "collective_time", "step_time",
           "render_step_time"]

FWD_KERNELS, BWD_KERNELS = 24, 48
"""Kernels per layer forward / backward (what ``op_overhead`` multiplies)."""


@dataclass(frozen=True, kw_only=True)
class Options:
    """How the software runs a layout (what the formulas' config does not say)."""

    async_tp: bool = True
    """Backward tp reductions overlap the wgrad GEMM (Megatron's async dgrad; sp always)."""
    overlap_p2p: bool = False
    bubble_scale: float = 1.0
    """Fraction of the 1F1B bubble that remains (0 for a zero-bubble schedule)."""
    grad_accum_fusion: bool = True
    """Weight grads accumulate straight into fp32 ``main_grad`` (Megatron-LM's default); off
    (paraloom's default) each microbatch adds ``.grad`` into ``main_grad`` through memory."""
    early_stop: bool = True
    """torch's non-reentrant checkpoint (paraloom); ``False``: Megatron's re-runs everything."""
    recompute_comm: float = 0.5
    """Fraction of a layer's forward tp communication full recomputation repeats (paraloom: proj
    only, 1/2; Megatron's reentrant checkpoint: 1)."""
    p2p_scatter_gather: bool = False
    """Megatron's scatter/gather of inter-node p2p tensors over tp (Narayanan et al. 4.1)."""


def spans_nodes(stride: int, size: int, gpus_per_node: int) -> bool:
    """Whether a group of ``size`` ranks ``stride`` apart leaves a node of ``gpus_per_node``."""
    return size > 1 and (stride * size > gpus_per_node or gpus_per_node % (stride * size) != 0)


def collective_time(op: str, n: int, nbytes: float, hw: Hardware, inter: bool) -> float:
    """Seconds for one collective of ``n`` ranks; ``nbytes``: the full tensor (all-reduce input,
    all-gather output, reduce-scatter input, all-to-all input, p2p message)."""
    if n <= 1 and op != "p2p":
        return 0.0
    alpha, beta = hw.link(inter)
    if op == "all_reduce":
        return 2 * (n - 1) * (alpha + nbytes / (n * beta))
    if op in ("all_gather", "reduce_scatter"):
        return hw.gather_factor * (n - 1) * (alpha + nbytes / (n * beta))
    if op == "all_to_all":
        return (n - 1) * (alpha + nbytes / (n * beta))
    if op == "p2p":
        return alpha + nbytes / beta
    raise ValueError(f"unknown collective {op!r}")


def elementwise_bytes(tokens: float, outside: float, h: int, f: int, t: int, probs: float,
                      e: int) -> float:
    """Bytes the element-wise kernels of one layer forward move: LayerNorms and
    bias-dropout-adds on the ``outside`` tokens (``T/t`` under sp) ``12 h``, bias + GeLU
    ``4 f/t``, q/k/v splits ``6 h/t`` per token, scale-mask-softmax ``4`` per score."""
    return e * (12 * outside * h + 4 * tokens * f / t + 6 * tokens * h / t + 4 * probs)


def _gemm(hw: Hardware, m: float, n: float, k: float, batch: float = 1.0) -> float:
    d0 = hw.gemm_half_dim
    eff = hw.gemm_efficiency * m / (m + d0) * n / (n + d0)
    return 2 * m * n * k * batch / (hw.peak_flops * eff)


def _cp_comm(c: CommConfig, hw: Hardware, attention: float) -> tuple[float, float]:
    """Exposed seconds of one layer's cp K/V exchange (:mod:`~paraloom.analysis.cp_formulas`):
    ``(forward, backward)``. The ring (``p2p``) sends ``cp - 1`` K/V chunks forward and
    ``2cp - 1`` backward, each step overlapping the attention of the chunk it already holds;
    ``all_gather`` gathers K/V before attention and reduce-scatters their gradient after it."""
    if c.cp == 1:
        return 0.0, 0.0
    kv, cp = cp_kv_bytes(c), c.cp
    inter = spans_nodes(c.tp, cp, hw.gpus_per_node)
    if c.cp_comm_type == "p2p":
        step = collective_time("p2p", 2, kv, hw, inter)
        hide = hw.overlap_efficiency * attention * (cp - 1) / cp  # the last chunk has no peer
        return (max(0.0, (cp - 1) * step - hide),
                max(0.0, (2 * cp - 1) * step - 2 * hide))
    return (collective_time("all_gather", cp, cp * kv, hw, inter),
            collective_time("reduce_scatter", cp, cp * kv, hw, inter))


def _layer(c: CommConfig, hw: Hardware, o: Options, ranks_per_node: int,
           moe_layer: bool = False) -> dict:
    """Seconds of one layer (a MoE layer: ``moe_layer``) for one microbatch on one rank."""
    t, h, f, a, e = c.tp, c.hidden, c.f, c.heads, c.dtype_bytes
    s = c.seq_len // c.cp
    tokens, b = s * c.micro_batch, c.micro_batch
    d = h // a
    qkv = (a + 2 * (c.arch.num_query_groups or a)) * d      # GQA: fewer K/V heads
    fc1 = 2 * f if c.arch.swiglu else f                      # SwiGLU: gate and up
    linears = _gemm(hw, tokens, qkv / t, h) + _gemm(hw, tokens, h, h / t)
    if moe_layer:  # the router, then E/ep local experts of N k ep / E rows each (balanced)
        m = c.moe
        rows = tokens * m.topk * m.ep / m.num_experts
        linears += _gemm(hw, tokens, m.num_experts, h) + m.num_experts / m.ep * (
            _gemm(hw, rows, f / t, h) + _gemm(hw, rows, h, f / t))
        fc1 = m.topk * f
    else:
        linears += _gemm(hw, tokens, fc1 / t, h) + _gemm(hw, tokens, h, f / t)
    qk = _gemm(hw, s, c.seq_len, d, b * a / t)
    av = _gemm(hw, s, d, c.seq_len, b * a / t)
    fwd = linears + qk + av
    outside = tokens / t if c.sp else tokens                 # tokens outside the tp regions
    probs = b * a / t * s * c.seq_len
    elem_bytes = elementwise_bytes(tokens, outside, h, fc1, t, probs, e)
    elem = elem_bytes / (hw.hbm_bw * hw.mem_efficiency) + FWD_KERNELS * hw.op_overhead
    scale = min(1.0, hw.cores / ranks_per_node) if hw.cores else 1.0  # CPU: shared cores
    fwd, elem, qk, av = fwd / scale, elem / scale, qk / scale, av / scale
    # tensor-parallel communication of one layer
    act = tokens * h * e
    inter = spans_nodes(1, t, hw.gpus_per_node)
    hide = hw.overlap_efficiency
    if t == 1:
        tp_fwd = tp_bwd = 0.0
    elif c.sp:
        ag = collective_time("all_gather", t, act, hw, inter)
        rs = collective_time("reduce_scatter", t, act, hw, inter)
        tp_fwd = 2 * (ag + rs)
        # row layers gather the output grad (exposed); column layers re-gather under dgrad and
        # reduce-scatter under wgrad
        tp_bwd = 2 * ag + 2 * max(0.0, ag + rs - hide * linears / 2)
    else:
        ar = collective_time("all_reduce", t, act, hw, inter)
        tp_fwd = 2 * ar
        tp_bwd = 2 * max(0.0, ar - hide * linears / 4) if o.async_tp else 2 * ar
    cp_fwd, cp_bwd = _cp_comm(c, hw, qk + av)
    ep_fwd = ep_comm = 0.0
    if moe_layer and c.moe.ep > 1:  # counts, dispatch and combine (k N h each); reversed in bwd
        ep, ep_inter = c.moe.ep, spans_nodes(t * c.cp, c.moe.ep, hw.gpus_per_node)
        token_a2a = collective_time("all_to_all", ep, c.moe.topk * act, hw, ep_inter)
        ep_fwd = 2 * token_a2a + collective_time("all_to_all", ep, 8 * c.moe.num_experts, hw,
                                                 ep_inter)
        ep_comm = ep_fwd + 2 * token_a2a
    recompute = 0.0
    if c.recompute == "full":
        recompute = fwd + elem + o.recompute_comm * tp_fwd + cp_fwd + ep_fwd
    elif c.recompute == "selective":
        again = qk if o.early_stop and c.arch.attention == "core" else qk + av
        recompute = again + cp_fwd + 4 * e * probs / (hw.hbm_bw * hw.mem_efficiency * scale)
    return {"gemm": 3 * fwd, "elementwise": 3 * elem + (BWD_KERNELS - 2 * FWD_KERNELS)
            * hw.op_overhead / scale, "recompute": recompute, "tp_comm": tp_fwd + tp_bwd,
            "cp_comm": cp_fwd + cp_bwd, "ep_comm": ep_comm}


def step_time(c: CommConfig, hw: Hardware, o: Options | None = None) -> dict:
    """Predicted seconds per step, its breakdown, tokens/s, TFLOP/s per GPU, MFU and HFU."""
    o = o or Options()
    p, m, v, t = c.pp, c.num_microbatches, c.v, c.tp
    dp, cp = c.dp, c.cp
    gpus = t * cp * dp * p
    per_node = min(hw.gpus_per_node, gpus)
    n_layers = stage_layers(c)
    n_moe = moe_layers_on_rank(c, 0) if c.moe is not None else 0
    dense, moe = _layer(c, hw, o, per_node), _layer(c, hw, o, per_node, moe_layer=True) \
        if n_moe else {}
    tokens = c.seq_len // cp * c.micro_batch
    e = c.dtype_bytes
    scale = min(1.0, hw.cores / per_node) if hw.cores else 1.0
    # the last stage adds the logits (tied output layer) and the cross-entropy
    vt = -(-c.vocab // t)
    logits = 3 * _gemm(hw, tokens, vt, c.hidden) / scale
    logits += 6 * tokens * vt * 4 / (hw.hbm_bw * hw.mem_efficiency) / scale
    parts = {k: (n_layers - n_moe) * val + n_moe * moe.get(k, 0.0) for k, val in dense.items()}
    parts["gemm"] += logits if p == 1 else 0.0
    # tp communication outside the layers: the vocabulary-parallel embedding's sum (first
    # stage), the output layer's input (gather under sp, grad sum without) and the
    # cross-entropy's max and sums (last stage)
    head = 0.0
    if t > 1:
        inter, act = spans_nodes(1, t, hw.gpus_per_node), tokens * c.hidden * e
        gather = 2 * collective_time("reduce_scatter", t, act, hw, inter) if c.sp else \
            collective_time("all_reduce", t, act, hw, inter)
        loss = 2 * collective_time("all_reduce", t, 3 * tokens * 4, hw, inter)
        head = gather * (2 if p == 1 else 1) + loss
    parts["tp_comm"] += head if p == 1 else 0.0
    stage = {k: val for k, val in parts.items()}
    busiest = sum(stage.values()) + (logits + head if p > 1 else 0.0)
    # pipeline p2p per microbatch: activations forward, gradients backward, v times
    p2p = 0.0
    if p > 1:
        inter = spans_nodes(t * cp * dp, p, hw.gpus_per_node)
        nbytes = tokens * c.hidden * e / (t if c.sp or (o.p2p_scatter_gather and inter) else 1)
        p2p = 2 * v * collective_time("p2p", 2, nbytes, hw, inter)
        p2p *= 1 - hw.overlap_efficiency if o.overlap_p2p else 1.0
    extra = {r: moe_plan(c, r) if c.moe is not None else {"params": 0, "expert_params": 0}
             for r in {0, p - 1}}
    params = max(params_per_rank(c, r) + extra[r]["params"] for r in {0, p - 1})
    experts = max(x["expert_params"] for x in extra.values())
    accum = 0.0
    if not o.grad_accum_fusion:  # .grad written, then main_grad read and written
        accum = params * (e + 2 * c.grad_bytes) / (hw.hbm_bw * hw.mem_efficiency) / scale
    busiest += accum
    micro = busiest + p2p
    bubble = o.bubble_scale * (p - 1) / v * micro
    # data parallelism: the busiest stage's gradient buckets, over dp x cp ranks (Megatron's
    # data-parallel group with cp); the experts' over their edp = dp / ep ranks
    reduce = gather = 0.0
    edp = dp // c.moe.ep if c.moe is not None else dp
    for n_par, n, stride in ((params - experts, dp * cp, t), (experts, edp, t * cp * dp // edp)):
        inter = spans_nodes(stride, n, hw.gpus_per_node)
        if c.distributed_optimizer:
            reduce += collective_time("reduce_scatter", n, n_par * c.grad_bytes, hw, inter)
            gather += collective_time("all_gather", n, n_par * e, hw, inter)
        else:
            reduce += collective_time("all_reduce", n, n_par * c.grad_bytes, hw, inter)
    if c.overlap_grad_reduce and dp > 1:
        # buckets launch as the last microbatch's backward fills them; the last one is exposed
        buckets = -(-params // bucket_size_of(c))
        reduce = max(reduce / buckets, reduce - hw.overlap_efficiency * parts["gemm"] * 2 / 3)
    emb = 0.0
    if p > 1 and c.arch.tied:
        emb = collective_time("all_reduce", 2, vt * c.hidden * c.grad_bytes, hw,
                              spans_nodes(t * cp * dp * (p - 1), 2, hw.gpus_per_node))
    if gpus > 1:  # the step's loss and gradient norm (two float64) over every rank
        emb += collective_time("all_reduce", gpus, 16, hw, gpus > hw.gpus_per_node)
    opt_params = (params - experts) / (dp * cp) + experts / edp if c.distributed_optimizer \
        else params
    optimizer = opt_params * 38 / (hw.hbm_bw * hw.mem_efficiency) / scale \
        + 60 * hw.op_overhead
    out = {"compute": m * (stage["gemm"] + stage["elementwise"] + accum
                           + (logits if p > 1 else 0.0)),
           "recompute": m * stage["recompute"],
           "tp_comm": m * (stage["tp_comm"] + (head if p > 1 else 0.0)),
           "cp_comm": m * stage["cp_comm"],
           "ep_comm": m * stage["ep_comm"],
           "pp_comm": m * p2p, "bubble": bubble, "dp_comm": reduce + gather,
           "emb_comm": emb, "optimizer": optimizer}
    total = sum(out.values())
    gbs = c.micro_batch * m * dp
    model, hardware = model_flops(c), hardware_flops(c, early_stop=o.early_stop)
    return {"step_time_s": total, "breakdown_s": out, "gpus": gpus,
            "tokens_per_s": gbs * c.seq_len / total,
            "model_tflops_per_gpu": model / total / gpus / 1e12,
            "hardware_tflops_per_gpu": hardware / total / gpus / 1e12,
            "mfu": model / total / gpus / hw.peak_flops,
            "hfu": hardware / total / gpus / hw.peak_flops,
            "hardware": hw.name}


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
             "cp_comm": "exposed cp K/V comm", "ep_comm": "ep all-to-all",
             "pp_comm": "exposed pp p2p", "bubble": "pipeline bubble",
             "dp_comm": "exposed dp comm", "emb_comm": "embedding, loss sums",
             "optimizer": "optimizer step"}
    lines += [f"    {names[k]:<20} {v:9.4f} {v / total:7.1%}"
              for k, v in r["breakdown_s"].items() if v > 0]
    return "\n".join(lines)
