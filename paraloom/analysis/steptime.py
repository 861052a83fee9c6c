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
  all-to-all ``(n-1)(alpha + B/(n beta))``, p2p ``alpha + B/beta``.
* **Overlap**: tp forward reductions are exposed; in backward the column layers' input-grad
  all-reduce (async dgrad, or the sp reduce-scatter) hides under the wgrad GEMM and the sp
  re-gather under dgrad; pipeline p2p is exposed unless ``overlap_p2p``; the data-parallel bucket
  reductions hide under the last microbatch's backward (``overlap_grad_reduce``) except the last
  bucket; ZeRO's parameter all-gather, the tied-embedding reduction and the optimizer are not
  hidden; the gradient norm, the step's agreements (over tp x pp) and the loss (over dp) are
  counted with the embedding's.
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

from .costs import Options, collective_time, gemm_time, layer_time, spans_nodes
from .flops import hardware_flops, model_flops
from .hardware import Hardware
from .layout import bucket_size_of, layers_per_stage, params_per_rank
from .moe_formulas import moe_layers_on_rank, moe_plan
from .spec import CommConfig

__all__ = ["Options", "step_time", "render_step_time"]

def step_time(c: CommConfig, hw: Hardware, o: Options | None = None) -> dict:
    """Predicted seconds per step, its breakdown, tokens/s, TFLOP/s per GPU, MFU and HFU."""
    o = o or Options()
    p, m, v, t = c.pp, c.num_microbatches, c.v, c.tp
    dp, cp = c.dp, c.cp
    gpus = t * cp * dp * p
    per_node = min(hw.gpus_per_node, gpus)
    n_layers = layers_per_stage(c)
    n_moe = moe_layers_on_rank(c, 0) if c.moe is not None else 0
    dense, moe = layer_time(c, hw, o, per_node), layer_time(c, hw, o, per_node, moe_layer=True) \
        if n_moe else {}
    tokens = c.seq_len // cp * c.micro_batch
    e = c.dtype_bytes
    scale = min(1.0, hw.cores / per_node) if hw.cores else 1.0
    # the last stage adds the logits (tied output layer) and the cross-entropy
    vt = -(-c.vocab // t)
    logits = 3 * gemm_time(hw, tokens, vt, c.hidden) / scale
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
        loss = 3 * collective_time("all_reduce", t, tokens * 4, hw, inter)  # max, 2 sums
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
    mp = t * p  # the grad norm and the update/norm agreements over tp x pp, the loss over dp
    if c.distributed_optimizer and gpus > 1:
        emb += collective_time("all_reduce", gpus, 4, hw, gpus > hw.gpus_per_node)
    elif mp > 1:
        emb += collective_time("all_reduce", mp, 4, hw, mp > hw.gpus_per_node)
    if mp > 1:
        emb += 2 * collective_time("all_reduce", mp, 4, hw, mp > hw.gpus_per_node)
    if dp * cp > 1:
        emb += collective_time("all_reduce", dp * cp, 8, hw, gpus > hw.gpus_per_node)
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
