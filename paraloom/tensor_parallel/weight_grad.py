"""Where a parallel linear's weight gradient goes: ``.grad``, ``main_grad``, or a deferred W step.

The wgrad GEMM ``grad_W = grad_y^T x`` of :class:`ColumnParallelLinear` / :class:`RowParallelLinear`
(:mod:`.layers`) ends in one of three places:

* ``weight.grad`` (autograd's accumulation), when nothing else asks for it: the GEMM's result is
  handed back to autograd, which takes it as it is (no copy) or adds it in.
* ``weight.main_grad`` directly (``addmm_`` into the fp32 buffer, ``beta = 0`` for the first
  gradient of a step, ``alpha = 1/dp`` as the data-parallel wrapper asks), when
  ``gradient_accumulation_fusion`` is on (Megatron's meaning: the weight gradient is accumulated
  in fp32 ``main_grad``, never materialised in the parameter dtype), **or** when a data-parallel
  wrapper listens (:class:`~paraloom.data_parallel.DistributedDataParallel` marks its parameters)
  and the parameter is already fp32. In the second case it is the same sum written one pass
  earlier: the wrapper would otherwise copy (or add) the autograd gradient into ``main_grad`` in
  its hook -- an allocation, a copy and a free per weight per microbatch, the largest cost of data
  parallelism on one CPU rank. The result equals ``.grad``-then-copy to float rounding (bitwise
  for a single microbatch at dp = 1; accumulating inside the GEMM rounds partial sums
  differently).
* a queue (:func:`defer_weight_grads`), in a zero-bubble pipeline's ``B`` step: the GEMM runs
  later, in the stage's ``W`` step, and then goes to one of the two places above.

Protocol with a data-parallel wrapper (contract between this file and ``data_parallel/ddp.py``):
the wrapper sets ``grad_added_to_main_grad = False``, ``overwrite_main_grad = True`` and
``main_grad_scale`` on each parameter; a direct write sets ``grad_added_to_main_grad = True``
and clears ``overwrite_main_grad``; the wrapper's post-accumulate-grad hook then only marks the
parameter ready, adding any ``.grad`` that another use of the same parameter produced (a tied
embedding). Autograd runs that hook also when the layer returns no gradient for the weight
(:func:`hooks_fire_without_grad` checks this once per process); on a torch where it does not, the
layer returns an uninitialised placeholder instead (Megatron's trick), the wrapper ignores
``.grad`` for such parameters, and only ``gradient_accumulation_fusion`` writes directly.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import cache

import torch
from torch import nn

from .. import ledger as _ledger

__all__ = ["weight_grad", "hooks_fire_without_grad", "defer_weight_grads", "is_deferring",
           "defer"]


class _NoWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


@cache
def hooks_fire_without_grad() -> bool:
    """Whether this torch runs a parameter's post-accumulate-grad hooks when the autograd
    function that used it returned ``None`` for it (torch's ``AccumulateGrad`` does in the
    versions we test; the answer decides whether a placeholder gradient is needed)."""
    weight, fired = nn.Parameter(torch.zeros(1)), []
    weight.register_post_accumulate_grad_hook(lambda _: fired.append(True))
    with torch.enable_grad():
        _NoWeightGrad.apply(torch.zeros(1, requires_grad=True), weight).sum().backward()
    return bool(fired)


def _direct(weight: torch.Tensor, dtype: torch.dtype, fusion: bool) -> bool:
    if fusion:
        return True
    main = getattr(weight, "main_grad", None)
    return (main is not None and main.dtype == dtype and hasattr(weight, "grad_added_to_main_grad")
            and hooks_fire_without_grad())


def weight_grad(weight: torch.Tensor, go: torch.Tensor, x: torch.Tensor, fusion: bool):
    """``go^T x`` for ``weight`` (``go``: ``[tokens, out]``, ``x``: ``[tokens, in]``), routed as the
    module docstring says. Returns what the autograd function returns for the weight: the
    gradient, ``None`` (it went into ``main_grad``) or a placeholder."""
    if not _direct(weight, go.dtype, fusion):
        return go.t().matmul(x)
    main = getattr(weight, "main_grad", None)
    if main is None:  # fusion without a data-parallel buffer: one of its own, accumulating
        weight.main_grad = main = torch.zeros(weight.shape, dtype=torch.float32,
                                              device=weight.device)
    overwrite = getattr(weight, "overwrite_main_grad", False)
    scale = getattr(weight, "main_grad_scale", 1.0)
    if overwrite and scale == 1.0 and go.dtype == main.dtype:
        torch.mm(go.t(), x, out=main)  # the very GEMM autograd would run, into the buffer
    elif go.dtype != main.dtype and _mixed_gemm(go.device, go.dtype):
        # bf16 inputs, fp32 accumulation and output (what Megatron's fused wgrad kernel does)
        torch.addmm(main, go.t(), x, beta=0.0 if overwrite else 1.0, alpha=scale,
                    out_dtype=main.dtype, out=main)
    else:  # beta = 0 ignores what the buffer held: no zeroing pass
        main.addmm_(go.t().to(main.dtype), x.to(main.dtype), beta=0.0 if overwrite else 1.0,
                    alpha=scale)
    weight.overwrite_main_grad = False
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None  # nobody listens: main_grad is the gradient
    weight.grad_added_to_main_grad = True
    if hooks_fire_without_grad():
        return None
    return torch.empty(weight.shape, dtype=go.dtype, device=go.device)  # never read


@cache
def _mixed_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(..., out_dtype=float32, out=main)`` takes 16-bit inputs into an fp32
    buffer in place on ``device`` (CUDA in recent torch), checked once against the fp32 product;
    otherwise the inputs are widened to fp32 first (two copies, an fp32 GEMM)."""
    if device.type != "cuda":
        return False
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        a, b = (torch.randn(64, 48, generator=gen, device=device) for _ in range(2))
        main = torch.randn(48, 48, generator=gen, device=device)
        want = main + 0.5 * (a.to(dtype).float().t() @ b.to(dtype).float())
        torch.addmm(main, a.to(dtype).t(), b.to(dtype), beta=1.0, alpha=0.5,
                    out_dtype=torch.float32, out=main)
        return bool(torch.allclose(main, want, rtol=1e-3, atol=1e-3))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


_DEFERRED: list | None = None
"""Where a zero-bubble ``B`` step queues its wgrad GEMMs (one backward at a time): the deferral
itself, opened and closed by :func:`defer_weight_grads` around the schedule's B step."""


def is_deferring() -> bool:
    """Whether a zero-bubble ``B`` step is running (weight gradients are queued)."""
    return _DEFERRED is not None


def defer(param: nn.Parameter, go: torch.Tensor, x: torch.Tensor, fusion: bool, name: str,
          module: str | None) -> None:
    """Queue ``param``'s wgrad GEMM for the current ``B`` step's later ``W`` step."""
    _DEFERRED.append((param, go, x, fusion, name, module))


@contextmanager
def defer_weight_grads():
    """Split a backward into B and W (zero-bubble pipelines): inside, the parallel linears
    compute and communicate only the input gradient and queue their wgrad GEMMs; the yielded
    callable, called later (the ``W`` step), runs them and hands each weight gradient on as an
    undivided backward would (``.grad`` or ``main_grad``), running the parameter's
    post-accumulate-grad hooks, so data-parallel wrappers see it as usual. Gradients of other
    parameters (norms, biases, embeddings) are computed in B."""
    global _DEFERRED
    saved, queue = _DEFERRED, []
    _DEFERRED = queue
    try:
        yield lambda: _run_deferred(queue)
    finally:
        _DEFERRED = saved


def _run_deferred(queue: list) -> None:
    while queue:
        param, go, xf, fusion, name, module = queue.pop(0)
        with (torch.no_grad(),  # as inside autograd's backward: the saved input requires grad
              _ledger.span(f"{name}.backward:wgrad", phase="backward", module=module)):
            grad = weight_grad(param, go, xf, fusion)
        del go, xf  # the saved activations can go as soon as their GEMM ran
        _accumulate_grad(param, grad)


def _accumulate_grad(param: nn.Parameter, grad: torch.Tensor | None) -> None:
    """What autograd's ``AccumulateGrad`` does for a leaf: ``grad`` becomes ``param.grad`` (this
    function holds the only reference, so it is taken as it is, not copied) or is added into it
    in place; then the parameter's post-accumulate-grad hooks run. A placeholder (the gradient is
    already in ``main_grad``) is not stored. Where this torch keeps no hook table, the gradient
    goes through ``torch.autograd.backward`` instead (which copies it)."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", ())
    if hooks is None or isinstance(hooks, dict):
        if grad is not None and not getattr(param, "grad_added_to_main_grad", False):
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
        for hook in list((hooks or {}).values()):
            hook(param)
    elif grad is not None:
        torch.autograd.backward(param, grad_tensors=grad)
