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
from ..mesh import ParallelMesh
from ..tensor_parallel.weight_grad import defer_weight_grads
from . import p2p
from .p2p import overlap_p2p as _overlap
from .p2p import tensor_shape_of
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


def _at(mb: int):
    led = _ledger.active()
    return led.at(microbatch=mb) if led is not None else nullcontext()


def _loss_of(result):
    """``(loss, report, tokens)`` of what a loss function returned: a loss; ``(loss, report)``;
    or, as Megatron's, ``(loss, num_tokens, report)`` (``tokens`` None but for that)."""
    if isinstance(result, (tuple, list)):
        return (result[0], result[1], None) if len(result) == 2 else \
            (result[0], result[2], result[1])
    return result, result.detach(), None


def execute(schedule, forward_step_func, data_iterators, chunks, num_microbatches, seq_length,
             micro_batch_size, forward_only, *, mesh, hidden_size, dtype=torch.float32,
             sequence_parallel=False, variable_seq_lengths=False, stats=None, no_sync_func=None,
             finalize_model_grads_func=None, overlap_p2p_comm=None, grad_sync_func=None,
             param_sync_func=None, calculate_per_token_loss=False):
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
    ``k - pp_rank`` (so every stage launches at the same moment), the rest at the end.

    ``param_sync_func`` (one per chunk; interleaved only: Megatron-LM's ``--align-param-gather``
    with ``--overlap-param-gather``) launches a chunk's parameter all-gathers: chunks 0 and 1
    before the first step, chunk ``c > 1`` before the forward of virtual microbatch ``k`` when
    ``k + pp_rank`` is chunk ``c - 1``'s first microbatch (Megatron-Core's
    ``forward_step_helper_preprocess``).

    ``calculate_per_token_loss`` (Megatron's flag): the loss function returns ``(loss,
    num_tokens, report)``; each microbatch's loss is differentiated as it is (not divided by
    ``num_tokens`` and the microbatches), and ``finalize_model_grads_func(chunks, num_tokens)``
    gets the stage's token count (zero but on the last stage) to divide the gradients by."""
    p, rank, v, m = mesh.pp.size, mesh.pp.rank, len(chunks), num_microbatches
    validate(schedule, p, m, v)
    if schedule == "interleaved" and v != mesh.vpp:
        raise ValueError(f"got {v} model chunks but the mesh has vpp = {mesh.vpp}")
    for chunk in chunks:
        if not hasattr(chunk, "set_input_tensor"):
            raise TypeError(f"the stage model {type(chunk).__name__} has no set_input_tensor(); "
                            f"the schedule passes each received activation through it")
    device = next((q.device for chunk in chunks for q in chunk.parameters()), None)
    overlap = _overlap(overlap_p2p_comm, device, variable_seq_lengths)
    plan = p2p_plan(schedule, p, m, rank, v, forward_only, overlap)
    no_sync = no_sync_func if isinstance(no_sync_func, (list, tuple)) else [no_sync_func] * v
    grad_sync = (grad_sync_func if isinstance(grad_sync_func, (list, tuple))
                 else [grad_sync_func] * v) if grad_sync_func is not None and not forward_only \
        else None
    if grad_sync is not None and not (schedule == "interleaved"
                                      or (schedule == "1f1b" and rank > 0)):
        grad_sync = None  # no pipelining, the first 1F1B stage, ZB-H1: the hooks launch
    stage = _Stage(
        mesh=mesh, schedule=schedule, plan=plan, chunks=chunks, data_iterators=data_iterators,
        forward_step_func=forward_step_func, m=m, forward_only=forward_only,
        shape=tensor_shape_of(seq_length, micro_batch_size, hidden_size, mesh,
                              sequence_parallel),
        dtype=dtype, device=device, variable_seq_lengths=variable_seq_lengths,
        stats=stats if stats is not None else PipelineStats(), no_sync=no_sync,
        grad_sync=grad_sync, param_sync=param_sync_func if schedule == "interleaved"
        and not forward_only else None,
        num_tokens=torch.zeros((), dtype=torch.int, device=device)
        if calculate_per_token_loss else None)
    if stage.param_sync is not None:  # Megatron: "synchronize params for first two chunks"
        stage.param_sync[0]()
        stage.param_sync[1]()
    for i, step in enumerate(plan):
        _STEPS[step[0]](stage, i, step)
    stage.finish()
    if finalize_model_grads_func is not None and not forward_only:
        finalize_model_grads_func(chunks, *(() if stage.num_tokens is None
                                            else (stage.num_tokens,)))
    return stage.losses


@dataclass
class _Stage:
    """One call's state while :func:`execute` runs the plan: the messages received, to send and
    in flight, the activations held for backward, the deferred weight gradients, the losses."""

    mesh: ParallelMesh
    schedule: str
    plan: list
    chunks: list
    data_iterators: list
    forward_step_func: object
    m: int
    forward_only: bool
    shape: tuple
    dtype: torch.dtype
    device: object
    variable_seq_lengths: bool
    stats: PipelineStats
    no_sync: list
    grad_sync: list | None
    param_sync: list | None = None
    num_tokens: torch.Tensor | None = None
    """The tokens of the losses so far (``calculate_per_token_loss``), int32 ``[]``."""
    received: dict = field(default_factory=dict)
    outbox: dict = field(default_factory=dict)
    saved: dict = field(default_factory=dict)
    handles: dict = field(default_factory=dict)
    wgrads: dict = field(default_factory=dict)
    """``(mb, chunk)`` -> runs the wgrad GEMMs a ZB-H1 B step deferred."""
    losses: list = field(default_factory=list)
    synced: set = field(default_factory=set)
    done_b: int = 0
    done_f: int = 0

    def __post_init__(self) -> None:
        p = self.mesh.pp.size
        # gradient sync (e.g. a data-parallel all-reduce) only in each chunk's last backward
        # (and, zero bubble, its last W: the deferred weight gradients become final there)
        self.last = {(s[0], s[2]): i for i, s in enumerate(self.plan) if s[0] in ("B", "W")}
        self.backwards = [(s[1], s[2]) for s in self.plan if s[0] == "B"]  # (mb, chunk)
        self.forwards = [(s[1], s[2]) for s in self.plan if s[0] == "F"]
        self.split = self.schedule == "zb-h1"
        self.where = "pipeline" if p > 1 else "microbatch"  # the compute spans' site
        self.last_vs = p * len(self.chunks) - 1

    def ops(self, step) -> list:
        return [(what, side, self.outbox.pop(msg) if what == "send" else None,
                 "forward" if msg[0] == "act" else "backward", msg[1])
                for what, side, msg in step[1]]

    def span(self, c: int) -> dict:
        if self.mesh.pp.size > 1:
            return dict(stage=self.mesh.pp.rank, chunk=c, module=f"chunk{c}")
        return dict(stage=0, chunk=0)

    def finish(self) -> None:
        if self.grad_sync is not None:  # Megatron: "launch any remaining grad reductions"
            for c in range(len(self.chunks)):
                if c not in self.synced:
                    self.grad_sync[c]()
        if self.received or self.outbox or self.saved or self.handles or self.wgrads:
            raise RuntimeError(  # a plan bug, never a user error
                f"pipeline plan left messages behind: received={list(self.received)}, "
                f"unsent={list(self.outbox)}, held={list(self.saved)}, "
                f"in flight={list(self.handles)}, weight grads left={list(self.wgrads)}")


def _post(st: _Stage, i: int, step) -> None:
    """Start the step's p2p without waiting; one handle per op."""
    handles = p2p.post(st.ops(step), mesh=st.mesh, tensor_shape=st.shape, dtype=st.dtype,
                       device=st.device)
    st.handles.update(zip(step[1], handles, strict=True))


def _wait(st: _Stage, i: int, step) -> None:
    """Wait for posted ops; received activations are what the stage differentiates against."""
    for op in step[1]:
        got = st.handles.pop(op).wait()[0]
        if op[0] == "recv":
            st.received[op[2]] = got.requires_grad_() if op[2][0] == "act" else got


def _comm(st: _Stage, i: int, step) -> None:
    """One blocking batch of sends and receives."""
    got = iter(p2p.communicate(st.ops(step), mesh=st.mesh, tensor_shape=st.shape,
                               dtype=st.dtype, variable_seq_lengths=st.variable_seq_lengths,
                               device=st.device))
    for what, _, msg in step[1]:
        if what == "recv":
            st.received[msg] = next(got)


def _forward(st: _Stage, i: int, step) -> None:
    """F: the chunk's forward on the received activation (the last virtual stage: the loss,
    divided by m: gradients of the mean over microbatches). Under ZB-H1 the layers (built with
    own_backward) can split their backward."""
    _, mb, c = step
    vs = c * st.mesh.pp.size + st.mesh.pp.rank
    ahead = st.done_f + st.mesh.pp.rank  # the chunk after the one that starts there: gathered
    st.done_f += 1
    if st.param_sync is not None and ahead < len(st.forwards) and st.forwards[ahead][0] == 0 \
            and 1 < st.forwards[ahead][1] + 1 < len(st.chunks):
        st.param_sync[st.forwards[ahead][1] + 1]()
    with _at(mb), _ledger.span(f"{st.where}.forward", phase="forward", **st.span(c)):
        inp = st.received.pop(("act", mb, vs - 1)) if vs > 0 else None  # [s, b, h]
        st.chunks[c].set_input_tensor(inp)
        out, loss_func = st.forward_step_func(st.data_iterators[c], st.chunks[c])
        if vs == st.last_vs:
            loss, info, tokens = _loss_of(loss_func(out))
            st.losses.append(info)
            if st.num_tokens is None:
                out = loss / st.m
            else:  # Megatron's per-token loss: the sum, divided by the step's tokens later
                st.num_tokens += tokens
                out = loss
        else:
            st.outbox[("act", mb, vs)] = out  # [s, b, h]
    if not st.forward_only:
        st.saved[(mb, c)] = (inp, out)
        st.stats._change(+1)


def _weight_grad(st: _Stage, i: int, step) -> None:
    """W (ZB-H1): the weight gradients a B step deferred; gradients sync at the chunk's last."""
    _, mb, c = step
    skip = st.no_sync[c] is not None and i != st.last[("W", c)]
    with (_at(mb), _ledger.span(f"{st.where}.weight_grad", phase="backward", **st.span(c)),
          st.no_sync[c]() if skip else nullcontext()):
        st.wgrads.pop((mb, c))()
    st.stats._change(-1)


def _backward(st: _Stage, i: int, step) -> None:
    """B: backward from the received gradient (or the loss), the input's gradient to send;
    gradients sync in the chunk's last backward unless the schedule launches them
    (``grad_sync``: interleaved syncs chunk ``backwards[done - 1 - pp_rank]`` once its last
    microbatch is done, Megatron's ``backward_step_helper_postprocess``)."""
    _, mb, c = step
    vs = c * st.mesh.pp.size + st.mesh.pp.rank
    skip = st.no_sync[c] is not None and (st.grad_sync is not None or i != st.last[("B", c)])
    sync = st.no_sync[c]() if skip else nullcontext()
    with (_at(mb), _ledger.span(f"{st.where}.backward", phase="backward", **st.span(c)), sync,
          defer_weight_grads() if st.split else nullcontext() as run_w):
        inp, out = st.saved.pop((mb, c))
        grad = st.received.pop(("grad", mb, vs + 1)) if vs < st.last_vs else None
        torch.autograd.backward(out, grad_tensors=grad)
        if vs > 0:
            st.outbox[("grad", mb, vs)] = inp.grad  # [s, b, h]
    if st.split:
        st.wgrads[(mb, c)] = run_w
    else:
        st.stats._change(-1)
    st.done_b += 1
    g = st.done_b - 1 - st.mesh.pp.rank
    if st.schedule == "interleaved" and st.grad_sync is not None and g >= 0 \
            and st.backwards[g][0] == st.m - 1 and st.backwards[g][1] not in st.synced:
        st.synced.add(st.backwards[g][1])
        st.grad_sync[st.backwards[g][1]]()


_STEPS = {"post": _post, "wait": _wait, "comm": _comm, "F": _forward, "W": _weight_grad,
          "B": _backward}
"""The plan's step kinds and the function that runs each."""
