"""CUDA as Megatron-Core asks for it, answered on a CPU (``record --megatron-on-cpu``).

A ``torch`` stand-in for the modules of :data:`paraloom.record.megatron_core_cpu.CUDA_MODULES`: its
tensor factories put ``device="cuda"`` tensors on the CPU, its ``torch.cuda.current_device()``
is the CPU (its random state the CPU generator's), ``synchronize`` does nothing, and its streams and
events do nothing either (work on
a CPU is synchronous: an event is reached when it is recorded). Every other name is torch's.
"""

from __future__ import annotations

import contextlib
import types

import torch

__all__ = ["torch_on_cpu", "TORCH"]

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like",
              "empty_like", "full_like", "rand", "randn", "randint", "as_tensor")


class _NullEvent:
    """A CUDA event on a CPU: already reached (work is synchronous)."""

    def __init__(self, *_args, **_kwargs) -> None:
        pass

    def query(self) -> bool:
        return True

    def __getattr__(self, _name):  # record, synchronize, wait: nothing to do
        return lambda *_a, **_k: None


class _NullStream:
    """A CUDA stream on a CPU: every method does nothing (work is synchronous already);
    ``record_event`` gives an event that is already reached (the MoE all-to-all dispatcher
    synchronises on one after moving its token counts to the host)."""

    def __init__(self, *_args, **_kwargs) -> None:
        pass

    def record_event(self, event=None) -> _NullEvent:
        return event if event is not None else _NullEvent()

    def __getattr__(self, _name):
        return lambda *_a, **_k: None

    def __enter__(self):
        return self

    def __exit__(self, *_exc) -> None:
        return None


def _cpu(device):
    text = str(device) if device is not None else ""
    return "cpu" if text.startswith("cuda") or isinstance(device, int) else device


def _on_cpu(factory):
    def make(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return factory(*args, **kwargs)
    make.__name__ = getattr(factory, "__name__", "factory")
    return make


class _CudaOnCpu(types.ModuleType):
    """``torch.cuda`` for :data:`CUDA_MODULES`: the device is the CPU."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        if name == "current_device":
            return lambda: torch.device("cpu")
        if name == "synchronize":
            return lambda *_a, **_k: None
        if name in ("current_stream", "default_stream"):
            return lambda *_a, **_k: _NullStream()
        if name == "Stream":
            return _NullStream
        if name == "Event":
            return _NullEvent
        if name == "stream":
            return lambda *_a, **_k: contextlib.nullcontext()
        if name == "get_rng_state":  # the device's generator is the CPU's
            return lambda *_a, **_k: torch.get_rng_state()
        if name == "set_rng_state":
            return lambda state, *_a, **_k: torch.set_rng_state(state)
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """``torch`` for :data:`CUDA_MODULES`: its factories put ``"cuda"`` tensors on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.__dict__["cuda"] = _CudaOnCpu()

    def __getattr__(self, name):
        value = getattr(torch, name)
        return _on_cpu(value) if name in _FACTORIES else value


TORCH = _TorchOnCpu()
"""The shared stand-in."""


def torch_on_cpu() -> types.ModuleType:
    """A new ``torch`` stand-in (its own ``torch.cuda``, which a caller may extend)."""
    return _TorchOnCpu()
