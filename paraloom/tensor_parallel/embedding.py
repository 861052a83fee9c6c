"""The vocabulary-parallel ends of a GPT: :class:`VocabParallelEmbedding` (the input lookup) and
:func:`parallel_lm_logits` (the output layer, tied to it or not).

* VocabParallelEmbedding (rows split by vocabulary range): forward all-reduces the looked-up
  rows ``[b, s, h]`` (or, with ``reduce_scatter_embeddings``, turns them sequence-first and
  reduce-scatters them along the sequence), as Megatron-Core's.
* The output layer is a column-parallel GEMM over the vocabulary split (Megatron-Core's
  ``ColumnParallelLinear`` output layer): its input is copied into the tp region (backward:
  all-reduce of the input gradient, async with ``async_grad_allreduce``), or, with sequence
  parallelism, all-gathered along the sequence (backward: async re-gather of the input for the
  weight gradient, async reduce-scatter of the input gradient). The full-vocabulary
  logits are never gathered: the loss is :func:`.cross_entropy.vocab_parallel_cross_entropy`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..mesh import Axis, ParallelMesh
from ..utils import divide
from .init import CounterInit
from .linear import (
    default_mesh,
    linear_with_grad_accumulation_and_async_allreduce,
    set_tensor_model_parallel_attributes,
    shard_param,
)
from .mappings import (
    Where,
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

__all__ = ["VocabParallelEmbedding", "parallel_lm_logits"]


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary range: rank ``i`` holds rows ``[i V/tp, (i+1) V/tp)``.

    Each rank looks up the tokens in its range (zeros elsewhere); the partial results (ids
    ``[b, s]`` give ``[b, s, h]``) are all-reduced over tp, or, with
    ``reduce_scatter_embeddings`` (sequence parallel without learned positions), transposed to
    ``[s, b, h]`` and reduce-scattered along the sequence so each rank keeps ``[s/tp, b, h]``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method=None,
                 reduce_scatter_embeddings: bool = False, mesh: ParallelMesh | None = None,
                 name: str = "embedding", params_dtype: torch.dtype = torch.float32,
                 device=None) -> None:
        super().__init__()
        self.mesh = default_mesh(mesh)
        tp = self.mesh.tp
        self.num_embeddings, self.embedding_dim, self.name = num_embeddings, embedding_dim, name
        self.num_embeddings_per_partition = divide(num_embeddings, tp.size,
                                                   f"{name}: num_embeddings (vocabulary)")
        self.vocab_start_index = tp.rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        init_method = init_method or CounterInit()
        self.weight = shard_param(init_method, f"{name}.weight", (num_embeddings, embedding_dim),
                                   0, self.mesh, params_dtype, device)
        set_tensor_model_parallel_attributes(self.weight, True, 0)
        self._where = Where(tp, "VocabParallelEmbedding", "output", name,
                            "embedding rows, vocabulary range")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.mesh.tp.size == 1:
            out = F.embedding(ids, self.weight)
            return out.transpose(0, 1).contiguous() if self.reduce_scatter_embeddings else out
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local = (ids - self.vocab_start_index).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        w = self._where
        if self.reduce_scatter_embeddings:                   # [b, s, h] -> [s/tp, b, h]
            partial = partial.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(partial, w.axis, site=w.site,
                                                              module=w.module, split=w.split)
        return reduce_from_tensor_model_parallel_region(partial, w.axis, site=w.site,
                                                        module=w.module, split=w.split)


def parallel_lm_logits(x: torch.Tensor, weight: torch.Tensor, axis: Axis, *,
                       sequence_parallel: bool = False, async_grad_allreduce: bool | None = None,
                       site: str = "GPTModel.output", module: str = "output") -> torch.Tensor:
    """``[s(/tp), b, h] -> [s, b, Vp/tp]``: the logits of this rank's vocabulary range
    (``weight``: ``[Vp/tp, h]``, the output layer's or the tied word embeddings)."""
    if sequence_parallel and axis.size > 1:
        # Megatron-Core's sequence-parallel output layer: gather the sequence in forward; in
        # backward re-gather it (async) for the weight gradient and reduce-scatter the input
        # gradient (async), as every sequence-parallel ColumnParallelLinear does
        where = Where(axis, site, module=module, split="vocabulary")
        return linear_with_grad_accumulation_and_async_allreduce(x, weight, None, where, True,
                                                                 False, False)
    if async_grad_allreduce is None:  # Megatron-Core's rule
        async_grad_allreduce = not sequence_parallel
    if axis.size > 1 and async_grad_allreduce:
        # the same async all-reduce of the input gradient as a ColumnParallelLinear, overlapping
        # the (tied) weight-gradient GEMM
        where = Where(axis, site, module=module, split="vocabulary")
        return linear_with_grad_accumulation_and_async_allreduce(x, weight, None, where, False,
                                                                 True, False)
    if axis.size > 1:
        x = copy_to_tensor_model_parallel_region(x, axis, site=site, module=module,
                                                 split="vocabulary")
    return F.linear(x, weight)
