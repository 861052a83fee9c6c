"""Where a rank's parameters sit: the per-chunk parameter list and its gradient buckets.

The data-parallel reduction of a step is one collective per gradient bucket, so its exact count
and bytes depend on how :class:`~paraloom.data_parallel.grad_buffer.GradBuffer` cuts a chunk's
parameters. This module derives that layout from the configuration alone (no model):

* :func:`chunk_params` lists one pipeline chunk's parameters in registration order, as
  :class:`~paraloom.models.gpt.GPTModel` creates them — ``embedding.word_embeddings.weight``
  (``[V/t, h]``; tied, ``shared_embedding``, when ``pp > 1``), ``embedding.position_embeddings
  .weight`` (``[s, h]``, first chunk only), per layer ``ln1``, ``attention.qkv``,
  ``attention.proj``, ``ln2``, ``mlp.fc1``, ``mlp.fc2`` (weights then biases), and
  ``final_layernorm`` on the last chunk — with their ``sequence_parallel`` marks (LayerNorms,
  row biases and position embeddings under sequence parallelism with ``t > 1``).
* :func:`chunk_buckets` replays the buffer's cut (the same function,
  :func:`paraloom.data_parallel.grad_buffer.cut_buckets`): parameters in *reverse* order, a
  bucket closes once it holds ``bucket_size`` elements (halving in the last ``bucket_size``), a
  shared embedding gets a bucket of its own, and every bucket is padded to a multiple of ``dp``
  under the distributed optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .arch import arch_chunk_params

if TYPE_CHECKING:  # pragma: no cover
    from .formulas import CommConfig

__all__ = ["Param", "Bucket", "chunk_params", "chunk_buckets", "rank_buckets", "sp_elems",
           "bucket_size_of"]


@dataclass(frozen=True)
class Param:
    """One parameter of a chunk as the gradient buffer sees it."""

    name: str
    numel: int
    shared: bool = False
    """``shared_embedding``: the tied word embedding when ``pp > 1`` (its own bucket)."""
    sp: bool = False
    """``sequence_parallel``: its gradient is all-reduced over tp by ``finalize_model_grads``."""
    expert: bool = False
    """An expert's parameter (``allreduce=False``): its own buffer, reduced over edp."""


@dataclass(frozen=True)
class Bucket:
    """One gradient bucket: padded elements and whether it is reduce-scattered."""

    numel: int
    reduce_scatter: bool
    names: tuple[str, ...]
    expert: bool = False
    """Expert parameters' bucket: reduced (and ZeRO-sharded) over edp, not dp."""


def bucket_size_of(c: CommConfig) -> int:
    """Elements per bucket: ``c.bucket_size`` or Megatron's ``max(40M, 1M * dp)``."""
    return c.bucket_size or max(40_000_000, 1_000_000 * c.dp)


def chunk_params(c: CommConfig, pp_rank: int, chunk: int = 0) -> list[Param]:
    """The parameters of chunk ``chunk`` on pipeline rank ``pp_rank``, in registration order."""
    t, h, f, s = c.tp, c.hidden, c.f, c.seq_len
    per_chunk = c.layers // (c.pp * c.v)
    virtual = chunk * c.pp + pp_rank
    first, last = virtual == 0, virtual == c.pp * c.v - 1
    if not c.arch.is_gpt2:  # Llama family: see paraloom.analysis.arch
        layer_ids = range(virtual * per_chunk, (virtual + 1) * per_chunk)
        return arch_chunk_params(c, first, last, layer_ids, Param)
    sp = c.sp
    vocab = -(-c.vocab // t) * t  # padded to a multiple of tp
    out: list[Param] = []
    if first or last:
        out.append(Param("embedding.word_embeddings.weight", vocab // t * h, shared=c.pp > 1))
    if first:
        out.append(Param("embedding.position_embeddings.weight", s * h, sp=sp))
    for i in range(virtual * per_chunk, (virtual + 1) * per_chunk):
        p = f"layers.{i}."
        out += [Param(p + "ln1.weight", h, sp=sp), Param(p + "ln1.bias", h, sp=sp),
                Param(p + "attention.qkv.weight", 3 * h // t * h),
                Param(p + "attention.qkv.bias", 3 * h // t),
                Param(p + "attention.proj.weight", h * (h // t)),
                Param(p + "attention.proj.bias", h, sp=sp),
                Param(p + "ln2.weight", h, sp=sp), Param(p + "ln2.bias", h, sp=sp)]
        if c.moe is not None and c.moe.is_moe_layer(i):  # router + this ep rank's experts
            from .moe_formulas import moe_layer_params
            out += moe_layer_params(c, p + "mlp.")
            continue
        out += [Param(p + "mlp.fc1.weight", f // t * h), Param(p + "mlp.fc1.bias", f // t),
                Param(p + "mlp.fc2.weight", h * (f // t)), Param(p + "mlp.fc2.bias", h, sp=sp)]
    if last:
        out += [Param("final_layernorm.weight", h, sp=sp), Param("final_layernorm.bias", h, sp=sp)]
    return out


def chunk_buckets(c: CommConfig, pp_rank: int, chunk: int = 0) -> list[Bucket]:
    """The gradient buckets of one chunk, in launch order (as ``GradBuffer`` cuts them): the
    non-expert buffer's, then the expert buffer's (padded to a multiple of edp under ZeRO)."""
    params = chunk_params(c, pp_rank, chunk)
    edp = c.dp // c.moe.ep if c.moe is not None else c.dp
    return _cut(c, [p for p in params if not p.expert], c.dp, False) + \
        _cut(c, [p for p in params if p.expert], edp, True)


def _cut(c: CommConfig, params: list[Param], axis: int, expert: bool) -> list[Bucket]:
    from ..data_parallel.grad_buffer import cut_buckets  # the buffer's own rule
    pad = axis if c.distributed_optimizer else 1
    order = list(reversed(params))  # backward order: last layer first
    out = []
    for group in cut_buckets([(p.numel, p.shared) for p in order], bucket_size_of(c)):
        members = [order[i] for i in group]
        n = sum(p.numel for p in members)
        out.append(Bucket(-(-n // pad) * pad, c.distributed_optimizer and
                          not any(p.shared for p in members),
                          tuple(p.name for p in members), expert))
    return out


def rank_buckets(c: CommConfig, pp_rank: int) -> list[Bucket]:
    """Every bucket of a pipeline rank, all of its chunks (one DDP wrapper per chunk)."""
    return [b for chunk in range(c.v) for b in chunk_buckets(c, pp_rank, chunk)]


def sp_elems(c: CommConfig, pp_rank: int) -> int:
    """Elements of the rank's ``sequence_parallel`` parameters (one coalesced all-reduce)."""
    return sum(p.numel for chunk in range(c.v) for p in chunk_params(c, pp_rank, chunk) if p.sp)
