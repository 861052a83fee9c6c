"""Starting a world: local gloo ranks on one machine, or joining one started by ``torchrun``.

* :func:`spawn` forks ``world_size`` local ranks (rendezvous through a ``file://`` store, so no
  port is ever taken) and runs ``fn(rank, world_size, *args)`` in each; if one rank raises or dies,
  the others are stopped and the error names the rank.
* :func:`init_distributed` initialises ``torch.distributed`` from explicit arguments or, under
  ``torchrun``, from its environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``).
* :func:`get_device` is the one place that decides CPU vs CUDA (``cuda:LOCAL_RANK`` with NCCL).
* :func:`shutdown` ends a world (a barrier first after a good run); :func:`exit_process` then
  ends a torchrun worker without interpreter finalization.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import comm

__all__ = ["init_distributed", "spawn", "under_torchrun", "get_device", "print0", "shutdown",
           "exit_process", "get_rng_state", "set_rng_state", "timing_event_type", "tune_allocator"]


def under_torchrun() -> bool:
    """True when the environment was set by ``torchrun`` (or another launcher using its
    variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _cuda_usable() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def default_backend() -> str:
    """The backend :func:`init_distributed` picks when none is given: NCCL where CUDA is usable,
    else gloo (local :func:`spawn` worlds always use gloo)."""
    return "nccl" if _cuda_usable() else "gloo"


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
    backend = backend or default_backend()
    if backend == "nccl":
        get_device("nccl")
    comm.set_timeout(timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return rank, world_size


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


def shutdown(*, barrier: bool = False) -> None:
    """Tear down the default process group (and every group made from it) if one exists.

    ``barrier=True`` (after a good run) first waits, with the usual timeout, until every rank
    has arrived, so no rank destroys its groups while a peer may still be using them (rank 0
    writing the reports, say). After an error there is no barrier: the peers may be gone.
    """
    global _WORLD_ENDED
    if not dist.is_initialized():
        return
    if barrier and dist.get_world_size() > 1:
        from .mesh import Axis
        world = Axis("world", tuple(range(dist.get_world_size())), dist.get_rank(),
                     dist.group.WORLD)
        try:
            comm.barrier(world, site="shutdown")
        except comm.CommTimeout:
            barrier = False  # a peer is gone: still destroy ours, and say the end was not clean
    dist.destroy_process_group()
    _WORLD_ENDED = _WORLD_ENDED or barrier


_WORLD_ENDED = False


def skip_finalization() -> None:
    """Let :func:`exit_process` end this torchrun worker with ``os._exit`` although paraloom did
    not shut a world down itself: ``paraloom record`` joined to a world, once the user's program
    has ended and the ledger is written. A program that leaves its process group for the
    interpreter to tear down aborts there the same way (measured: rank 1 of a joined record of a
    program that exits without ``destroy_process_group``, now and then)."""
    global _WORLD_ENDED
    _WORLD_ENDED = True


def exit_process(code: int) -> None:
    """End a ``torchrun`` worker once its world was shut down cleanly: flush, then ``os._exit``.

    The process groups outlive ``destroy_process_group()``: after it and a ``gc.collect()`` the
    mesh's groups are still alive, held by references no Python module or frame reaches (the
    model's autograd hooks keep the model and its mesh). What is left of them, gloo's threads
    and work objects included, would be torn down during interpreter finalization and exit, in
    no fixed order; a finished rank aborting there ("terminate called without an active
    exception") is the failure reported for two-node runs. Nothing remains to be done after a
    clean shutdown, so the process ends without finalization, as forked local ranks (:func:`spawn`,
    multiprocessing ends them with ``os._exit``) always have. Otherwise this is ``sys.exit``.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if _WORLD_ENDED and under_torchrun():
        os._exit(code)
    sys.exit(code)


def _die_with(launcher: int) -> None:
    """Make the kernel SIGKILL this rank when the launcher ends, however it ends (SIGTERM or
    SIGKILL included; ``PR_SET_PDEATHSIG``, Linux): orphaned ranks would train on unseen. If
    the launcher is already gone, stop now."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != launcher:
        os._exit(1)


def _rank_main(rank: int, world_size: int, store: str, timeout_s: float, threads: int, fn, args,
               errors, launcher: int) -> None:
    _die_with(launcher)
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # gloo connects the ranks over TCP: keep a local world on the loopback interface
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    try:
        init_distributed(rank, world_size, init_method=f"file://{store}", backend="gloo",
                         timeout_s=timeout_s)
        try:
            fn(rank, world_size, *args)
        finally:
            shutdown()
    except BaseException as err:  # noqa: BLE001 - reported to the launcher, then exit non-zero
        secondary = _is_peer_failure(err)  # another rank's failure surfacing here
        errors.put((rank, time.time(), secondary, traceback.format_exc()))
        sys.stdout.flush()
        os._exit(1)


_PEER_GONE = ("closed by peer", "connection reset", "broken pipe", "timed out", "timeout")


def _is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` only says that a peer went away or stopped answering."""
    if isinstance(err, comm.CommTimeout):
        return True
    return isinstance(err, RuntimeError) and any(s in str(err).lower() for s in _PEER_GONE)


def _root_cause(failures: dict, exits: dict) -> str:
    """The error to report: a rank's own exception before a killed rank before a rank that only
    saw a peer disappear (a communication timeout or reset), earliest first."""
    own = sorted((t, r) for r, (t, secondary, _) in failures.items() if not secondary)
    if own:
        rank = own[0][1]
        return f"rank {rank} failed:\n{failures[rank][2]}"
    died = sorted(r for r, code in exits.items() if code is not None and code < 0)
    if died:
        rank, code = died[0], exits[died[0]]
        return f"rank {rank} died (exit code {code}, signal {signal.Signals(-code).name})"
    if failures:
        rank = min(failures, key=lambda r: failures[r][0])
        return f"rank {rank} failed:\n{failures[rank][2]}"
    rank = min(r for r, code in exits.items() if code)
    return f"rank {rank} exited with code {exits[rank]}"


def spawn(fn, world_size: int, *args, timeout_s: float = 300.0, threads: int = 1,
          grace_s: float = 3.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local gloo ranks and wait for all.

    With ``threads == 1`` (the default) ranks are forked from this process, which has already
    imported torch, so starting costs ~0.1 s instead of ~2.5 s a rank. More intra-op threads per
    rank need fresh interpreters (``spawn``): OpenMP's thread pool does not survive ``fork`` once
    the parent has used it, and a forked rank would hang in its first parallel op. ``fn`` and
    ``args`` must then be picklable (module-level functions). The rendezvous is a file, and gloo
    binds to loopback.

    If any rank raises or dies, the others get ``grace_s`` seconds to report (their own errors
    are usually just "peer went away"), then every survivor is killed; the ``RuntimeError`` names
    the rank that caused it (its own exception first, then a killed rank) with its traceback.
    Ranks end with the launcher: a signal that ends it (SIGTERM, SIGKILL) ends them too.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    ctx = mp.get_context("fork" if threads == 1 else "spawn")
    errors = ctx.SimpleQueue()
    fd, store = tempfile.mkstemp(prefix="paraloom-store-")
    os.close(fd)
    os.unlink(store)  # the file store creates it; a stale file would confuse the rendezvous
    procs = [ctx.Process(target=_rank_main, daemon=True, name=f"paraloom-rank-{rank}",
                         args=(rank, world_size, store, timeout_s, threads, fn, args, errors,
                               os.getpid()))
             for rank in range(world_size)]
    failures: dict[int, tuple] = {}
    try:
        for proc in procs:
            proc.start()
        failed_at = None
        while True:
            while not errors.empty():  # drain as we go: a full pipe would block the writer
                rank, t, secondary, text = errors.get()
                failures[rank] = (t, secondary, text)
            if not any(p.is_alive() for p in procs):
                break
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = time.time()
            if failed_at is not None and time.time() - failed_at > grace_s:
                break
            time.sleep(0.02)
        exits = {rank: proc.exitcode for rank, proc in enumerate(procs)}  # before we kill any
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        while not errors.empty():
            rank, t, secondary, text = errors.get()
            failures[rank] = (t, secondary, text)
        if failures or any(exits.values()):
            raise RuntimeError(_root_cause(failures, exits))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        if os.path.exists(store):
            os.unlink(store)


def print0(*args, **kwargs) -> None:
    """``print`` on global rank 0 only (or always, outside a distributed run)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


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
