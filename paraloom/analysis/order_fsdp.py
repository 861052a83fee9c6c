"""Megatron-FSDP's rows of ``paraloom plan --table`` (:mod:`.order`), placed at its hooks.

``where`` names the hook point the order walks past: ``embedding``, ``layers.i``,
``final_layernorm``, ``output_layer`` before those modules' forward (``forward``) or before a
layer's backward (``backward``); ``after layers.i`` once a layer's backward is done; ``end`` once
a microbatch's backward is done; ``optimizer`` after the update. What comes there:

* ``no_shard``, ``optim``: every bucket's reduction at the ``end`` of the last microbatch;
  ``optim_grads``: at the ``end`` of every microbatch; ``optim``, ``optim_grads``: the first
  forward's unsharding gathers before the ``embedding`` (:func:`.order_dp.unshard_rows`);
* ``optim_grads_params`` (ZeRO-3): the parameter gathers :func:`.fsdp_formulas.
  zero3_gather_events` replays, each at its hook; each layer's reduce-scatter ``after`` its
  backward, the rest of the model's at the ``end``, every microbatch.
"""

from __future__ import annotations

from dataclasses import replace

from .fsdp_formulas import zero3_gather_events
from .layout import chunk_groups
from .order_dp import bucket_rows, unshard_rows

__all__ = ["FsdpRows"]

_SPLIT = "parameter bucket, 1/dp contiguous shard"


class FsdpRows:
    """The Megatron-FSDP rows of one rank's step 1 (pp = 1), by hook point."""

    def __init__(self, cfg, c, rank_cp: int, item: int) -> None:
        self.cfg, self.cp, self.item = cfg, rank_cp, item
        self.groups = [([b.numel for b in g], g[0].expert, g[0].names)
                       for g in chunk_groups(c, 0, 0)]
        self.zero3 = cfg.data_parallel_sharding_strategy == "optim_grads_params"
        self.gathers: dict[tuple, list[dict]] = {}
        step_one = replace(c, first_step=True)  # the table is the process's first step
        for phase, where, shape, nbytes, mb in zero3_gather_events(step_one) if self.zero3 \
                else ():
            site = "DistributedOptimizer.step:param_shards" if phase == "optimizer" else \
                f"FullyShardedDataParallel.{phase}:param_unshard"
            again = phase == "recompute"  # a re-run's forward hook (full recomputation)
            self.gathers.setdefault((mb, "forward" if again else phase, where), []).append(dict(
                kind="dp", op="all_gather", site=site.replace("recompute", "forward"),
                split=_SPLIT, shape=shape, bytes=nbytes, **{"async": True},
                **({"recompute": True} if again else {})))

    def rows(self, mb: int, phase: str, where: str) -> list[dict]:
        """The rows at hook point ``where`` of microbatch ``mb`` (``phase`` as the ledger's)."""
        cfg, last = self.cfg, mb == self.cfg.num_microbatches - 1
        dense = [g for g in self.groups if not g[1]]
        reduce = last or cfg.data_parallel_sharding_strategy in ("optim_grads",  # ZeRO-2, 3:
                                                                 "optim_grads_params")  # each
        if where.startswith("experts layers."):  # an expert bucket completes with its lowest
            layer = int(where.split(".")[1])    # layer's experts' backward
            return self._reductions([g for g in self.groups if g[1]
                                     and _lowest_layer(g[2]) == layer], last) if reduce else []
        if self.zero3:
            if where.startswith("after layers."):
                unit = where.removeprefix("after ")
                return self._reductions([g for g in dense if g[2][0].startswith(unit + ".")],
                                        last)
            if where == "end":
                return self._reductions([g for g in dense
                                         if not g[2][0].startswith("layers.")], last)
            return self.gathers.get((mb, phase, where), [])
        if where == "embedding" and mb == 0:
            return unshard_rows(cfg, [g[:2] for g in self.groups], self.cp, self.item)
        if where == "end" and reduce:
            return self._reductions(dense, last)
        return []

    def _reductions(self, groups: list, last: bool) -> list[dict]:
        """The groups' reductions; across the optimizer instances after the ``last``
        microbatch's."""
        return bucket_rows(self.cfg, [g[:2] for g in groups], self.cp, "backward", across=last)


def _lowest_layer(names: tuple) -> int:
    """The lowest transformer layer a bucket's parameters belong to (the last its backward
    reaches)."""
    return min(int(n.split(".")[1]) for n in names if n.startswith("layers."))
