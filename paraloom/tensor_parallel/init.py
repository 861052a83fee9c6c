"""Counter-based initialisation: the same model whatever the parallel layout.

Element ``(i, j)`` of a parameter is a pure function of ``(seed, the parameter's global name,
i, j)``: a 32-bit integer hash of the element's global linear index, keyed by a digest of the seed
and the name, turned into a normal sample by Box-Muller in float64. A rank evaluates it only on its
own index range, so it creates only its shard (never the full matrix), and the shards of any
tensor-parallel split assemble to exactly the tp=1 weight. Global names use global layer indices
(``layers.7.mlp.fc1.weight``), so pipeline splits agree too.

The hash is "lowbias32" (C. Wellons); every multiply is split into 16-bit halves so no step can
overflow int64, which keeps CPU and CUDA results bit-identical.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

__all__ = ["CounterInit", "counter_normal", "counter_uniform", "shard_range"]

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``0 <= x, c < 2**32`` without int64 overflow."""
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return x.mul_(c & 0xFFFF).add_(hi).bitwise_and_(_M32)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of a fresh int64 tensor holding values in [0, 2**32) (modified in place)."""
    x ^= x >> 16
    x = _mul32(x, 0x7FEB352D)
    x ^= x >> 15
    x = _mul32(x, 0x846CA68B)
    x ^= x >> 16
    return x


def _keys(seed: int, name: str) -> list[int]:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=16).digest()
    return [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)]


def _global_index(global_shape: tuple[int, ...], ranges: tuple[tuple[int, int], ...],
                  device) -> torch.Tensor:
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for size, (start, stop) in reversed(list(zip(global_shape, ranges, strict=True))):
        if not 0 <= start <= stop <= size:
            raise ValueError(f"index range {start}:{stop} is outside a dimension of size {size}")
        coord = torch.arange(start, stop, dtype=torch.int64, device=device) * stride
        index = coord.view(-1, *([1] * index.dim())) + index
        stride *= size
    return index


def _hash_index(index: torch.Tensor, k1: int, k2: int) -> torch.Tensor:
    h = _hash32((index & _M32) ^ k1)
    if index.numel() and int(index.max()) > _M32:  # the high word is 0 for most parameters
        h ^= index >> 32
    h ^= k2
    return _hash32(h)


def _to_unit(h: torch.Tensor) -> torch.Tensor:
    return (h.double() + 0.5) / 2.0**32  # in (0, 1), never 0 or 1


def _uniform(index: torch.Tensor, k1: int, k2: int) -> torch.Tensor:
    return _to_unit(_hash_index(index, k1, k2))


def counter_uniform(seed: int, name: str, global_shape, ranges=None, *,
                    device=None) -> torch.Tensor:
    """Uniform(0, 1) float64 values of ``name``'s elements in ``ranges`` (default: all)."""
    global_shape = tuple(global_shape)
    ranges = tuple(ranges) if ranges is not None else tuple((0, n) for n in global_shape)
    k = _keys(seed, name)
    return _uniform(_global_index(global_shape, ranges, device), k[0], k[1])


def counter_normal(seed: int, name: str, global_shape, ranges=None, *, mean: float = 0.0,
                   std: float = 1.0, dtype=torch.float32, device=None) -> torch.Tensor:
    """Normal(mean, std) values of ``name``'s elements in ``ranges``, cast to ``dtype``."""
    global_shape = tuple(global_shape)
    ranges = tuple(ranges) if ranges is not None else tuple((0, n) for n in global_shape)
    k = _keys(seed, name)
    index = _global_index(global_shape, ranges, device)
    h1 = _hash_index(index, k[0], k[1])
    u2 = _to_unit(_hash32(h1 ^ k[2]))
    z = _to_unit(h1).log_().mul_(-2.0).sqrt_().mul_(u2.mul_(2.0 * math.pi).cos_())
    return (z * std + mean).to(dtype)


def shard_range(global_shape, partition_dim: int, rank: int, world: int):
    """Index ranges of shard ``rank`` of ``world`` when ``global_shape`` is split on one dim."""
    ranges = [(0, n) for n in global_shape]
    size = global_shape[partition_dim] // world
    ranges[partition_dim] = (rank * size, (rank + 1) * size)
    return tuple(ranges)


@dataclass(frozen=True)
class CounterInit:
    """``init_method`` for paraloom layers: normal(0, std), evaluated on a shard only.

    ``std`` may be scaled per layer (Megatron's ``scaled_init_method_normal`` uses
    ``std / sqrt(2 * num_layers)`` for output projections).
    """

    seed: int = 1234
    std: float = 0.02

    def __call__(self, name: str, global_shape, ranges, *, dtype=torch.float32,
                 device=None) -> torch.Tensor:
        return counter_normal(self.seed, name, global_shape, ranges, std=self.std, dtype=dtype,
                              device=device)
