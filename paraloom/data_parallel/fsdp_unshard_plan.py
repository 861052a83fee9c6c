"""Megatron-FSDP's ZeRO-3 bookkeeping: which bucket is gathered when (no tensors, no torch).

The rules (megatron-core 0.19.2's ``MegatronFSDP`` hooks and ``AllGatherPipeline``) are those of
:mod:`.megatron_fsdp_unshard`, which runs them on the real buckets; :func:`zero3_gathers` replays
them over one step of a pipeline-free GPT for the analysis (``paraloom check``, ``plan``).
"""

from __future__ import annotations

__all__ = ["UnshardPlan", "PREFETCH_LIMIT", "zero3_gathers", "group_order"]

PREFETCH_LIMIT = 500_000_000
"""Elements prefetched beyond the buckets asked for (Megatron-FSDP: half its communication unit,
at least 1B elements by default)."""
EMPTY, READY, PRESERVED, MOVING = "empty", "ready", "preserved", "communicating"
IDLE, FORWARD, BACKWARD = "idle", "forward", "pre_backward"


def group_order(buckets: list[tuple]) -> list[int]:
    """Megatron-FSDP's bucket order over ``(group, registration indices of its parameters)``
    per bucket (``group``: dense or expert, by unit): the groups in the order of their first
    parameter, each group's buckets in turn (paraloom's buffers hold the dense buckets, then the
    experts'). Returns the buckets' positions in that order."""
    first: dict = {}
    for group, indices in buckets:
        first[group] = min(first.get(group, min(indices)), min(indices))
    return sorted(range(len(buckets)), key=lambda k: (first[buckets[k][0]],
                                                      min(buckets[k][1])))


class UnshardPlan:
    """The state of every bucket (released, gathered, kept across steps) and of every module
    (idle, in forward, in backward). ``sizes``: each bucket's elements; ``unit_buckets``: unit
    key -> its buckets. Subclasses act in :meth:`_gather_now` and :meth:`_free`."""

    def __init__(self, sizes: list[int], unit_buckets: dict) -> None:
        self.sizes, self.unit_buckets = list(sizes), unit_buckets
        self.in_units = {b for ids in unit_buckets.values() for b in ids}
        self.status = [EMPTY] * len(sizes)  # Megatron-FSDP shards the model when it wraps it
        self.releasable = [False] * len(sizes)
        self.state: dict = {}

    # ------------------------------------------------------------------ the hooks' rules
    def pre_forward(self, key, owned: list[int], phase: str = "forward") -> None:
        """Before a module's forward: its buckets, prefetching forward unless in backward
        (``phase`` ``backward``: a recomputation's re-run)."""
        prefetch = self.state.get(key, IDLE) != BACKWARD
        if prefetch:
            self.state[key] = FORWARD
        self.gather(owned, prefetch=prefetch, forward=True, phase=phase)

    def post_forward(self, unit) -> None:
        """After a unit's forward: released (lazily, at the next gather, in a recomputation)."""
        again = self.state.get(unit) == BACKWARD
        for b in self.unit_buckets[unit]:
            if again:
                self.releasable[b] = True
            else:
                self.release(b)
        if not again:
            self.state[unit] = IDLE

    def pre_backward(self, unit, keys) -> None:
        """Before a unit's backward (``keys``: it and its submodules)."""
        for key in keys:
            self.state[key] = BACKWARD
        self.gather(self.unit_buckets[unit], prefetch=True, forward=False, phase="backward")

    def post_backward(self, unit, keys) -> None:
        for b in self.unit_buckets[unit]:
            self.release(b)
        for key in keys:
            self.state[key] = IDLE

    def root_pre_backward(self, keys) -> None:
        """A backward starts: every module in its backward state, the units releasable."""
        for key in keys:
            self.state[key] = BACKWARD
        for b in self.in_units:
            self.releasable[b] = True

    def after_step(self) -> None:
        """After the optimizer step: the units released, the rest kept, then all gathered."""
        for b in range(len(self.sizes)):
            if b in self.in_units:
                self.release(b)
            elif self.status[b] == READY:
                self.status[b] = PRESERVED
            self.releasable[b] = False
        for b in range(len(self.sizes)):
            self.status[b] = MOVING
        self._gather_now(list(range(len(self.sizes))), "optimizer")

    # ------------------------------------------------------------------ buckets
    def gather(self, asked: list[int], *, prefetch: bool, forward: bool, phase: str) -> None:
        """``all_gather_params``: ``asked`` plus, with ``prefetch``, the next buckets in pass
        order up to :data:`PREFETCH_LIMIT`; the released ones gathered, in bucket order."""
        ag = sorted(set(asked))
        if not ag:
            return
        for b in ag:
            self.releasable[b] = False
        if prefetch:
            base = self._size(ag)
            nxt = self._next(ag, forward)
            while nxt is not None and self._size(ag) - base < PREFETCH_LIMIT:
                ag = sorted({*ag, nxt})
                nxt = self._next(ag, forward)
        todo = [b for b in ag if self.status[b] in (EMPTY, PRESERVED)]
        for b in todo:
            self.releasable[b] = False
            self.status[b] = MOVING
            self.recycle()
        if todo:
            self._gather_now(todo, phase)

    def recycle(self) -> None:
        """Release every bucket marked releasable (Megatron-FSDP does before each gather)."""
        for b, lazy in enumerate(self.releasable):
            if lazy:
                self.release(b)
                self.releasable[b] = False

    def release(self, b: int) -> None:
        if self.status[b] != EMPTY:
            self.status[b] = EMPTY
            self._free(b)

    def _gather_now(self, buckets: list[int], phase: str) -> None:
        for b in buckets:
            self.status[b] = READY

    def _free(self, b: int) -> None:
        """Nothing to free in the plan."""

    def _size(self, ids: list[int]) -> int:
        return sum(self.sizes[b] for b in ids)

    def _next(self, ids: list[int], forward: bool) -> int | None:
        """The first bucket past the run of consecutive ones at the start (forward) or the end
        (backward) of ``ids``."""
        step = 1 if forward else -1
        b = ids[0] if forward else ids[-1]
        while b + step in ids:
            b += step
        b += step
        return b if 0 <= b < len(self.sizes) else None


class _Recorder(UnshardPlan):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.events: list[tuple[str, int, str, int]] = []
        self.where, self.mb = "", 0

    def _gather_now(self, buckets: list[int], phase: str) -> None:
        self.events += [(phase, b, self.where, self.mb) for b in buckets]
        super()._gather_now(buckets, phase)


def zero3_gathers(sizes: list[int], unit_buckets: list[list[int]], rest: dict[str, list[int]],
                  microbatches: int, first_step: bool, recompute: bool = False
                  ) -> list[tuple[str, int, str, int]]:
    """One training step's parameter gathers ``(phase, bucket, where, microbatch)`` in order (the
    optimizer step's: the last microbatch's number), for a GPT on
    one pipeline stage: ``unit_buckets[i]`` layer i's buckets; ``rest``: each module outside the
    layers, in forward order before/after them (``"embedding"``, ``"final_layernorm"``,
    ``"output_layer"``), with the buckets of its own parameters. ``where``: the module whose
    hook gathers (``layers.i`` for a unit; ``recompute layers.i``: its re-run's forward hook
    under full ``recompute``, which Megatron's checkpoint runs inside the backward, before the
    unit's pre-backward), for the order table. The state is the one a process reaches: its first
    step from scratch, a later one after at least one step."""
    plan = _Recorder(sizes, {i: ids for i, ids in enumerate(unit_buckets)})
    keys = ["embedding", *range(len(unit_buckets)), "final_layernorm", "output_layer"]
    for warm in ([] if first_step else [True]) + [False]:
        if not warm:
            plan.events = []
        for mb in range(microbatches):
            plan.mb = mb
            _microbatch(plan, rest, len(unit_buckets), keys, recompute)
        plan.where = "optimizer"
        plan.after_step()
    return plan.events


def _microbatch(plan: _Recorder, rest: dict, layers: int, keys: list, recompute: bool) -> None:
    for name in ("embedding",):
        plan.where = name
        plan.pre_forward(name, rest.get(name, []))
    for i in range(layers):
        plan.where = f"layers.{i}"
        plan.pre_forward(i, plan.unit_buckets[i])
        plan.post_forward(i)
    for name in ("final_layernorm", "output_layer"):
        plan.where = name
        plan.pre_forward(name, rest.get(name, []))
    plan.root_pre_backward(keys)
    for i in reversed(range(layers)):
        if recompute:  # the re-run: the unit's forward hooks in its backward state
            plan.where = f"recompute layers.{i}"
            plan.pre_forward(i, plan.unit_buckets[i], phase="recompute")
            plan.post_forward(i)
        plan.where = f"layers.{i}"
        plan.pre_backward(i, [i])
        plan.post_backward(i, [i])
