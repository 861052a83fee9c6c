"""Megatron-FSDP's ZeRO-3 (``optim_grads_params``): parameters gathered before use, released after.

Each transformer layer is an FSDP unit with a bucket of its own (:mod:`.fsdp_layout`); the rest
of the model (embeddings, final norm) is one bucket that, once gathered, stays. Each rank keeps
only its ``1/dp`` piece of every bucket (``Bucket.kept``, what the optimizer updates); a bucket's
full storage (``Bucket.full``, the parameters are views of it) is filled by an all-gather and
freed again. When, as megatron-core 0.19.2 does it (``MegatronFSDP._register_fsdp_hooks`` and its
``AllGatherPipeline``), recorded on CPU:

* before a module's forward (every module outside the units with parameters of its own, and each
  unit): its buckets are gathered if released, and, unless the module is in its backward state,
  the buckets after it in forward order are prefetched (up to 500M elements, i.e. all of them in
  any model below that size); a unit's buckets are released right after its forward;
* before a unit's backward (a hook on its outputs' gradients): its buckets, and those before it
  (backward order) prefetched; right after its backward (an identity function on its inputs):
  released. At the start of a backward every module enters its backward state (a module outside
  the units never leaves it: from the second microbatch on their forwards prefetch nothing) and
  every unit's bucket may be released at the next gather;
* after the optimizer step every bucket is gathered from the updated pieces (the units' released
  first), so the next step's first forward finds them all;
* under full recomputation a unit's hooks fire in its re-run inside the backward instead
  (Megatron's checkpoint wraps the unit): see :meth:`Unshard._recomputed`.

The buckets are taken in Megatron-FSDP's order (:func:`_megatron_order`: with experts, each
unit's dense and expert buckets side by side), which the prefetch follows.

Every gather is launched asynchronously (the record's ``async``), one per bucket, in bucket
order. A process starts with every bucket released (Megatron-FSDP shards the model when it wraps
it): the first forward gathers them. The hooks act only where gradients are recorded (paraloom's
held-out evaluations run on the parameters as the last optimizer step left them, all gathered).
Gradients: a reduce-scatter per unit as its bucket completes, every microbatch, as ZeRO-2. The
rules themselves are :class:`~.fsdp_unshard_plan.UnshardPlan` (the analysis replays them).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .bucket_group import gather_params
from .fsdp_unshard_plan import UnshardPlan, group_order

__all__ = ["Unshard"]

_SITE = "FullyShardedDataParallel.{phase}:param_unshard"


class _AfterBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward, which runs once the unit's is done, calls
    ``after``."""

    @staticmethod
    def forward(ctx, after, *inputs):
        ctx.after = after
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.after()
        return (None, *grads)


class Unshard(UnshardPlan):
    """ZeRO-3's gathers and releases for one :class:`~.megatron_fsdp.FullyShardedDataParallel`
    (``ddp``) around ``module``, whose ``units`` are FSDP units: the hooks that apply
    :class:`UnshardPlan`'s rules to the buckets' storage."""

    def __init__(self, ddp, module: nn.Module, units: list[nn.Module]) -> None:
        self.buckets = _megatron_order(ddp.buckets, module, units)
        of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        super().__init__([b.numel for b in self.buckets],
                         {id(u): sorted({of[id(p)] for p in u.parameters()}) for u in units})
        self.modules = list(module.modules())
        for bucket in self.buckets:
            bucket.kept = _piece(bucket).clone()
        inside = {id(m) for u in units for m in u.modules() if m is not u}
        for m in self.modules:
            if id(m) in inside:
                continue
            unit = id(m) in self.unit_buckets
            owned = self.unit_buckets[id(m)] if unit else \
                sorted({of[id(p)] for p in m.parameters(recurse=False) if id(p) in of})
            if owned:
                m.register_forward_pre_hook(partial(self._pre_forward, owned))
            if unit:
                m.register_forward_pre_hook(self._wrap_inputs, with_kwargs=True)
                m.register_forward_hook(self._post_forward)
            if unit and getattr(m, "full_recompute", False):  # its re-run (see _recomputed)
                m._forward = partial(self._recomputed, m, m._forward)
        module.register_forward_hook(self._root_output)

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, owned: list[int], module: nn.Module, _args) -> None:
        if torch.is_grad_enabled():
            self.pre_forward(id(module), owned)

    def _wrap_inputs(self, unit: nn.Module, args, kwargs):
        """The unit's tensor inputs through :class:`_AfterBackward` (its post-backward)."""
        if not torch.is_grad_enabled():
            return None
        flat = list(args) + list(kwargs.values())
        where = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
        if not where:
            return None
        keys = [id(m) for m in unit.modules()]
        out = _AfterBackward.apply(partial(self.post_backward, id(unit), keys),
                                   *(flat[i] for i in where))
        for i, t in zip(where, out if len(where) > 1 else (out,), strict=True):
            flat[i] = t
        return tuple(flat[:len(args)]), dict(zip(list(kwargs), flat[len(args):], strict=True))

    def _post_forward(self, unit: nn.Module, _inputs, output):
        if not torch.is_grad_enabled():
            return
        self.post_forward(id(unit))
        outs = [t for t in (output if isinstance(output, (tuple, list)) else (output,))
                if torch.is_tensor(t) and t.requires_grad]
        keys = [id(m) for m in unit.modules()]
        first = getattr(unit, "full_recompute", False) and \
            torch._C._current_graph_task_id() == -1  # Megatron: under no_grad, no hook
        if outs and not first:
            torch.autograd.graph.register_multi_grad_hook(
                outs, lambda _grads: self.pre_backward(id(unit), keys), mode="any")

    def _recomputed(self, unit: nn.Module, forward, *args):
        """A fully recomputed unit's forward. Megatron's checkpoint wraps the whole unit, so its
        hooks fire in the re-run inside the backward (the first run is under ``no_grad``): the
        unit gathered if released (no prefetch: it is in its backward state), released lazily
        after, and its pre-backward (gather, prefetch) hooked to the re-run's outputs, which take
        their gradients next. paraloom's checkpoint sits inside the unit's forward: these calls
        stand in for the hooks."""
        if torch._C._current_graph_task_id() == -1:  # the first run
            return forward(*args)
        self.pre_forward(id(unit), self.unit_buckets[id(unit)])
        out = forward(*args)
        self._post_forward(unit, args, out)
        return out

    def _root_output(self, _module, _inputs, output):
        if torch.is_grad_enabled() and torch.is_tensor(output) and output.requires_grad:
            keys = [id(m) for m in self.modules]
            torch.autograd.graph.register_multi_grad_hook(
                [output], lambda _grads: self.root_pre_backward(keys), mode="any")

    # ------------------------------------------------------------------ storage
    def _gather_now(self, buckets: list[int], phase: str) -> None:
        """Launch each bucket's all-gather (async), then land them in their storage."""
        site = "DistributedOptimizer.step:param_shards" if phase == "optimizer" else \
            _SITE.format(phase=phase)
        handles = [(b, gather_params(self.buckets[b].group, phase=phase, async_op=True,
                                     site=site)) for b in buckets]
        for b, handle in handles:
            full = self.buckets[b].full
            storage = full.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(full.numel() * full.element_size())
            full.data.copy_(handle.wait())  # .data: autograd's saved views keep their version
        super()._gather_now(buckets, phase)

    def _free(self, b: int) -> None:
        self.buckets[b].full.untyped_storage().resize_(0)

    def refresh(self) -> None:
        """After a checkpoint loaded into the parameters (all held): the kept pieces again."""
        for bucket in self.buckets:
            bucket.kept.copy_(_piece(bucket))


def _megatron_order(buckets: list, module: nn.Module, units: list[nn.Module]) -> list:
    """The buckets in Megatron-FSDP's order (:func:`~.fsdp_unshard_plan.group_order`)."""
    index = {id(p): i for i, p in enumerate(module.parameters())}
    unit_of = {id(p): u for u, unit in enumerate(units) for p in unit.parameters()}
    order = group_order([((b.expert, unit_of.get(id(b.params[0]))),
                          [index[id(p)] for p in b.params]) for b in buckets])
    return [buckets[k] for k in order]


def _piece(bucket) -> torch.Tensor:
    """This rank's ``1/dp`` piece of a bucket's gathered parameters."""
    return bucket.full[slice(*bucket.shard(bucket.axis.rank, bucket.axis.size))]
