"""What the source reader knows by name: collectives, region helpers, world-size getters.

Everything here is a fact about a public API (``torch.distributed``, Megatron-Core's and
paraloom's region helpers, ``paraloom.comm``), not a guess about the file being read.
"""

from __future__ import annotations

import re

__all__ = ["COLLECTIVES", "PARALOOM_COMM", "REGIONS", "PHASES", "KINDS", "ASYNC_BY_NATURE",
           "WORLD_SIZE_CALL", "HOOK_REGISTRARS", "FORWARD_HOOKS", "FUNCOL", "FUNCOL_MODULES",
           "SYMM_MEM", "SYMM_MEM_MODULES", "DTENSOR_METHODS", "FSDP_METHODS",
           "DISTRIBUTE", "PLAN_STYLES",
           "region_semantics"]

COLLECTIVES = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather", "all_gather_single": "all_gather",
    "all_gather_object": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
    "broadcast": "broadcast", "broadcast_object_list": "broadcast",
    "send": "send", "isend": "send", "recv": "recv", "irecv": "recv",
    "batch_isend_irecv": "batch_p2p", "P2POp": "p2p_op", "ring_exchange": "send_recv",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
    "reduce": "reduce", "gather": "gather", "scatter": "scatter", "barrier": "barrier",
}
"""``torch.distributed`` function name -> primitive (the ledger's ``op`` vocabulary)."""

PARALOOM_COMM = {"all_reduce": "all_reduce", "all_gather": "all_gather",
                 "reduce_scatter": "reduce_scatter", "broadcast": "broadcast",
                 "batch_p2p": "batch_p2p", "barrier": "barrier", "gather_objects": "gather",
                 "all_to_all": "all_to_all"}
"""``paraloom.comm`` function -> primitive (paraloom's only door to torch.distributed)."""

ASYNC_BY_NATURE = {"isend", "irecv", "batch_isend_irecv", "P2POp"}
"""Calls that always return a request handle to wait on."""

PHASES = ("forward", "backward", "optimizer", "setup", "data")
KINDS = ("tp", "sp", "pp", "dp", "emb", "loss", "cp", "ep", "dp_inter")

# name -> (forward op, backward op, kind, what moves); None = no communication in that pass.
REGIONS = {
    "copy_to_tensor_model_parallel_region": (None, "all_reduce", "tp", "activation (identity)"),
    "reduce_from_tensor_model_parallel_region": ("all_reduce", None, "tp", "partial sums"),
    "scatter_to_tensor_model_parallel_region": (None, "all_gather", "tp", "last dim"),
    "gather_from_tensor_model_parallel_region": ("all_gather", None, "tp", "last dim"),
    "scatter_to_sequence_parallel_region": (None, "all_gather", "sp", "sequence dim 0"),
    "gather_from_sequence_parallel_region": ("all_gather", "reduce_scatter", "sp",
                                             "sequence dim 0"),
    "reduce_scatter_to_sequence_parallel_region": ("reduce_scatter", "all_gather", "sp",
                                                   "sequence dim 0"),
    "all_gather_last_dim_from_tensor_parallel_region": ("all_gather", "reduce_scatter", "tp",
                                                        "last dim"),
    "reduce_scatter_last_dim_to_tensor_parallel_region": ("reduce_scatter", "all_gather", "tp",
                                                          "last dim"),
    "all_to_all_sp2hp": ("all_to_all", "all_to_all", "sp", "sequence <-> hidden"),
    "all_to_all_hp2sp": ("all_to_all", "all_to_all", "sp", "hidden <-> sequence"),
}
"""Megatron-Core's region helpers (paraloom uses the same names): "forward: X / backward: Y"."""

WORLD_SIZE_CALL = re.compile(r"^(get_\w*world_size|get_world_size|get_pg_size)$")
"""Functions whose result is a world size (``get_tensor_model_parallel_world_size()``, ...)."""

FUNCOL = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_tensor": "all_gather", "all_gather_tensor_autograd": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_autograd": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "all_to_all_single": "all_to_all",
    "all_to_all_single_autograd": "all_to_all", "broadcast": "broadcast",
    "permute_tensor": "send_recv",
}
"""``torch.distributed._functional_collectives`` (and the ``_c10d_functional`` ops): they return
a tensor that waits on first use, so they are asynchronous by nature."""

FUNCOL_MODULES = ("torch.distributed._functional_collectives", "torch.ops._c10d_functional",
                  "torch.ops.c10d_functional", "torch.ops._c10d_functional_autograd")

SYMM_MEM = {
    "fused_all_gather_matmul": "all_gather", "fused_all_gather_scaled_matmul": "all_gather",
    "fused_matmul_reduce_scatter": "reduce_scatter",
    "fused_scaled_matmul_reduce_scatter": "reduce_scatter",
    "one_shot_all_reduce": "all_reduce", "one_shot_all_reduce_out": "all_reduce",
    "two_shot_all_reduce_": "all_reduce", "two_shot_all_reduce_out": "all_reduce",
    "multimem_all_reduce_": "all_reduce", "multimem_one_shot_all_reduce": "all_reduce",
    "multimem_all_gather_out": "all_gather", "_low_contention_all_gather": "all_gather",
    "_low_contention_reduce_scatter": "reduce_scatter", "all_to_all_vdev": "all_to_all",
}
"""Symmetric-memory ops (``torch.ops.symm_mem.*``, ``torch.distributed._symmetric_memory``):
collective fused with a GEMM; they complete before returning."""

SYMM_MEM_MODULES = ("torch.ops.symm_mem", "torch.distributed._symmetric_memory")

DTENSOR_METHODS = {"redistribute", "full_tensor"}
"""DTensor methods that change placements (which collective depends on the placements)."""

DISTRIBUTE = {"distribute_module": "broadcast", "distribute_tensor": "scatter"}
"""DTensor's ``torch.distributed.tensor`` constructors: ``distribute_module`` replicates the
parameters its partition_fn leaves (a broadcast from rank 0); ``distribute_tensor`` sends each
rank its shard (a scatter; a broadcast for Replicate placements)."""

FSDP_METHODS = {"unshard": "all_gather"}
"""FSDP2 (``fully_shard``) module methods that communicate when called explicitly."""

PLAN_STYLES = {
    # style -> [(phase, op)] with default layouts; Shard output / input layouts change them
    "ColwiseParallel": [("backward", "all_reduce")],
    "RowwiseParallel": [("forward", "all_reduce")],
    "PrepareModuleInput": [("forward", "redistribute")],
    "PrepareModuleOutput": [("forward", "redistribute")],
    "PrepareModuleInputOutput": [("forward", "redistribute")],
}
"""``parallelize_module`` plan styles: the communication each one installs around its module.
ColwiseParallel with ``input_layouts=Shard(..)`` all-gathers its input in forward and
reduce-scatters the gradient; RowwiseParallel with ``output_layouts=Shard(..)`` reduce-scatters
its output and all-gathers the output gradient."""

FORWARD_HOOKS = re.compile(r"^(register_forward_(pre_)?hook|distribute_module)$")
"""Functions passed to these run in forward (module hooks; DTensor's input/output fns)."""

HOOK_REGISTRARS = re.compile(r"register_(\w*_)?hook$")
"""``tensor.register_hook``, ``register_post_accumulate_grad_hook``,
``register_full_backward_hook``: functions passed to them run in backward."""


def region_semantics(name: str) -> tuple[str | None, str | None, str, str] | None:
    """(forward op, backward op, kind, what moves) of a region helper, by its (last) name.

    ``inference_*`` variants keep the forward op and have no backward."""
    if name in REGIONS:
        return REGIONS[name]
    if name.startswith("inference_") and name[len("inference_"):] in REGIONS:
        fwd, _, kind, what = REGIONS[name[len("inference_"):]]
        return fwd, None, kind, what
    return None
