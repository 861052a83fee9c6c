"""Hypothesis property tests: exact division, shard ranges and the region mappings on random
shapes and tp sizes (the mappings in one warm 4-rank world)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paraloom.mesh import ParallelMesh
from paraloom.tensor_parallel import mappings as M
from paraloom.tensor_parallel.init import counter_normal, shard_range
from paraloom.utils import divide


@given(st.integers(-10**6, 10**6), st.integers(1, 1000))
def test_divide_is_exact_or_names_both_numbers(n, d):
    if n % d == 0:
        assert divide(n, d) * d == n
    else:
        with pytest.raises(ValueError, match=f"{n} is not divisible by {d}"):
            divide(n, d)


@given(st.lists(st.integers(1, 6), min_size=1, max_size=3), st.integers(0, 2),
       st.sampled_from([1, 2, 3, 4]))
@settings(max_examples=60, deadline=None)
def test_shards_tile_the_full_tensor_exactly(base, dim, world):
    dim = dim % len(base)
    shape = list(base)
    shape[dim] *= world
    full = counter_normal(7, "w", shape)
    parts = [counter_normal(7, "w", shape, shard_range(shape, dim, r, world))
             for r in range(world)]
    assert torch.equal(torch.cat(parts, dim), full)


def _tensors(seed, shape, size):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(size)]


def mapping_case(tp, shape, seed):
    """Each mapping's forward and backward against sums/concatenations computed locally."""
    mesh = ParallelMesh(tp=tp, dp=4 // tp)
    r, ax = mesh.tp.rank, mesh.tp
    xs, gs = _tensors(seed, shape, tp), _tensors(seed + 1, shape, tp)
    full_x = _tensors(seed + 2, shape, 1)[0].repeat_interleave(tp, 0)      # dim 0 divisible
    full_xl = _tensors(seed + 3, shape, 1)[0].repeat(*([1] * (len(shape) - 1)), tp)

    def run(fn, x, grad):
        x = x.clone().requires_grad_()
        y = fn(x, ax)
        y.backward(grad.clone())  # the mappings reduce the incoming gradient in place
        return y.detach(), x.grad

    y, g = run(M.copy_to_tensor_model_parallel_region, xs[r], gs[r])
    assert torch.equal(y, xs[r]) and torch.allclose(g, sum(gs))
    y, g = run(M.reduce_from_tensor_model_parallel_region, xs[r], gs[0])
    assert torch.allclose(y, sum(xs)) and torch.equal(g, gs[0])
    y, g = run(M.gather_from_tensor_model_parallel_region, xs[r], torch.cat(gs, -1))
    assert torch.equal(y, torch.cat(xs, -1)) and torch.equal(g, gs[r])
    y, g = run(M.scatter_to_tensor_model_parallel_region, full_xl, gs[r])
    assert torch.equal(y, full_xl.chunk(tp, -1)[r]) and torch.equal(g, torch.cat(gs, -1))
    y, g = run(M.scatter_to_sequence_parallel_region, full_x, gs[r])
    assert torch.equal(y, full_x.chunk(tp, 0)[r]) and torch.equal(g, torch.cat(gs, 0))
    big = [torch.cat([t] * tp, 0) * (i + 1) for i, t in enumerate(gs)]     # per-rank full grads
    y, g = run(M.gather_from_sequence_parallel_region, xs[r], big[r])
    assert torch.equal(y, torch.cat(xs, 0)) and torch.allclose(g, sum(big).chunk(tp, 0)[r])
    fulls = [torch.cat([t] * tp, 0) + i for i, t in enumerate(xs)]
    y, g = run(M.reduce_scatter_to_sequence_parallel_region, fulls[r], gs[r])
    assert torch.allclose(y, sum(fulls).chunk(tp, 0)[r]) and torch.equal(g, torch.cat(gs, 0))
    return True


@given(tp=st.sampled_from([1, 2, 4]),
       shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       seed=st.integers(0, 10_000))
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_region_mappings_on_random_shapes(world4, tp, shape, seed):
    assert all(world4.run(mapping_case, tp, tuple(shape), seed))
