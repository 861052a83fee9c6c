"""The parts step time is built from (:mod:`.steptime`): one collective, one GEMM, the
element-wise traffic and one transformer layer of one microbatch on one rank, on described
hardware, and the software :class:`Options` that change them.

Fused attention (``--attention sdpa``: FlashAttention, cuDNN, Transformer Engine's default on
GPUs): the ``s x s`` scores never reach HBM, so the softmax moves no bytes; a causal kernel skips
the blocks the mask hides (half the score GEMMs' work); its backward recomputes ``QK^T`` itself
(five attention GEMMs against the forward's two: 2.5x, not 2x); selective recomputation runs
the kernel's forward again."""

from __future__ import annotations

from dataclasses import dataclass

from .cp_formulas import cp_kv_bytes, cp_q_bytes, ring_size
from .hardware import Hardware
from .moe_formulas import split_tp
from .spec import CommConfig

__all__ = ["Options", "FWD_KERNELS", "BWD_KERNELS", "spans_nodes", "node_lanes",
           "collective_time",
           "elementwise_bytes", "gemm_time", "cp_comm_time", "layer_time", "dispatcher_time"]

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
    early_stop: bool = False
    """A re-run that stops once every saved tensor is back (torch's non-reentrant checkpoint with
    early stop on); ``False``: the whole function again, as Megatron's and paraloom's."""
    recompute_comm: float = 1.0
    """Fraction of a layer's forward tp communication full recomputation repeats (Megatron's and
    paraloom's re-run: all of it, 1; an early-stopping checkpoint: proj only, 1/2)."""
    p2p_scatter_gather: bool = False
    """Megatron's scatter/gather of inter-node p2p tensors over tp (Narayanan et al. 4.1)."""
    tp_comm_overlap: bool = False
    """Megatron's ``--tp-comm-overlap`` (sp only): each linear layer's all-gather or
    reduce-scatter is cut into chunks pipelined with its GEMM, forward and backward; only what
    the GEMM cannot cover stays exposed."""
    overlap_param_gather: bool = False
    """Megatron's ``--overlap-param-gather`` (distributed optimizer): the parameter all-gather
    runs bucket by bucket under the next forward; only the first bucket's is exposed."""


def spans_nodes(stride: int, size: int, gpus_per_node: int) -> bool:
    """Whether a group of ``size`` ranks ``stride`` apart leaves a node of ``gpus_per_node``."""
    return size > 1 and (stride * size > gpus_per_node or gpus_per_node % (stride * size) != 0)


def node_lanes(stride: int, size: int, gpus_per_node: int) -> int:
    """Ranks of a group of ``size`` ranks ``stride`` apart that share one node."""
    return max(1, min(size, gpus_per_node // stride))


def collective_time(op: str, n: int, nbytes: float, hw: Hardware, inter: bool,
                    lanes: int = 1) -> float:
    """Seconds for one collective of ``n`` ranks; ``nbytes``: the full tensor (all-reduce input,
    all-gather output, reduce-scatter input, all-to-all input, p2p message). ``lanes``: for a
    ring that leaves the node, its ranks per node (:meth:`Hardware.link`)."""
    if n <= 1 and op != "p2p":
        return 0.0
    alpha, beta = hw.link(inter, lanes if op in ("all_reduce", "all_gather",
                                                  "reduce_scatter") else 1)
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


def gemm_time(hw: Hardware, m: float, n: float, k: float, batch: float = 1.0) -> float:
    """Seconds of ``batch`` GEMMs ``(m, n, k)`` at the hardware's size-dependent efficiency."""
    d0 = hw.gemm_half_dim
    eff = hw.gemm_efficiency * m / (m + d0) * n / (n + d0)
    return 2 * m * n * k * batch / (hw.peak_flops * eff)


def cp_comm_time(c: CommConfig, hw: Hardware, attention: float) -> tuple[float, float]:
    """Exposed seconds of one layer's cp K/V exchange (:mod:`~paraloom.analysis.cp_formulas`):
    ``(forward, backward)``. The ring (``p2p``) sends ``cp - 1`` K/V chunks forward and
    ``2cp - 1`` backward, each step overlapping the attention of the chunk it already holds;
    ``all_gather`` gathers K/V before attention and reduce-scatters their gradient after it;
    ``a2a`` (Ulysses) all-to-alls Q, K, V before attention and the output after it (backward:
    the output's gradient, then dQ, dK, dV), none of it hidden; ``a2a+p2p`` adds Ulysses over
    its inner ``A`` ranks to the ring over the ``cp / A`` groups (``A`` consecutive cp ranks
    apart, so across nodes first)."""
    if c.cp == 1:
        return 0.0, 0.0
    kv, cp, a2a = cp_kv_bytes(c), c.cp, c.cp_a2a if c.cp_comm_type == "a2a+p2p" else c.cp
    fwd = bwd = 0.0
    if c.cp_comm_type in ("p2p", "a2a+p2p"):
        ring = ring_size(c)
        step = collective_time("p2p", 2, kv, hw, spans_nodes(c.tp * cp // ring, ring,
                                                              hw.gpus_per_node))
        hide = hw.overlap_efficiency * attention * (ring - 1) / ring  # the last has no peer
        fwd, bwd = max(0.0, (ring - 1) * step - hide), max(0.0, (2 * ring - 1) * step - 2 * hide)
    if c.cp_comm_type in ("a2a", "a2a+p2p"):  # Q, K, V and the output, each way, not hidden
        q, inter = cp_q_bytes(c), spans_nodes(c.tp, a2a, hw.gpus_per_node)
        each_way = sum(collective_time("all_to_all", a2a, b, hw, inter)
                       for b in (q, q, kv / 2, kv / 2))
        fwd, bwd = fwd + each_way, bwd + each_way
    if c.cp_comm_type != "all_gather":
        return fwd, bwd
    inter = spans_nodes(c.tp, cp, hw.gpus_per_node)
    return (collective_time("all_gather", cp, cp * kv, hw, inter),
            collective_time("reduce_scatter", cp, cp * kv, hw, inter))


def layer_time(c: CommConfig, hw: Hardware, o: Options, ranks_per_node: int,
           moe_layer: bool = False) -> dict:
    """Seconds of one layer (a MoE layer: ``moe_layer``) for one microbatch on one rank."""
    t, h, f, a, e = c.tp, c.hidden, c.f, c.heads, c.dtype_bytes
    s = c.seq_len // c.cp
    tokens, b = s * c.micro_batch, c.micro_batch
    d = h // a
    qkv = (a + 2 * (c.arch.num_query_groups or a)) * d      # GQA: fewer K/V heads
    fc1 = c.arch.fc1(f)                                      # SwiGLU: gate and up
    linears = gemm_time(hw, tokens, qkv / t, h) + gemm_time(hw, tokens, h, h / t)
    if moe_layer:  # the router, then E/ep local experts of N k ep / E rows each (balanced)
        m = c.moe
        rows = tokens * m.topk * m.ep / m.num_experts
        linears += gemm_time(hw, tokens, m.num_experts, h) + m.num_experts / m.ep * (
            gemm_time(hw, rows, fc1 / t, h) + gemm_time(hw, rows, h, f / t))
        fc1 = m.topk * fc1
        if m.shared_ffn:  # the shared expert: a dense MLP of width shared_ffn on every token
            sf = m.shared_ffn
            linears += gemm_time(hw, tokens, c.arch.fc1(sf) / t, h) + \
                gemm_time(hw, tokens, h, sf / t)
            fc1 += c.arch.fc1(sf)
    else:
        linears += gemm_time(hw, tokens, fc1 / t, h) + gemm_time(hw, tokens, h, f / t)
    qk = gemm_time(hw, s, c.seq_len, d, b * a / t)
    av = gemm_time(hw, s, d, c.seq_len, b * a / t)
    fused = c.arch.attention == "sdpa"  # flash attention (see the module docstring)
    if fused:  # causal: the fused kernel skips the masked half of the scores
        qk, av = qk / 2, av / 2
    fwd = linears + qk + av
    outside = tokens / t if c.sp else tokens                 # tokens outside the tp regions
    probs = 0 if fused else b * a / t * s * c.seq_len
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
    elif c.sp and o.tp_comm_overlap:  # each collective pipelined with its own GEMM
        ag = collective_time("all_gather", t, act, hw, inter)
        rs = collective_time("reduce_scatter", t, act, hw, inter)
        tp_fwd = 2 * max(0.0, ag + rs - hide * linears / 2)
        tp_bwd = 2 * max(0.0, 2 * ag + rs - hide * linears)
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
    own = moe_layer and split_tp(c)  # tp ranks dispatch their own tokens: no dense MLP region
    if moe_layer:  # the attention's region, the MLP's unless own, the shared expert's if any
        regions = 1 + (not own) + bool(c.moe.shared_ffn)
        tp_fwd, tp_bwd = regions / 2 * tp_fwd, regions / 2 * tp_bwd
    cp_fwd, cp_bwd = cp_comm_time(c, hw, qk + av)
    ep_fwd = ep_comm = 0.0
    if moe_layer:
        ep_fwd, ep_bwd = dispatcher_time(c, hw, act, inter)
        ep_comm = ep_fwd + ep_bwd
    recompute = 0.0
    if c.recompute == "full":
        recompute = fwd + elem + o.recompute_comm * tp_fwd + cp_fwd + ep_fwd
    elif c.recompute == "selective":  # fused: the kernel's forward again, no score bytes
        again = qk if o.early_stop and c.arch.attention == "core" else qk + av
        recompute = again + cp_fwd + 4 * e * probs / (hw.hbm_bw * hw.mem_efficiency * scale)
    flash = (qk + av) / 2 if fused else 0.0    # QK^T again inside the backward kernel
    return {"gemm": 3 * fwd + flash, "elementwise": 3 * elem + (BWD_KERNELS - 2 * FWD_KERNELS)
            * hw.op_overhead / scale, "recompute": recompute, "tp_comm": tp_fwd + tp_bwd,
            "cp_comm": cp_fwd + cp_bwd, "ep_comm": ep_comm}


def dispatcher_time(c: CommConfig, hw: Hardware, act: float, tp_inter: bool
                    ) -> tuple[float, float]:
    """Seconds of one MoE layer's token dispatcher (forward, backward) for one microbatch.
    allgather: every rank's tokens gathered over the group, the outputs reduce-scattered in
    fp32 (backward: the fp32 gradient gathered, the tokens' reduce-scattered). alltoall:
    the counts' gather, the all-to-alls of ``k N h`` rows (``N / tp`` tokens when tp ranks
    dispatch their own: Megatron's order under sp), there and back (reversed in backward),
    and with those tp ranks the uneven all-gather of the ``k N h`` rows each brings and the
    reduce-scatter of the outputs (reversed in backward)."""
    m, t = c.moe, c.tp
    own = split_tp(c)
    fwd = bwd = 0.0
    if m.dispatcher == "allgather":  # tokens of tp x ep (own) or ep ranks gathered, outputs
        group = m.ep * (t if own else 1)  # reduce-scattered (fp32); reversed in backward
        if group == 1:
            return fwd, bwd
        inter = spans_nodes(t * c.cp, m.ep, hw.gpus_per_node)  # ep blocks tp x cp apart
        tokens = group * act / (t if own else 1)            # every rank's tokens, gathered
        gather = collective_time("all_gather", group, tokens, hw, inter)
        scatter = collective_time("reduce_scatter", group, tokens * 4 / c.dtype_bytes, hw,
                                  inter)
        return gather + scatter, gather * 4 / c.dtype_bytes + scatter * c.dtype_bytes / 4
    if m.ep > 1:
        ep_inter = spans_nodes(t * c.cp, m.ep, hw.gpus_per_node)
        token_a2a = collective_time("all_to_all", m.ep, m.topk * act / (t if own else 1), hw,
                                    ep_inter)
        fwd = 2 * token_a2a + collective_time("all_to_all", m.ep, 8 * m.num_experts, hw,
                                              ep_inter)
        bwd = 2 * token_a2a
    if own:  # the rows of every tp rank gathered, the outputs reduce-scattered
        rows = m.topk * act
        gather = collective_time("all_gather", t, rows, hw, tp_inter)
        scatter = collective_time("reduce_scatter", t, rows, hw, tp_inter)
        fwd, bwd = fwd + gather + scatter, bwd + gather + scatter
    return fwd, bwd
