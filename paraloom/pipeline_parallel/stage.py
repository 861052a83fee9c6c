"""Which layers live where: the split of ``L`` layers over ``p`` pipeline stages and ``v`` chunks.

Pure functions (no processes), shared by the model builder, the schedules and the tests.

Without interleaving stage ``r`` holds the contiguous block ``[r*L/p, (r+1)*L/p)``. With ``v``
virtual stages (chunks) per rank, Megatron's interleaved assignment cuts the stack into ``p*v``
equal pieces and deals them round-robin over the ranks: chunk ``c`` of stage ``r`` is piece
``c*p + r``, i.e. layers ``[(c*p + r) * L/(p*v), (c*p + r + 1) * L/(p*v))``. A microbatch then
visits rank 0, 1, ..., p-1, 0, 1, ... — ``v`` times around the ring — which is what shrinks the
bubble by ``v``.

Roles: the first *virtual* stage (rank 0, chunk 0) owns the embedding, the last (rank p-1,
chunk v-1) owns the output layer and the loss. Layer names are global (``layers.7``) whatever the
split, so the counter-based initializer and checkpoints see the same names in every layout.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StageRole", "layer_range", "stage_layers", "stage_role", "virtual_stage",
           "owner_of_layer", "layer_names"]


def _check(num_layers: int, pp: int, vpp: int, pp_rank: int | None = None,
           chunk: int | None = None) -> int:
    """Validate the split and return the number of layers per chunk ``L / (p*v)``."""
    for name, value in (("num_layers", num_layers), ("pp", pp), ("vpp", vpp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if num_layers % (pp * vpp):
        raise ValueError(f"num_layers = {num_layers} is not divisible by pp * vpp = {pp} * {vpp} "
                         f"= {pp * vpp}; use a multiple of {pp * vpp} layers or other pp/vpp")
    if pp_rank is not None and not 0 <= pp_rank < pp:
        raise ValueError(f"pipeline rank {pp_rank} is outside 0..{pp - 1} (pp = {pp})")
    if chunk is not None and not 0 <= chunk < vpp:
        raise ValueError(f"chunk {chunk} is outside 0..{vpp - 1} (vpp = {vpp})")
    return num_layers // (pp * vpp)


def virtual_stage(pp: int, pp_rank: int, chunk: int = 0) -> int:
    """Position of (rank, chunk) along the model: ``chunk * pp + pp_rank``."""
    return chunk * pp + pp_rank


def layer_range(num_layers: int, pp: int, pp_rank: int, vpp: int = 1, chunk: int = 0) -> range:
    """Global indices of the layers of ``chunk`` on stage ``pp_rank``.

    >>> layer_range(8, 2, 1, vpp=2, chunk=0)
    range(2, 4)
    """
    per_chunk = _check(num_layers, pp, vpp, pp_rank, chunk)
    start = virtual_stage(pp, pp_rank, chunk) * per_chunk
    return range(start, start + per_chunk)


def stage_layers(num_layers: int, pp: int, pp_rank: int, vpp: int = 1) -> list[range]:
    """The layer ranges of every chunk of stage ``pp_rank`` (one range without interleaving)."""
    return [layer_range(num_layers, pp, pp_rank, vpp, c) for c in range(vpp)]


def owner_of_layer(layer: int, num_layers: int, pp: int, vpp: int = 1) -> tuple[int, int]:
    """``(pp_rank, chunk)`` holding global layer ``layer``."""
    per_chunk = _check(num_layers, pp, vpp)
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} is outside 0..{num_layers - 1}")
    piece = layer // per_chunk
    return piece % pp, piece // pp


def layer_names(num_layers: int, pp: int, pp_rank: int, vpp: int = 1, chunk: int = 0,
                prefix: str = "layers") -> list[str]:
    """Global module names of the chunk's layers, e.g. ``["layers.6", "layers.7"]``."""
    return [f"{prefix}.{i}" for i in layer_range(num_layers, pp, pp_rank, vpp, chunk)]


@dataclass(frozen=True)
class StageRole:
    """What one (stage, chunk) owns besides its layers."""

    pp_rank: int
    chunk: int
    layers: range
    """Global layer indices of this chunk."""
    is_first: bool
    """First virtual stage: owns the (word + position) embedding and reads the data."""
    is_last: bool
    """Last virtual stage: owns the final norm, the output layer and the loss."""

    @property
    def has_embedding(self) -> bool:
        return self.is_first

    @property
    def has_loss(self) -> bool:
        return self.is_last


def stage_role(num_layers: int, pp: int, pp_rank: int, vpp: int = 1, chunk: int = 0) -> StageRole:
    """The layers and the roles of ``chunk`` on stage ``pp_rank``.

    >>> stage_role(8, 4, 3).is_last, stage_role(8, 4, 3, vpp=2, chunk=0).is_last
    (True, False)
    """
    layers = layer_range(num_layers, pp, pp_rank, vpp, chunk)
    vs = virtual_stage(pp, pp_rank, chunk)
    return StageRole(pp_rank, chunk, layers, is_first=vs == 0, is_last=vs == pp * vpp - 1)
