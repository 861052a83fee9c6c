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
The communication each stage posts between its compute steps is planned from these orders in
:mod:`.plans` (``p2p_plan``; ``check_plans`` proves a set of plans cannot deadlock).
"""

from __future__ import annotations

from .zero_bubble import zb_h1_orders

__all__ = ["SCHEDULES", "validate", "warmup_count", "stage_order", "timetable", "bubble_fraction",
           "pipeline_bubble", "idle_share", "in_flight_profile", "max_in_flight"]

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
                         + " or ".join(map(str, sorted({max(p, m - m % p), m - m % p + p}))))


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
