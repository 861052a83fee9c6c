"""DistributedDataParallel: bucketed gradient reduction over the data-parallel group.

Each trainable parameter gets a ``main_grad`` view into a contiguous fp32 :class:`GradBuffer` and a
post-accumulate-grad hook, which adds ``param.grad`` into ``main_grad`` and drops ``.grad``.
paraloom's parallel linears write their weight gradients into ``main_grad`` themselves and flag
``grad_added_to_main_grad`` (:mod:`paraloom.tensor_parallel.weight_grad`). No pass zeroes or
averages the buffer: :meth:`zero_grad_buffer` flags every parameter ``overwrite_main_grad``, the
first gradient of a step is *written* into ``main_grad``, and every accumulation is scaled by
``main_grad_scale = 1/dp`` on the way in, so a bucket holds this rank's share of the average when
it is reduced (every parameter of a bucket must get a gradient first; padding stays zero).

Outside :meth:`no_sync` (the last microbatch) the hook also marks the parameter ready; with
``overlap_grad_reduce`` a complete bucket is reduced at once, asynchronously, while autograd
computes earlier layers' gradients; :meth:`finish_grad_sync` waits for all (with overlap off it
launches them there, synchronously). As in Megatron-Core, the first step launches nothing from
the hooks (Megatron learns then which gradients a step makes): its reductions start in
:meth:`finish_grad_sync`, or at :meth:`start_grad_sync`, which launches every bucket at once (the
schedule's ``grad_sync_func`` under ``--align-grad-reduce``). The buckets are Megatron's
(:mod:`.grad_buffer`): ``bucket_size`` applies only with overlap, on the first pipeline stage and
to a rank's first model chunk (``disable_bucketing`` for the others, as Megatron-LM builds them);
elsewhere the chunk is one bucket. A bucket is launched from the hook that completes it (with
``disable_bucketing`` a buffer's buckets form one group, launched as one coalesced collective once
all are complete: :mod:`.bucket_group`, Megatron's bucket groups), so buckets
go out in the order they complete (Megatron-Core's ``register_grad_ready``), which is the same on
every rank because every rank runs the same graph; the buckets launched from
:meth:`start_grad_sync` and :meth:`finish_grad_sync` go out in index order.

The reduction is a SUM over ``mesh.dp_cp`` (dp x cp) of contributions already scaled by ``1/dp``
(Megatron-Core's ``gradient_scaling_factor``; what an AVG computes, bitwise for a power-of-two
dp); ``average_in_collective`` computes the same, ``average=False`` the plain sum.
``grad_reduce_in_fp32=False`` reduces a bf16 copy of each bucket and writes the result back into
the fp32 buffer. Expert parameters (``allreduce=False``, Megatron's mark; ``paraloom/moe``) live in
buffers of their own reduced over ``mesh.edp`` (divided by the full dp size too: an expert's
gradient already sums its ep group's data); ``bucket.axis`` says which. Parameters that never got
a gradient by :meth:`finish_grad_sync` raise a ``RuntimeError`` naming them; their bucket is never
launched, so no rank waits in a collective the others never start.

With ``instances = N > 1`` (Megatron's ``--num-distributed-optimizer-instances``, distributed
optimizer only) a bucket is sharded and reduce-scattered over its block of ``dp x cp / N`` ranks
(``bucket.axis``: ``dp_intra``, or ``edp_intra``), then its shard is all-reduced across the ``N``
blocks (``bucket.inter``, kind ``dp_inter``); both are synchronous, as Megatron issues them then
(on a side stream, so the host does not wait for them, and the record shows ``async`` false).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..mesh import ParallelMesh
from ..tensor_parallel.weight_grad import hooks_fire_without_grad
from .bucket_group import gather_params, group_buckets, land_params
from .grad_buffer import Bucket, GradBuffer, accumulate_grad, default_bucket_size

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` (already tensor-parallel, one pipeline stage) for data parallelism.

    Args:
        module: the model (chunk); its trainable parameters get ``main_grad`` views.
        mesh: the layout; gradients are reduced over ``mesh.dp_cp`` (``mesh.dp`` when cp = 1).
        overlap_grad_reduce: launch a bucket's reduction from the gradient hooks as soon as the
            bucket is complete on the last microbatch (else all at :meth:`finish_grad_sync`).
        bucket_size: elements per bucket (default ``max(40M, 1M * dp)``, as Megatron); ``None``
            (one bucket) without overlap, with ``disable_bucketing`` or on a pipeline rank > 0.
        average_in_collective: Megatron's flag (average in the collective); contributions are
            always scaled by 1/dp before the SUM here, which is what it computes.
        grad_reduce_in_fp32: reduce the fp32 buffer; ``False`` reduces a bf16 copy.
        use_distributed_optimizer: reduce-scatter the buckets (each padded to a multiple of dp)
            for :class:`~paraloom.data_parallel.optimizer.DistributedOptimizer`; the parameters'
            data then lives in a flat buffer of the same layout.
        average: average over dp (``False``: sum).
        disable_bucketing: one bucket (Megatron-LM passes it for every model chunk but the
            first).
        tail_splits: paraloom's halving of the last buckets of backward (off: 0).
        instances: distributed-optimizer instances (``use_distributed_optimizer`` only): each
            bucket sharded within a block of ``dp x cp / instances`` ranks (see above).
    """

    param_gather = None  # a ParamGather (.param_gather) under --overlap-param-gather
    fsdp_layout = False  # Megatron-FSDP's buffer layout (.megatron_fsdp sets it)
    units: dict | None = None  # with it, ZeRO-3: id(param) -> its FSDP unit
    param_gather_async = False  # the optimizer step's parameter all-gather, async then waited

    def __init__(self, module: nn.Module, mesh: ParallelMesh, *, overlap_grad_reduce: bool = True,
                 bucket_size: int | None = None, average_in_collective: bool = False,
                 grad_reduce_in_fp32: bool = True, use_distributed_optimizer: bool = False,
                 average: bool = True, disable_bucketing: bool = False,
                 tail_splits: int = 0, instances: int = 1) -> None:
        super().__init__()
        self.module, self.mesh = module, mesh
        self.overlap_grad_reduce = overlap_grad_reduce
        self.average_in_collective, self.average = average_in_collective, average
        self.grad_reduce_in_fp32 = grad_reduce_in_fp32
        self.use_distributed_optimizer = use_distributed_optimizer
        self.dp = mesh.dp_cp  # Megatron: non-expert grads reduced over dp x cp, in one reduction
        dp = self.dp.size
        self.bucket_size = self._bucket_size(bucket_size, disable_bucketing)
        by_dtype: dict[tuple[torch.dtype, bool], list] = {}
        for name, param in module.named_parameters():
            if param.requires_grad:
                expert = not getattr(param, "allreduce", True)
                by_dtype.setdefault((param.dtype, expert), []).append((name, param))
        if not by_dtype:
            raise ValueError("DistributedDataParallel: the module has no trainable parameters")
        self.buffers_: list[GradBuffer] = []
        self.buckets: list[Bucket] = []
        axes = mesh.optimizer_instances(instances if use_distributed_optimizer else 1)
        self.distopt = axes["distopt"]  # the optimizer instance: its grad norm's group
        for (_, expert), named in by_dtype.items():
            axis, inter = (axes["edp_intra"], axes["edp_inter"]) if expert else \
                (axes["dp_intra"], axes["dp_inter"])
            buf = GradBuffer(named, bucket_size=self.bucket_size, first_index=len(self.buckets),
                             shard_over=axis.size if use_distributed_optimizer else 1,
                             hold_params=use_distributed_optimizer, tail_splits=tail_splits,
                             fsdp=self.fsdp_layout, units=self.units)
            for bucket in buf.buckets:
                bucket.axis, bucket.inter, bucket.expert = axis, inter, expert
            self.buffers_.append(buf)
            self.buckets.extend(buf.buckets)
        for bucket in self.buckets:
            bucket.reduce_scatter = use_distributed_optimizer
        self.groups = group_buckets(self.buckets, single=disable_bucketing)
        """Megatron's bucket groups (:mod:`.bucket_group`): one bucket each, or with
        ``disable_bucketing`` every bucket of a buffer in one coalesced group."""
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._sync = True
        self._synced = False  # finish_grad_sync completed since the last synchronising backward
        self._first_batch = True  # Megatron: the first step launches only in finish_grad_sync
        self._scale = 1.0 / dp if average else 1.0
        self._hooks = []
        self._placeholders = not hooks_fire_without_grad()
        # Nothing to reduce (dp x cp = 1, no expert replicas): no hooks at all; autograd
        # accumulates .grad over the microbatches and finish_grad_sync folds it into main_grad
        # once (a Python call per parameter per microbatch, and a free in the middle of every
        # backward, saved: ~2 % of a one-rank step)
        self.hookless = all(b.axis.size * b.inter.size == 1 for b in self.buckets)
        for bucket in self.buckets:
            for param in bucket.params:
                param.grad_added_to_main_grad = False  # opt in to the layers' fusion protocol
                param.main_grad_scale = self._scale  # the layers' fused GEMM scales by it too
                param.overwrite_main_grad = True  # the next gradient replaces main_grad
                if not self.hookless:
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad))

    def _bucket_size(self, given: int | None, disable_bucketing: bool) -> int | None:
        """Megatron's: ``given`` or ``max(40M, 1M x dp)``; one bucket (``None``) with nothing to
        overlap, on a model chunk after the first (Megatron-LM's ``disable_bucketing``) or a
        pipeline stage after the first (its reduction is off the critical path)."""
        if not self.overlap_grad_reduce or disable_bucketing or self.mesh.pp.rank > 0:
            return None
        return default_bucket_size(self.mesh.dp.size) if given is None else given

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ------------------------------------------------------------------ hooks and launching
    def _fold(self, param: nn.Parameter) -> bool:
        """Move the gradient that came for ``param`` into ``main_grad``; whether one came."""
        grad, direct = param.grad, param.grad_added_to_main_grad
        if grad is None and not direct:
            return False  # none came (a zero-bubble B step defers it to its W step's hook)
        if grad is not None:
            # with a direct write, .grad is another use's share (a tied embedding), unless the
            # layer had to hand autograd a placeholder (see tensor_parallel/weight_grad.py)
            if not (direct and self._placeholders):
                accumulate_grad(param.main_grad, grad, self._scale, param.overwrite_main_grad)
            param.grad = None  # the gradient lives in main_grad from now on
        param.grad_added_to_main_grad = param.overwrite_main_grad = False
        return True

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._fold(param) or not self._sync:
            return
        self._synced = False
        bucket = self._bucket_of[id(param)]
        bucket.ready.add(id(param))
        group = bucket.group
        if self.overlap_grad_reduce and not self._first_batch and group.is_complete() \
                and group.pending is None:  # as soon as it is complete, as Megatron-Core
            group.launch_grads("backward", True, self.grad_reduce_in_fp32)

    def _launch_ready(self, phase: str, async_op: bool = True) -> None:
        """Launch every complete bucket group not launched yet, in index order."""
        for group in self.groups:
            if group.pending is None and group.is_complete():
                group.launch_grads(phase, async_op, self.grad_reduce_in_fp32)

    # ------------------------------------------------------------------ public API
    @contextmanager
    def no_sync(self):
        """Microbatches run inside accumulate into ``main_grad`` without communicating."""
        saved, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = saved

    def start_grad_sync(self, *_unused) -> None:
        """Launch the reduction of every bucket not yet launched, now (phase ``backward``):
        Megatron's ``start_grad_sync``, which its schedule calls as ``grad_sync_func`` with
        ``--align-grad-reduce`` once this chunk's backward is over. Every parameter that got a
        gradient this step counts as ready (its backward ran, in ``no_sync`` or not)."""
        if not self.overlap_grad_reduce or self.hookless:
            return  # the reduction happens in finish_grad_sync
        for bucket in self.buckets:
            bucket.ready.update(id(p) for p in bucket.params if not p.overwrite_main_grad)
        self._synced = False
        self._launch_ready("backward")

    def finish_grad_sync(self) -> None:
        """Wait until every bucket is reduced (launching the rest first when not overlapped).

        Raises ``RuntimeError`` naming the parameters that received no gradient in the last
        backward; the buckets holding them are never launched (on any rank, for a model whose
        unused parameters are the same everywhere), so nothing hangs. A second call after a
        successful one (e.g. the training loop, then :func:`finalize_model_grads`) does nothing.
        """
        if not self._finish_begins():
            return
        if not any(b.ready for b in self.buckets):
            raise RuntimeError("DistributedDataParallel.finish_grad_sync(): no backward ran "
                               "outside no_sync() since the last step; the last microbatch must")
        missing = [name for b in self.buckets for name in b.missing()]
        if not missing:
            self._launch_ready("optimizer", async_op=self.overlap_grad_reduce)
        for group in self.groups:
            if group.pending is not None:
                group.finish_grads()
        for bucket in self.buckets:
            bucket.ready.clear()
        self._synced = not missing
        self._first_batch = self._first_batch and bool(missing)
        if missing:
            raise RuntimeError(
                f"DistributedDataParallel: {len(missing)} parameter(s) received no gradient in "
                f"the last backward (not used to compute the loss?): {', '.join(missing)}. "
                f"Remove them, set requires_grad=False, or make the loss depend on them.")

    def _finish_begins(self) -> bool:
        """``finish_grad_sync``'s start: refused inside ``no_sync``; ``False`` when done already;
        without hooks the gradients folded into ``main_grad`` now (the buckets ready)."""
        if not self._sync:
            raise RuntimeError(f"{type(self).__name__}.finish_grad_sync() called inside "
                               f"no_sync(): run the last microbatch's backward outside no_sync()")
        if self._synced:
            return False
        if self.hookless:
            for bucket in self.buckets:
                bucket.ready.update(id(p) for p in bucket.params if self._fold(p))
        return True

    def start_param_sync(self) -> None:
        """After the optimizer step: every bucket's parameters all-gathered from the updated
        shards, in bucket order (Megatron's ``start_param_sync``; synchronous, or launched
        asynchronously and waited at once with ``param_gather_async``)."""
        self.gather_all_params("optimizer", "DistributedOptimizer.step:param_shards",
                               self.param_gather_async)

    def gather_all_params(self, phase: str, site: str, async_op: bool) -> None:
        """Every bucket group's parameters all-gathered from the shards, in order (each waited
        before the next is launched) and landed in the parameters."""
        for group in self.groups:
            gathered = gather_params(group, phase=phase, async_op=async_op, site=site)
            land_params(group, gathered.wait() if async_op else gathered)

    def scale_gradients(self, scale: float) -> None:
        """Every ``main_grad`` times ``scale`` (Megatron's ``scale_gradients``: clipping, the
        per-token loss's division)."""
        for buf in self.buffers_:
            buf.grad.mul_(scale)

    def zero_grad_buffer(self) -> None:
        """Start a step: every ``main_grad`` counts as zero (the next gradient overwrites it; no
        pass over the buffer) and readiness and pending work are forgotten."""
        for group in self.groups:
            if group.pending is not None:
                group.pending[0].wait()
                group.pending = None
        for bucket in self.buckets:
            bucket.ready.clear()
            for param in bucket.params:
                param.grad = None
                param.grad_added_to_main_grad = False
                param.overwrite_main_grad = True
        self._synced = False

    def param_range(self, param: nn.Parameter) -> tuple[Bucket, int, int]:
        """``(bucket, start, end)`` of ``param``, bucket-relative."""
        bucket = self._bucket_of[id(param)]
        lo, hi = bucket.buffer.param_range(param)
        return bucket, lo - bucket.start, hi - bucket.start

    def named_main_params(self):
        """``(name, param)`` of every parameter with a ``main_grad`` in this wrapper."""
        for bucket in self.buckets:
            yield from zip(bucket.names, bucket.params, strict=True)
