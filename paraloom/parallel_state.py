"""Megatron-named accessors on the current :class:`~paraloom.mesh.ParallelMesh`.

For people who know Megatron-LM's ``parallel_state``: call :func:`initialize_model_parallel` once,
then ask ``get_tensor_model_parallel_world_size()`` and friends. paraloom's own code passes the mesh
(or an axis) explicitly; this module only remembers the mesh it built.
"""

from __future__ import annotations

from .mesh import ParallelMesh

__all__ = [
    "initialize_model_parallel", "destroy_model_parallel", "model_parallel_is_initialized",
    "get_mesh", "get_tensor_model_parallel_world_size", "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_group", "get_pipeline_model_parallel_world_size",
    "get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_group",
    "get_data_parallel_world_size", "get_data_parallel_rank", "get_data_parallel_group",
    "get_embedding_group", "is_pipeline_first_stage", "is_pipeline_last_stage",
    "get_pipeline_model_parallel_next_rank", "get_pipeline_model_parallel_prev_rank",
    "get_virtual_pipeline_model_parallel_world_size", "get_virtual_pipeline_model_parallel_rank",
    "set_virtual_pipeline_model_parallel_rank", "get_context_parallel_world_size",
    "get_context_parallel_rank", "get_context_parallel_group",
    "get_expert_model_parallel_world_size", "get_expert_model_parallel_rank",
    "get_expert_model_parallel_group", "get_expert_data_parallel_world_size",
    "get_expert_data_parallel_rank", "get_expert_data_parallel_group",
    "get_data_modulo_expert_parallel_group",
]

_MESH: ParallelMesh | None = None
_VIRTUAL_RANK: int | None = None


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              data_parallel_size: int | None = None,
                              virtual_pipeline_model_parallel_size: int | None = None,
                              context_parallel_size: int = 1,
                              expert_model_parallel_size: int = 1) -> ParallelMesh:
    """Build the groups (tensor fastest, then context, data, pipeline) and make them current.

    ``data_parallel_size`` defaults to ``world_size // (tp * cp * pp)``, as in Megatron;
    ``expert_model_parallel_size`` (ep) is carved out of the data-parallel (x cp) ranks.
    """
    global _MESH
    import torch.distributed as dist

    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    if data_parallel_size is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world % (tp * cp * pp):
            raise ValueError(f"world size {world} is not divisible by tp*cp*pp = "
                             f"{tp}*{cp}*{pp}")
        data_parallel_size = world // (tp * cp * pp)
    _MESH = ParallelMesh(tp=tp, pp=pp, dp=data_parallel_size,
                         vpp=virtual_pipeline_model_parallel_size, cp=cp,
                         ep=expert_model_parallel_size)
    return _MESH


def destroy_model_parallel() -> None:
    global _MESH, _VIRTUAL_RANK
    _MESH, _VIRTUAL_RANK = None, None


def model_parallel_is_initialized() -> bool:
    return _MESH is not None


def get_mesh() -> ParallelMesh:
    """The current mesh; raises if :func:`initialize_model_parallel` was not called."""
    if _MESH is None:
        raise RuntimeError("model parallel is not initialised: call initialize_model_parallel()")
    return _MESH


def get_tensor_model_parallel_world_size() -> int:
    return get_mesh().tp.size


def get_tensor_model_parallel_rank() -> int:
    return get_mesh().tp.rank


def get_tensor_model_parallel_group():
    return get_mesh().tp.group


def get_pipeline_model_parallel_world_size() -> int:
    return get_mesh().pp.size


def get_pipeline_model_parallel_rank() -> int:
    return get_mesh().pp.rank


def get_pipeline_model_parallel_group():
    return get_mesh().pp.group


def get_data_parallel_world_size() -> int:
    return get_mesh().dp.size


def get_data_parallel_rank() -> int:
    return get_mesh().dp.rank


def get_data_parallel_group():
    return get_mesh().dp.group


def get_context_parallel_world_size() -> int:
    return get_mesh().cp.size


def get_context_parallel_rank() -> int:
    return get_mesh().cp.rank


def get_context_parallel_group():
    return get_mesh().cp.group


def get_embedding_group():
    return get_mesh().emb.group


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return get_mesh().config.vpp


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    return _VIRTUAL_RANK


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    global _VIRTUAL_RANK
    _VIRTUAL_RANK = rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """First stage (and, with interleaving, first model chunk unless ``ignore_virtual``)."""
    mesh = get_mesh()
    if not ignore_virtual and mesh.config.vpp and _VIRTUAL_RANK not in (None, 0):
        return False
    return mesh.is_first_stage


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """Last stage (and, with interleaving, last model chunk unless ``ignore_virtual``)."""
    mesh = get_mesh()
    if not ignore_virtual and mesh.config.vpp and _VIRTUAL_RANK not in (None, mesh.vpp - 1):
        return False
    return mesh.is_last_stage


def get_pipeline_model_parallel_next_rank() -> int:
    return get_mesh().next_rank


def get_pipeline_model_parallel_prev_rank() -> int:
    return get_mesh().prev_rank


def get_expert_model_parallel_world_size() -> int:
    return get_mesh().ep.size


def get_expert_model_parallel_rank() -> int:
    return get_mesh().ep.rank


def get_expert_model_parallel_group():
    return get_mesh().ep.group


def get_expert_data_parallel_world_size() -> int:
    return get_mesh().edp.size


def get_expert_data_parallel_rank() -> int:
    return get_mesh().edp.rank


def get_expert_data_parallel_group():
    return get_mesh().edp.group


def get_data_modulo_expert_parallel_group():
    """Megatron-Core's older name for :func:`get_expert_data_parallel_group`."""
    return get_mesh().edp.group
