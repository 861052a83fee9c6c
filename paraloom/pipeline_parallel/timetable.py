"""Pipeline schedules as pure data: per-stage op orders, unit-time timetables and p2p plans.

Everything here is logic without processes; the runtime (:mod:`.schedules`) executes the very
plans built here, and the tests and the schedule picture read the same timetables.

* :func:`stage_order` — the order in which one stage runs its forward (``F``) and backward
  (``B``) steps: ``(kind, microbatch, chunk)``. Schedules: ``"none"`` (one stage, gradient
  accumulation), ``"gpipe"`` (all forwards, then all backwards), ``"1f1b"`` (warm-up of
  ``min(p - rank - 1, m)`` forwards, steady one-forward-one-backward, cool-down) and
  ``"interleaved"`` (1F1B over ``v`` chunks per stage, Megatron's order) and ``"zb-h1"`` (1F1B
  with backward split into ``B``, the input gradient, and ``W``, the deferred weight gradient;
  see :mod:`.zero_bubble`).
* :func:`timetable` — simulate all stages with unit-time steps: a list of time slots, each a list
  of ``(stage, "F" | "B" | "W", microbatch, chunk)`` running in it. An op starts once its
  dependency (the previous virtual stage's forward, the next one's backward, a ``W``'s own
  ``B``) finished in an earlier slot.
* :func:`p2p_plan` — the communication each stage posts between its compute steps (see there);
  :func:`check_plans` proves a set of plans matches message for message and cannot deadlock.
"""

from __future__ import annotations

from .plan_check import check_plans
from .zero_bubble import zb_h1_orders

__all__ = ["SCHEDULES", "validate", "warmup_count", "stage_order", "timetable", "bubble_fraction",
           "pipeline_bubble", "idle_share", "in_flight_profile", "max_in_flight", "p2p_plan",
           "check_plans"]

SCHEDULES = ("none", "gpipe", "1f1b", "interleaved", "zb-h1")


def validate(schedule: str, p: int, m: int, v: int = 1) -> None:
    """Raise ``ValueError`` naming the value unless ``(schedule, p, m, v)`` is runnable."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    for name, value in (("pp", p), ("num_microbatches", m), ("vpp", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if schedule == "none" and p != 1:
        raise ValueError(f"no pipelining runs on one stage, got pp = {p}")
    if schedule != "interleaved" and v != 1:
        raise ValueError(f"vpp = {v} needs the interleaved schedule, not {schedule!r}")
    if schedule == "interleaved" and m % p:
        raise ValueError(f"the interleaved schedule needs num_microbatches to be a multiple of "
                         f"pp (as Megatron): got num_microbatches = {m}, pp = {p}; use "
                         f"{max(p, m - m % p)} or {m - m % p + p}")


def warmup_count(schedule: str, p: int, m: int, rank: int, v: int = 1) -> int:
    """Forward steps stage ``rank`` runs before its first backward."""
    if schedule in ("1f1b", "zb-h1"):
        return min(p - rank - 1, m)
    if schedule == "interleaved":  # Megatron: 2 per later stage, plus (v - 1) rounds of p
        return min((p - rank - 1) * 2 + (v - 1) * p, m * v)
    return m * v  # none / gpipe: every forward first (none interleaves F/B itself)


def _interleaved_id(k: int, p: int, m: int, v: int, backward: bool) -> tuple[int, int]:
    """Megatron's k-th virtual microbatch: groups of p microbatches sweep the chunks in turn."""
    group, pos = divmod(k, p * v)
    chunk = pos // p
    return group * p + pos % p, (v - 1 - chunk) if backward else chunk


def stage_order(schedule: str, p: int, m: int, rank: int, v: int = 1,
                forward_only: bool = False) -> list[tuple[str, int, int]]:
    """The ``(kind, microbatch, chunk)`` steps of stage ``rank`` in execution order."""
    validate(schedule, p, m, v)
    if not 0 <= rank < p:
        raise ValueError(f"stage {rank} is outside 0..{p - 1}")
    total = m * v
    if schedule == "interleaved":
        fwd = [("F", *_interleaved_id(k, p, m, v, False)) for k in range(total)]
        bwd = [("B", *_interleaved_id(k, p, m, v, True)) for k in range(total)]
    else:
        fwd = [("F", i, 0) for i in range(m)]
        bwd = [("B", i, 0) for i in range(m)]
    if forward_only:
        return fwd
    if schedule == "none":
        return [op for pair in zip(fwd, bwd, strict=True) for op in pair]
    if schedule == "zb-h1":
        return list(zb_h1_orders(tuple(tuple(stage_order("1f1b", p, m, r)) for r in range(p)))
                    [rank])
    w = warmup_count(schedule, p, m, rank, v)
    order = fwd[:w]
    for k in range(total - w):  # steady state: one forward, one backward
        order += [fwd[w + k], bwd[k]]
    return order + bwd[total - w:]


def _orders(schedule, p, m, v, forward_only):
    return [stage_order(schedule, p, m, r, v, forward_only) for r in range(p)]


def timetable(schedule: str, p: int, m: int, v: int = 1,
              forward_only: bool = False) -> list[list[tuple[int, str, int, int]]]:
    """Unit-time simulation: ``slots[t]`` lists the ``(stage, kind, mb, chunk)`` run at ``t``."""
    orders = _orders(schedule, p, m, v, forward_only)
    last_vs = p * v - 1
    done: dict[tuple[str, int, int], int] = {}  # (kind, mb, virtual stage) -> finishing slot
    pos, slots = [0] * p, []
    while any(pos[r] < len(orders[r]) for r in range(p)):
        t, slot = len(slots), []
        for r in range(p):
            if pos[r] == len(orders[r]):
                continue
            kind, mb, c = orders[r][pos[r]]
            vs = c * p + r
            if kind == "F":
                dep = ("F", mb, vs - 1) if vs > 0 else None
            elif kind == "W":  # the weight gradient of this stage's own backward
                dep = ("B", mb, vs)
            else:
                dep = ("B", mb, vs + 1) if vs < last_vs else ("F", mb, vs)
            if dep is None or done.get(dep, t) < t:
                slot.append((r, kind, mb, c))
        for r, kind, mb, c in slot:
            done[(kind, mb, c * p + r)] = t
            pos[r] += 1
        if not slot:
            raise RuntimeError(f"schedule {schedule!r} (p={p}, m={m}, v={v}) is stuck at slot {t}")
        slots.append(slot)
    return slots


def idle_share(busy: float, rows: int, span: float) -> float:
    """The bubble of any drawn or recorded schedule: the share of ``rows`` stages x ``span``
    (time slots, or seconds) in which a stage does nothing (``busy``: the stages' busy total)."""
    return 1.0 - busy / (rows * span) if rows and span > 0 else 0.0


def bubble_fraction(slots: list[list[tuple]], p: int) -> float:
    """Idle share of the ``p * len(slots)`` stage-slots of a timetable: what
    :func:`pipeline_bubble` predicts."""
    return idle_share(sum(len(slot) for slot in slots), p, len(slots))


def pipeline_bubble(pp: int, num_microbatches: int, vpp: int | None = None,
                    schedule: str = "1f1b") -> float:
    """The bubble in closed form: ``(p-1)/(m+p-1)`` for GPipe and 1F1B (Narayanan et al. 2021),
    ``(p-1)/(v m+p-1)`` interleaved, ``(p-1)/(3m+p-1)`` for ZB-H1 (``m >= p``: its ``B`` and
    ``W`` take one slot each), 0 without pipelining."""
    if schedule == "none" or pp == 1:
        return 0.0
    factor = 3 if schedule == "zb-h1" else (vpp or 1)
    return (pp - 1) / (factor * num_microbatches + pp - 1)


def in_flight_profile(ops) -> list[int]:
    """Microbatch-chunks whose activations are held after each op of one stage's op sequence
    (until the backward, or until the ``W`` step where the weight gradient is deferred)."""
    ops = list(ops)
    release = "W" if any(kind == "W" for kind, _, _ in ops) else "B"
    held, profile = set(), []
    for kind, mb, chunk in ops:
        if kind == "F":
            held.add((mb, chunk))
        elif kind == release:
            held.discard((mb, chunk))
        profile.append(len(held))
    return profile


def max_in_flight(slots: list[list[tuple]], stage: int) -> int:
    """Most microbatch-chunks stage ``stage`` holds at once in a (training) timetable."""
    ops = [(k, mb, c) for slot in slots for s, k, mb, c in slot if s == stage]
    return max(in_flight_profile(ops), default=0)


# ----------------------------------------------------------------------------- p2p plans
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
    for group, recvs in zip(groups, needs, strict=True):
        ops = _megatron_order([("send", _side(msg), msg) for msg in pending] + recvs, p)
        if ops:
            plan.append(("comm", ops))
        plan += group
        pending = [msg for msg in (_produced(op, rank, p, v) for op in group) if msg]
    if pending:
        plan.append(("comm", _megatron_order([("send", _side(msg), msg) for msg in pending], p)))
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
