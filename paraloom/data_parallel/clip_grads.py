"""The global gradient norm and clipping, over the data-parallel wrappers' main grads.

Every parameter counts once in the global norm, wherever its copies live: a tensor-parallel
shard on every tp rank, a replicated parameter (norms, biases, positions) on tp rank 0 only, the
last stage's tied copy of the word embeddings not at all (the first stage counts it); every
data-parallel replica computes the norm of its whole model replica (after the all-reduce they
hold the same gradients), or, with the distributed optimizer, each rank its own shard.
:class:`GradNorm` works out once which contiguous stretches of the buffers that is, merging
neighbours, so the norm is a few reductions per bucket rather than one per parameter.

:meth:`GradNorm.local_sq_norm` is this rank's part of the squared norm; :meth:`GradNorm.total`
sums it as Megatron-Core's ``get_grad_norm_fp32`` does, inside the optimizer step: one fp32 ``[1]``
all-reduce over the optimizer's grad-stats group — the model-parallel group ``mesh.mp`` (tp x pp,
kind ``mp``), or, with the distributed optimizer, the optimizer instance (every rank, or with
``--num-distributed-optimizer-instances N`` the ``1/N`` of them in this rank's instance; kind
``distopt``). Expert gradients (MoE) are a second optimizer in Megatron (its ``ChainedOptimizer``):
their part is a second ``[1]`` over tp x ep x pp (kind ``tp_ep_pp``; the instance with the
distributed optimizer), and the norm is the root of the two sums. In the first step only,
Megatron 0.19 also agrees once over each grad-stats group whether any rank holds parameters with a
separate norm group (``MegatronOptimizer.has_grad_norm_group``: an int32 ``[1]`` MAX); paraloom
has none and issues the same agreement, so its first step communicates as Megatron's.
:meth:`GradNorm.clip` then scales every main grad if the total is above the limit.
"""

from __future__ import annotations

import math

import torch

from .. import comm
from ..mesh import ParallelMesh
from .ddp import DistributedDataParallel

__all__ = ["GradNorm", "counts_once"]


def counts_once(param, mesh: ParallelMesh) -> bool:
    """Whether this rank's copy of ``param`` is its one counted copy in the global norm."""
    if getattr(param, "shared_embedding", False) and not mesh.is_first_stage:
        return False  # the last stage's tied copy: counted on the first stage
    return getattr(param, "tensor_model_parallel", False) or mesh.tp.rank == 0


class GradNorm:
    """The stretches of main grads this rank counts in the global norm (fixed for a run)."""

    def __init__(self, ddps: list[DistributedDataParallel], mesh: ParallelMesh, *,
                 sharded: bool, dense_optimizers: int = 1, one_optimizer: bool = False) -> None:
        """``sharded``: each dp rank owns a shard of every bucket (the distributed optimizer).
        ``dense_optimizers``: how many optimizers Megatron chains for the dense parameters (two
        under ``--overlap-param-gather-with-optimizer-step``: chunk 0's and the rest's); each
        makes the first step's agreement of its own. ``one_optimizer``: dense and expert
        parameters in one optimizer (Megatron-FSDP's), so one norm over the dense group."""
        self.ddps, self.mesh, self.sharded = ddps, mesh, sharded
        self.pieces: list[tuple] = []  # (bucket, lo, hi), in buffer order
        self.expert_pieces: list[tuple] = []
        self.expert = any(b.expert for ddp in ddps for b in ddp.buckets)
        for ddp in ddps:
            for bucket in ddp.buckets:
                axis = bucket.axis  # mesh.dp, or mesh.edp for experts (distinct over ep)
                lo, hi = bucket.shard(axis.rank, axis.size) if sharded else (0, bucket.numel)
                into = self.expert_pieces if bucket.expert else self.pieces
                for param in bucket.params:  # in buffer order: offsets increase
                    if counts_once(param, mesh):
                        _, a, b = ddp.param_range(param)
                        self._add(into, bucket, max(a, lo), min(b, hi))
        if one_optimizer:  # the experts' stretches summed over the dense group with the rest
            self.pieces, self.expert_pieces = self.pieces + self.expert_pieces, []
            self.expert = False
        # the grad-stats groups of Megatron's dense and expert optimizers, with their kinds
        if sharded:
            self.groups = [(ddps[0].distopt, "distopt")] * (2 if self.expert else 1)
        else:
            self.groups = [(mesh.mp, "mp")] + ([(mesh.tp_ep_pp, "tp_ep_pp")] if self.expert
                                               else [])
        self._first = True
        self.flags = self.groups[:1] * dense_optimizers + self.groups[1:]

    @staticmethod
    def _add(pieces: list, bucket, a: int, b: int) -> None:
        if a >= b:
            return
        last = pieces[-1] if pieces else None
        if last is not None and last[0] is bucket and last[2] == a:
            pieces[-1] = (bucket, last[1], b)
        else:
            pieces.append((bucket, a, b))

    def local_sq_norm(self, device: torch.device, expert: bool = False) -> torch.Tensor:
        """Sum of squared main grads this rank is responsible for (the dense ones, or with
        ``expert`` the experts'): each stretch's fp32 norm (torch's reduction, no fp64 copy of
        the gradients), squared and summed in fp64."""
        grads = [bucket.grad[a:b] for bucket, a, b in
                 (self.expert_pieces if expert else self.pieces)]
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=device)
        norms = torch.stack([torch.linalg.vector_norm(g) for g in grads])
        return norms.double().square().sum()

    def total(self, device: torch.device) -> float:
        """The global gradient norm: each part's fp32 ``[1]`` squared norm summed over its
        grad-stats group (phase ``optimizer``), then the root of the parts' sum."""
        sums = []
        for expert, (axis, kind) in enumerate(self.groups):
            part = self.local_sq_norm(device, bool(expert)).float().view(1)
            comm.all_reduce(part, axis, phase="optimizer", kind=kind,
                            site="get_grad_norm_fp32:squared_norm",
                            split="this rank's squared gradient norm")
            sums.append(part.item())
        if self._first:  # Megatron 0.19's one-off has_grad_norm_group agreement (see above)
            for axis, kind in self.flags:  # one per optimizer of Megatron's chain
                flag = torch.zeros(1, dtype=torch.int32, device=device)
                comm.all_reduce(flag, axis, op="max", phase="optimizer", kind=kind,
                                site="has_grad_norm_group:flag",
                                split="whether any rank has separately-normed parameters")
            self._first = False
        return math.sqrt(sum(sums))  # inf or nan when a part is

    def count_zeros(self, device: torch.device) -> int:
        """Megatron's ``count_zeros_fp32`` (``--log-num-zeros-in-grad``, inside the optimizer
        step after clipping): the zeros among the gradients this rank counts in the norm, an
        int64 ``[1]`` summed over the grad-stats group — once over both parts when the dense
        and expert optimizers share it (the distributed optimizer), else per optimizer."""
        shared = self.sharded or not self.expert  # Megatron: the chain's groups are one
        parts = [(self.pieces + self.expert_pieces, self.groups[0])] if shared else \
            [(self.pieces, self.groups[0]), (self.expert_pieces, self.groups[1])]
        total = 0
        for pieces, (axis, kind) in parts:
            zeros = torch.zeros(1, dtype=torch.int64, device=device)
            for bucket, a, b in pieces:
                zeros += (b - a) - torch.count_nonzero(bucket.grad[a:b])
            comm.all_reduce(zeros, axis, phase="optimizer", kind=kind,
                            site="count_zeros_fp32:num_zeros",
                            split="this rank's count of zero gradients")
            total += int(zeros.item())
        return total

    def clip(self, total_norm: float, max_norm: float) -> bool:
        """Scale every main grad by ``max_norm / total_norm`` if ``total_norm`` exceeds
        ``max_norm > 0`` (torch's ``clip_grad_norm_`` rule, with its 1e-6); returns whether it
        clipped."""
        if not (max_norm > 0 and total_norm > max_norm):
            return False
        scale = max_norm / (total_norm + 1e-6)
        for ddp in self.ddps:
            ddp.scale_gradients(scale)
        return True
