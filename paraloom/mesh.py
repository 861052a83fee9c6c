"""ParallelMesh: the (pp, dp, cp, tp) rank grid and one process group per axis.

Rank order is Megatron's default (tp-cp-dp-pp): tensor fastest, then context, data, pipeline::

    rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank

so the ranks of a tensor-parallel group are neighbours (same node, fastest links), and pipeline
stages are the furthest apart. ``mesh.tp``, ``mesh.dp``, ``mesh.pp`` and ``mesh.emb`` are
:class:`Axis` handles carrying the group, its size, this rank's index in it and its global ranks.
``mesh.tp_cp`` holds the tp x cp ranks of one sequence.
``mesh.emb`` is the embedding group: the first and the last pipeline stage of this (dp, tp) column,
over which the tied word-embedding gradients are all-reduced. ``mesh.cp`` holds the ranks sharing
one sequence (context parallelism); ``mesh.dp_cp`` is Megatron's data-parallel group "with context
parallel" (the dp x cp ranks holding the same model shard), over which gradients are reduced. With
``cp == 1`` it is the dp group itself. ``mesh.mp`` is Megatron's model-parallel group (the tp x pp
ranks holding one replica of the model), over which the gradient norm is summed and the step's
update flag and norm are agreed.

The grid itself (:mod:`paraloom.grid`: :func:`rank_groups` and the others) is pure logic, tested
without processes.

Expert parallelism (:func:`expert_rank_groups`) is carved out of the data-parallel ranks (times
context parallelism), as in Megatron-Core: of the ``dp * cp`` ranks that share a (pp, tp)
position, consecutive blocks of ``ep`` form ``mesh.ep`` (the experts are divided over them and
tokens are exchanged by all-to-all), and the ranks at the same place in every block form
``mesh.edp`` (expert-data-parallel, size ``dp * cp / ep``: replicas of the same experts, over
which expert gradients are reduced). ``ep = 1`` gives size-1 ep groups and ``edp == dp``.

Megatron's partial distributed optimizer (``--num-distributed-optimizer-instances N``,
:func:`instance_rank_groups`, built on demand by :meth:`ParallelMesh.optimizer_instances`) splits
each dp x cp group (and each edp group) into ``N`` consecutive blocks: a block (``dp_intra``,
``edp_intra``) shards the optimizer, the ranks at the same place in every block (``dp_inter``,
``edp_inter``) all-reduce their shards, and ``distopt`` is one instance's ranks (every rank whose
dp x cp index lies in its block: the grad norm's group).

Megatron's hierarchical context parallelism (``--hierarchical-context-parallel-sizes A B``,
:func:`hierarchical_cp_rank_groups`) adds ``mesh.cp_a2a`` (A consecutive cp ranks) and
``mesh.cp_p2p`` (the cp ranks A apart); ``mesh.cp_levels`` is the pair, ``None`` without.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from .config import ParallelConfig
from .grid import (
    expert_rank_groups,
    hierarchical_cp_rank_groups,
    instance_rank_groups,
    rank_coords,
    rank_groups,
)

__all__ = ["Axis", "ParallelMesh", "rank_groups", "rank_coords", "expert_rank_groups",
           "instance_rank_groups", "hierarchical_cp_rank_groups", "world_axis"]


@dataclass(frozen=True)
class Axis:
    """One parallel dimension as seen from this rank."""

    name: str
    """``tp``, ``dp``, ``pp`` or ``emb``."""
    ranks: tuple[int, ...]
    """Global ranks of this rank's group, in group order."""
    rank: int
    """This rank's index inside ``ranks`` (-1 if it is not a member, e.g. a middle stage in
    emb)."""
    group: object = field(default=None, repr=False, compare=False)
    """The ``torch.distributed`` process group; ``None`` for a size-1 axis (nothing to
    communicate)."""

    @property
    def size(self) -> int:
        return len(self.ranks)


def world_axis() -> Axis:
    """Every rank of the initialised world as one :class:`Axis` (for setup before, or without,
    a :class:`ParallelMesh`)."""
    world = dist.get_world_size()
    return Axis("world", tuple(range(world)), dist.get_rank(),
                dist.group.WORLD if world > 1 else None)


class ParallelMesh:
    """Process groups for a (tp, pp, dp) layout; build it on every rank, in the same order.

    Without an initialised ``torch.distributed`` (a single process), only the 1x1x1 layout is
    valid and every axis has size 1, so layers run with no communication at all.
    """

    def __init__(self, config: ParallelConfig | None = None, *, tp: int = 1, pp: int = 1,
                 dp: int = 1, vpp: int | None = None, cp: int = 1, ep: int = 1) -> None:
        self.config = config or ParallelConfig(tp=tp, pp=pp, dp=dp, vpp=vpp, cp=cp, ep=ep)
        cfg = self.config
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        self.rank = dist.get_rank() if distributed else 0
        if cfg.world_size != world:
            raise ValueError(f"tp*cp*pp*dp = {cfg.tp}*{cfg.cp}*{cfg.pp}*{cfg.dp} = "
                             f"{cfg.world_size} does not match the world size {world}; choose "
                             f"sizes whose product is {world}")
        self.world_size = world
        self.axes: dict[str, Axis] = {}
        self._made: dict[tuple[int, ...], object] = {}  # a group with the same ranks: made once
        self._distributed = distributed
        self._instances: dict[int, dict[str, Axis]] = {}
        self._add_axes({**rank_groups(cfg.tp, cfg.pp, cfg.dp, cfg.cp),
                        **expert_rank_groups(cfg.tp, cfg.pp, cfg.dp, cfg.ep, cfg.cp)}, self.axes)
        if cfg.cp == 1:
            self.axes["dp_cp"] = self.axes["dp"]
        if cfg.cp_sizes and len(cfg.cp_sizes) == 2 and cfg.cp > 1:  # Megatron makes them if given
            self._add_axes(hierarchical_cp_rank_groups(cfg.tp, cfg.pp, cfg.dp, cfg.cp,
                                                       cfg.cp_sizes[0]), self.axes)
        world_group = dist.group.WORLD if distributed and world > 1 else None
        self.axes["world"] = Axis("world", tuple(range(world)), self.rank, world_group)

    def _add_axes(self, every: dict[str, list[tuple[int, ...]]], into: dict[str, Axis]) -> None:
        for name, groups in every.items():
            mine = None
            for ranks in groups:  # every rank creates every group, in the same order
                if self._distributed and len(ranks) > 1 and ranks not in self._made:
                    self._made[ranks] = dist.new_group(list(ranks))
                pg = self._made.get(ranks)
                if self.rank in ranks:
                    mine = Axis(name, ranks, ranks.index(self.rank), pg)
            if mine is None:  # emb: a middle pipeline stage is in no embedding group
                mine = Axis(name, (), -1, None)
            into[name] = mine

    def optimizer_instances(self, n: int) -> dict[str, Axis]:
        """The axes of ``n`` distributed-optimizer instances (:func:`instance_rank_groups`),
        made on first use: every rank must ask for the same ``n`` at the same point. ``n = 1``:
        ``dp_intra`` is ``dp_cp``, ``edp_intra`` is ``edp``, the inter axes have size 1 and
        ``distopt`` is the world."""
        if n not in self._instances:
            if n == 1:
                one = Axis("dp_inter", (self.rank,), 0, None)
                self._instances[1] = dict(dp_intra=self.dp_cp, edp_intra=self.edp,
                                          dp_inter=one, edp_inter=one, distopt=self.world)
            else:
                c = self.config
                axes: dict[str, Axis] = {}
                self._add_axes(instance_rank_groups(c.tp, c.pp, c.dp, n, c.cp, c.ep), axes)
                self._instances[n] = axes
        return self._instances[n]

    tp = property(lambda self: self.axes["tp"], doc="Tensor-parallel axis.")
    dp = property(lambda self: self.axes["dp"], doc="Data-parallel axis.")
    pp = property(lambda self: self.axes["pp"], doc="Pipeline axis (stage = ``mesh.pp.rank``).")
    cp = property(lambda self: self.axes["cp"], doc="Context-parallel axis (one sequence).")
    cp_a2a = property(lambda self: self.axes["cp_a2a"],
                      doc="Hierarchical cp level 0: consecutive cp ranks (a2a+p2p's all-to-all).")
    cp_p2p = property(lambda self: self.axes["cp_p2p"],
                      doc="Hierarchical cp level 1: cp ranks a level-0 size apart (the ring).")
    dp_cp = property(lambda self: self.axes["dp_cp"],
                     doc="Data-parallel x context-parallel axis: where gradients are reduced.")
    emb = property(lambda self: self.axes["emb"], doc="Embedding group (first + last stage).")
    mp = property(lambda self: self.axes["mp"],
                  doc="Model-parallel axis (tp x pp: one model replica): the grad norm's group.")
    world = property(lambda self: self.axes["world"], doc="Every rank (the step's scalars).")
    ep = property(lambda self: self.axes["ep"], doc="Expert-parallel axis (experts divided).")
    edp = property(lambda self: self.axes["edp"],
                   doc="Expert-data-parallel axis (replicas of this rank's experts).")
    tp_ep = property(lambda self: self.axes["tp_ep"],
                     doc="tp x ep: the MoE token dispatcher's counts are gathered over it.")
    tp_cp = property(lambda self: self.axes["tp_cp"],
                     doc="tp x cp: one sequence's ranks (the MoE aux loss's token counts).")
    tp_ep_pp = property(lambda self: self.axes["tp_ep_pp"],
                        doc="tp x ep x pp: one replica of every expert (their grad norm).")

    @property
    def cp_levels(self) -> tuple[Axis, Axis] | None:
        """``(cp_a2a, cp_p2p)`` with two hierarchical cp levels, else ``None``."""
        return (self.cp_a2a, self.cp_p2p) if "cp_a2a" in self.axes else None

    @property
    def vpp(self) -> int:
        """Virtual stages (chunks) per pipeline rank; 1 without interleaving."""
        return self.config.vpp or 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next pipeline stage (wrapping around, as Megatron does)."""
        return self.pp.ranks[(self.pp.rank + 1) % self.pp.size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (wrapping around)."""
        return self.pp.ranks[(self.pp.rank - 1) % self.pp.size]

    def __repr__(self) -> str:
        c = self.config
        cp = f", cp={c.cp}" if c.cp > 1 else ""
        cp_rank = f", cp_rank={self.cp.rank}" if c.cp > 1 else ""
        return (f"ParallelMesh(rank={self.rank}, tp={c.tp}{cp}, pp={c.pp}, dp={c.dp}, "
                f"vpp={c.vpp}; tp_rank={self.tp.rank}{cp_rank}, dp_rank={self.dp.rank}, "
                f"pp_rank={self.pp.rank})")
