"""Mixture of experts with expert parallelism: router, experts, Megatron's two token dispatchers
(allgather, alltoall)."""

from .allgather_dispatcher import MoEAllGatherTokenDispatcher
from .experts import Expert, local_expert_ids
from .moe_layer import MoELayer, is_moe_layer, moe_step_stats, reset_moe_stats
from .router import (
    MoEAuxLossAutoScaler,
    TopKRouter,
    expert_capacity,
    switch_load_balancing_loss,
    topk_routing,
    z_loss,
)
from .token_dispatcher import MoEAlltoAllTokenDispatcher, all_to_all

__all__ = ["MoELayer", "is_moe_layer", "moe_step_stats", "reset_moe_stats", "Expert",
           "local_expert_ids", "TopKRouter", "topk_routing", "switch_load_balancing_loss",
           "z_loss", "MoEAuxLossAutoScaler", "expert_capacity", "MoEAlltoAllTokenDispatcher",
           "MoEAllGatherTokenDispatcher", "all_to_all"]
