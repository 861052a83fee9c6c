"""Tensor-parallel RNG tracker: dropout inside split regions differs per tp rank, reproducibly.

Two streams, as in Megatron: the default generator is seeded identically on every tp rank (dropout
on replicated activations must agree), and a named ``"model-parallel-rng"`` stream is seeded with
``seed + 2718 + tp_rank`` for dropout on tp-split activations (attention probabilities of local
heads), entered with ``with get_rng_tracker().fork():``. Forking swaps the device's default
generator state in and out, so code inside uses ordinary ``torch`` random calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .. import ledger as _ledger
from ..device import get_rng_state, set_rng_state

__all__ = ["RNGStatesTracker", "get_rng_tracker", "model_parallel_seed", "reseed_for_step",
           "tensor_parallel_seed", "checkpoint", "CheckpointFunction", "MODEL_PARALLEL_RNG",
           "rng_state_dict",
           "load_rng_state_dict"]

MODEL_PARALLEL_RNG = "model-parallel-rng"
TP_SEED_OFFSET = 2718
"""Megatron's offset of the tensor-parallel stream: ``seed + 2718 + tp_rank``."""
STEP_SEED_STRIDE = 1_000_003
"""A run re-seeded at step ``k`` (resumed under another layout) uses ``seed + k * stride``: a
prime, so two (seed, step) pairs of a run never meet."""


def tensor_parallel_seed(seed: int, tp_rank: int) -> int:
    """The seed of tp rank ``tp_rank``'s model-parallel stream."""
    return seed + TP_SEED_OFFSET + tp_rank


class RNGStatesTracker:
    """Named generator states for one device; ``fork(name)`` runs a block on that stream."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: dict[str, int] = {}

    def reset(self) -> None:
        self.states.clear()
        self.seeds.clear()

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed`` (each name and seed used once)."""
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists (seed {self.seeds[name]})")
        if seed in self.seeds.values():
            raise ValueError(f"seed {seed} is already used by another RNG stream")
        self.states[name] = torch.Generator(self.device).manual_seed(seed).get_state()
        self.seeds[name] = seed

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on stream ``name``; the stream advances, the default one is untouched."""
        if name not in self.states:
            raise KeyError(f"RNG stream {name!r} was not added; known: {sorted(self.states)}")
        outer = get_rng_state(self.device)
        set_rng_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = get_rng_state(self.device)
            set_rng_state(outer, self.device)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (one per rank)."""
    return _TRACKER


def model_parallel_seed(seed: int, tp_rank: int, device: torch.device | str = "cpu") -> None:
    """Seed the default stream with ``seed`` and the tensor-parallel stream with
    ``seed + 2718 + tp_rank`` (Megatron's ``model_parallel_cuda_manual_seed``)."""
    global _TRACKER
    torch.manual_seed(seed)
    _TRACKER = RNGStatesTracker(device)
    _TRACKER.add(MODEL_PARALLEL_RNG, tensor_parallel_seed(seed, tp_rank))


def reseed_for_step(seed: int, step: int, tp_rank: int, device: torch.device | str = "cpu"
                    ) -> None:
    """:func:`model_parallel_seed` for a run continued at ``step`` without its own streams."""
    model_parallel_seed(seed + STEP_SEED_STRIDE * step, tp_rank, device)


def rng_state_dict(device: torch.device | str = "cpu") -> dict:
    """Every generator this rank's dropout draws from, as plain tensors (for a checkpoint).

    ``cpu``: torch's default CPU generator; ``device``: the default generator of a CUDA device
    (absent on CPU, where it is the same as ``cpu``); ``tracker``: the tracker's named streams.
    The states are per rank: rank r's streams are only meaningful for rank r of the same layout.
    """
    device = torch.device(device)
    state = {"device_type": device.type, "cpu": torch.get_rng_state(),
             "tracker": {name: s.clone() for name, s in get_rng_tracker().states.items()}}
    if device.type != "cpu":
        state["device"] = get_rng_state(device)
    return state


def load_rng_state_dict(state: dict, device: torch.device | str = "cpu") -> None:
    """Restore what :func:`rng_state_dict` captured (on a device of the same type)."""
    device = torch.device(device)
    if state.get("device_type") != device.type:
        raise ValueError(f"RNG state was captured on {state.get('device_type')!r}, this rank "
                         f"runs on {device.type!r}: generator states do not carry over")
    torch.set_rng_state(state["cpu"])
    if device.type != "cpu":
        set_rng_state(state["device"], device)
    tracker = get_rng_tracker()
    for name, s in state["tracker"].items():
        tracker.states[name] = s.clone()


class CheckpointFunction(torch.autograd.Function):
    """Activation recomputation as Megatron-Core's (reentrant) ``CheckpointFunction``.

    Forward: run ``function`` without autograd, keep only its inputs and the random state.
    Backward: restore the random state (the default generator and every tracker stream, so dropout
    draws the same masks), re-run all of ``function`` with autograd, then back-propagate the
    output gradients through the re-run. The re-run comes *first* in the block's backward, before
    any of the block's own backward communication (with sequence parallelism, the re-run's
    all-gathers and reduce-scatters precede the all-gather of the block's output gradient), as in
    Megatron; torch's non-reentrant checkpoint would re-run lazily, after it. Communications of
    the re-run are recorded with ``recompute: true``.
    """

    @staticmethod
    def forward(ctx, function, device, *args):
        ctx.function, ctx.device = function, device
        ctx.cpu_state = torch.get_rng_state()
        ctx.device_state = get_rng_state(device)
        ctx.tracker_states = {n: st.clone() for n, st in get_rng_tracker().states.items()}
        ctx.tensor_at = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_at))
        with torch.no_grad():
            return function(*args)

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_at, ctx.saved_tensors, strict=True):
            args[i] = t.detach().requires_grad_(t.requires_grad)
        tracker, led = get_rng_tracker(), _ledger.active()
        now = (torch.get_rng_state(), get_rng_state(ctx.device), tracker.states)
        outer = led.recompute if led else False
        torch.set_rng_state(ctx.cpu_state)
        set_rng_state(ctx.device_state, ctx.device)
        tracker.states = {n: st.clone() for n, st in ctx.tracker_states.items()}
        if led:
            led.recompute = True
        try:
            with torch.enable_grad():
                outputs = ctx.function(*args)
        finally:
            torch.set_rng_state(now[0])
            set_rng_state(now[1], ctx.device)
            tracker.states = now[2]
            if led:
                led.recompute = outer
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(a.grad if torch.is_tensor(a) and a.requires_grad else None
                              for a in args))


def checkpoint(function, *args):
    """Activation recomputation: keep only ``args``, re-run ``function`` first in backward
    (:class:`CheckpointFunction`). ``args`` must hold at least one tensor that needs a gradient
    (a layer's hidden states)."""
    device = next((a.device for a in args if torch.is_tensor(a)), torch.device("cpu"))
    return CheckpointFunction.apply(function, device, *args)
