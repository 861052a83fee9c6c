"""Local worlds (``launch.spawn``) that run every rank, end naming the rank when one fails or
dies, and time out instead of hanging when a peer never joins."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from paraloom import comm, launch
from paraloom.mesh import ParallelMesh


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
