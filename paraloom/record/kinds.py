"""The ``kind`` of a recorded communication: which parallel dimension its group is.

In order: Megatron-Core's ``parallel_state`` groups (only when the program has already imported
``megatron.core.parallel_state``; nothing is imported for it: :data:`MEGATRON_GROUPS`, e.g. the
model-parallel group ``mp`` of the grad norm, the distributed optimizer's instance group
``distopt`` and, with several instances, ``dp`` for a block of the data-parallel ranks and
``dp_inter`` across the blocks), then the dimension names of the DeviceMeshes the program
built (DTensor, FSDP2; ``DeviceMesh`` objects are collected while the recorder is installed,
and a mesh group's ``group_desc`` — ``mesh_<dim>`` — names it otherwise), then ``world`` for
the default group,
else the group's global ranks, ``group[0,1]``. Groups are matched by their ``group_name``, which
identifies one process group, so two groups with the same ranks (Megatron's model-parallel and
tensor-parallel groups at pp=1) keep their own names.
"""

from __future__ import annotations

import sys
import weakref

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["KindResolver", "MEGATRON_GROUPS"]

MEGATRON_GROUPS = (  # (kind, getter, keyword arguments), first match wins
    ("tp", "get_tensor_model_parallel_group", {}),
    ("cp", "get_context_parallel_group", {}),
    ("cp", "get_hierarchical_context_parallel_groups", {}),  # a2a+p2p's levels: a list
    ("ep", "get_expert_model_parallel_group", {}),
    ("pp", "get_pipeline_model_parallel_group", {}),
    ("dp", "get_data_parallel_group", {}),
    ("dp", "get_data_parallel_group", {"with_context_parallel": True}),
    ("dp", "get_data_parallel_group", {"with_context_parallel": True,
                                       "partial_data_parallel": True}),
    ("dp_inter", "get_inter_distributed_optimizer_instance_group", {}),
    ("emb", "get_embedding_group", {}),
    ("emb", "get_position_embedding_group", {}),
    ("etp", "get_expert_tensor_parallel_group", {}),
    ("edp", "get_expert_data_parallel_group", {}),
    ("mp", "get_model_parallel_group", {}),
    ("distopt", "get_intra_distributed_optimizer_instance_group", {}),
    ("tp_ep", "get_expert_tensor_and_model_parallel_group", {}),
    ("tp_ep_pp", "get_expert_tensor_model_pipeline_parallel_group", {}),
)
"""Megatron-Core's parallel_state getters, by the ledger kind their group gets."""


def _names(group) -> list[str]:
    groups = group if isinstance(group, (list, tuple)) else [group]
    return [getattr(g, "group_name", None) for g in groups if g is not None]


def _is_world(name: str) -> bool:
    world = dist.group.WORLD if dist.is_initialized() else None
    return world is not None and getattr(world, "group_name", None) == name


class KindResolver:
    """``kind(group_name, group_desc, ranks)`` with a cache per group; collects DeviceMeshes
    while :meth:`install` is in effect."""

    def __init__(self) -> None:
        self._cache: dict[str, str] = {}
        self._meshes: list[weakref.ref] = []  # in creation order
        self._orig_init = None

    def install(self) -> None:
        orig = self._orig_init = DeviceMesh.__init__
        meshes = self._meshes

        def init(mesh, *args, **kwargs):
            orig(mesh, *args, **kwargs)
            meshes[:] = [m for m in meshes if m() is not None] + [weakref.ref(mesh)]
            self._cache.clear()

        DeviceMesh.__init__ = init

    def uninstall(self) -> None:
        if self._orig_init is not None:
            DeviceMesh.__init__ = self._orig_init
            self._orig_init = None

    def kind(self, name: str, desc: str, ranks: list[int]) -> str:
        cached = self._cache.get(name)
        if cached is not None:
            return cached
        kind, final = self._megatron(name)
        if kind is None:
            kind = self._mesh(name, desc)
        if kind is None and _is_world(name):
            kind = "world"
        if kind is None:
            kind = "group[" + ",".join(map(str, ranks)) + "]"
        if final:
            self._cache[name] = kind
        return kind

    def _megatron(self, name: str) -> tuple[str | None, bool]:
        """Megatron's kind of the group, and whether the answer is final (parallel_state is
        initialised; before that a group may still become one of its groups)."""
        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is None:
            return None, True
        try:
            ready = bool(ps.model_parallel_is_initialized())
        except Exception:  # noqa: BLE001 - a foreign module's state: never fail the program
            ready = False
        for kind, getter, kwargs in MEGATRON_GROUPS:
            fn = getattr(ps, getter, None)
            if fn is None:
                continue
            try:
                group = fn(check_initialized=False, **kwargs) if "check_initialized" in \
                    fn.__code__.co_varnames else fn(**kwargs)
            except Exception:  # noqa: BLE001 - an uninitialised group asserts
                continue
            if name in _names(group):
                return kind, True
        return None, ready

    def _mesh(self, name: str, desc: str) -> str | None:
        """The newest mesh first: 1-D meshes over the whole world share the default group, and
        the one built last is the one in use."""
        for ref in reversed(self._meshes):
            mesh = ref()
            if mesh is None:
                continue
            for dim, dim_name in enumerate(mesh.mesh_dim_names or ()):
                try:
                    if mesh.get_group(dim).group_name == name:
                        return dim_name
                except Exception:  # noqa: BLE001 - a mesh this rank is not part of
                    continue
        if desc.startswith("mesh_") and len(desc) > 5:
            return desc[5:]
        return None
