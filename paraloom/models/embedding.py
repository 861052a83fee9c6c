"""The GPT's input embedding, as Megatron-Core's ``LanguageModelEmbedding``: word embeddings
(vocabulary split over tp) plus learned positions (replicated)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..mesh import ParallelMesh
from ..tensor_parallel import VocabParallelEmbedding, scatter_to_sequence_parallel_region
from ..tensor_parallel.init import CounterInit
from .layers import dropout
from .options import ParallelOptions

__all__ = ["Embedding"]


class Embedding(nn.Module):
    """Word embeddings (vocabulary split over tp) plus learned positions (replicated), as
    Megatron-Core's ``LanguageModelEmbedding``: the lookup on ``[b, s]`` ids all-reduces
    ``[b, s, h]``, positions are added, the sum turns sequence-first ``[s, b, h]`` and, with
    sequence parallelism, each rank keeps its ``s/tp`` slice (no communication; the backward
    all-gathers the gradient, so the position embeddings' gradient is whole on every tp rank).
    Without learned positions (rotary) and with sequence parallelism the word embedding
    reduce-scatters along the sequence instead.

    On the last pipeline stage (``positions=False``) it holds only the word embeddings: the copy
    tied to the output layer, initialised identically (same global name) and kept in sync by
    all-reducing its gradient over the embedding group (``shared_embedding``).
    """

    def __init__(self, cfg: ModelConfig, mesh: ParallelMesh, opt: ParallelOptions, *,
                 positions: bool = True) -> None:
        super().__init__()
        init = CounterInit(opt.seed, cfg.init_std)
        self.mesh, self.dropout = mesh, cfg.dropout
        self.sp = opt.uses_sequence_parallel(mesh)
        learned = cfg.position_embedding_type == "learned_absolute"
        self.word_embeddings = VocabParallelEmbedding(
            cfg.padded_vocab(mesh.tp.size), cfg.hidden_size, init_method=init,
            reduce_scatter_embeddings=self.sp and not learned,
            mesh=mesh, name="embedding.word_embeddings", params_dtype=opt.params_dtype)
        self.word_embeddings.weight.vocab_rows = cfg.vocab_size  # the rest is padding
        if mesh.pp.size > 1 and not cfg.untie_embeddings_and_output_weights:
            self.word_embeddings.weight.shared_embedding = True
        self.position_embeddings = None
        if positions:  # a module of its own, called in forward (as Megatron's nn.Embedding):
            # --overlap-param-gather gathers a parameter in its module's forward pre-hook
            self.position_embeddings = nn.Embedding(cfg.seq_length, cfg.hidden_size, _weight=init(
                "embedding.position_embeddings.weight", (cfg.seq_length, cfg.hidden_size), None,
                dtype=opt.params_dtype))

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None):
        x = self.word_embeddings(tokens)                     # [b, s, h] ([s/tp, b, h]: rs)
        if self.word_embeddings.reduce_scatter_embeddings:
            return dropout(x, self.dropout, self.training, self.sp)
        if self.position_embeddings is not None:
            if position_ids is None:                         # [s, h], broadcast over b
                position_ids = torch.arange(tokens.shape[1], device=tokens.device)
            pos = self.position_embeddings(position_ids)     # global positions [(b,) s]
            x = x + pos                                      # [b, s, h]
        x = x.transpose(0, 1).contiguous()                   # [s, b, h]
        if self.sp:                                          # [s/tp, b, h]: this rank's slice
            x = scatter_to_sequence_parallel_region(
                x, self.mesh.tp, site="Embedding", module="embedding",
                split="embeddings, sequence slice")
        return dropout(x, self.dropout, self.training, self.sp)
