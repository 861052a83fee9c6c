"""Megatron-FSDP's gradient buffer layout: which parameters share a bucket, and where each sits.

megatron-core 0.19's Megatron-FSDP (``megatron_fsdp/param_and_grad_buffer.py``: its parameter
groups and ``build_data_parallel_buffer_index``) lays buffers out differently from its
``DistributedDataParallel`` (:func:`paraloom.data_parallel.grad_buffer.bucket_layout`), and the
sizes it communicates follow from that layout:

* parameters grouped by FSDP unit (under ``optim_grads_params`` each transformer layer is one;
  the rest of the model is one group, whatever its place), groups in the order of their first
  parameter, each in *registration* (forward) order; a unit is one bucket; outside the units a
  bucket closes once it holds at least ``bucket_size`` elements (``None``, Megatron-LM's default
  ``--ddp-bucket-size``: no limit), and under a sharding strategy a parameter marked
  ``shared_embedding`` gets a bucket of its own;
* inside a bucket the parameters are ordered by their row size (the product of every dimension
  but the first; 1 for vectors), largest first, and the bucket has a *chunk size*: the first
  one's row size, widened to the least common multiple with the row size of any later parameter
  that neither divides it, nor has a multiple of it as its size, nor is smaller than it;
* parameters smaller than the chunk ("fragments") fill the gaps that a larger parameter whose
  size is not a multiple of the chunk leaves at the end of its last chunk (after a second such
  parameter whose remainder fits there has been put beside it), the rest go at the end;
* a sharded bucket (every strategy but ``no_shard``) is padded to a multiple of
  ``dp x chunk``, so each rank owns an equal contiguous piece; ``no_shard`` pads nothing.

The offsets are what the gradients' reduction and the optimizer's shards cut; the collective
sizes are the padded bucket sizes.
"""

from __future__ import annotations

import math

__all__ = ["fsdp_layout"]


def fsdp_layout(params: list[tuple], bucket_size: int | None, *,
                shard_over: int = 1, sharded: bool = False
                ) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """Cut ``params``, given in registration order as ``(numel, row, shared_embedding)`` or
    ``(numel, row, shared_embedding, unit)`` (``unit``: its FSDP unit's number, ``None``
    outside), into Megatron-FSDP's buckets: ``(start, end, members)`` per bucket, buffer offsets
    (``end`` padded), ``members`` the ``(index, start, end)`` of each parameter in buffer order.

    ``sharded``: the bucket is sharded over ``shard_over`` ranks (padded to ``shard_over x
    chunk``; a shared embedding alone). Pure: the analysis replays it.
    """
    out: list[tuple[int, int, list[tuple[int, int, int]]]] = []
    start = 0
    for members in _buckets(params, bucket_size, sharded):
        placed, size, chunk = _place([(i, *params[i][:2]) for i in members])
        if sharded:
            size = -(-size // (shard_over * chunk)) * (shard_over * chunk)
        out.append((start, start + size,
                    sorted((i, start + lo, start + hi) for i, lo, hi in placed)))
        start += size
    for k, (lo, hi, members) in enumerate(out):
        out[k] = (lo, hi, sorted(members, key=lambda m: m[1]))
    return out


def _buckets(params, bucket_size: int | None, sharded: bool) -> list[list[int]]:
    """Indices of each bucket: the groups (by unit) in order of their first parameter,
    registration order kept inside."""
    groups: dict = {}
    for i, param in enumerate(params):
        groups.setdefault(param[3] if len(param) > 3 else None, []).append(i)
    buckets: list[list[int]] = []
    for unit, members in groups.items():
        current: list[int] = []
        held = 0
        for i in members:
            numel, _, shared = params[i][:3]
            if sharded and shared:  # its own bucket: first and last stage shard it alike
                if current:
                    buckets.append(current)
                buckets.append([i])
                current, held = [], 0
                continue
            current.append(i)
            held += numel
            if unit is None and bucket_size is not None and held >= bucket_size:
                buckets.append(current)
                current, held = [], 0
        if current:
            buckets.append(current)
    return buckets


def _chunk(items: list[tuple[int, int, int]]) -> int:
    """The bucket's chunk size over ``(index, numel, row)`` sorted by row, largest first."""
    chunk = items[0][2]
    for _, numel, row in items:
        fits = row == chunk or (chunk % row == 0 and numel % chunk == 0) or numel < chunk
        if not fits:
            chunk = math.lcm(chunk, row)
    return chunk


def _place(items: list[tuple[int, int, int]]) -> tuple[list[tuple[int, int, int]], int, int]:
    """Offsets inside one bucket: ``([(index, lo, hi)], unpadded size, chunk)``."""
    items = sorted(items, key=lambda it: -it[2])  # stable: registration order among equals
    chunk = _chunk(items)
    regular = [(i, n) for i, n, _ in items if n >= chunk]
    fragments = [(i, n) for i, n, _ in items if n < chunk]
    placed: list[tuple[int, int, int]] = []
    offset = 0
    while regular:
        i, numel = regular.pop(0)
        placed.append((i, offset, offset + numel))
        if numel % chunk == 0:
            offset += numel
            continue
        gap = offset + numel  # where this parameter's last chunk leaves room
        offset += (numel // chunk + 1) * chunk
        space = chunk - numel % chunk
        partner = next((r for r in regular if r[1] % chunk
                        and numel % chunk + r[1] % chunk <= chunk), None)
        if partner is not None:  # its remainder ends the same chunk, its full chunks follow
            regular.remove(partner)
            j, other = partner
            placed.append((j, offset - other % chunk, offset - other % chunk + other))
            space -= other % chunk
            offset += other // chunk * chunk
        for frag in list(fragments):
            if frag[1] <= space:
                placed.append((frag[0], gap, gap + frag[1]))
                space -= frag[1]
                gap += frag[1]
                fragments.remove(frag)
    for i, numel in fragments:
        placed.append((i, offset, offset + numel))
        offset += numel
    return placed, offset, chunk
