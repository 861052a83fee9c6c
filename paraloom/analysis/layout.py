"""Where a rank's parameters sit: the per-chunk parameter list and its gradient buckets.

The data-parallel reduction of a step is one collective per gradient bucket, so its exact count
and bytes depend on how :class:`~paraloom.data_parallel.grad_buffer.GradBuffer` cuts a chunk's
parameters. This module derives that layout from the configuration alone (no model):

* :func:`chunk_params` lists one pipeline chunk's parameters in registration order, as
  :class:`~paraloom.models.gpt.GPTModel` creates them — on the first chunk
  ``embedding.word_embeddings.weight`` (``[V/t, h]``; tied, ``shared_embedding``, when
  ``pp > 1``) and ``embedding.position_embeddings.weight`` (``[s, h]``, replicated), per layer
  ``ln1``, ``attention.proj``, ``attention.qkv`` (Megatron's order), ``ln2``, ``mlp.fc1``,
  ``mlp.fc2`` (weights then biases), and on the last chunk ``final_layernorm`` then
  (``pp > 1``) its copy of the tied word embedding — with their ``sequence_parallel`` marks
  (LayerNorms and row biases under sequence parallelism with ``t > 1``).
* :func:`chunk_buckets` replays the buffer's cut (the same function,
  :func:`paraloom.data_parallel.grad_buffer.bucket_layout`): Megatron's layout, with
  ``bucket_size`` only where Megatron applies it (overlap on, the first pipeline stage, a rank's
  first chunk; else one bucket) and the distributed optimizer's padding and separate
  shared-embedding bucket.
"""

from __future__ import annotations

from dataclasses import replace

from ..data_parallel.fsdp_layout import fsdp_layout
from ..data_parallel.grad_buffer import bucket_layout
from .arch import arch_chunk_params
from .moe_formulas import moe_layer_params
from .spec import Bucket, CommConfig, Param

__all__ = ["Param", "Bucket", "chunk_params", "chunk_buckets", "rank_buckets", "sp_elems",
           "bucket_size_of", "layers_per_stage", "params_per_rank", "param_count",
           "arch_params_per_rank", "arch_param_count", "default_buckets"]


def bucket_size_of(c: CommConfig, pp_rank: int = 0, chunk: int = 0) -> int | None:
    """Elements at which a bucket of this chunk closes: ``c.bucket_size`` or Megatron's
    ``max(40M, 1M * dp)``; ``None`` (one bucket) without overlap, on a pipeline rank > 0 or
    for a chunk after the first (Megatron's ``disable_bucketing``; for every chunk with
    ``param_gather_with_optimizer_step``)."""
    if c.megatron_fsdp:  # Megatron-FSDP: --ddp-bucket-size, else no limit
        return c.bucket_size
    if not c.overlap_grad_reduce or pp_rank > 0 or chunk > 0 or \
            c.param_gather_with_optimizer_step:
        return None
    return c.bucket_size or max(40_000_000, 1_000_000 * c.dp)


def chunk_params(c: CommConfig, pp_rank: int, chunk: int = 0) -> list[Param]:
    """The parameters of chunk ``chunk`` on pipeline rank ``pp_rank``, in registration order."""
    per_chunk = c.layers // (c.pp * c.v)
    virtual = chunk * c.pp + pp_rank
    first, last = virtual == 0, virtual == c.pp * c.v - 1
    layer_ids = range(virtual * per_chunk, (virtual + 1) * per_chunk)
    if not c.arch.is_gpt2:  # Llama family: see paraloom.analysis.arch
        return arch_chunk_params(c, first, last, layer_ids, Param)
    t, h, f, s = c.tp, c.hidden, c.f, c.seq_len
    sp = c.sp
    vocab = -(-c.vocab // t) * t  # padded to a multiple of tp
    word = Param("embedding.word_embeddings.weight", vocab // t * h, shared=c.pp > 1, row=h)
    out: list[Param] = []
    if first:
        out += [word, Param("embedding.position_embeddings.weight", s * h, row=h)]
    for i in layer_ids:
        p = f"layers.{i}."
        out += [Param(p + "ln1.weight", h, sp=sp), Param(p + "ln1.bias", h, sp=sp),
                Param(p + "attention.proj.weight", h * (h // t), row=h // t),
                Param(p + "attention.proj.bias", h, sp=sp),
                Param(p + "attention.qkv.weight", 3 * h // t * h, row=h),
                Param(p + "attention.qkv.bias", 3 * h // t),
                Param(p + "ln2.weight", h, sp=sp), Param(p + "ln2.bias", h, sp=sp)]
        if c.moe is not None and c.moe.is_moe_layer(i):  # router + this ep rank's experts
            out += moe_layer_params(c, p + "mlp.")
            continue
        out += [Param(p + "mlp.fc1.weight", f // t * h, row=h), Param(p + "mlp.fc1.bias", f // t),
                Param(p + "mlp.fc2.weight", h * (f // t), row=f // t),
                Param(p + "mlp.fc2.bias", h, sp=sp)]
    if last:
        out += [Param("final_layernorm.weight", h, sp=sp), Param("final_layernorm.bias", h, sp=sp)]
        if not first:  # the tied copy, registered as the last stage's output layer
            out.append(word)
    return out


def chunk_buckets(c: CommConfig, pp_rank: int, chunk: int = 0) -> list[Bucket]:
    """The gradient buckets of one chunk, in launch order (as ``GradBuffer`` cuts them): the
    non-expert buffer's, then the expert buffer's (sharded over edp under ZeRO)."""
    params = chunk_params(c, pp_rank, chunk)
    edp = c.dp // c.moe.ep if c.moe is not None else c.dp
    size = bucket_size_of(c, pp_rank, chunk)
    n = c.instances  # distributed-optimizer instances: sharded within a block of dp / n
    return _cut(c, [p for p in params if not p.expert], c.dp // n, False, size) + \
        _cut(c, [p for p in params if p.expert], edp // n, True, size)


def chunk_groups(c: CommConfig, pp_rank: int, chunk: int = 0) -> list[list[Bucket]]:
    """Megatron's bucket groups of a chunk (:mod:`paraloom.data_parallel.bucket_group`): one
    per bucket, or where bucketing is disabled (a chunk after the first; every chunk with
    ``param_gather_with_optimizer_step``) the non-expert buckets together and the expert
    buckets together, each group one coalesced collective."""
    buckets = chunk_buckets(c, pp_rank, chunk)
    if not (chunk > 0 or c.param_gather_with_optimizer_step):
        return [[b] for b in buckets]
    kinds = [b for b in buckets if not b.expert], [b for b in buckets if b.expert]
    return [kind for kind in kinds if kind]


def _cut(c: CommConfig, params: list[Param], axis: int, expert: bool,
         size: int | None) -> list[Bucket]:
    if not params:
        return []
    if c.megatron_fsdp:  # Megatron-FSDP: registration order, its own padding
        zero3 = c.megatron_fsdp == "optim_grads_params"  # each transformer layer a unit
        layout = fsdp_layout([(p.numel, p.row, p.shared, int(p.name.split(".")[1])
                               if zero3 and p.name.startswith("layers.") else None)
                              for p in params], size, shard_over=axis,
                             sharded=c.distributed_optimizer)
        return [Bucket(end - start, c.distributed_optimizer,
                       tuple(params[i].name for i, _, _ in members), expert)
                for start, end, members in layout]
    order = list(reversed(params))  # backward order: last layer first
    layout = bucket_layout([(p.numel, p.shared) for p in order], size, shard_over=axis,
                           sharded=c.distributed_optimizer, tail_splits=c.bucket_tail_splits)
    return [Bucket(end - start, c.distributed_optimizer,
                   tuple(order[i].name for i, _, _ in members), expert)
            for start, end, members in layout]


def rank_buckets(c: CommConfig, pp_rank: int) -> list[Bucket]:
    """Every bucket of a pipeline rank, all of its chunks (one DDP wrapper per chunk)."""
    return [b for chunk in range(c.v) for b in chunk_buckets(c, pp_rank, chunk)]


def sp_elems(c: CommConfig, pp_rank: int) -> int:
    """Elements of the rank's ``sequence_parallel`` parameters (one coalesced all-reduce)."""
    return sum(p.numel for chunk in range(c.v) for p in chunk_params(c, pp_rank, chunk) if p.sp)


def layers_per_stage(c: CommConfig) -> int:
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
    n = layers_per_stage(c) * (split // c.tp + replicated)
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


_COUNTS: dict = {}
"""Counts already made, by what they depend on (``plan --search`` asks for many layouts)."""


def arch_params_per_rank(c, pp_rank: int) -> int:
    """Parameters one rank of pipeline stage ``pp_rank`` stores (all of its chunks) in the dense
    model: as for GPT-2, what MoE layers change is :func:`~.moe_formulas.moe_plan`'s to add."""
    key = (c.arch, c.layers, c.hidden, c.heads, c.f, c.seq_len, c.vocab, c.tp, c.pp, c.v, c.sp,
           pp_rank)
    if key not in _COUNTS:
        dense = replace(c, moe=None)
        _COUNTS[key] = sum(p.numel for k in range(c.v) for p in chunk_params(dense, pp_rank, k))
    return _COUNTS[key]


def arch_param_count(c) -> int:
    """Parameters of the whole model (one copy: tp = pp = 1)."""
    return arch_params_per_rank(replace(c, tp=1, pp=1, vpp=None, sequence_parallel=False), 0)
