"""The tensor-parallel RNG tracker: dropout streams per tp rank, reproducible, and a fork that
leaves the default stream untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
