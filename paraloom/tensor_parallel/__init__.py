"""Tensor and sequence parallelism: region mappings (:mod:`.mappings`), the linear GEMM with its
backward communication (:mod:`.linear`), the parallel layers (:mod:`.layers`), the vocabulary-
parallel embedding and output layer (:mod:`.embedding`) and loss (:mod:`.cross_entropy`), the
RNG tracker (:mod:`.random`), layout-independent initialisation (:mod:`.init`) and where weight
gradients go (:mod:`.weight_grad`)."""

from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding, parallel_lm_logits
from .init import CounterInit, counter_normal
from .layers import ColumnParallelLinear, RowParallelLinear
from .linear import (
                     linear_with_grad_accumulation_and_async_allreduce,
                     set_tensor_model_parallel_attributes,
)
from .mappings import (
                     copy_to_tensor_model_parallel_region,
                     gather_from_sequence_parallel_region,
                     gather_from_tensor_model_parallel_region,
                     reduce_from_tensor_model_parallel_region,
                     reduce_scatter_to_sequence_parallel_region,
                     scatter_to_sequence_parallel_region,
                     scatter_to_tensor_model_parallel_region,
)
from .random import RNGStatesTracker, get_rng_tracker, model_parallel_seed

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "parallel_lm_logits",
    "linear_with_grad_accumulation_and_async_allreduce", "set_tensor_model_parallel_attributes",
    "vocab_parallel_cross_entropy",
    "CounterInit", "counter_normal", "RNGStatesTracker", "get_rng_tracker", "model_parallel_seed",
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
]
