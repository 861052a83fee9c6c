"""The rank grid, as pure logic (no process groups): which global ranks form each group of a
layout, in Megatron's rank order (tp-cp-dp-pp, tensor fastest). :mod:`paraloom.mesh` makes the
process groups from these lists; the tests read them without processes.
"""

from __future__ import annotations

__all__ = ["rank_groups", "rank_coords", "expert_rank_groups", "instance_rank_groups",
           "hierarchical_cp_rank_groups"]


def _levels(groups: list[tuple[int, ...]], size: int) -> tuple[list, list]:
    """Each group cut into consecutive blocks of ``size`` ranks, and the ranks at one place in
    every block (``size`` apart): Megatron's two levels of a hierarchical group."""
    inner = [g[i:i + size] for g in groups for i in range(0, len(g), size)]
    outer = [g[j::size] for g in groups for j in range(size)]
    return inner, outer


def rank_coords(rank: int, tp: int, pp: int, dp: int, cp: int = 1) -> tuple[int, ...]:
    """``(pp_rank, dp_rank, tp_rank)`` of a global rank; ``(pp, dp, cp, tp)`` ranks if
    ``cp > 1``."""
    world = tp * cp * pp * dp
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of tp*cp*pp*dp = "
                         f"{tp}*{cp}*{pp}*{dp} = {world}")
    coords = rank // (dp * cp * tp), (rank // (cp * tp)) % dp, (rank // tp) % cp, rank % tp
    return coords if cp > 1 else (coords[0], coords[1], coords[3])


def rank_groups(tp: int, pp: int, dp: int, cp: int = 1) -> dict[str, list[tuple[int, ...]]]:
    """Every group of every axis, in a fixed order that all ranks share.

    >>> rank_groups(2, 2, 1)["pp"]
    [(0, 2), (1, 3)]
    >>> rank_groups(1, 1, 2, cp=2)["dp_cp"]
    [(0, 1, 2, 3)]
    """
    def r(p: int, d: int, c: int, t: int) -> int:
        return ((p * dp + d) * cp + c) * tp + t

    P, D, C, T = range(pp), range(dp), range(cp), range(tp)
    groups = {
        "tp": [tuple(r(p, d, c, t) for t in T) for p in P for d in D for c in C],
        "dp": [tuple(r(p, d, c, t) for d in D) for p in P for c in C for t in T],
        "pp": [tuple(r(p, d, c, t) for p in P) for d in D for c in C for t in T],
        "cp": [tuple(r(p, d, c, t) for c in C) for p in P for d in D for t in T],
        "dp_cp": [tuple(r(p, d, c, t) for d in D for c in C) for p in P for t in T],
        "mp": [tuple(r(p, d, c, t) for p in P for t in T) for d in D for c in C],
        "tp_cp": [tuple(r(p, d, c, t) for c in C for t in T) for p in P for d in D],
    }
    groups["emb"] = [tuple(dict.fromkeys((g[0], g[-1]))) for g in groups["pp"]]
    return groups


def expert_rank_groups(tp: int, pp: int, dp: int, ep: int, cp: int = 1
                       ) -> dict[str, list[tuple[int, ...]]]:
    """The ``ep`` and ``edp`` groups (Megatron-Core's expert-model-parallel and expert-data-parallel
    groups): the ``dp * cp`` ranks at each (pp, tp) position, in rank order ``tp-cp-dp-pp``, split
    into consecutive blocks of ``ep``; ``tp_ep``, one block with its tp ranks (Megatron's
    ``tp_ep`` group: the token dispatcher's counts are gathered over it); and ``tp_ep_pp``, the
    ranks holding one replica of every expert (tp x ep x pp, Megatron's expert
    tensor-model-pipeline group: the experts' grad norm).

    >>> groups = expert_rank_groups(tp=1, pp=1, dp=4, ep=2)
    >>> groups["ep"], groups["edp"], groups["tp_ep_pp"]
    ([(0, 1), (2, 3)], [(0, 2), (1, 3)], [(0, 1), (2, 3)])
    """
    dp_cp = dp * cp
    if ep < 1 or dp_cp % ep:
        raise ValueError(f"ep = {ep} must divide dp * cp = {dp} * {cp} = {dp_cp} (expert "
                         f"parallelism is carved out of the data-parallel ranks)")

    def r(p: int, d: int, t: int) -> int:  # d: index in dp x cp (cp fastest)
        return p * dp_cp * tp + d * tp + t

    edp = dp_cp // ep
    return {
        "ep": [tuple(r(p, b * ep + e, t) for e in range(ep))
               for p in range(pp) for b in range(edp) for t in range(tp)],
        "edp": [tuple(r(p, b * ep + e, t) for b in range(edp))
                for p in range(pp) for e in range(ep) for t in range(tp)],
        "tp_ep_pp": [tuple(r(p, b * ep + e, t) for p in range(pp) for e in range(ep)
                           for t in range(tp)) for b in range(edp)],
        "tp_ep": [tuple(r(p, b * ep + e, t) for e in range(ep) for t in range(tp))
                  for p in range(pp) for b in range(edp)],
    }


def instance_rank_groups(tp: int, pp: int, dp: int, n: int, cp: int = 1, ep: int = 1
                         ) -> dict[str, list[tuple[int, ...]]]:
    """The groups of ``n`` distributed-optimizer instances (Megatron-Core's intra- and
    inter-instance groups): ``dp_intra`` / ``edp_intra`` cut every dp x cp / edp group into ``n``
    consecutive blocks, ``dp_inter`` / ``edp_inter`` take the ranks at one place in every block,
    ``distopt`` holds the ranks of one instance (sorted).

    >>> groups = instance_rank_groups(tp=1, pp=1, dp=4, n=2)
    >>> groups["dp_intra"], groups["dp_inter"], groups["distopt"]
    ([(0, 1), (2, 3)], [(0, 2), (1, 3)], [(0, 1), (2, 3)])
    """
    dp_cp = dp * cp
    if n < 1 or dp_cp % n or (dp_cp // ep) % n:
        raise ValueError(f"num_distributed_optimizer_instances = {n} must divide dp * cp = "
                         f"{dp_cp} and the expert-data-parallel size dp * cp / ep = "
                         f"{dp_cp // ep}")

    def split(groups: list[tuple[int, ...]]) -> tuple[list, list]:
        return _levels(groups, len(groups[0]) // n)

    dense, expert = rank_groups(tp, pp, dp, cp)["dp_cp"], expert_rank_groups(tp, pp, dp, ep, cp)
    out = dict(zip(("dp_intra", "dp_inter"), split(dense), strict=True))
    out.update(zip(("edp_intra", "edp_inter"), split(expert["edp"]), strict=True))
    block = dp_cp // n
    out["distopt"] = [tuple(sorted(r for r in range(tp * pp * dp_cp)
                                   if (r // tp) % dp_cp // block == i)) for i in range(n)]
    return out


def hierarchical_cp_rank_groups(tp: int, pp: int, dp: int, cp: int, inner: int
                                ) -> dict[str, list[tuple[int, ...]]]:
    """Megatron's two hierarchical context-parallel levels (``--hierarchical-context-parallel-
    sizes inner cp/inner``): ``cp_a2a``, every cp group cut into blocks of ``inner`` consecutive
    cp ranks (level 0: Ulysses' all-to-all under ``a2a+p2p``), and ``cp_p2p``, the cp ranks
    ``inner`` apart (level 1: the ring).

    >>> groups = hierarchical_cp_rank_groups(tp=1, pp=1, dp=1, cp=4, inner=2)
    >>> groups["cp_a2a"], groups["cp_p2p"]
    ([(0, 1), (2, 3)], [(0, 2), (1, 3)])
    """
    if inner < 1 or cp % inner:
        raise ValueError(f"the inner hierarchical cp size {inner} must divide cp = {cp}")
    return dict(zip(("cp_a2a", "cp_p2p"), _levels(rank_groups(tp, pp, dp, cp)["cp"], inner),
                    strict=True))
