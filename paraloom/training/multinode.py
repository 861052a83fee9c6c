"""A run over several nodes: who creates the run folder, who sees it, and a clean end.

Under ``torchrun --nnodes N`` the run folder (``--out``) is, as usual, a local path on each node;
it may or may not be on a filesystem every node sees. Here is what each case gets:

* **Node-local output.** On every node, local rank 0 creates ``OUT/`` and ``OUT/ledger/`` before
  any rank writes there, so every rank can write its ``ledger/rank_N.jsonl``. Global rank 0 writes
  the run's reports (``config.json``, ``ledger.jsonl``, ...); the merged ledger is gathered over
  the network, so it holds every rank's events wherever they were written, and so are the last
  rank's ``metrics.jsonl`` lines when its node does not see rank 0's folder.
* **Who sees what.** :func:`prepare_run_folder` finds out: rank 0 writes a random token into
  ``OUT/``, every rank reads it back, and one all-reduce tells every rank which ranks share rank
  0's folder. When some do not, rank 0 says which (and on which hosts), and those nodes get a
  ``node.json`` saying where the reports are.
* **Checkpoints need a shared folder** (DCP writes each rank's shards, rank 0 the index).
  ``--save-every N`` given without one stops every rank before the first step
  (:class:`SetupError`, exit 2); not given, the run has no checkpoints and rank 0 says why
  (:func:`checkpoint_interval`). ``--resume``, ``--data``, ``--tokenizer`` and
  ``--init-from-hf`` are checked on every rank (:func:`agree`): if some ranks do not see the
  checkpoint, file or folder, every rank stops with one message that names them. A rank that
  finds its problem while reading the flags, before the world exists, still joins it to say so
  (:func:`refuse_under_torchrun`): the others would otherwise wait for it until the timeout.
* **A clean end** is :func:`paraloom.launch.shutdown` after a barrier (see there).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import comm, launch
from ..config.run import DEFAULT_SAVE_EVERY
from ..device import get_device
from ..mesh import world_axis
from .checkpoint import find_checkpoint

__all__ = ["SetupError", "RunFolder", "prepare_run_folder", "needs_shared_folder",
           "checkpoint_interval", "agree",
           "same_everywhere", "local_rank", "run_under_torchrun", "refuse_under_torchrun",
           "checkpoint_seen", "shared_clock"]

TOKEN_FILE = ".paraloom-folder-token"
SEE_PATIENCE_S = 3.0
"""How long a rank looks for rank 0's token before it counts as not sharing the folder."""


class SetupError(ValueError):
    """A problem every rank knows about (so every rank stops alike, with exit code 2)."""


def _device() -> torch.device:
    """Where this rank's small setup tensors live (CUDA with NCCL, which has no CPU tensors)."""
    return get_device()


def local_rank() -> int:
    """This rank's index on its node (torchrun's ``LOCAL_RANK``; 0 outside a launcher)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def _ranks_text(ranks: list[int], hosts: list[str] | None) -> str:
    if hosts is None:
        return ", ".join(map(str, ranks))
    by_host: dict[str, list[int]] = {}
    for r in ranks:
        by_host.setdefault(hosts[r], []).append(r)
    return "; ".join(f"{', '.join(map(str, rs))} on {h}" for h, rs in by_host.items())


def agree(error: str | None, world, *, what: str) -> None:
    """Every rank passes its own problem (or ``None``); if any rank has one, every rank raises
    :class:`SetupError`, and rank 0's message lists each rank's problem. One all-reduce, and a
    gather only when something failed."""
    failed = torch.zeros(world.size, dtype=torch.float64, device=_device())
    failed[world.rank] = error is not None
    comm.all_reduce(failed, world, phase="setup", kind="world", site=f"agree:{what}")
    if not failed.any():
        return
    texts = comm.gather_objects((socket.gethostname(), error), world)
    if texts is None:  # rank 0 has every rank's problem; the other nodes still hear their own
        if failed.all():  # a problem on every rank (a bad flag, most often): just say it
            raise SetupError(error)
        raise SetupError(f"{what} (rank 0's message names every rank's); rank {world.rank}: "
                         f"{error if error is not None else 'no problem here'}")
    by_error: dict[str, list[int]] = {}
    for rank, (_, text) in enumerate(texts):
        if text is not None:
            by_error.setdefault(text, []).append(rank)
    if len(by_error) == 1 and failed.all():  # the same problem everywhere: just say it
        raise SetupError(next(iter(by_error)))
    hosts = [h for h, _ in texts]
    lines = [f"rank{'s' * (len(rs) > 1)} {_ranks_text(rs, hosts)}: {text}"
             for text, rs in by_error.items()]
    ok = [r for r in range(world.size) if not failed[r]]
    tail = ""
    if ok:
        tail = (f" (ranks {_ranks_text(ok, hosts)} had no problem: a file or folder that only "
                f"some nodes see needs a filesystem every node shares, at the same path)")
    raise SetupError(f"{what}:\n  " + "\n  ".join(lines) + tail)


@dataclass
class RunFolder:
    """What :func:`prepare_run_folder` found."""

    path: Path
    sees_rank0: list[bool]
    """For each global rank: whether it sees rank 0's run folder (the same files)."""
    hosts: list[str] | None = None
    """Host name of each rank (rank 0 only; ``None`` elsewhere)."""

    @property
    def shared(self) -> bool:
        return all(self.sees_rank0)

    def elsewhere(self) -> list[int]:
        return [r for r, sees in enumerate(self.sees_rank0) if not sees]

    def describe(self) -> str:
        """Rank 0's sentence about the ranks that wrote into another folder."""
        others = _ranks_text(self.elsewhere(), self.hosts)
        return (f"ranks {others} do not see this run folder ({str(self.path)!r}; it is not on a "
                f"filesystem every node shares): they wrote their ledger/rank_N.jsonl into "
                f"--out on their own node, and it stays there; ledger.jsonl, trace.json and "
                f"comm_table.md here have every rank's "
                f"events (gathered over the network)")


def prepare_run_folder(out: Path, world) -> RunFolder:
    """Create ``out/ledger`` on every node (local rank 0 does, then everyone waits) and find out
    which ranks see rank 0's folder. Every rank calls this, in the same order."""
    if local_rank() == 0:
        (out / "ledger").mkdir(parents=True, exist_ok=True)
    comm.barrier(world, site="run_folder:created")
    (out / "ledger").mkdir(parents=True, exist_ok=True)  # LOCAL_RANK not set as torchrun does
    token = torch.tensor([random.SystemRandom().getrandbits(62)], dtype=torch.int64,
                         device=_device())
    comm.broadcast(token, world, src=0, phase="setup", kind="world", site="run_folder:token")
    if world.rank == 0:
        tmp = out / (TOKEN_FILE + ".tmp")
        tmp.write_text(str(int(token.item())))
        os.replace(tmp, out / TOKEN_FILE)
    comm.barrier(world, site="run_folder:token_written")
    mine = _sees_token(out / TOKEN_FILE, str(int(token.item())))
    sees = torch.zeros(world.size, dtype=torch.float64, device=_device())
    sees[world.rank] = mine
    comm.all_reduce(sees, world, phase="setup", kind="world", site="run_folder:who_sees")
    folder = RunFolder(out, [bool(s) for s in sees.tolist()])
    if folder.shared:
        if world.rank == 0:
            (out / TOKEN_FILE).unlink(missing_ok=True)  # everyone has read it (the all-reduce)
        return folder
    hosts = comm.gather_objects(socket.gethostname(), world)
    if world.rank == 0:
        (out / TOKEN_FILE).unlink(missing_ok=True)
        folder.hosts = hosts
    elif not mine and local_rank() == 0:
        (out / "node.json").write_text(json.dumps({
            "note": "this node's part of a multi-node run: each rank's raw ledger is here; the "
                    "reports (metrics, merged ledger, trace, table) are in rank 0's folder",
            "host": socket.gethostname(),
            "folder": str(out.resolve())}, indent=1))
    return folder


def _sees_token(path: Path, token: str, patience_s: float = SEE_PATIENCE_S) -> bool:
    """Whether ``path`` holds ``token``, looking again for ``patience_s``: a network filesystem
    may show a file another node just wrote only after its attribute cache expires."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            if path.read_text() == token:
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def checkpoint_interval(folder: RunFolder, save_every: int | None) -> tuple[int, str | None]:
    """Steps between checkpoints and rank 0's note: ``--save-every`` as given (checked by
    :func:`needs_shared_folder`); not given, the default, or none without a shared folder."""
    if save_every is not None:
        needs_shared_folder(folder, save_every)
    if save_every is not None or folder.shared:
        return (DEFAULT_SAVE_EVERY if save_every is None else save_every), None
    return 0, (f"no checkpoints: not every node sees the run folder (--out "
               f"{str(folder.path)!r}) and each rank writes its own shards; for checkpoints "
               f"give --out a path every node shares and --save-every N")


def needs_shared_folder(folder: RunFolder, save_every: int) -> None:
    """:class:`SetupError` on every rank when checkpoints would be saved into a folder that not
    every rank shares (they would be incomplete on every node)."""
    if folder.shared or not save_every:
        return
    who = _ranks_text(folder.elsewhere(), folder.hosts) if folder.hosts else "some ranks"
    raise SetupError(
        f"--save-every {save_every}: checkpoints need the run folder (--out {str(folder.path)!r}) "
        f"on a filesystem every node shares, and ranks {who} do not see rank 0's copy of it "
        f"(a file rank 0 wrote there did not appear on their side within {SEE_PATIENCE_S:g} s; "
        f"each rank writes its own shards, so only a shared folder holds a whole checkpoint). "
        f"Give --out a path on a shared filesystem (the same path on every node), or "
        f"--save-every 0 to train without checkpoints")


def same_everywhere(value: str, world, *, what: str) -> None:
    """:class:`SetupError` on every rank unless every rank passes the same ``value`` (e.g. the
    checkpoint it found); rank 0's message says which ranks saw what."""
    digest = int.from_bytes(hashlib.sha256(value.encode()).digest()[:6], "big")  # exact in fp64
    seen = torch.zeros(world.size, dtype=torch.float64, device=_device())
    seen[world.rank] = digest
    comm.all_reduce(seen, world, phase="setup", kind="world", site=f"agree:{what}")
    if (seen == seen[0]).all():
        return
    values = comm.gather_objects((socket.gethostname(), value), world)
    if values is None:
        raise SetupError(f"{what} (rank 0's message says which ranks saw what); rank "
                         f"{world.rank} sees {value}")
    hosts = [h for h, _ in values]
    by_value: dict[str, list[int]] = {}
    for rank, (_, v) in enumerate(values):
        by_value.setdefault(v, []).append(rank)
    raise SetupError(f"{what}: " + "; ".join(f"ranks {_ranks_text(rs, hosts)} see {v}"
                                              for v, rs in by_value.items())
                     + " (each rank must read the same files: use a filesystem every node "
                       "shares, at the same path)")


def checkpoint_seen(path: str | None) -> str:
    """What ``--resume path`` resolves to on this rank (compared across ranks)."""
    if path is None:
        return "no checkpoint"
    ckpt, meta = find_checkpoint(path)
    return f"{str(ckpt)!r} (step {meta.get('step')})"


def run_under_torchrun(prog: str, timeout_s: float, check, body, resume: str | None = None
                       ) -> int:
    """Join torchrun's world, run ``check()`` on every rank (the inputs each rank reads: data,
    checkpoint), agree on the result (and on the checkpoint ``resume`` resolves to), run
    ``body()``, and end cleanly; returns the exit code.

    A :class:`SetupError` (known to every rank) is printed once per node (rank 0's names every
    rank's problem) and gives 2 on every rank; any other exception propagates (torchrun reports
    the rank). After a good run every rank meets in a barrier before the process groups are
    destroyed (:func:`paraloom.launch.shutdown`)."""
    launch.init_distributed(timeout_s=timeout_s)
    world = world_axis()
    clean = False
    try:
        try:
            check()
            error = None
        except ValueError as err:
            error = str(err)
        agree(error, world, what="the inputs are not readable on every rank")
        same_everywhere(checkpoint_seen(resume), world, what=f"--resume {resume!r} differs")
        body()
        clean = True
        return 0
    except SetupError as err:
        if local_rank() == 0:  # once per node: a node's own log says why it stopped
            print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        clean = True
        return 2
    finally:
        launch.shutdown(barrier=clean)


def refuse_under_torchrun(prog: str, error: str, timeout_s: float) -> int:
    """Exit code 2 for a rank that found ``error`` before joining torchrun's world (reading its
    flags: a ``--tokenizer`` or ``--init-from-hf`` folder, a ``--resume`` checkpoint only some
    nodes have). It joins the world anyway and reports the problem in the agreement the other
    ranks hold after their own checks, so every rank stops at once with rank 0's message naming
    the ranks and their hosts, instead of the others waiting for it until the timeout."""
    def check():
        raise ValueError(error)
    timeout_s = timeout_s if timeout_s and timeout_s > 0 else 120.0  # the problem may be --timeout

    def unreachable():
        raise AssertionError("refuse_under_torchrun: the agreement let a failed rank through")
    return run_under_torchrun(prog, timeout_s, check, unreachable)


def shared_clock() -> float:
    """Rank 0's clock, broadcast, so every rank's ledger times share one origin."""
    t = torch.tensor([time.time()], dtype=torch.float64, device=_device())  # NCCL: on GPU
    comm.broadcast(t, world_axis(), src=0, phase="setup", kind="world", site="train:clock")
    return float(t.item())
