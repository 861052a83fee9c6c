"""Starting a world: local gloo ranks on one machine, or joining one started by ``torchrun``.

* :func:`spawn` forks ``world_size`` local ranks (rendezvous through a ``file://`` store, so no
  port is ever taken) and runs ``fn(rank, world_size, *args)`` in each; if one rank raises or dies,
  the others are stopped and the error names the rank.
* :func:`init_distributed` initialises ``torch.distributed`` from explicit arguments or, under
  ``torchrun``, from its environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``).
* :func:`get_device` is the one place that decides CPU vs CUDA (``cuda:LOCAL_RANK`` with NCCL).
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import comm

__all__ = ["init_distributed", "spawn", "under_torchrun", "get_device", "print0", "shutdown",
           "get_rng_state", "set_rng_state"]


def under_torchrun() -> bool:
    """True when the environment was set by ``torchrun`` (or another launcher using its
    variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _cuda_usable() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def get_device(backend: str | None = None) -> torch.device:
    """``cuda:LOCAL_RANK`` when the backend is NCCL (or unset and CUDA is present), else CPU."""
    backend = backend or (dist.get_backend() if dist.is_initialized() else None)
    if backend == "nccl" or (backend is None and _cuda_usable()):
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init_distributed(rank: int | None = None, world_size: int | None = None, *,
                     init_method: str | None = None, backend: str | None = None,
                     timeout_s: float = 300.0) -> tuple[int, int]:
    """Initialise the default process group; returns ``(rank, world_size)``.

    Without arguments it reads torchrun's environment. ``backend`` defaults to NCCL when CUDA is
    available and gloo otherwise. ``timeout_s`` bounds every collective (the process group's
    timeout and :func:`paraloom.comm.set_timeout`), so a dead peer ends the world, not hangs it.
    """
    if rank is None or world_size is None:
        if not under_torchrun():
            raise RuntimeError("init_distributed() without rank/world_size needs torchrun's "
                               "environment (RANK, WORLD_SIZE, LOCAL_RANK); use spawn() for a "
                               "local run")
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init_method = init_method or "env://"
    backend = backend or ("nccl" if _cuda_usable() else "gloo")
    if backend == "nccl":
        get_device("nccl")
    comm.set_timeout(timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return rank, world_size


def shutdown() -> None:
    """Tear down the default process group if one exists."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _rank_main(rank: int, world_size: int, store: str, timeout_s: float, threads: int, fn, args):
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    init_distributed(rank, world_size, init_method=f"file://{store}", backend="gloo",
                     timeout_s=timeout_s)
    try:
        fn(rank, world_size, *args)
    finally:
        shutdown()


def spawn(fn, world_size: int, *args, timeout_s: float = 300.0, threads: int = 1) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local gloo ranks and wait for all.

    Ranks are forked from this process (which has already imported torch, so starting costs
    ~0.1 s instead of ~2.5 s a rank). A forked rank runs with ``threads`` intra-op threads
    (default 1): OpenMP's thread pool does not survive ``fork`` once the parent has used it, so
    more than one is safe only when this process has not run a parallel torch op yet (the CLI
    forks before computing anything). If any rank raises or is killed, the rest are
    terminated and a ``RuntimeError`` names the rank and carries its traceback.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    fd, store = tempfile.mkstemp(prefix="paraloom-store-")
    os.close(fd)
    os.unlink(store)  # the file store creates it; a stale file would confuse the rendezvous
    try:
        mp.start_processes(_rank_main, args=(world_size, store, timeout_s, threads, fn, args),
                           nprocs=world_size, start_method="fork")
    except mp.ProcessRaisedException as err:
        raise RuntimeError(f"rank {err.error_index} failed:\n{err}") from None
    except mp.ProcessExitedException as err:
        raise RuntimeError(f"rank {err.error_index} died (exit code {err.exit_code}, "
                           f"signal {err.signal_name})") from None
    finally:
        if os.path.exists(store):
            os.unlink(store)


def print0(*args, **kwargs) -> None:
    """``print`` on global rank 0 only (or always, outside a distributed run)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


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
