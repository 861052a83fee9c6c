"""finalize_model_grads: everything between the last backward and the optimizer step.

1. Finish the data-parallel reduction of every model chunk (:meth:`finish_grad_sync`).
2. Sequence-parallel-replicated parameters (LayerNorm weights and biases, a RowParallelLinear bias
   under sequence parallelism; attribute ``sequence_parallel=True``) saw only this rank's
   ``s/tp`` tokens, so their gradients are partial sums: all-reduce them over ``mesh.tp``
   (kind ``sp``), coalesced into one flat tensor so it is one collective whatever their number.
3. Tied word embeddings (attribute ``shared_embedding=True``; the input embedding on the first
   pipeline stage and the output projection on the last) are one parameter stored twice: sum
   their gradients over the embedding group ``mesh.emb`` (kind ``emb``), the ``[V/tp, h]``
   gradient as it is (Megatron-Core's ``_allreduce_embedding_grad``). With the distributed
   optimizer only this rank's shard of it is dp-reduced; the sum is valid there, which is all the
   optimizer reads.

4. With Megatron's per-token loss (``num_tokens`` given: the gradients are sums over the
   step's tokens, not averages): the token count, known on the last pipeline stage, is
   broadcast from it over ``mesh.pp`` (kind ``pp``) and summed over ``mesh.dp_cp`` (kind
   ``dp``), int32 ``[]`` both; every chunk's gradients are then divided by it.

Both sums are linear, so doing them after the data-parallel average gives the same result as
before it. Each reduction is one ledger event with its kind (phase ``optimizer``).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import comm
from ..mesh import ParallelMesh
from .ddp import DistributedDataParallel

__all__ = ["finalize_model_grads"]


def _grad(param: nn.Parameter) -> torch.Tensor | None:
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def _allreduce_coalesced(params: list[tuple[str, nn.Parameter]], axis, *, kind: str,
                         site: str) -> None:
    """Sum the gradients of ``params`` over ``axis`` with one collective (flatten, reduce, copy
    back; a single gradient is reduced in place, unflattened); parameters without a gradient are
    skipped (the same on every rank of the group)."""
    named = [(n, g) for n, p in params if (g := _grad(p)) is not None]
    if axis.size <= 1 or not named:
        return
    grads = [g for _, g in named]
    if len(grads) == 1 and grads[0].is_contiguous():  # one tensor: reduced as it is
        comm.all_reduce(grads[0], axis, phase="optimizer", kind=kind, site=site,
                        params=[named[0][0]])
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, axis, phase="optimizer", kind=kind, site=site,
                    params=[n for n, _ in named])
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def finalize_model_grads(model_chunks, mesh: ParallelMesh,
                         num_tokens: torch.Tensor | None = None) -> None:
    """Finish dp reduction, then the sp (over tp) and tied-embedding (over emb) gradient sums.

    ``model_chunks``: one module or a list (virtual pipeline chunks); each may be a
    :class:`DistributedDataParallel` wrapper (then its reduction is finished first) or a plain
    module (its ``main_grad`` / ``.grad`` are used as they are). The tied-embedding parameters
    must be listed in the same order (and shapes) on the first and the last stage: they are
    flattened into one tensor for a single all-reduce.
    """
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    for chunk in chunks:
        if isinstance(chunk, DistributedDataParallel):
            chunk.finish_grad_sync()
            if chunk.param_gather is not None:  # Megatron's finish_grad_sync: gather again
                chunk.param_gather.reset()
    modules = [c.module if isinstance(c, DistributedDataParallel) else c for c in chunks]
    named = [(n, p) for m in modules for n, p in m.named_parameters() if p.requires_grad]
    sp = [(n, p) for n, p in named if getattr(p, "sequence_parallel", False)]
    _allreduce_coalesced(sp, mesh.tp, kind="sp",
                         site="finalize_model_grads:sequence_parallel_grads")
    if mesh.emb.rank >= 0:  # a middle pipeline stage is in no embedding group
        emb = [(n, p) for n, p in named if getattr(p, "shared_embedding", False)]
        _allreduce_coalesced(emb, mesh.emb, kind="emb",
                             site="finalize_model_grads:embedding_grads")
    if num_tokens is not None:  # the per-token loss: the count from the last stage, over dp x cp
        comm.broadcast(num_tokens, mesh.pp, src=mesh.pp.ranks[-1], phase="optimizer", kind="pp",
                       site="finalize_model_grads:num_tokens", split="the step's token count")
        comm.all_reduce(num_tokens, mesh.dp_cp, phase="optimizer", kind="dp",
                        site="finalize_model_grads:num_tokens", split="the step's token count")
        _scale_gradients(chunks, modules, 1.0 / max(int(num_tokens), 1))


def _scale_gradients(chunks, modules, scale: float) -> None:
    """Every gradient times ``scale`` (Megatron's ``scale_gradients``)."""
    for chunk, module in zip(chunks, modules, strict=True):
        if isinstance(chunk, DistributedDataParallel):
            chunk.scale_gradients(scale)
        else:
            for p in module.parameters():
                if (g := _grad(p)) is not None:
                    g.mul_(scale)
