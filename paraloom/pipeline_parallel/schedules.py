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

Every runtime executes the plan built by :func:`.timetable.p2p_plan` — the same pure timetable
the tests and the schedule picture read — so the order of compute and communication here is
exactly the one shown there. On gloo the plan overlaps communication with compute (Megatron's
``overlap_p2p_comm``; ``overlap_p2p_comm=False`` for the blocking batches): a step's receive is
posted one step ahead, outputs are sent asynchronously as soon as computed, and the ledger's
``t_start`` / ``t_wait`` / ``t_end`` of each p2p event show the overlap. Each forward /
backward step is a ledger compute span (site ``pipeline.forward`` / ``pipeline.backward``, with
``stage`` and ``chunk``) attributed to its microbatch — under ZB-H1 the backward computes
only input gradients and a later ``pipeline.weight_grad`` span runs the microbatch's deferred
wgrad GEMMs (:func:`~paraloom.tensor_parallel.weight_grad.defer_weight_grads`) — and
:class:`PipelineStats` counts the microbatches whose activations a stage holds.

Launch: build a :class:`~paraloom.mesh.ParallelMesh` with ``pp > 1`` on every rank (``torchrun
--nproc-per-node 4 ...`` or :func:`paraloom.launch.spawn`), build the stage's chunks
(:mod:`.stage`), then call ``get_forward_backward_func(pp, vpp)(...)`` each step.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from .. import ledger as _ledger
from ..device import get_device
from ..mesh import ParallelMesh
from ..tensor_parallel.weight_grad import defer_weight_grads
from . import p2p
from .timetable import bubble_fraction, p2p_plan, stage_order, timetable, validate  # noqa: F401

__all__ = ["PipelineStats", "forward_backward_no_pipelining",
           "forward_backward_pipelining_without_interleaving",
           "forward_backward_pipelining_with_interleaving", "forward_backward_gpipe",
           "forward_backward_zero_bubble",
           "get_forward_backward_func", "tensor_shape_of", "timetable", "stage_order",
           "bubble_fraction", "p2p_plan"]


@dataclass
class PipelineStats:
    """Activations held by this stage during one call (pass one in through ``stats=``)."""

    in_flight: int = 0
    """Microbatch-chunks whose forward ran and whose backward has not yet."""
    max_in_flight: int = 0
    """The most held at once: ``min(p - rank, m)`` for 1F1B, ``m`` for GPipe."""
    history: list[int] = field(default_factory=list)
    """``in_flight`` after every compute step."""

    def _change(self, delta: int) -> None:
        self.in_flight += delta
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.history.append(self.in_flight)


def tensor_shape_of(seq_length: int, micro_batch_size: int, hidden_size: int, mesh: ParallelMesh,
                    sequence_parallel: bool = False) -> tuple[int, int, int]:
    """The ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism) tensor between stages."""
    if sequence_parallel and seq_length % mesh.tp.size:
        raise ValueError(f"seq_length = {seq_length} is not divisible by tp = {mesh.tp.size} "
                         f"(needed by sequence_parallel)")
    return (seq_length // mesh.tp.size if sequence_parallel else seq_length, micro_batch_size,
            hidden_size)


def _at(mb: int):
    led = _ledger.active()
    return led.at(microbatch=mb) if led is not None else nullcontext()


def _loss_of(result):
    if isinstance(result, (tuple, list)):
        return result[0], result[1]
    return result, result.detach()


def _overlap(requested, device, variable_seq_lengths) -> bool:
    """Whether to run the overlapped plan: by default on gloo (CPU) without shape exchange."""
    gloo = (device or get_device()).type == "cpu"
    if requested is None:
        return gloo and not variable_seq_lengths
    if requested and not gloo:  # NCCL runs a peer pair's p2p in posting order: a receive
        # posted ahead of a send would wait for a peer waiting on that send
        raise ValueError(f"overlap_p2p_comm=True is for gloo (CPU); got a {device} model")
    if requested and variable_seq_lengths:
        raise ValueError("overlap_p2p_comm=True needs fixed shapes (variable_seq_lengths=False): "
                         "a receive is posted before the shape it would need is known")
    return bool(requested)


def _execute(schedule, forward_step_func, data_iterators, chunks, num_microbatches, seq_length,
             micro_batch_size, forward_only, *, mesh, hidden_size, dtype=torch.float32,
             sequence_parallel=False, variable_seq_lengths=False, stats=None, no_sync_func=None,
             finalize_model_grads_func=None, overlap_p2p_comm=None):
    """Run ``p2p_plan(schedule, ...)`` for this stage; the one engine behind every schedule.

    ``overlap_p2p_comm`` (default: on for gloo without ``variable_seq_lengths``) runs the
    overlapped plan, whose receives are posted one step ahead and whose sends are waited for
    late, so transfers run during compute; ``False`` runs the blocking batches."""
    p, rank, v, m = mesh.pp.size, mesh.pp.rank, len(chunks), num_microbatches
    validate(schedule, p, m, v)
    if schedule == "interleaved" and v != mesh.vpp:
        raise ValueError(f"got {v} model chunks but the mesh has vpp = {mesh.vpp}")
    for chunk in chunks:
        if not hasattr(chunk, "set_input_tensor"):
            raise TypeError(f"the stage model {type(chunk).__name__} has no set_input_tensor(); "
                            f"the schedule passes each received activation through it")
    shape = tensor_shape_of(seq_length, micro_batch_size, hidden_size, mesh, sequence_parallel)
    stats = stats if stats is not None else PipelineStats()
    device = next((q.device for chunk in chunks for q in chunk.parameters()), None)
    overlap = _overlap(overlap_p2p_comm, device, variable_seq_lengths)
    plan = p2p_plan(schedule, p, m, rank, v, forward_only, overlap)
    # gradient sync (e.g. a data-parallel all-reduce) only in each chunk's last backward (and,
    # zero bubble, its last W: the deferred weight gradients become final there)
    last = {(step[0], step[2]): i for i, step in enumerate(plan) if step[0] in ("B", "W")}
    split = schedule == "zb-h1"
    wgrads = {}  # (mb, chunk) -> runs the wgrad GEMMs a B step deferred
    no_sync = no_sync_func if isinstance(no_sync_func, (list, tuple)) else [no_sync_func] * v
    last_vs = p * v - 1
    received, outbox, saved, losses, handles = {}, {}, {}, [], {}
    for i, step in enumerate(plan):
        if step[0] == "post":  # start without waiting; keep one handle per op
            ops = [(what, side, outbox.pop(msg) if what == "send" else None,
                    "forward" if msg[0] == "act" else "backward", msg[1])
                   for what, side, msg in step[1]]
            handles.update(zip(step[1], p2p.post(ops, mesh=mesh, tensor_shape=shape, dtype=dtype,
                                                 device=device), strict=True))
            continue
        if step[0] == "wait":
            for op in step[1]:
                got = handles.pop(op).wait()[0]
                if op[0] == "recv":  # received activations: the stage differentiates w.r.t. them
                    received[op[2]] = got.requires_grad_() if op[2][0] == "act" else got
            continue
        if step[0] == "comm":
            ops = [(what, side, outbox.pop(msg) if what == "send" else None,
                    "forward" if msg[0] == "act" else "backward", msg[1])
                   for what, side, msg in step[1]]
            got = iter(p2p.communicate(ops, mesh=mesh, tensor_shape=shape, dtype=dtype,
                                       variable_seq_lengths=variable_seq_lengths, device=device))
            for what, _, msg in step[1]:
                if what == "recv":
                    received[msg] = next(got)
            continue
        kind, mb, c = step
        vs = c * p + rank
        span = dict(stage=rank, chunk=c, module=f"chunk{c}")
        if kind == "F":  # under ZB-H1 the layers (built with own_backward) can split backward
            with _at(mb), _ledger.span("pipeline.forward", phase="forward", **span):
                inp = received.pop(("act", mb, vs - 1)) if vs > 0 else None  # [s, b, h]
                chunks[c].set_input_tensor(inp)
                out, loss_func = forward_step_func(data_iterators[c], chunks[c])
                if vs == last_vs:
                    loss, info = _loss_of(loss_func(out))
                    losses.append(info)
                    out = loss / m  # gradients of the mean over microbatches
                else:
                    outbox[("act", mb, vs)] = out  # [s, b, h]
            if not forward_only:
                saved[(mb, c)] = (inp, out)
                stats._change(+1)
        elif kind == "W":
            skip = no_sync[c] is not None and i != last[("W", c)]
            with (_at(mb), _ledger.span("pipeline.weight_grad", phase="backward", **span),
                  no_sync[c]() if skip else nullcontext()):
                wgrads.pop((mb, c))()
            stats._change(-1)
        else:
            skip = no_sync[c] is not None and i != last[("B", c)]
            sync = no_sync[c]() if skip else nullcontext()
            with (_at(mb), _ledger.span("pipeline.backward", phase="backward", **span), sync,
                  defer_weight_grads() if split else nullcontext() as run_w):
                inp, out = saved.pop((mb, c))
                grad = received.pop(("grad", mb, vs + 1)) if vs < last_vs else None
                torch.autograd.backward(out, grad_tensors=grad)
                if vs > 0:
                    outbox[("grad", mb, vs)] = inp.grad  # [s, b, h]
            if split:
                wgrads[(mb, c)] = run_w
            else:
                stats._change(-1)
    if received or outbox or saved or handles or wgrads:  # a plan bug, never a user error
        raise RuntimeError(f"pipeline plan left messages behind: received={list(received)}, "
                           f"unsent={list(outbox)}, held={list(saved)}, "
                           f"in flight={list(handles)}, weight grads left={list(wgrads)}")
    if finalize_model_grads_func is not None and not forward_only:
        finalize_model_grads_func(chunks)
    return losses


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
    return _execute("none", forward_step_func, [data_iterator], _single(model), num_microbatches,
                    seq_length, micro_batch_size, forward_only, **kw)


def forward_backward_pipelining_without_interleaving(forward_step_func, data_iterator, model,
                                                     num_microbatches, seq_length,
                                                     micro_batch_size, forward_only=False, **kw):
    """1F1B: ``min(p - rank - 1, m)`` warm-up forwards, then one forward / one backward, then
    the remaining backwards; stage ``rank`` holds at most ``min(p - rank, m)`` microbatches."""
    return _execute("1f1b", forward_step_func, [data_iterator], _single(model), num_microbatches,
                    seq_length, micro_batch_size, forward_only, **kw)


def forward_backward_gpipe(forward_step_func, data_iterator, model, num_microbatches, seq_length,
                           micro_batch_size, forward_only=False, **kw):
    """All forwards, then all backwards (GPipe): same bubble as 1F1B but holds all ``m``
    microbatches' activations; here for comparison."""
    return _execute("gpipe", forward_step_func, [data_iterator], _single(model), num_microbatches,
                    seq_length, micro_batch_size, forward_only, **kw)


def forward_backward_zero_bubble(forward_step_func, data_iterator, model, num_microbatches,
                                 seq_length, micro_batch_size, forward_only=False, **kw):
    """ZB-H1 (Qi et al., 2024): 1F1B's F/B order with each backward split into B (input
    gradient, sent on at once) and W (the wgrad GEMMs, deferred into what was 1F1B's bubble);
    the same memory bound as 1F1B. Only the parallel linears' weight gradients are deferred."""
    return _execute("zb-h1", forward_step_func, [data_iterator], _single(model),
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
    return _execute("interleaved", forward_step_func, list(iters), chunks, num_microbatches,
                    seq_length, micro_batch_size, forward_only, **kw)


def get_forward_backward_func(pp: int, vpp: int | None = None):
    """The schedule Megatron would pick: none for ``pp == 1``, interleaved for ``vpp > 1``."""
    if pp == 1:
        return forward_backward_no_pipelining
    if vpp is not None and vpp > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving
