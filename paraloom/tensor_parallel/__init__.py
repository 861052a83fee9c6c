"""Tensor and sequence parallelism: region mappings, parallel layers, vocab-parallel loss, RNG."""

from .cross_entropy import vocab_parallel_cross_entropy
from .init import CounterInit, counter_normal
from .layers import (
                     ColumnParallelLinear,
                     RowParallelLinear,
                     VocabParallelEmbedding,
                     linear_with_grad_accumulation_and_async_allreduce,
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
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "linear_with_grad_accumulation_and_async_allreduce", "vocab_parallel_cross_entropy",
    "CounterInit", "counter_normal", "RNGStatesTracker", "get_rng_tracker", "model_parallel_seed",
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
]
