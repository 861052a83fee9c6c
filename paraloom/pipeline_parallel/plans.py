"""Pipeline p2p plans: what each stage posts and waits for between its compute steps.

:func:`p2p_plan` turns a stage's order (:func:`.timetable.stage_order`) into compute steps and
communication entries -- blocking batches as Megatron-Core's p2p functions issue them, or the
overlapped plan that posts receives one step ahead; :func:`check_plans` (:mod:`.plan_check`)
proves a set of plans matches message for message and cannot deadlock. The runtime
(:mod:`.runtime`) executes exactly these plans.
"""

from __future__ import annotations

from .plan_check import check_plans
from .timetable import stage_order, warmup_count

__all__ = ["p2p_plan", "check_plans", "batch_site"]


def batch_site(ops) -> str:
    """Megatron's name for a batch of ``(send | recv, phase)`` ops:
    ``p2p.send_forward_recv_backward`` and so on (one op: ``p2p.recv_forward``)."""
    parts = []
    for what in ("send", "recv"):
        phases = [ph for ph in ("forward", "backward") if (what, ph) in ops]
        if phases:
            parts.append(f"{what}_{'_'.join(phases)}")
    return "p2p." + "_".join(parts)


def _produced(op, rank, p, v):
    """The message op ``(kind, mb, chunk)`` of stage ``rank`` sends: (kind, mb, source vs)."""
    kind, mb, c = op
    vs = c * p + rank
    if kind == "F" and vs < p * v - 1:
        return ("act", mb, vs)
    if kind == "B" and vs > 0:
        return ("grad", mb, vs)
    return None


def _needed(op, rank, p, v):
    kind, mb, c = op
    vs = c * p + rank
    if kind == "F" and vs > 0:
        return ("act", mb, vs - 1)
    if kind == "B" and vs < p * v - 1:
        return ("grad", mb, vs + 1)
    return None


def _side(msg):
    """Where a message goes: activations to the next stage, gradients to the previous one."""
    return "next" if msg[0] == "act" else "prev"


def _groups(schedule, p, m, rank, v, forward_only):
    """Steps that share one communication batch: interleaved 1F1B pairs its steady-state F and B
    (Megatron's send_forward_backward_recv_forward_backward); everything else goes one by one."""
    order = stage_order(schedule, p, m, rank, v, forward_only)
    if schedule != "interleaved" or forward_only:
        return [[op] for op in order]
    w, total = warmup_count(schedule, p, m, rank, v), m * v
    steady_end = w + 2 * (total - w)
    return ([[op] for op in order[:w]] + [order[i:i + 2] for i in range(w, steady_end, 2)]
            + [[op] for op in order[steady_end:]])


def _recv(msg):
    return ("recv", "prev" if msg[0] == "act" else "next", msg)


def p2p_plan(schedule: str, p: int, m: int, rank: int, v: int = 1,
             forward_only: bool = False, overlap: bool = False) -> list[tuple]:
    """What stage ``rank`` does, in order: communication entries and ``(kind, mb, chunk)``.

    Ops are ``("send" | "recv", side, (kind, mb, source virtual stage))`` with side ``"next"``
    or ``"prev"``. Blocking (``overlap=False``), Megatron's rule generalised: before each
    compute step (each steady-state F+B pair when interleaved) one ``("comm", ops)`` batch posts
    the *sends* of the previous step's outputs together with the *receives* the step needs
    (send_forward_recv_backward in 1F1B's steady state, and so on) and waits for all of them, so
    neighbours meet in the same batch instead of each waiting on a send the other has not yet
    received.

    Overlapped (``overlap=True``, Megatron's ``overlap_p2p_comm``): ``("post", ops)`` starts
    ops without waiting, ``("wait", ops)`` blocks until posted ops finished. The receives a step
    needs are posted before the step *before* it computes, so the transfer overlaps that compute;
    each step waits only for its own receive, right before it runs; each output is sent as soon
    as it is computed, and a send is waited for only after the next step computed (its tensor is
    left untouched meanwhile) or at the end. Every op is posted in the same per-peer order as in
    the blocking plan, and never later, so the matching is the same.

    Matching is first-in-first-out per pair of ranks, so every receiver must take a peer's
    messages in the order the peer sends them; with ``pp = 2`` and interleaving, activations and
    gradients share the two directions and a wrong order would silently swap equal-shaped
    tensors. :func:`check_plans` verifies exactly that (and deadlock freedom); the tests run it
    over many ``(schedule, p, m, v)``.
    """
    if overlap and schedule == "interleaved":
        return _interleaved_overlapped(p, m, rank, v, forward_only)
    groups = _groups(schedule, p, m, rank, v, forward_only)
    needs = [[_recv(msg) for msg in (_needed(op, rank, p, v) for op in group) if msg]
             for group in groups]
    plan, pending = [], []
    if overlap:
        if needs and needs[0]:
            plan.append(("post", needs[0]))
        for k, group in enumerate(groups):
            if k + 1 < len(groups) and needs[k + 1]:
                plan.append(("post", needs[k + 1]))
            sends = []
            for op in group:
                need = _needed(op, rank, p, v)
                if need is not None:
                    plan.append(("wait", [_recv(need)]))
                plan.append(op)
                out = _produced(op, rank, p, v)
                if out is not None:
                    sends.append(("send", _side(out), out))
                    plan.append(("post", [sends[-1]]))
            if pending:
                plan.append(("wait", pending))
            pending = sends
        return plan + ([("wait", pending)] if pending else [])
    if schedule == "1f1b":
        return _one_f_one_b(p, m, rank, forward_only)
    for group, recvs in zip(groups, needs, strict=True):
        ops = _megatron_order([("send", _side(msg), msg) for msg in pending] + recvs, p)
        if ops:
            plan.append(("comm", ops))
        plan += group
        pending = [msg for msg in (_produced(op, rank, p, v) for op in group) if msg]
    if pending:
        plan.append(("comm", _megatron_order([("send", _side(msg), msg) for msg in pending], p)))
    return plan


_EVEN_ORDER = {("send", "next"): 0, ("recv", "prev"): 1, ("send", "prev"): 2, ("recv", "next"): 3}
_ODD_ORDER = {("recv", "prev"): 0, ("send", "next"): 1, ("recv", "next"): 2, ("send", "prev"): 3}


def _p2p_order(ops: list, rank: int) -> list:
    """One unbatched call in Megatron-Core's order (``_p2p_ops``, what it uses with
    ``overlap_p2p_comm``): an even stage sends to the next, receives from the previous, sends to
    the previous, receives from the next; an odd stage receives first in each direction."""
    order = _EVEN_ORDER if rank % 2 == 0 else _ODD_ORDER
    return sorted((op for op in ops if op is not None), key=lambda op: order[op[0], op[1]])


def _interleaved_overlapped(p: int, m: int, rank: int, v: int, forward_only: bool) -> list:
    """Megatron-Core's interleaved schedule with ``overlap_p2p_comm`` (Megatron-LM's default for
    interleaving; ``overlap_p2p_comm_warmup_flush`` off), every call in ``_p2p_ops``' order:

    * warm-up: ``recv_forward``; after each forward a blocking ``send_forward_recv_forward``;
      after the last, the first backward's receive posted (``send_backward_recv_backward``);
    * steady state, per forward-backward pair: wait for the forward's input, F, post its send
      with the next forward's receive and wait for that send (the output is freed after it), wait
      for the backward's gradient, B, post its send with the next backward's receive (the
      previous backward's send is waited for then);
    * cool-down: wait for the posted receive, then B and a blocking ``send_backward_recv_backward``
      each; the last backward send of the steady state is waited for at the end.
    """
    order = stage_order("interleaved", p, m, rank, v, forward_only)
    fs = [op for op in order if op[0] == "F"]
    bs = [op for op in order if op[0] == "B"]
    total = len(fs)
    w = total if forward_only else warmup_count("interleaved", p, m, rank, v)

    def need(op):
        msg = _needed(op, rank, p, v) if op is not None else None
        return _recv(msg) if msg else None

    def out(op):
        msg = _produced(op, rank, p, v)
        return ("send", _side(msg), msg) if msg else None

    def at(ops, i):
        return ops[i] if i < len(ops) else None

    plan: list[tuple] = []

    def call(kind, *ops):
        ops = _p2p_order(list(ops), rank)
        if ops:
            plan.append((kind, ops))
        return ops

    call("comm", need(fs[0]))
    posted_b, sent_b = [], []
    for k in range(w):
        plan.append(fs[k])
        call("comm", out(fs[k]), need(at(fs, k + 1)))
        if k == w - 1 and w < total:
            posted_b = call("post", need(bs[0]))
    posted_f = []
    for j in range(total - w):
        f, b = fs[w + j], bs[j]
        if posted_f:
            plan.append(("wait", posted_f))
        plan.append(f)
        send = out(f)
        nxt = need(at(fs, w + j + 1))
        call("post", send, nxt)
        if send:
            plan.append(("wait", [send]))
        posted_f = [nxt] if nxt else []
        if posted_b:
            plan.append(("wait", posted_b))
        plan.append(b)
        send = out(b)
        nxt = need(at(bs, j + 1))
        call("post", send, nxt)
        if sent_b:
            plan.append(("wait", sent_b))
        sent_b, posted_b = ([send] if send else []), ([nxt] if nxt else [])
    if not forward_only:
        if w == total:
            call("comm", need(bs[0]))
        for i in range(total - w, total):
            if posted_b:
                plan.append(("wait", posted_b))
                posted_b = []
            plan.append(bs[i])
            call("comm", out(bs[i]), need(at(bs, i + 1)))
    if sent_b:
        plan.append(("wait", sent_b))
    return plan


def _one_f_one_b(p: int, m: int, rank: int, forward_only: bool) -> list[tuple]:
    """Blocking 1F1B as Megatron-Core calls its p2p functions, one batch per call: warm-up
    ``recv_forward``, F, ``send_forward`` (separately, so a middle stage posts recv, send, recv);
    one more ``recv_forward`` before the steady state; then F, ``send_forward_recv_backward``, B,
    ``send_backward_recv_forward`` (``send_backward`` after the last); cool-down
    ``recv_backward``, B, ``send_backward``. Forward only: F, ``send_forward``, ``recv_forward``.
    """
    w = warmup_count("1f1b", p, m, rank)
    plan: list[tuple] = []

    def comm(*ops):
        ops = [op for op in ops if op is not None]
        if ops:
            plan.append(("comm", _megatron_order(ops, p)))

    def recv(kind, mb):
        msg = _needed((kind, mb, 0), rank, p, 1)
        return _recv(msg) if msg else None

    def send(kind, mb):
        msg = _produced((kind, mb, 0), rank, p, 1)
        return ("send", _side(msg), msg) if msg else None

    for i in range(w):
        comm(recv("F", i))
        plan.append(("F", i, 0))
        comm(send("F", i))
    if m > w:
        comm(recv("F", w))
    for k in range(m - w):
        i, last = w + k, k == m - w - 1
        plan.append(("F", i, 0))
        if forward_only:
            comm(send("F", i))
            if not last:
                comm(recv("F", i + 1))
            continue
        comm(send("F", i), recv("B", k))
        plan.append(("B", k, 0))
        comm(send("B", k), None if last else recv("F", i + 1))
    if not forward_only:
        for k in range(m - w, m):
            comm(recv("B", k))
            plan.append(("B", k, 0))
            comm(send("B", k))
    return plan


_BATCH_ORDER = {("send", "prev"): 0, ("recv", "prev"): 1, ("send", "next"): 2,
                ("recv", "next"): 3}


def _megatron_order(ops: list, p: int) -> list:
    """A blocking batch in Megatron-Core's order (``_batched_p2p_ops``: send to the previous
    stage, receive from it, send to the next, receive from it). Kept as planned when ``p = 2``
    and two sends or two receives of the batch go to the one neighbour (interleaved): FIFO
    matching then needs the planned order (Megatron-LM refuses that layout: interleaving with
    blocking batches needs ``pp > 2``)."""
    if p == 2 and any(sum(1 for o in ops if o[0] == what) > 1 for what in ("send", "recv")):
        return ops
    return sorted(ops, key=lambda op: _BATCH_ORDER[op[0], op[1]])
