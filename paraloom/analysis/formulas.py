"""The analytical model: what one training step communicates, stores and computes.

:func:`expected_comm` gives, for one rank, the number of operations and their logical bytes per
``(kind, op, phase)`` in one step, written from the same conventions ``comm.py`` records
(all-reduce and reduce-scatter: the local input; all-gather: the local shard; send/recv: the
tensor), so :mod:`paraloom.analysis.check` can demand exact equality with a recorded ledger.
Re-runs of forward communication under full recomputation are keyed with phase ``recompute``
(the ledger marks them ``recompute: true``; their recorded phase is ``forward``).

A train step (``grad_sync``) adds the data-parallel bucket reductions of the exact bucket
layout (:mod:`paraloom.analysis.layout`), ``finalize_model_grads``' sp and tied-embedding sums
and the loss + gradient-norm all-reduce; :func:`paraloom.analysis.check.check_main` compares all
of it with a ``paraloom train`` run folder.

Notation: ``s`` sequence, ``b`` microbatch, ``h`` hidden, ``a`` heads, ``L`` layers, ``V``
vocabulary, ``t``/``p``/``d`` tp/pp/dp sizes, ``v`` virtual stages, ``m`` microbatches. With
context parallelism (``cp``) activations hold ``s/cp`` tokens and gradients are reduced over
``dp * cp`` ranks; the cp messages themselves are in :mod:`paraloom.analysis.cp_formulas`.

Sources: Shoeybi et al. 2019 (Megatron-LM: 2 all-reduces forward + 2 backward per layer),
Korthikanti et al. 2022 (sequence parallelism, Table 2 activation memory), Narayanan et al. 2021
(pipeline p2p, bubble, FLOPs per iteration, parameter count).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .arch import Architecture, arch_params_per_rank
from .cp_formulas import add_cp_comm, grad_sync_view, local_seq
from .layout import rank_buckets, sp_elems

__all__ = ["CommConfig", "expected_comm", "bubble_fraction", "activation_bytes_per_layer",
           "flops_per_iteration", "model_flops_per_iteration", "hardware_flops_per_iteration",
           "recompute_flops_per_iteration", "param_count", "params_per_rank", "stage_layers",
           "default_buckets"]

F32 = 4


@dataclass(frozen=True, kw_only=True)
class CommConfig:
    """One layout of the GPT of :mod:`paraloom.models.gpt`, as the formulas need it."""

    layers: int
    """Transformer layers ``L`` (all stages)."""
    hidden: int
    """Model width ``h``."""
    heads: int
    """Attention heads ``a``."""
    seq_len: int
    """Tokens per sample ``s``."""
    vocab: int
    """Vocabulary ``V`` (already padded to a multiple of ``t``)."""
    ffn: int | None = None
    """MLP width; ``None`` means ``4h``."""
    micro_batch: int = 1
    """Samples per microbatch ``b``."""
    num_microbatches: int = 1
    """Microbatches per step ``m`` (per data-parallel rank)."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B); ``None`` or 1: one chunk."""
    sequence_parallel: bool = False
    recompute: str = "none"
    """``none``, ``selective`` (attention core only: no communication) or ``full`` (each layer's
    forward communication runs again in backward, up to proj's reduction and fc1's gather: the
    re-run stops once every saved tensor is rebuilt, so fc2's reduction is not repeated)."""
    distributed_optimizer: bool = False
    """ZeRO-1: gradient buckets reduce-scattered, parameter shards all-gathered."""
    grad_sync: bool = True
    """The step is a train step: it reduces gradients (data-parallel buckets,
    ``finalize_model_grads``) and the loss + gradient norm (kind ``loss``); ``False`` for a
    bare forward + backward of the model."""
    optimizer_step: bool = True
    """The optimizer step ran; a train step whose loss or gradient norm is not finite skips
    it (``"skipped"`` in metrics.jsonl), and with it the distributed optimizer's all-gathers."""
    overlap_grad_reduce: bool = True
    """Bucket reductions launched from backward hooks (phase ``backward``), else ``optimizer``."""
    buckets: tuple[int, ...] | None = None
    """Elements per gradient bucket of this rank (padded as the buffer pads them), an override
    for one stage; ``None``: the exact layout (:func:`paraloom.analysis.layout.rank_buckets`)."""
    bucket_size: int | None = None
    """Elements at which a bucket closes (``None``: Megatron's ``max(40M, 1M * dp)``)."""
    dtype_bytes: int = 4
    """Bytes per activation / parameter element (fp32 4, bf16 2)."""
    grad_bytes: int = 4
    """Bytes per element of reduced gradients (fp32 ``main_grad``: 4; bf16 reduction: 2)."""
    label_smoothing: bool = False
    """Cross-entropy reduces a third per-token number (the sum of logits)."""
    arch: Architecture = Architecture()
    """Llama-family switches (:mod:`paraloom.analysis.arch`); the default is GPT-2."""
    cp: int = 1
    """Context-parallel size: each rank holds ``s/cp`` tokens of every sequence
    (:mod:`paraloom.analysis.cp_formulas`)."""
    cp_comm_type: str = "p2p"
    """``p2p`` (K/V ring) or ``all_gather``."""
    moe: object = None
    """Mixture of experts (:class:`paraloom.analysis.moe_formulas.MoECommConfig`); ``None``:
    dense. Its all-to-alls are checked by :mod:`paraloom.analysis.moe_formulas`."""

    def __post_init__(self) -> None:
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be none, selective or full, got {self.recompute!r}")
        for name in ("layers", "hidden", "heads", "seq_len", "vocab", "micro_batch",
                     "num_microbatches", "tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.layers % (self.pp * self.v):
            raise ValueError(f"layers = {self.layers} is not divisible by pp * vpp = "
                             f"{self.pp} * {self.v}")

    @property
    def v(self) -> int:
        return self.vpp or 1

    @property
    def f(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (it needs tp > 1)."""
        return self.sequence_parallel and self.tp > 1


def stage_layers(c: CommConfig) -> int:
    """Transformer layers held by one pipeline rank (all of its virtual chunks)."""
    return c.layers // c.pp


def _layer_params(c: CommConfig) -> tuple[int, int]:
    """``(split over tp, replicated)`` parameters of one layer: QKV, proj, fc1, fc2 (+ biases)
    are split except the row biases; the two LayerNorms and row biases are replicated."""
    h, f = c.hidden, c.f
    split = 3 * h * h + 3 * h + h * h + h * f + f + f * h
    return split, 4 * h + 2 * h


def params_per_rank(c: CommConfig, pp_rank: int = 0) -> int:
    """Parameters stored by one rank of pipeline stage ``pp_rank`` (tied embedding counted on
    both the first and the last stage when ``pp > 1``)."""
    if not c.arch.is_gpt2:
        return arch_params_per_rank(c, pp_rank)
    split, replicated = _layer_params(c)
    n = stage_layers(c) * (split // c.tp + replicated)
    if pp_rank == 0:
        n += c.vocab * c.hidden // c.tp + c.seq_len * c.hidden
    if pp_rank == c.pp - 1:
        n += 2 * c.hidden + (c.vocab * c.hidden // c.tp if c.pp > 1 else 0)
    return n


def param_count(layers: int, hidden: int, vocab: int, seq_len: int,
                ffn: int | None = None) -> int:
    """Parameters of the whole GPT (tied embeddings, learned positions, final LayerNorm):
    ``12 L h^2 + 13 L h + (V + s) h + 2h`` for ``ffn = 4h`` — Narayanan et al.'s
    ``12 L h^2 (1 + 13/(12h) + (V + s)/(12 L h))`` plus the final LayerNorm."""
    f = ffn or 4 * hidden
    per_layer = 4 * hidden * hidden + 2 * hidden * f + f + 9 * hidden
    return layers * per_layer + (vocab + seq_len) * hidden + 2 * hidden


def default_buckets(c: CommConfig, pp_rank: int = 0) -> tuple[int, ...]:
    """Elements of each gradient bucket of this rank (all chunks, padded), exactly as the
    gradient buffer cuts them (:func:`paraloom.analysis.layout.rank_buckets`)."""
    return tuple(b.numel for b in rank_buckets(c, pp_rank))


def expected_comm(c: CommConfig, pp_rank: int = 0) -> dict[tuple[str, str, str], dict]:
    """``{(kind, op, phase): {"count": n, "bytes": total}}`` for one step on one rank of
    pipeline stage ``pp_rank`` (every tp/dp rank of a stage communicates the same)."""
    out: dict = defaultdict(lambda: {"count": 0, "bytes": 0})

    def add(kind, op, phase, count, nbytes):
        if count:
            out[kind, op, phase]["count"] += count
            out[kind, op, phase]["bytes"] += count * nbytes

    t, m, sp = c.tp, c.num_microbatches, c.sp
    first, last = pp_rank == 0, pp_rank == c.pp - 1
    act = local_seq(c) * c.micro_batch * c.hidden * c.dtype_bytes  # one [s(/cp), b, h] tensor
    shard = act // t                                              # one [s/t, b, h] tensor
    ml = m * stage_layers(c)                                       # layer passes per step
    if t > 1:
        if sp:  # per layer: QKV and fc1 gather the input, proj and fc2 reduce-scatter the output
            add("sp", "all_gather", "forward", 2 * ml, shard)
            add("sp", "reduce_scatter", "forward", 2 * ml, act)
            # backward: row layers gather the output grad, column layers re-gather the saved
            # input shard and reduce-scatter the input grad
            add("sp", "all_gather", "backward", 4 * ml, shard)
            add("sp", "reduce_scatter", "backward", 2 * ml, act)
            if c.recompute == "full":  # the re-run stops before fc2's reduction (see below)
                add("sp", "all_gather", "recompute", 2 * ml, shard)
                add("sp", "reduce_scatter", "recompute", ml, act)
        else:   # Shoeybi et al.: row outputs all-reduced forward, column input grads backward
            add("tp", "all_reduce", "forward", 2 * ml, act)
            add("tp", "all_reduce", "backward", 2 * ml, act)
            if c.recompute == "full":
                # torch's non-reentrant checkpoint stops the re-run once every tensor backward
                # needs is rebuilt: fc2's reduced output only joins the residual sum, so only
                # proj's reduction is repeated (Megatron's reentrant checkpoint repeats both)
                add("tp", "all_reduce", "recompute", ml, act)
        if first:  # vocabulary-parallel embedding: partial rows summed
            if sp:
                add("sp", "reduce_scatter", "forward", m, act)
                add("sp", "all_gather", "backward", m, shard)
            else:
                add("tp", "all_reduce", "forward", m, act)
        if last:  # output layer input (copy / sequence gather) and vocab-parallel cross-entropy
            if sp:
                add("sp", "all_gather", "forward", m, shard)
                add("sp", "reduce_scatter", "backward", m, act)
            else:
                add("tp", "all_reduce", "backward", m, act)
            tokens = local_seq(c) * c.micro_batch
            add("tp", "all_reduce", "forward", m, tokens * F32)                   # MAX
            add("tp", "all_reduce", "forward", m, (3 if c.label_smoothing else 2) * tokens * F32)
    add_cp_comm(c, ml, add)
    if c.pp > 1:
        _pipeline(c, pp_rank, add, shard if sp else act)
    if c.moe is not None:  # MoE layers' tp/sp traffic instead of the dense MLP's, and ep counts
        from .moe_formulas import moe_comm
        moe_comm(c, pp_rank, add)
    if c.grad_sync:
        _grad_sync(grad_sync_view(c), pp_rank, add)  # cp: gradients reduced over dp x cp
    return dict(out)


def _pipeline(c: CommConfig, r: int, add, nbytes: int) -> None:
    """p2p per microbatch: activations to the next virtual stage, gradients to the previous one
    (Narayanan et al.); with ``v`` chunks a rank sits at ``v`` virtual stages."""
    p, v, m = c.pp, c.v, c.num_microbatches
    stages = [k * p + r for k in range(v)]           # this rank's virtual stage indices
    sends = sum(1 for s in stages if s < v * p - 1)   # has a successor
    recvs = sum(1 for s in stages if s > 0)           # has a predecessor
    add("pp", "send", "forward", sends * m, nbytes)
    add("pp", "recv", "forward", recvs * m, nbytes)
    add("pp", "send", "backward", recvs * m, nbytes)
    add("pp", "recv", "backward", sends * m, nbytes)


def _grad_sync(c: CommConfig, r: int, add) -> None:
    """What a train step adds after the schedule: the data-parallel bucket reductions (launched
    from the gradient hooks, phase ``backward``, or at finish, phase ``optimizer``; under the
    distributed optimizer reduce-scattered, except a tied embedding's own bucket, and every
    bucket's parameter shard all-gathered), ``finalize_model_grads`` (one coalesced all-reduce
    over tp of the sequence-parallel grads, one over the embedding group of the tied word
    embedding) and the step's loss + gradient-norm reduction over all ranks (2 float64)."""
    if c.dp > 1:
        phase = "backward" if c.overlap_grad_reduce else "optimizer"
        buckets = [(b.numel, b.reduce_scatter) for b in rank_buckets(c, r)] \
            if c.buckets is None else [(n, c.distributed_optimizer) for n in c.buckets]
        edp = c.dp // c.moe.ep if c.moe is not None else c.dp
        if c.buckets is None:
            buckets = [(b.numel, b.reduce_scatter, edp if b.expert else c.dp)
                       for b in rank_buckets(c, r)]
        else:
            buckets = [(n, c.distributed_optimizer, c.dp) for n in c.buckets]
        for n, scatter, size in buckets:
            if size == 1:  # an expert bucket with ep = dp: no replica to reduce with
                continue
            add("dp", "reduce_scatter" if scatter else "all_reduce", phase, 1, n * c.grad_bytes)
            if c.distributed_optimizer and c.optimizer_step:
                add("dp", "all_gather", "optimizer", 1, n // size * c.dtype_bytes)
    if c.tp > 1 and sp_elems(c, r):  # LayerNorms etc. under sp; MoE: experts' fc2 biases
        add("sp", "all_reduce", "optimizer", 1, sp_elems(c, r) * c.grad_bytes)
    if c.pp > 1 and r in (0, c.pp - 1) and c.arch.tied:
        vocab = -(-c.vocab // c.tp) * c.tp
        add("emb", "all_reduce", "optimizer", 1, vocab * c.hidden // c.tp * c.grad_bytes)
    if c.tp * c.pp * c.dp > 1:
        stats = 3 + c.layers * c.moe.num_experts if c.moe is not None else 0
        add("loss", "all_reduce", "optimizer", 1, (2 + stats) * 8)


def bubble_fraction(pp: int, num_microbatches: int, vpp: int | None = None) -> float:
    """Idle fraction of a 1F1B step: ``(p-1)/(m+p-1)``; interleaved ``(p-1)/(v m + p-1)``."""
    v = vpp or 1
    return (pp - 1) / (v * num_microbatches + pp - 1)


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, *,
                               sequence_parallel: bool = False, recompute: str = "none",
                               attention: str = "core") -> float:
    """Activation bytes one layer keeps for backward (16-bit activations), Korthikanti et al.
    2022 Table 2: none ``sbh(34 + 5as/h)``; tp ``sbh(10 + 24/t + 5as/(ht))``; tp + sp
    ``sbh(34/t + 5as/(ht))``; selective + tp ``sbh(10 + 24/t)``; selective + tp + sp
    ``sbh(34/t)``; full recomputation ``2sbh`` (only the layer input). ``attention="sdpa"``
    (fused attention) keeps no ``s x s`` tensor: the ``5as/(ht)`` term drops, as with selective
    recomputation (its per-row softmax statistics are O(sb), below this resolution)."""
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh
    attn = 0.0 if recompute == "selective" or attention == "sdpa" else 5 * a * s / (h * t)
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    if sequence_parallel and t > 1:
        return sbh * (34 / t + attn)
    return sbh * (10 + 24 / t + attn)


def flops_per_iteration(batch: int, s: int, layers: int, h: int, vocab: int) -> float:
    """Narayanan et al. 2021, eq. (3): ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` — forward,
    backward and one forward recomputation of a GPT on a global batch of ``B`` samples."""
    return 96 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


def model_flops_per_iteration(batch: int, s: int, layers: int, h: int, vocab: int,
                              ffn: int | None = None) -> float:
    """The FLOPs the model needs per step, without any recomputation (what MFU divides):
    forward ``2 B s (4h^2 + 2hf) + 4 B s^2 h`` per layer (QKV, proj, fc1, fc2 GEMMs; QK^T and
    attention x V) plus the logits ``2 B s h V``; backward twice the forward. With ``f = 4h``:
    ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))`` (Narayanan et al.'s eq. (3) without its fourth,
    recomputed forward pass)."""
    f = ffn or 4 * h
    layer = 2 * batch * s * (4 * h * h + 2 * h * f) + 4 * batch * s * s * h
    return 3 * (layers * layer + 2 * batch * s * h * vocab)


def recompute_flops_per_iteration(batch: int, s: int, layers: int, h: int,
                                  ffn: int | None = None, recompute: str = "none", *,
                                  early_stop: bool = True) -> float:
    """FLOPs that recomputation adds per step. ``full``: every layer's forward again
    ``l (2 B s (4h^2 + 2hf) + 4 B s^2 h)`` (not the logits). ``selective``: the core attention
    again; torch's non-reentrant checkpoint (paraloom's, ``early_stop=True``) stops once every
    saved tensor is rebuilt, so only QK^T re-runs (the softmax output is what attention x V
    saved): ``2 B s^2 h l``; Megatron's own checkpoint re-runs QK^T and attention x V:
    ``4 B s^2 h l``. Both counted against ``torch.utils.flop_counter`` in the tests."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    f = ffn or 4 * h
    if recompute == "full":
        return layers * (2 * batch * s * (4 * h * h + 2 * h * f) + 4 * batch * s * s * h)
    if recompute == "selective":
        return (2 if early_stop else 4) * batch * s * s * h * layers
    return 0.0


def hardware_flops_per_iteration(batch: int, s: int, layers: int, h: int, vocab: int,
                                 ffn: int | None = None, recompute: str = "none", *,
                                 early_stop: bool = True) -> float:
    """The FLOPs the GPUs execute per step (what HFU divides): model FLOPs plus the configured
    recomputation. Full recomputation with ``f = 4h`` is Narayanan's eq. (3),
    ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``."""
    return (model_flops_per_iteration(batch, s, layers, h, vocab, ffn)
            + recompute_flops_per_iteration(batch, s, layers, h, ffn, recompute,
                                            early_stop=early_stop))
