"""Where a rank computes and how its clock and random state are read: the one place that decides
CPU or CUDA (no ``torch.cuda`` call elsewhere in paraloom), plus the allocator setting the
training ranks use.

* :func:`get_device`: ``cuda:LOCAL_RANK`` with NCCL (or CUDA present and no backend), else CPU;
  :func:`default_backend` the backend that goes with it.
* :func:`timing_event_type`: what a ledger stamps times with (the wall clock, or CUDA events).
* :func:`get_rng_state` / :func:`set_rng_state`: the default generator of a device.
* :func:`tune_allocator`: keep freed memory for the next training step (glibc, Linux).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch
import torch.distributed as dist

__all__ = ["get_device", "default_backend", "cuda_usable", "timing_event_type", "get_rng_state",
           "set_rng_state", "tune_allocator"]


def cuda_usable() -> bool:
    """Whether this process can use a CUDA device."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def default_backend() -> str:
    """The backend :func:`init_distributed` picks when none is given: NCCL where CUDA is usable,
    else gloo (local :func:`spawn` worlds always use gloo)."""
    return "nccl" if cuda_usable() else "gloo"


def get_device(backend: str | None = None) -> torch.device:
    """``cuda:LOCAL_RANK`` when the backend is NCCL (or unset and CUDA is present), else CPU."""
    backend = backend or (dist.get_backend() if dist.is_initialized() else None)
    if backend == "nccl" or (backend is None and cuda_usable()):
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def tune_allocator() -> bool:
    """Keep memory a training step frees for the next step (glibc ``malloc``; Linux only).

    By default glibc serves every allocation above 128 KiB-32 MiB with a fresh ``mmap`` and
    returns it to the system on ``free``, and trims the heap's top whenever 128 KiB-64 MiB lie
    unused there; a training step frees and re-allocates the same activation and gradient sizes
    every step (and a data-parallel wrapper frees each ``.grad`` in the middle of backward), so
    the process keeps faulting in fresh, zeroed pages: ~2,500 page faults and ~8-10 % of a step
    of a 3M-parameter GPT on a 2-core VM (``benchmarks/single.py``). Raising both thresholds
    (allocations below 256 MiB from the heap, trimming only past 1 GiB free) keeps the pages;
    resident memory then stays at the step's peak, which a training process reaches anyway.
    CUDA memory is untouched (PyTorch's caching allocator already does this on the GPU).
    ``PARALOOM_MALLOC_TUNING=0`` leaves the allocator alone. Returns whether it was applied.
    ``paraloom train`` and ``eval`` call it in every rank; a library user calls it (or not) in
    their own processes, and the benchmarks, which run paraloom and PyTorch side by side in one
    process, leave it to a flag (both sides then share the setting)."""
    if os.environ.get("PARALOOM_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 256 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def timing_event_type(device: torch.device):
    """What a :class:`~paraloom.ledger.Ledger` stamps times with on ``device``: ``None`` on CPU
    (the wall clock), a timing-enabled ``torch.cuda.Event`` factory on CUDA. On CUDA the device
    is synchronised once here, so the ledger's anchor event is recorded on an idle stream."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return functools.partial(torch.cuda.Event, enable_timing=True)


def get_rng_state(device: torch.device) -> torch.Tensor:
    """The default generator state of ``device`` (CPU or CUDA)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    """Restore the default generator state of ``device``."""
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
