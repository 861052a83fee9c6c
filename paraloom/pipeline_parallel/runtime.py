"""The engine behind every schedule: one stage executes its p2p plan.

:func:`execute` runs :func:`.plans.p2p_plan` for this stage — posting and waiting for the
plan's p2p (blocking batches, or the overlapped plan on gloo), running each forward and backward
step as a ledger compute span attributed to its microbatch, deferring ZB-H1's weight gradients,
syncing data-parallel gradients only in each chunk's last backward (or where Megatron's
``grad_sync_func`` says) and calling ``finalize_model_grads_func`` at the end.
:mod:`.schedules` gives it Megatron's names and signature. :class:`PipelineStats` counts the
microbatches whose activations a stage holds.
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
from .plans import p2p_plan
from .timetable import validate

__all__ = ["PipelineStats", "tensor_shape_of", "execute"]


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


def execute(schedule, forward_step_func, data_iterators, chunks, num_microbatches, seq_length,
             micro_batch_size, forward_only, *, mesh, hidden_size, dtype=torch.float32,
             sequence_parallel=False, variable_seq_lengths=False, stats=None, no_sync_func=None,
             finalize_model_grads_func=None, overlap_p2p_comm=None, grad_sync_func=None):
    """Run ``p2p_plan(schedule, ...)`` for this stage; the one engine behind every schedule.

    ``overlap_p2p_comm`` (default: on for gloo without ``variable_seq_lengths``) runs the
    overlapped plan, whose receives are posted one step ahead and whose sends are waited for
    late, so transfers run during compute; ``False`` runs the blocking batches.

    ``grad_sync_func`` (one per chunk; Megatron-LM's ``--align-grad-reduce``) moves the launch of
    the gradient reduction from the hooks into the schedule, as Megatron-Core's 1F1B and
    interleaved schedules do: 1F1B on stages after the first runs every backward in ``no_sync``
    and calls it after its last ``send_backward`` (the first stage keeps the hooks of its last
    backward); interleaved runs every backward in ``no_sync`` and, right after the backward of
    virtual microbatch ``k``, syncs the chunk whose last backward was virtual microbatch
    ``k - pp_rank`` (so every stage launches at the same moment), the rest at the end."""
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
    grad_sync = (grad_sync_func if isinstance(grad_sync_func, (list, tuple))
                 else [grad_sync_func] * v) if grad_sync_func is not None and not forward_only \
        else None
    if grad_sync is not None and not (schedule == "interleaved"
                                      or (schedule == "1f1b" and rank > 0)):
        grad_sync = None  # no pipelining, the first 1F1B stage, ZB-H1: the hooks launch
    backwards = [(step[1], step[2]) for step in plan if step[0] == "B"]  # (mb, chunk) in order
    where = "pipeline" if p > 1 else "microbatch"  # the compute spans' site
    synced: set[int] = set()
    done_b = 0
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
        span = dict(stage=rank, chunk=c, module=f"chunk{c}") if p > 1 else dict(stage=0, chunk=0)
        if kind == "F":  # under ZB-H1 the layers (built with own_backward) can split backward
            with _at(mb), _ledger.span(f"{where}.forward", phase="forward", **span):
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
            with (_at(mb), _ledger.span(f"{where}.weight_grad", phase="backward", **span),
                  no_sync[c]() if skip else nullcontext()):
                wgrads.pop((mb, c))()
            stats._change(-1)
        else:
            skip = no_sync[c] is not None and (grad_sync is not None or i != last[("B", c)])
            sync = no_sync[c]() if skip else nullcontext()
            with (_at(mb), _ledger.span(f"{where}.backward", phase="backward", **span), sync,
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
            done_b += 1
            g = done_b - 1 - rank  # Megatron's backward_step_helper_postprocess
            if schedule == "interleaved" and grad_sync is not None and g >= 0 \
                    and backwards[g][0] == m - 1 and backwards[g][1] not in synced:
                synced.add(backwards[g][1])
                grad_sync[backwards[g][1]]()
    if grad_sync is not None:  # Megatron: "launch any remaining grad reductions"
        for c in range(v):
            if c not in synced:
                grad_sync[c]()
    if received or outbox or saved or handles or wgrads:  # a plan bug, never a user error
        raise RuntimeError(f"pipeline plan left messages behind: received={list(received)}, "
                           f"unsent={list(outbox)}, held={list(saved)}, "
                           f"in flight={list(handles)}, weight grads left={list(wgrads)}")
    if finalize_model_grads_func is not None and not forward_only:
        finalize_model_grads_func(chunks)
    return losses
