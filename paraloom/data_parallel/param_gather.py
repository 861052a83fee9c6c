"""Megatron's ``overlap_param_gather``: the distributed optimizer's parameter all-gather moved
from the optimizer step into the next forward, bucket by bucket, ahead of each bucket's first use.

Under :class:`~paraloom.data_parallel.optimizer.DistributedOptimizer` each data-parallel rank
updates only its ``1/dp`` shard of every bucket; without overlap the step then all-gathers every
bucket at once, synchronously. With a :class:`ParamGather` on the
:class:`~paraloom.data_parallel.ddp.DistributedDataParallel` the step gathers nothing, and a
forward pre-hook on every module of the wrapped chunk makes sure the buckets holding the
module's own parameters are gathered before it runs (Megatron-Core's
``_make_forward_pre_hook`` / ``finish_param_sync``):

* the first hook that meets a bucket not yet dispatched this step launches its all-gather and
  waits for it — in a step, the bucket of the first module that runs (the embedding: buckets
  hold the parameters in reverse registration order, so forward meets the last bucket first);
* a bucket's gather, once complete, launches the next one's asynchronously: bucket ``i`` is
  followed by bucket ``i - 1`` (dense and expert buckets each a chain of their own), which then
  runs while the modules of bucket ``i`` compute;
* :func:`~paraloom.data_parallel.finalize.finalize_model_grads` marks every bucket undispatched
  again (Megatron's ``finish_grad_sync``): each step's first forward gathers each bucket once;
* paraloom's GPT reads its output layer's weight (the last stage's copy of tied embeddings, or an
  untied ``output_layer.weight``) without calling a module of its own: it calls
  ``output_weight_hooks`` instead, where the gather of that bucket happens (Megatron's
  ``output_layer`` is a module: its pre-hook). Another model must use every parameter inside
  its own module's forward, as Megatron's hooks require.

With interleaving (``aligned``: Megatron-LM's ``--align-param-gather``, its default there) the
schedule launches the gathers instead: every bucket of chunks 0 and 1 as it starts, of chunk
``c > 1`` at the forward step whose virtual microbatch plus the pipeline rank is chunk
``c - 1``'s first (the same moment on every stage), through :meth:`start_all`; the hooks then
only wait.

As Megatron-LM's ``train()`` drives it, the hooks are off until a training step has succeeded
(:meth:`enable` after it): that step's update is the first the hooks gather. :meth:`sync` is
Megatron's ``start_param_sync(force_sync=True)``: every bucket gathered now, synchronously
(dense buckets first), for a checkpoint or an evaluation; the next forward then gathers nothing
until the next step's gradients are reduced.

With ``with_optimizer_step`` (Megatron-LM's ``--overlap-param-gather-with-optimizer-step``, the
first chunk of an interleaved pipeline, one bucket) the chunk's gather is launched by its own
optimizer step as soon as the update is done (:meth:`after_step`), asynchronously, while the
other chunks' optimizers step; the schedule's launch skips it and its hook only waits.

Every gather is kind ``dp``, site ``DistributedDataParallel.start_param_sync:param_shards``,
phase ``forward`` from the hooks and the schedule (all launched asynchronously; the first of a
step is waited for at once) and ``optimizer`` from :meth:`sync` and :meth:`after_step`.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import comm
from .bucket_group import BucketGroup, gather_params, land_params

__all__ = ["ParamGather", "force_param_sync", "paused"]

SITE = "DistributedDataParallel.start_param_sync:param_shards"


class ParamGather:
    """The overlapped parameter all-gathers of one :class:`DistributedDataParallel` (one model
    chunk); it registers itself as ``ddp.param_gather``. The hooks start disabled."""

    def __init__(self, ddp, *, aligned: bool = False, with_optimizer_step: bool = False) -> None:
        if not ddp.use_distributed_optimizer:
            raise ValueError("ParamGather needs DistributedDataParallel(..., "
                             "use_distributed_optimizer=True): without the distributed "
                             "optimizer there is no parameter all-gather to overlap")
        self.ddp, self.aligned = ddp, aligned
        self.with_optimizer_step = with_optimizer_step
        # the unit is Megatron's bucket group (one bucket, or a chunk's buckets coalesced)
        self._owner = {id(p): b.group for b in ddp.buckets for p in b.params}
        dense = [g for g in ddp.groups if not g.lead.expert]
        expert = [g for g in ddp.groups if g.lead.expert]
        self._order = dense + expert
        self._next: dict[int, BucketGroup] = {}
        for chain in (dense, expert):
            for earlier, later in zip(chain, chain[1:], strict=False):
                self._next[later.lead.index] = earlier  # forward meets them last to first
        self._dispatched: set[int] = set()
        self._pending: dict[int, comm.Handle] = {}
        self._hooks: list = []
        self._names = {id(m): n or "module" for n, m in ddp.module.named_modules()}
        ddp.param_gather = self
        if hasattr(ddp.module, "output_weight_hooks"):  # paraloom's GPTModel (models/gpt.py)
            ddp.module.output_weight_hooks.append(self._output_weight)

    # -- Megatron-LM's training loop ---------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return bool(self._hooks)

    def enable(self) -> None:
        """Register the forward pre-hooks (Megatron's ``enable_forward_pre_hook``)."""
        if not self._hooks:
            self._hooks = [m.register_forward_pre_hook(self._hook)
                           for m in self.ddp.module.modules()]

    def disable(self, param_sync: bool = True) -> None:
        """Remove the hooks, gathering every bucket first unless ``param_sync`` is False
        (Megatron's ``disable_forward_pre_hook``)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if param_sync:
            self.sync()

    def sync(self) -> None:
        """Gather every bucket now, synchronously; a gather in flight is waited for instead."""
        for group in self._order:
            index = group.lead.index
            if index in self._pending:
                land_params(group, self._pending.pop(index).wait())
            else:
                land_params(group, self._launch(group, "optimizer", async_op=False))
            self._dispatched.add(index)

    def start_all(self, *_unused, phase: str = "forward", force_dispatch: bool = False) -> None:
        """Launch every bucket's gather now, asynchronously (Megatron's ``start_param_sync``,
        the interleaved schedule's ``param_sync_func`` under ``--align-param-gather``); the
        hooks then only wait for them. A chunk gathered ``with_optimizer_step`` is skipped
        unless ``force_dispatch`` (its gather is already in flight, as in Megatron)."""
        if self.with_optimizer_step and not force_dispatch:
            return
        for group in self._order:
            if group.lead.index in self._pending:
                raise RuntimeError(f"bucket {group.lead.index}'s parameter all-gather is "
                                   f"already in flight")
            self._start(group, None, phase)

    def after_step(self) -> None:
        """This chunk's optimizer step is done: with ``with_optimizer_step`` (Megatron's
        ``--overlap-param-gather-with-optimizer-step``, the first chunk) its gathers start now,
        asynchronously, phase ``optimizer`` (the chained optimizer's
        ``start_param_sync(force_dispatch=True)``), also before the hooks are on; else nothing:
        the next forward gathers them."""
        if self.with_optimizer_step:
            self._dispatched.clear()
            self.start_all(phase="optimizer", force_dispatch=True)

    def reset(self) -> None:
        """A step's gradients are reduced: the next forward gathers every bucket again."""
        for index in list(self._pending):  # a gather no module waited for (an unused bucket)
            land_params(self._group(index), self._pending.pop(index).wait())
        self._dispatched.clear()

    # -- the hooks ---------------------------------------------------------------------------
    def _hook(self, module: nn.Module, _args) -> None:
        for param in module.parameters(recurse=False):
            group = self._owner.get(id(param))
            if group is not None:
                self._finish(group, self._names.get(id(module)))

    def _output_weight(self, weight: torch.Tensor) -> None:
        """The output layer's weight, read without a module call of its own: its bucket
        gathered now, as Megatron's ``output_layer`` pre-hook gathers it."""
        group = self._owner.get(id(weight))
        if self._hooks and group is not None:
            self._finish(group, "output_layer")

    def _finish(self, group: BucketGroup, module: str | None) -> None:
        """Megatron's ``finish_param_sync``: this group gathered before ``module`` runs, and
        the next group's gather started behind it (both recorded at ``module``)."""
        index = group.lead.index
        if index not in self._dispatched:
            self._start(group, module)
        handle = self._pending.pop(index, None)
        if handle is None:
            return
        land_params(group, handle.wait())
        later = None if self.aligned else self._next.get(index)
        if later is not None and later.lead.index not in self._dispatched:
            self._start(later, module)

    def _start(self, group: BucketGroup, module: str | None, phase: str = "forward") -> None:
        self._pending[group.lead.index] = self._launch(group, phase, True, module)
        self._dispatched.add(group.lead.index)

    def _launch(self, group: BucketGroup, phase: str, async_op: bool,
                module: str | None = None):
        return gather_params(group, phase=phase, site=SITE, async_op=async_op, module=module)

    def _group(self, index: int) -> BucketGroup:
        return next(g for g in self.ddp.groups if g.lead.index == index)


def _enabled(ddps) -> list[ParamGather]:
    return [d.param_gather for d in ddps if d.param_gather is not None and d.param_gather.enabled]


class paused:  # noqa: N801 (a context manager, named for how it reads)
    """Megatron-LM's ``disable_forward_pre_hook`` ... ``enable_forward_pre_hook`` around an
    evaluation or a checkpoint: every enabled chunk's buckets gathered first (:meth:`sync`), its
    hooks off inside, on again after."""

    def __init__(self, ddps) -> None:
        self.gathers = _enabled(ddps)

    def __enter__(self):
        for gather in self.gathers:
            gather.disable(param_sync=True)
        return self

    def __exit__(self, *exc) -> None:
        for gather in self.gathers:
            gather.enable()


def force_param_sync(ddps) -> None:
    """Megatron-LM's ``force_param_sync`` before a checkpoint: every enabled chunk's buckets
    gathered now (the hooks stay on; the next forward then gathers nothing)."""
    for gather in _enabled(ddps):
        gather.sync()
