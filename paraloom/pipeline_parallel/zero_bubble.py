"""The ZB-H1 zero-bubble order (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

Backward is split in two: ``B`` computes the input gradient (on the critical path: the previous
stage waits for it) and ``W`` the weight gradients (needed only by the optimizer step). ZB-H1
keeps 1F1B's order of ``F`` and ``B`` and defers each ``W`` into a slot where the stage would
otherwise wait, so with unit costs ``F = B = W = 1`` the bubble shrinks from 1F1B's
``3(p-1)`` slots per stage to ``p - 1``: bubble fraction ``(p-1)/(3m+p-1)`` for ``m >= p``.

Rule, simulated in unit time over all stages at once: stage ``r`` runs its next 1F1B step when
that step's input has arrived, else its oldest deferred ``W``; and it runs a ``W`` first once
more than ``r`` are deferred. That cap keeps stage ``r``'s held activations (forward done,
``W`` not yet) at most ``p`` like 1F1B's stage 0, the paper's memory bound for ZB-H1. The result
is one static op order per stage, which the runtime executes and the timetable replays.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["zb_h1_orders"]


@lru_cache(maxsize=64)
def zb_h1_orders(orders_1f1b: tuple[tuple[tuple[str, int, int], ...], ...]
                 ) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Per-stage ``(kind, mb, 0)`` orders with ``W`` steps, from each stage's 1F1B order."""
    p = len(orders_1f1b)
    done: dict[tuple[str, int, int], int] = {}  # (kind, mb, stage) -> finishing slot
    pos, deferred = [0] * p, [[] for _ in range(p)]
    out: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
    t = 0
    while any(pos[r] < len(orders_1f1b[r]) or deferred[r] for r in range(p)):
        ran = []
        for r in range(p):
            step = None
            if pos[r] < len(orders_1f1b[r]) and len(deferred[r]) <= r:
                kind, mb, _ = orders_1f1b[r][pos[r]]
                if kind == "F":
                    dep = ("F", mb, r - 1) if r > 0 else None
                else:
                    dep = ("B", mb, r + 1) if r < p - 1 else ("F", mb, r)
                if dep is None or done.get(dep, t) < t:
                    step = (kind, mb, 0)
            if step is None and deferred[r]:
                step = ("W", deferred[r][0], 0)
            if step is not None:
                ran.append((r, step))
        if not ran:
            raise RuntimeError(f"zb-h1 order is stuck at slot {t}")
        for r, (kind, mb, c) in ran:
            out[r].append((kind, mb, c))
            if kind == "W":
                deferred[r].pop(0)
            else:
                done[(kind, mb, r)] = t
                pos[r] += 1
                if kind == "B":
                    deferred[r].append(mb)
        t += 1
    return tuple(tuple(order) for order in out)
