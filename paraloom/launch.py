"""Starting a world: local gloo ranks on one machine, or joining one started by ``torchrun``.

* :func:`spawn` forks ``world_size`` local ranks (rendezvous through a ``file://`` store, so no
  port is ever taken) and runs ``fn(rank, world_size, *args)`` in each; if one rank raises or dies,
  the others are stopped and the error names the rank.
* :func:`init_distributed` initialises ``torch.distributed`` from explicit arguments or, under
  ``torchrun``, from its environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``).
* The device and backend are :mod:`paraloom.device`'s choice (``cuda:LOCAL_RANK`` with NCCL).
* :func:`shutdown` ends a world (a barrier first after a good run); :func:`exit_process` then
  ends a torchrun worker without interpreter finalization.
"""

from __future__ import annotations

import ctypes
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
from .device import default_backend, get_device
from .mesh import world_axis

__all__ = ["init_distributed", "spawn", "under_torchrun", "print0", "shutdown", "exit_process",
           "skip_finalization", "is_peer_failure", "PEER_GONE", "local_threads", "Hung"]


def under_torchrun() -> bool:
    """True when the environment was set by ``torchrun`` (or another launcher using its
    variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


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
        try:
            comm.barrier(world_axis(), site="shutdown")
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
        secondary = is_peer_failure(err)  # another rank's failure surfacing here
        errors.put((rank, time.time(), secondary, traceback.format_exc()))
        sys.stdout.flush()
        os._exit(1)


PEER_GONE = ("closed by peer", "connection reset", "broken pipe", "timed out", "timeout")
"""Words of an error that only says a peer went away or stopped answering."""


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` only says that a peer went away or stopped answering."""
    if isinstance(err, comm.CommTimeout):
        return True
    return isinstance(err, RuntimeError) and any(s in str(err).lower() for s in PEER_GONE)


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


class Hung(RuntimeError):
    """:func:`spawn`'s ``check`` found the ranks hung; ``diagnosis`` is what it returned."""

    def __init__(self, diagnosis) -> None:
        super().__init__("the ranks hung")
        self.diagnosis = diagnosis


def spawn(fn, world_size: int, *args, timeout_s: float = 300.0, threads: int = 1,
          grace_s: float = 3.0, check=None) -> None:
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
    ``check(alive_ranks)``, called in the wait loop, returns something true when the ranks hang
    (:func:`paraloom.diagnose.watch.checker`): every rank is then killed and :class:`Hung`
    carries it.
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
            found = check([r for r, p in enumerate(procs) if p.is_alive()]) if check else None
            if found:
                raise Hung(found)
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


def local_threads(world_size: int) -> int:
    """Intra-op threads per local rank: the machine's cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // world_size)


def print0(*args, **kwargs) -> None:
    """``print`` on global rank 0 only (or always, outside a distributed run)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)
