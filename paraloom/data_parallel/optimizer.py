"""Adam(W) on fp32 main parameters and ``main_grad``: replicated, or sharded over dp (ZeRO-1).

The update (:func:`adam_step_`) is torch's own fused Adam(W) kernel (``torch._fused_adamw_``,
the one ``torch.optim.AdamW(fused=True)`` runs; CPU and CUDA) over the list of tensors: one pass
over memory for the parameter, gradient and both moments, instead of the seven passes of the same
formula written out in torch ops (:func:`adam_update_`, the fallback where the kernel is missing
and the reference the tests hold it to; on a 3.3M-parameter GPT on CPU 1.0 ms against 9.9 ms).
Both are elementwise, so updating a shard of a flat buffer gives, element for element, what
updating the whole parameter gives: the exactness of the distributed optimizer rests on that.

Weight decay applies to every parameter unless ``no_weight_decay_cond(name, param)`` says
otherwise (``paraloom train`` passes :func:`no_weight_decay_cond`: Megatron-Core's default). The
update then runs as two kernel calls, one per setting, over views fixed at construction; under
the distributed optimizer a shard is cut where its parameters' settings change.

* :class:`MainParamsOptimizer` keeps, for every parameter, an fp32 master copy (the parameter
  itself when it is already fp32) and the Adam moments; every dp rank repeats the whole update.
  State: ``2 * N * 4`` bytes (+ ``N * 4`` for non-fp32 parameters).
* :class:`DistributedOptimizer` (ZeRO-1) works with a :class:`DistributedDataParallel` built with
  ``use_distributed_optimizer=True``: each gradient bucket is reduce-scattered (not all-reduced),
  so data-parallel rank ``r`` holds the reduced gradient of the ``r``-th contiguous ``1/dp`` of the
  bucket; it keeps master weights and moments for that shard only, updates it, and the updated
  shards are all-gathered into the flat parameter buffer (kind ``dp``, phase ``optimizer``; one
  synchronous all-gather per bucket, in bucket order, as Megatron-Core). State:
  ``2 * N * 4 / dp`` bytes (+ the fp32 master shard for non-fp32 parameters); bucket padding
  elements have zero gradient and zero value, so their update is exactly zero.
"""

from __future__ import annotations

import math

import torch

from .ddp import DistributedDataParallel

__all__ = ["adam_update_", "adam_step_", "MainParamsOptimizer", "DistributedOptimizer",
           "no_weight_decay_cond"]


def no_weight_decay_cond(name: str, param: torch.Tensor) -> bool:
    """Megatron-Core's default rule (and nanoGPT's): biases and every 1-D parameter (LayerNorm
    and RMSNorm weights) get no weight decay; matrices and embeddings do."""
    return name.endswith(".bias") or param.dim() == 1


def adam_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, step: int, *, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: float, decoupled: bool) -> None:
    """One Adam step in place (``decoupled``: AdamW's weight decay, else L2 added to the grad)."""
    if weight_decay and decoupled:
        param.mul_(1.0 - lr * weight_decay)
    elif weight_decay:
        grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bias1, bias2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias1)


_NO_FUSED: set = set()
"""``(device type, dtype)`` pairs on which the fused kernel raised: the written-out update runs."""


def adam_step_(params: list[torch.Tensor], grads: list[torch.Tensor],
               exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], step: int, *,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               decoupled: bool, fused: bool | None = None) -> None:
    """One Adam(W) step in place over lists of fp32 tensors (``step`` counts from 1).

    ``fused=None`` uses torch's fused kernel (``torch._fused_adamw_`` / ``_fused_adam_``) where
    this torch has one for the tensors' device, else :func:`adam_update_` per tensor; ``True``
    insists on the kernel, ``False`` runs the written-out formula."""
    if not params:
        return
    kernel = getattr(torch, "_fused_adamw_" if decoupled else "_fused_adam_", None)
    key = (params[0].device.type, params[0].dtype)
    if fused is not False and kernel is not None and key not in _NO_FUSED:
        steps = [torch.full((), float(step), dtype=torch.float32, device=params[0].device)]
        try:
            kernel(params, grads, exp_avgs, exp_avg_sqs, [], steps * len(params), lr=lr,
                   beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False,
                   maximize=False)
            return
        except (RuntimeError, NotImplementedError):  # no kernel for this device / dtype
            if fused:
                raise
            _NO_FUSED.add(key)
    elif fused:
        raise RuntimeError(f"fused=True, but this torch {torch.__version__} has no fused Adam "
                           f"kernel for {key[0]} {key[1]}")
    for param, grad, exp_avg, exp_avg_sq in zip(params, grads, exp_avgs, exp_avg_sqs,
                                                strict=True):
        adam_update_(param, grad, exp_avg, exp_avg_sq, step, lr=lr, beta1=beta1, beta2=beta2,
                     eps=eps, weight_decay=weight_decay, decoupled=decoupled)


class _AdamBase:
    def __init__(self, ddp: DistributedDataParallel, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled_weight_decay: bool = True,
                 fused: bool | None = None, no_weight_decay_cond=None) -> None:
        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"{type(self).__name__} needs a DistributedDataParallel model (it "
                            f"reads main_grad from its buffers), got {type(ddp).__name__}")
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid Adam hyper-parameters: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay} (need lr, eps, weight_decay >= 0 and "
                             f"0 <= beta < 1)")
        self.ddp, self.step_count = ddp, 0
        self.hp = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                       weight_decay=weight_decay, decoupled=decoupled_weight_decay, fused=fused)
        """``fused``: :func:`adam_step_`'s choice (``None``: torch's fused kernel where there is
        one)."""
        cond = no_weight_decay_cond or (lambda name, param: False)
        self.decays = {name: not cond(name, param) for name, param in ddp.named_main_params()}
        """Whether each parameter (by name) is decayed."""
        self.lists: list[tuple[bool, tuple[list, list, list, list]]] = []
        """``(decayed, (params, grads, exp_avgs, exp_avg_sqs))``: what one kernel call updates
        (fixed views: the step builds no list)."""

    def _group_lists(self, runs) -> None:
        """``runs``: ``(decayed, param, grad, exp_avg, exp_avg_sq)`` views, in order."""
        by = {}
        for decayed, *views in runs:
            lists = by.setdefault(decayed, ([], [], [], []))
            for lst, view in zip(lists, views, strict=True):
                lst.append(view)
        self.lists = sorted(by.items(), key=lambda kv: not kv[0])

    def _update(self) -> None:
        """One Adam(W) step over :attr:`lists` (no weight decay where a parameter has none)."""
        self.step_count += 1
        for decayed, lists in self.lists:
            hp = self.hp if decayed else {**self.hp, "weight_decay": 0.0}
            adam_step_(*lists, self.step_count, **hp)

    @property
    def lr(self) -> float:
        return self.hp["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        self.hp["lr"] = value

    def zero_grad(self) -> None:
        """Zero the main grads (the DDP buffers) for the next step."""
        self.ddp.zero_grad_buffer()

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor this optimizer allocated (moments and separate master copies)."""
        raise NotImplementedError

    def state_bytes(self) -> int:
        """Measured bytes of :meth:`state_tensors` (distinct storages only)."""
        seen, total = set(), 0
        for t in self.state_tensors():
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total


class MainParamsOptimizer(_AdamBase):
    """Adam(W) replicated on every dp rank, on fp32 master params with ``main_grad``: one
    :func:`adam_step_` over every parameter of the wrapper."""

    def __init__(self, ddp: DistributedDataParallel, **hp) -> None:
        super().__init__(ddp, **hp)
        self.groups = []  # (param, master, exp_avg, exp_avg_sq)
        runs = []
        for name, param in ddp.named_main_params():
            fp32 = param.dtype == torch.float32
            master = param.data if fp32 else param.data.float()
            group = (param, master, torch.zeros_like(master), torch.zeros_like(master), fp32)
            self.groups.append(group)
            runs.append((self.decays[name], master, param.main_grad, group[2], group[3]))
        self._group_lists(runs)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for p, m, a, b, fp32 in self.groups for t in ((a, b) if fp32 else (m, a, b))]

    @torch.no_grad()
    def step(self) -> None:
        """Update every parameter from its ``main_grad`` (call after finalize_model_grads)."""
        self._update()
        for param, master, _, _, fp32 in self.groups:
            if not fp32:
                param.data.copy_(master)


class DistributedOptimizer(_AdamBase):
    """ZeRO-1 Adam(W): each dp rank updates only its ``1/dp`` shard of every bucket, then
    all-gathers every bucket's parameters, one bucket after the other and synchronously
    (Megatron-Core's ``start_param_sync`` without ``overlap_param_gather``)."""

    def __init__(self, ddp: DistributedDataParallel, **hp) -> None:
        super().__init__(ddp, **hp)
        if not ddp.use_distributed_optimizer:
            raise ValueError("DistributedOptimizer needs DistributedDataParallel(..., "
                             "use_distributed_optimizer=True): its buckets must be padded to a "
                             "multiple of dp, reduce-scattered, and the parameters held flat")
        self.shards = []  # (bucket, lo, hi, master, exp_avg, exp_avg_sq, is_copy)
        runs = []
        for bucket in ddp.buckets:  # expert buckets are sharded over mesh.edp (bucket.axis)
            lo, hi = bucket.shard(bucket.axis.rank, bucket.axis.size)
            values = bucket.param_shard()  # this rank's piece (ZeRO-3: kept apart)
            copy = values.dtype != torch.float32
            master = values.float() if copy else values  # fp32 params: update in place
            shard = (bucket, lo, hi, master, torch.zeros_like(master), torch.zeros_like(master),
                     copy)
            self.shards.append(shard)
            grad = bucket.grad[lo:hi]
            for a, b, decayed in self._decay_runs(bucket, lo, hi):
                runs.append((decayed, *(t[a:b] for t in (master, grad, shard[4], shard[5]))))
        self._group_lists(runs)

    def _decay_runs(self, bucket, lo: int, hi: int) -> list[tuple[int, int, bool]]:
        """Shard-relative ``[a, b)`` pieces of ``[lo, hi)`` with one weight-decay setting each,
        covering it (padding joins the piece before it: its value and gradient are zero)."""
        pieces = []
        for name, param in zip(bucket.names, bucket.params, strict=True):
            _, p_lo, p_hi = self.ddp.param_range(param)
            a, b = max(p_lo, lo) - lo, min(p_hi, hi) - lo
            if a < b:
                pieces.append((a, b, self.decays[name]))
        runs: list[list] = []
        for a, b, decayed in sorted(pieces):
            if runs and runs[-1][2] == decayed:
                runs[-1][1] = b
            else:
                if runs:
                    runs[-1][1] = a
                runs.append([0 if not runs else a, b, decayed])
        if not runs:
            return [(0, hi - lo, True)]  # padding only
        runs[-1][1] = hi - lo
        return [tuple(r) for r in runs]

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for *_, m, a, b, copy in self.shards for t in ((m, a, b) if copy else (a, b))]

    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's shards, then all-gather every bucket's parameters (under
        ``--overlap-param-gather`` the next forward gathers them: :mod:`.param_gather`)."""
        self._update()
        for bucket, _, _, master, _, _, copy in self.shards:
            shard = bucket.param_shard()
            if copy:
                shard.copy_(master)
        if self.ddp.param_gather is not None:  # the next forward gathers them, or (the first
            self.ddp.param_gather.after_step()  # chunk with_optimizer_step) it starts now
            return
        self.ddp.start_param_sync()
