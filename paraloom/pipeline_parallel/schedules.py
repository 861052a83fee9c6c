"""Forward-backward schedules over microbatches: no pipelining, 1F1B, interleaved 1F1B, ZB-H1
(zero bubble) and GPipe.

Megatron's signature and contract::

    losses = forward_backward_func(forward_step_func, data_iterator, model, num_microbatches,
                                   seq_length, micro_batch_size, forward_only=False,
                                   mesh=mesh, hidden_size=h)

* ``forward_step_func(data_iterator, model) -> (output_tensor, loss_func)``; on the last stage
  ``loss_func(output_tensor)`` returns the loss, or ``(loss, info)``.
* A stage model receives its input activation through ``model.set_input_tensor(tensor)``
  (``None`` on the first stage, which reads its data itself).
* The loss is scaled by ``1 / num_microbatches`` before backward, so gradients are those of the
  mean loss; the return value is the list of per-microbatch losses (``info`` when ``loss_func``
  gives one, else the unscaled loss) on the last stage, ``[]`` elsewhere.
* Interleaved: ``model`` and ``data_iterator`` are lists with one entry per chunk.

Every schedule is :func:`.runtime.execute` running the plan built by :func:`.plans.p2p_plan`
— the same pure timetable
the tests and the schedule picture read — so the order of compute and communication here is
exactly the one shown there. On gloo the plan overlaps communication with compute (Megatron's
``overlap_p2p_comm``; ``overlap_p2p_comm=False`` for the blocking batches): a step's receive is
posted one step ahead, outputs are sent asynchronously as soon as computed, and the ledger's
``t_start`` / ``t_wait`` / ``t_end`` of each p2p event show the overlap. Each forward /
backward step is a ledger compute span (site ``pipeline.forward`` / ``pipeline.backward``, with
``stage`` and ``chunk``; on one stage ``microbatch.forward`` / ``microbatch.backward``, as there
is no pipeline) attributed to its microbatch — under ZB-H1 the backward computes
only input gradients and a later ``pipeline.weight_grad`` span runs the microbatch's deferred
wgrad GEMMs (:func:`~paraloom.tensor_parallel.weight_grad.defer_weight_grads`) — and
:class:`PipelineStats` counts the microbatches whose activations a stage holds.

Launch: build a :class:`~paraloom.mesh.ParallelMesh` with ``pp > 1`` on every rank (``torchrun
--nproc-per-node 4 ...`` or :func:`paraloom.launch.spawn`), build the stage's chunks
(:mod:`.stage`), then call ``get_forward_backward_func(pp, vpp)(...)`` each step.
"""

from __future__ import annotations

from .plans import p2p_plan  # noqa: F401
from .runtime import PipelineStats, execute, tensor_shape_of
from .timetable import bubble_fraction, stage_order, timetable  # noqa: F401

__all__ = ["PipelineStats", "forward_backward_no_pipelining",
           "forward_backward_pipelining_without_interleaving",
           "forward_backward_pipelining_with_interleaving", "forward_backward_gpipe",
           "forward_backward_zero_bubble",
           "get_forward_backward_func", "tensor_shape_of", "timetable", "stage_order",
           "bubble_fraction", "p2p_plan"]


def _single(model):
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError(f"this schedule runs one model chunk per stage, got {len(model)}; "
                             f"use the interleaved schedule for vpp > 1")
        return list(model)
    return [model]


def forward_backward_no_pipelining(forward_step_func, data_iterator, model, num_microbatches,
                                   seq_length, micro_batch_size, forward_only=False, **kw):
    """One stage, gradient accumulation over microbatches: F0 B0 F1 B1 ... (no communication).

    With ``no_sync_func`` (e.g. a data-parallel wrapper's ``no_sync``) the gradient reduction
    is skipped for every backward but the last (in every schedule: each chunk's last backward;
    pass one function per chunk for interleaving).
    """
    mesh = kw["mesh"]
    if mesh.pp.size != 1:
        raise ValueError(f"no pipelining needs pp = 1, got pp = {mesh.pp.size}; use "
                         f"get_forward_backward_func(pp, vpp)")
    return execute("none", forward_step_func, [data_iterator], _single(model), num_microbatches,
                    seq_length, micro_batch_size, forward_only, **kw)


def forward_backward_pipelining_without_interleaving(forward_step_func, data_iterator, model,
                                                     num_microbatches, seq_length,
                                                     micro_batch_size, forward_only=False, **kw):
    """1F1B: ``min(p - rank - 1, m)`` warm-up forwards, then one forward / one backward, then
    the remaining backwards; stage ``rank`` holds at most ``min(p - rank, m)`` microbatches."""
    return execute("1f1b", forward_step_func, [data_iterator], _single(model), num_microbatches,
                    seq_length, micro_batch_size, forward_only, **kw)


def forward_backward_gpipe(forward_step_func, data_iterator, model, num_microbatches, seq_length,
                           micro_batch_size, forward_only=False, **kw):
    """All forwards, then all backwards (GPipe): same bubble as 1F1B but holds all ``m``
    microbatches' activations; here for comparison."""
    return execute("gpipe", forward_step_func, [data_iterator], _single(model), num_microbatches,
                    seq_length, micro_batch_size, forward_only, **kw)


def forward_backward_zero_bubble(forward_step_func, data_iterator, model, num_microbatches,
                                 seq_length, micro_batch_size, forward_only=False, **kw):
    """ZB-H1 (Qi et al., 2024): 1F1B's F/B order with each backward split into B (input
    gradient, sent on at once) and W (the wgrad GEMMs, deferred into what was 1F1B's bubble);
    the same memory bound as 1F1B. Only the parallel linears' weight gradients are deferred."""
    return execute("zb-h1", forward_step_func, [data_iterator], _single(model),
                    num_microbatches, seq_length, micro_batch_size, forward_only, **kw)


def forward_backward_pipelining_with_interleaving(forward_step_func, data_iterator, model,
                                                  num_microbatches, seq_length, micro_batch_size,
                                                  forward_only=False, **kw):
    """Interleaved 1F1B over ``v = len(model)`` chunks per stage (Megatron's virtual stages).

    ``num_microbatches`` must be a multiple of ``pp``; ``data_iterator`` is a list with one
    iterator (or ``None``) per chunk. The bubble shrinks to ``(p-1)/(v*m + p-1)``, for ``v``
    times more p2p messages.
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    iters = data_iterator if isinstance(data_iterator, (list, tuple)) else None
    if iters is None or len(iters) != len(chunks):
        raise ValueError(f"the interleaved schedule needs one data iterator per model chunk "
                         f"({len(chunks)}), got {data_iterator!r}")
    return execute("interleaved", forward_step_func, list(iters), chunks, num_microbatches,
                    seq_length, micro_batch_size, forward_only, **kw)


def get_forward_backward_func(pp: int, vpp: int | None = None):
    """The schedule Megatron would pick: none for ``pp == 1``, interleaved for ``vpp > 1``."""
    if pp == 1:
        return forward_backward_no_pipelining
    if vpp is not None and vpp > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving
