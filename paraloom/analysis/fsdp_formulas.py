"""Megatron-FSDP's ZeRO-3 (``optim_grads_params``) parameter gathers of one step, as the formulas
and the order table count them: :func:`~paraloom.data_parallel.fsdp_unshard_plan.zero3_gathers`
replayed over the chunk's buckets (:func:`~.layout.chunk_groups`)."""

from __future__ import annotations

from ..data_parallel.fsdp_unshard_plan import group_order, zero3_gathers
from .layout import chunk_groups, chunk_params
from .spec import CommConfig

__all__ = ["zero3_gather_events"]

_REST = {"embedding": ("embedding.",), "final_layernorm": ("final_layernorm.",),
         "output_layer": ("output_layer.",)}
"""The modules outside the transformer layers with parameters of their own, in forward order
around them, and the name prefixes of those parameters."""


def zero3_gather_events(c: CommConfig, r: int = 0) -> list[tuple[str, str, list[int], int, int]]:
    """``(phase, where, shape, bytes, microbatch)`` of each parameter all-gather of one train
    step on pipeline rank ``r`` (pp = 1), in order: a ``1/dp`` piece of one bucket each.
    ``where``: the module whose hook gathers (``layers.i``, ``embedding``, ...) or
    ``optimizer``."""
    buckets = _megatron_order(c, r, [g[0] for g in chunk_groups(c, r, 0)])
    units: dict[int, list[int]] = {}
    rest: dict[str, list[int]] = {}
    for b, bucket in enumerate(buckets):
        for name in bucket.names:
            if name.startswith("layers."):
                units.setdefault(int(name.split(".")[1]), []).append(b)
                continue
            module = next(m for m, prefixes in _REST.items() if name.startswith(prefixes))
            rest.setdefault(module, []).append(b)
    layers = [sorted(set(units[i])) for i in sorted(units)]
    rest = {m: sorted(set(ids)) for m, ids in rest.items()}
    sizes = [b.numel for b in buckets]
    dp = c.dp * c.cp // c.instances  # sharded within an optimizer instance's block
    over = [dp // c.moe.ep if b.expert else dp for b in buckets]  # experts: over edp
    return [(phase, where, [sizes[b] // over[b]], sizes[b] // over[b] * c.dtype_bytes, mb)
            for phase, b, where, mb in zero3_gathers(sizes, layers, rest, c.num_microbatches,
                                                     c.first_step, c.recompute == "full")
            if over[b] > 1]


def _megatron_order(c: CommConfig, r: int, buckets: list) -> list:
    """Megatron-FSDP's bucket order (:func:`~paraloom.data_parallel.fsdp_unshard_plan.
    group_order`, as the runtime's)."""
    index = {p.name: i for i, p in enumerate(chunk_params(c, r, 0))}

    def group(bucket):
        name = bucket.names[0]
        return bucket.expert, int(name.split(".")[1]) if name.startswith("layers.") else None
    order = group_order([(group(b), [index[n] for n in b.names]) for b in buckets])
    return [buckets[k] for k in order]
