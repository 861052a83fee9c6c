"""Context parallelism: the grid, the load-balanced split, ring and all-gather attention.

Attention is checked against plain causal attention on the whole sequence in one 4-rank world
(cp = 2 as a (cp 2, dp 2) mesh, and cp = 4): outputs and the gradients of q, k, v at 1e-5.
Whole-model equivalence under ``paraloom train`` is in ``test_context_parallel_train.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from paraloom.config import ModelConfig, ParallelConfig, check_layout
from paraloom.context_parallel import chunk_ids, get_batch_on_this_cp_rank, position_ids
from paraloom.context_parallel.blocks import block_kind
from paraloom.mesh import rank_coords, rank_groups


def test_grid_order_is_tp_cp_dp_pp():
    g = rank_groups(tp=2, pp=2, dp=1, cp=2)
    assert g["tp"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert g["cp"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert g["pp"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    g = rank_groups(tp=1, pp=1, dp=2, cp=2)
    assert g["cp"] == [(0, 1), (2, 3)] and g["dp"] == [(0, 2), (1, 3)]
    assert g["dp_cp"] == [(0, 1, 2, 3)]
    assert rank_coords(6, tp=2, pp=2, dp=1, cp=2) == (1, 0, 1, 0)
    assert rank_groups(2, 2, 2)["dp_cp"] == rank_groups(2, 2, 2)["dp"]  # cp = 1: the dp group
    for axis, groups in rank_groups(2, 2, 3, cp=2).items():
        if axis != "emb":
            assert sorted(r for grp in groups for r in grp) == list(range(24)), axis


def test_load_balanced_split():
    assert [chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    tokens = torch.arange(32).view(2, 16)
    labels = tokens + 100
    t, lab, pos = get_batch_on_this_cp_rank(tokens, labels, 1, 4)
    assert pos.tolist() == [2, 3, 12, 13]
    assert t.tolist() == [[2, 3, 12, 13], [18, 19, 28, 29]]
    assert torch.equal(lab, t + 100)
    together = torch.cat([position_ids(16, r, 4) for r in range(4)]).sort().values
    assert together.tolist() == list(range(16))
    # every rank computes the same number of unmasked blocks over the ring
    for cp in (2, 4):
        work = []
        for r in range(cp):
            mine = chunk_ids(r, cp)
            work.append(sorted(block_kind(q, k) or "skip" for j in range(cp)
                               for q in mine for k in chunk_ids(j, cp)))
        assert all(w == work[0] for w in work), work


def test_bad_layouts_name_the_values():
    with pytest.raises(ValueError, match=r"seq_length = 12 is not divisible by 2 \* cp = 8"):
        check_layout(ModelConfig(seq_length=12), ParallelConfig(cp=4))
    with pytest.raises(ValueError, match="cp_comm_type must be one of p2p, all_gather, a2a, "
                                         "a2a\\+p2p, got 'ring'"):
        ParallelConfig(cp=2, cp_comm_type="ring")
    with pytest.raises(ValueError, match=r"seq_length / cp = 6 is not divisible by tp = 4"):
        check_layout(ModelConfig(seq_length=12), ParallelConfig(cp=2, tp=4,
                                                                sequence_parallel=True))
    assert ParallelConfig(tp=2, cp=2, dp=3).world_size == 12


def _reference(q, k, v):
    s = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


def attention_case(cp: int, comm_type: str):
    from paraloom import ledger
    from paraloom.config import ParallelConfig
    from paraloom.context_parallel import ContextParallelAttention, split_sequence
    from paraloom.mesh import ParallelMesh
    sizes = (2, 2) if comm_type == "a2a+p2p" else None  # two groups of two: a2a in, ring across
    mesh = ParallelMesh(ParallelConfig(cp=cp, dp=4 // cp, cp_comm_type=comm_type,
                                       cp_sizes=sizes))
    gen = torch.Generator().manual_seed(7)
    b, a, s, d = 2, 3 if comm_type in ("p2p", "all_gather") else 4, 8 * cp, 5  # a2a: divisible
    q, k, v, up = (torch.randn(b, a, s, d, generator=gen, dtype=torch.float64).float()
                   for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = _reference(*ref)
    out_ref.backward(up)
    mine = [split_sequence(t, mesh.cp.rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
    led = ledger.Ledger(rank=mesh.rank, t0=0.0)
    with ledger.recording(led):
        out = ContextParallelAttention(mesh.cp, comm_type, "core", levels=mesh.cp_levels)(*mine)
        out.backward(split_sequence(up, mesh.cp.rank, cp, dim=2))
    torch.testing.assert_close(out, split_sequence(out_ref, mesh.cp.rank, cp, dim=2),
                               rtol=1e-5, atol=1e-5)
    for got, want in zip(mine, ref, strict=True):
        torch.testing.assert_close(got.grad, split_sequence(want.grad, mesh.cp.rank, cp, dim=2),
                                   rtol=1e-5, atol=1e-5)
    spans = [e["phase"] for e in led.events if e["op"] == "compute"]
    if comm_type in ("p2p", "a2a+p2p"):  # each ring step's blocks: what its exchange overlaps
        ring = cp // sizes[0] if sizes else cp
        assert spans == ["forward"] * ring + ["backward"] * ring
    return [(e["op"], e["phase"], e["kind"], e["site"], e["bytes"], len(e["group"]))
            for e in led.events if e["op"] != "compute"]


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a"])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_matches_causal_attention(world4, cp, comm_type):
    events = world4.run(attention_case, cp, comm_type)[0]
    kv = 2 * 2 * 3 * 8 * 5 * 4   # [2, b, a, s/cp, d] fp32: two chunks of 4 tokens
    assert {e[2] for e in events} == {"cp"}
    if comm_type == "a2a":  # Ulysses: Q, K, V to head shards, the output back; backward mirrored
        one = 2 * 4 * 8 * 5 * 4  # [b, a, s/cp, d] fp32: each all-to-all moves a whole tensor
        assert [(e[0], e[1], e[3].split(":")[1], e[4]) for e in events] == [
            ("all_to_all", "forward", name, one) for name in ("q", "k", "v", "out")] + [
            ("all_to_all", "backward", name, one) for name in ("dout", "dq", "dk", "dv")]
    elif comm_type == "p2p":
        sends = [e for e in events if e[0] == "send"]
        fwd = [e for e in sends if e[1] == "forward"]
        assert len(fwd) == cp - 1 and len(sends) == (cp - 1) + (cp - 1) + cp
        assert all(e[4] == kv for e in sends)
    else:
        assert [(e[0], e[1], e[4]) for e in events] == [("all_gather", "forward", kv),
                                                        ("reduce_scatter", "backward", cp * kv)]


def test_hierarchical_cp_attention_matches_causal_attention(world4):
    """a2a+p2p at cp = 4 = 2 x 2: Ulysses' all-to-alls inside each pair of consecutive cp ranks,
    the ring (one K/V exchange forward, three backward) across the pairs, on half the heads."""
    events = world4.run(attention_case, 4, "a2a+p2p")[0]
    one = 2 * 4 * 8 * 5 * 4      # [b, a, s/cp, d] fp32: each all-to-all moves a whole tensor
    kv = 2 * 2 * 2 * 16 * 5 * 4  # [2, b, a/2, 2 s/cp, d]: the group's chunks, half the heads
    a2a = [("all_to_all", phase, "cp", f"ulysses_attention:{name}", one, 2) for phase, names in
           (("forward", ("q", "k", "v", "out")), ("backward", ("dout", "dq", "dk", "dv")))
           for name in names]

    def ring(phase, names):
        return [(op, phase, "cp", f"ring_attention:{name}", kv, 2) for name in names
                for op in ("send", "recv")]
    assert events == a2a[:3] + ring("forward", ["kv"]) + a2a[3:5] + \
        ring("backward", ["kv", "dkv", "dkv"]) + a2a[5:]


def accessors_case():
    from paraloom import parallel_state as ps
    mesh = ps.initialize_model_parallel(2, 1, context_parallel_size=2)
    try:
        return (ps.get_context_parallel_world_size(), ps.get_context_parallel_rank(),
                ps.get_context_parallel_group() is mesh.cp.group, ps.get_data_parallel_world_size(),
                mesh.dp_cp.ranks)
    finally:
        ps.destroy_model_parallel()


def test_megatron_cp_accessors(world4):
    # tp 2, cp 2 on 4 ranks: tp fastest, so ranks (0, 2) and (1, 3) share a sequence
    got = world4.run(accessors_case)
    assert got == [(2, 0, True, 1, (0, 2)), (2, 0, True, 1, (1, 3)), (2, 1, True, 1, (0, 2)),
                   (2, 1, True, 1, (1, 3))]


def test_plan_divides_activations_by_cp_and_counts_the_ring():
    from dataclasses import replace

    from paraloom.analysis.formulas import CommConfig, expected_comm
    from paraloom.analysis.plan import plan
    base = CommConfig(layers=4, hidden=64, heads=4, seq_len=64, vocab=256, micro_batch=2,
                      num_microbatches=3, tp=2, dp=2, sequence_parallel=True)
    ring, one = plan(replace(base, cp=4)), plan(base)
    assert ring["gpus"] == 4 * one["gpus"]
    act = ring["memory_per_gpu_bytes"]["activations"] / one["memory_per_gpu_bytes"]["activations"]
    assert act == pytest.approx(1 / 4)
    kv = 2 * 2 * (64 // 4) * (64 // 2) * 4          # 2 b (s/cp) (h/t) fp32 elements
    got = expected_comm(replace(base, cp=4))
    n = 3 * 4                                          # microbatches x layers
    assert got["cp", "send", "forward"] == {"count": 3 * n, "bytes": 3 * n * kv}
    assert got["cp", "send", "backward"] == {"count": 7 * n, "bytes": 7 * n * kv}
    gathered = expected_comm(replace(base, cp=4, cp_comm_type="all_gather", recompute="full"))
    assert gathered["cp", "all_gather", "recompute"] == {"count": n, "bytes": n * kv}
    assert gathered["cp", "reduce_scatter", "backward"] == {"count": n, "bytes": n * 4 * kv}
