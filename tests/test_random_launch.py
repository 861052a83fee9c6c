"""The tensor-parallel RNG tracker, and local worlds that end (naming the rank) when one fails."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.nn.functional as F

from paraloom import comm, launch
from paraloom.mesh import ParallelMesh
from paraloom.tensor_parallel.random import get_rng_tracker, model_parallel_seed


def dropout_streams():
    mesh = ParallelMesh(tp=2, dp=2)
    out = {}
    for attempt in range(2):
        model_parallel_seed(123, mesh.tp.rank)
        x = torch.ones(64)
        with get_rng_tracker().fork():
            split = F.dropout(x, 0.5)
        replicated = F.dropout(x, 0.5)
        out[attempt] = (split, replicated)
    return out


def test_tp_dropout_differs_per_tp_rank_and_is_reproducible(world4):
    res = world4.run(dropout_streams)
    for r in res:  # same seed, same masks
        assert torch.equal(r[0][0], r[1][0]) and torch.equal(r[0][1], r[1][1])
    split = [r[0][0] for r in res]
    replicated = [r[0][1] for r in res]
    assert not torch.equal(split[0], split[1])           # tp ranks 0 and 1 differ
    assert torch.equal(split[0], split[2])               # same tp rank in another dp replica
    assert all(torch.equal(replicated[0], t) for t in replicated)  # default stream: identical


def test_fork_leaves_the_default_stream_untouched():
    model_parallel_seed(7, 0)
    expected = torch.rand(4)
    model_parallel_seed(7, 0)
    with get_rng_tracker().fork():
        torch.rand(100)
    assert torch.equal(torch.rand(4), expected)
    with pytest.raises(KeyError, match="was not added"):
        with get_rng_tracker().fork("nope"):
            pass


def _raises_on_rank_1(rank, world):
    mesh = ParallelMesh(tp=world)
    if rank == 1:
        raise ValueError("boom from rank 1")
    comm.all_reduce(torch.ones(1), mesh.tp, phase="forward", kind="tp", site="test")


def _killed_rank_1(rank, world):
    mesh = ParallelMesh(tp=world)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    comm.all_reduce(torch.ones(1), mesh.tp, phase="forward", kind="tp", site="test")


def _sums(rank, world, out_dir):
    mesh = ParallelMesh(tp=world)
    t = comm.all_reduce(torch.tensor([rank + 1.0]), mesh.tp, phase="forward", kind="tp", site="t")
    with open(os.path.join(out_dir, f"{rank}.txt"), "w") as f:
        f.write(str(t.item()))


def test_spawn_runs_every_rank(tmp_path):
    launch.spawn(_sums, 3, str(tmp_path))
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["6.0"] * 3


def test_spawn_with_more_threads_after_this_process_used_openmp(tmp_path):
    torch.randn(512, 512).matmul(torch.randn(512, 512))  # the parent's thread pool is now up
    launch.spawn(_sums, 2, str(tmp_path), threads=2, timeout_s=60)  # fresh interpreters: no hang
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["3.0"] * 2


def test_spawn_names_the_failed_rank():
    with pytest.raises(RuntimeError, match=r"rank 1 failed:(.|\n)*boom from rank 1"):
        launch.spawn(_raises_on_rank_1, 2, timeout_s=20)
    with pytest.raises(RuntimeError, match="rank 1 died .*SIGKILL"):
        launch.spawn(_killed_rank_1, 2, timeout_s=20)
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        launch.spawn(_sums, 0)


def _timeout_case(rank, world):
    mesh = ParallelMesh(tp=world)
    comm.set_timeout(1.0)
    comm.all_reduce(torch.ones(1), mesh.tp, phase="forward", kind="tp", site="together")
    if rank == 0:  # rank 1 never joins this all-reduce
        with pytest.raises(comm.CommTimeout) as err:
            comm.all_reduce(torch.ones(1), mesh.tp, phase="forward", kind="tp", site="lonely")
        message = str(err.value)
        assert "all_reduce at lonely over tp group [0, 1]" in message
        # the flight recorder lists what this rank launched last, the stuck op at the end
        recorder = message.split("flight recorder, rank 0")[1].splitlines()
        assert "all_reduce at together" in recorder[-2] and "lonely" in recorder[-1]


def test_a_missing_peer_times_out_instead_of_hanging():
    launch.spawn(_timeout_case, 2, timeout_s=30)


def test_allocator_tuning_applies_on_glibc_and_can_be_refused(monkeypatch):
    """tune_allocator raises glibc's mmap/trim thresholds (paraloom train's ranks); the
    environment can refuse it. Run in a child process: the setting is process-wide."""
    import platform
    import subprocess
    import sys

    code = "from paraloom.device import tune_allocator; print(tune_allocator())"
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "PARALOOM_MALLOC_TUNING": "0"})
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert on.stdout.strip().splitlines()[-1] == str(glibc)
    assert off.stdout.strip().splitlines()[-1] == "False"
