"""Megatron-FSDP (megatron-core's ``FullyShardedDataParallel``): its four sharding strategies.

Megatron-LM's ``--use-megatron-fsdp --data-parallel-sharding-strategy S`` wraps each model chunk
in Megatron-FSDP instead of its ``DistributedDataParallel``. What each strategy communicates, as
megatron-core 0.19.2 does on CPU under ``paraloom record --megatron-on-cpu``
(``tests/test_megatron_fsdp.py``), over ``dp x cp``:

* ``no_shard``: one all-reduce per bucket when the last microbatch's backward completes it; the
  optimizer is not sharded (its gradient norm over the model-parallel group).
* ``optim`` (ZeRO-1): one reduce-scatter per bucket in the last microbatch's backward; each rank
  updates its ``1/dp`` piece, and the optimizer step all-gathers every bucket's parameters
  (launched asynchronously, waited at once).
* ``optim_grads`` (ZeRO-2): the reduce-scatter in *every* microbatch's backward, each rank adding
  the piece it owns into its sharded gradient; the same optimizer step.
* ``optim_grads_params`` (ZeRO-3, Megatron-LM's default): besides, each transformer layer is a
  unit whose parameters are gathered before use and released after (:mod:`.megatron_fsdp_unshard`).

Under ``optim`` and ``optim_grads`` the first training forward of the process all-gathers every
bucket's parameters (asynchronously) before it starts (Megatron-FSDP unshards the model from its
optimizer's shards). The reductions are synchronous (Megatron-FSDP issues them on a side
stream, so the record shows ``async`` false), each bucket as soon as every parameter in it got
its gradient (in the order they complete); contributions are scaled by ``1/dp`` before the sum
(its path without ``gradient_reduce_div_fusion``); in bf16 they are bf16 unless
``--megatron-fsdp-main-grads-dtype fp32`` (paraloom sums in fp32 and reduces a bf16 copy). The
buffers have Megatron-FSDP's layout (:mod:`.fsdp_layout`): the bucket sizes on the record are its
padded sizes.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config.megatron_fsdp_checks import BUILT
from ..mesh import ParallelMesh
from .ddp import DistributedDataParallel
from .megatron_fsdp_unshard import Unshard

__all__ = ["FullyShardedDataParallel"]

_FIRST = "FullyShardedDataParallel.forward:unshard"


class FullyShardedDataParallel(DistributedDataParallel):
    """Megatron-FSDP around ``module`` (one pipeline stage, already tensor-parallel).

    Args:
        module, mesh, average, grad_reduce_in_fp32: as :class:`DistributedDataParallel`.
        data_parallel_sharding_strategy: one of :data:`BUILT` (see the module's docstring).
        bucket_size: elements per bucket (Megatron-LM's ``--ddp-bucket-size``); ``None``, its
            default, one bucket per buffer (a shared embedding apart under sharding).
        units: under ZeRO-3 the FSDP units (Megatron's ``fsdp_unit_modules``: its transformer
            layers), in forward order; default ``module.layers``' modules.
    """

    fsdp_layout = True
    param_gather_async = True

    def __init__(self, module: nn.Module, mesh: ParallelMesh, *,
                 data_parallel_sharding_strategy: str = "optim_grads",
                 bucket_size: int | None = None, average: bool = True,
                 grad_reduce_in_fp32: bool = True, units: list[nn.Module] | None = None,
                 instances: int = 1) -> None:
        strategy = data_parallel_sharding_strategy
        if strategy not in BUILT:
            raise ValueError(f"data_parallel_sharding_strategy {strategy!r} is not built; "
                             f"valid: {', '.join(BUILT)}")
        self.strategy = strategy
        zero3 = strategy == "optim_grads_params"
        layers = [] if not zero3 else list(units) if units is not None else \
            list(getattr(module, "layers", {}).values())
        if layers:  # the transformer layers are the FSDP units
            self.units = {id(p): k for k, layer in enumerate(layers) for p in layer.parameters()}
        super().__init__(module, mesh, overlap_grad_reduce=True, bucket_size=bucket_size,
                         grad_reduce_in_fp32=grad_reduce_in_fp32, average=average,
                         use_distributed_optimizer=strategy != "no_shard", instances=instances)
        self.sharded = strategy != "no_shard"
        self.every_microbatch = strategy in ("optim_grads", "optim_grads_params")
        self.unshard = Unshard(self, module, layers) if zero3 else None
        self._owned: dict[int, torch.Tensor] = {}  # bucket index -> its summed 1/dp piece
        self._reduced = False  # this step's last backward completed (and reduced) every bucket
        self._done: set[int] = set()  # the bucket groups this backward reduced so far
        self._first = module.register_forward_pre_hook(self._unshard) \
            if self.sharded and not zero3 else None

    def _bucket_size(self, given: int | None, disable_bucketing: bool) -> int | None:
        return given  # Megatron-FSDP: no default limit

    def _unshard(self, *_unused) -> None:
        """The first training forward of the process: every bucket's parameters all-gathered
        from the shards (a forward pre-hook on the chunk, removed once it ran). paraloom's
        held-out evaluation before training (no gradients; Megatron-LM has none) does not count:
        the gather is in step 1, where Megatron-FSDP's is; the values are the same either way."""
        if not torch.is_grad_enabled():
            return
        self._first.remove()
        self.gather_all_params("forward", _FIRST, async_op=True)

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._fold(param) or not (self._sync or self.every_microbatch):
            return
        self._synced = False
        bucket = self._bucket_of[id(param)]
        bucket.ready.add(id(param))
        group = bucket.group
        if group.is_complete():  # reduced as soon as complete, as Megatron-FSDP's pipeline
            self._reduce(group)

    def _reduce(self, group) -> None:
        """Reduce ``group`` now (in backward); under ``optim_grads`` keep the owned pieces,
        summed across the optimizer instances after the last microbatch's (under ``optim``
        megatron-core sums its whole buckets across: their gradients are not sharded)."""
        owner, fp32 = type(self).__name__, self.grad_reduce_in_fp32
        group.launch_grads("backward", False, fp32, owner, across=False)
        group.finish_grads()
        if not self.every_microbatch and group.lead.inter.size > 1:  # optim: whole buckets
            group.reduce_across([b.grad for b in group.buckets], "backward", owner, fp32)
        for bucket in group.buckets:
            bucket.ready.clear()
            if self.every_microbatch:
                lo, hi = bucket.shard(bucket.axis.rank, bucket.axis.size)
                piece = bucket.grad[lo:hi]
                if bucket.index in self._owned:
                    self._owned[bucket.index].add_(piece)
                else:
                    self._owned[bucket.index] = piece.clone()
                for p in bucket.params:  # the next microbatch's gradient replaces main_grad
                    p.overwrite_main_grad = True
        if self.every_microbatch and self._sync and group.lead.inter.size > 1:
            group.reduce_across([self._owned[b.index] for b in group.buckets], "backward", owner,
                                fp32)
        self._done.add(id(group))
        if len(self._done) == len(self.groups):  # this backward reduced every bucket
            self._done.clear()
            self._reduced = True

    def start_param_sync(self) -> None:
        """After the optimizer step; under ZeRO-3 the units released, then all gathered."""
        if self.unshard is None:
            super().start_param_sync()
        else:
            self.unshard.after_step()

    def after_load(self) -> None:
        """A checkpoint was loaded into the parameters: ZeRO-3 keeps its pieces anew."""
        if self.unshard is not None:
            self.unshard.refresh()

    def start_grad_sync(self, *_unused) -> None:
        """Nothing: Megatron-FSDP reduces from its own backward hooks."""

    def finish_grad_sync(self) -> None:
        """After the last microbatch: the owned pieces (``optim_grads``) back in the buffer.

        Raises ``RuntimeError`` naming the parameters that got no gradient; the buckets
        holding them were reduced on no rank (every rank runs the same graph), so nothing
        hangs."""
        if not self._finish_begins():
            return
        if self.hookless:  # nothing to reduce with: complete once every gradient came
            self._reduced = all(b.is_complete() for b in self.buckets)
        missing = [] if self._reduced else [n for b in self.buckets for n in b.missing()]
        for bucket in self.buckets:
            bucket.ready.clear()
        if missing:
            raise RuntimeError(
                f"FullyShardedDataParallel: {len(missing)} parameter(s) received no gradient in "
                f"the last backward (not used to compute the loss?): {', '.join(missing)}")
        for bucket in self.buckets:
            owned = self._owned.pop(bucket.index, None)
            if owned is not None:
                lo, hi = bucket.shard(bucket.axis.rank, bucket.axis.size)
                bucket.grad[lo:hi].copy_(owned)
        self._synced, self._reduced = True, False

    def zero_grad_buffer(self) -> None:
        super().zero_grad_buffer()
        self._owned.clear()
        self._done.clear()
        self._reduced = False
