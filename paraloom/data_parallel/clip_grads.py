"""The global gradient norm and clipping, over the data-parallel wrappers' main grads.

Every parameter counts once in the global norm, wherever its copies live: a tensor-parallel
shard on every tp rank, a replicated parameter (norms, biases, positions) on tp rank 0 only, the
last stage's tied copy of the word embeddings not at all (the first stage counts it), and a
bucket on its data-parallel rank 0 after the all-reduce (every rank holds the same sum), or, with
the distributed optimizer, each rank its own shard of it. :class:`GradNorm` works out once which
contiguous stretches of the buffers that is, merging neighbours, so the norm is a few reductions
per bucket rather than one per parameter.

:meth:`GradNorm.local_sq_norm` is this rank's part of the squared norm; the caller sums it over
the world (together with whatever else it reduces then) and :meth:`GradNorm.clip` scales every
main grad if the total is above the limit.
"""

from __future__ import annotations

import torch

from ..mesh import ParallelMesh
from .ddp import DistributedDataParallel

__all__ = ["GradNorm"]


def _counts_once(param, mesh: ParallelMesh) -> bool:
    """Whether this rank's copy of ``param`` is its one counted copy in the global norm."""
    if getattr(param, "shared_embedding", False) and not mesh.is_first_stage:
        return False  # the last stage's tied copy: counted on the first stage
    return getattr(param, "tensor_model_parallel", False) or mesh.tp.rank == 0


class GradNorm:
    """The stretches of main grads this rank counts in the global norm (fixed for a run)."""

    def __init__(self, ddps: list[DistributedDataParallel], mesh: ParallelMesh, *,
                 sharded: bool) -> None:
        """``sharded``: each dp rank owns a shard of every bucket (the distributed optimizer)."""
        self.ddps = ddps
        self.pieces: list[tuple] = []  # (bucket, lo, hi), in buffer order
        for ddp in ddps:
            for bucket in ddp.buckets:
                axis = bucket.axis  # mesh.dp, or mesh.edp for experts (distinct over ep)
                if not sharded and axis.rank != 0:
                    continue  # replicated after the all-reduce: its rank 0 counts it
                lo, hi = bucket.shard(axis.rank, axis.size) if sharded else (0, bucket.numel)
                for param in bucket.params:  # in buffer order: offsets increase
                    if _counts_once(param, mesh):
                        _, a, b = ddp.param_range(param)
                        self._add(bucket, max(a, lo), min(b, hi))

    def _add(self, bucket, a: int, b: int) -> None:
        if a >= b:
            return
        last = self.pieces[-1] if self.pieces else None
        if last is not None and last[0] is bucket and last[2] == a:
            self.pieces[-1] = (bucket, last[1], b)
        else:
            self.pieces.append((bucket, a, b))

    def local_sq_norm(self, device: torch.device) -> torch.Tensor:
        """Sum of squared main grads this rank is responsible for: each stretch's fp32 norm
        (torch's reduction, no fp64 copy of the gradients), squared and summed in fp64."""
        grads = [bucket.grad[a:b] for bucket, a, b in self.pieces]
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=device)
        norms = torch.stack([torch.linalg.vector_norm(g) for g in grads])
        return norms.double().square().sum()

    def clip(self, total_norm: float, max_norm: float) -> bool:
        """Scale every main grad by ``max_norm / total_norm`` if ``total_norm`` exceeds
        ``max_norm > 0`` (torch's ``clip_grad_norm_`` rule, with its 1e-6); returns whether it
        clipped."""
        if not (max_norm > 0 and total_norm > max_norm):
            return False
        scale = max_norm / (total_norm + 1e-6)
        for ddp in self.ddps:
            for buf in ddp.buffers_:
                buf.grad.mul_(scale)
        return True
