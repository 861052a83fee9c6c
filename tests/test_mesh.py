"""The rank grid (pure logic), the process groups and Megatron's accessors."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from paraloom import parallel_state as ps
from paraloom.config import ModelConfig, ParallelConfig, check_layout
from paraloom.mesh import ParallelMesh, rank_coords, rank_groups


def test_rank_order_is_tensor_fastest_then_data_then_pipeline():
    g = rank_groups(tp=2, pp=2, dp=2)
    assert g["tp"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert g["dp"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert g["pp"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert g["emb"] == g["pp"]  # two stages: first and last are the whole pipeline
    assert rank_coords(6, tp=2, pp=2, dp=2) == (1, 1, 0)
    assert rank_groups(1, 4, 1)["emb"] == [(0, 3)]
    assert rank_groups(2, 1, 1)["emb"] == [(0,), (1,)]


def test_every_rank_is_in_exactly_one_group_per_axis():
    tp, pp, dp = 2, 3, 2
    for axis, groups in rank_groups(tp, pp, dp).items():
        if axis == "emb":
            continue
        members = sorted(r for g in groups for r in g)
        assert members == list(range(tp * pp * dp)), axis


def test_config_validation_names_the_values():
    with pytest.raises(ValueError, match="tp must be a positive integer, got 0"):
        ParallelConfig(tp=0)
    with pytest.raises(ValueError, match="vpp = 2 needs pipeline parallelism"):
        ParallelConfig(vpp=2)
    with pytest.raises(ValueError,
                       match="hidden_size = 30 is not divisible by num_attention_heads = 4"):
        ModelConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"num_layers = 6 is not divisible by pp \* vpp = 4.*"
                                         r"seq_length = 63 is not divisible by tp = 2"):
        check_layout(ModelConfig(num_layers=6, seq_length=63),
                     ParallelConfig(tp=2, pp=2, vpp=2, sequence_parallel=True))
    check_layout(ModelConfig(num_layers=8), ParallelConfig(tp=2, pp=2, vpp=2))


def test_single_process_mesh():
    mesh = ParallelMesh()
    assert (mesh.tp.size, mesh.pp.size, mesh.dp.size) == (1, 1, 1)
    assert mesh.tp.group is None and mesh.is_first_stage and mesh.is_last_stage


def accessors(tp, pp, dp):
    mesh = ps.initialize_model_parallel(tp, pp, dp)
    try:
        out = dict(
            tp=(ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()),
            pp=(ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()),
            dp=(ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()),
            first=ps.is_pipeline_first_stage(), last=ps.is_pipeline_last_stage(),
            next=ps.get_pipeline_model_parallel_next_rank(),
            prev=ps.get_pipeline_model_parallel_prev_rank(), emb=mesh.emb.ranks,
        )
        # the groups really connect the ranks they claim: sum the global ranks over each axis
        import torch
        for name in ("tp", "dp", "pp"):
            axis = mesh.axes[name]
            if axis.size > 1:
                t = torch.tensor([float(dist.get_rank())])
                dist.all_reduce(t, group=axis.group)
                out[name + "_sum"] = t.item()
        return out
    finally:
        ps.destroy_model_parallel()


def test_megatron_accessors_on_a_real_world(world4):
    results = world4.run(accessors, 1, 2, 2)  # pp=2, dp=2
    r3 = results[3]  # rank 3 = pp 1, dp 1
    assert r3["tp"] == (1, 0) and r3["pp"] == (2, 1) and r3["dp"] == (2, 1)
    assert r3["last"] and not r3["first"] and r3["next"] == 1 and r3["prev"] == 1
    assert r3["emb"] == (1, 3) and r3["pp_sum"] == 1 + 3 and r3["dp_sum"] == 2 + 3
    results = world4.run(accessors, 2, 1, 2)
    assert [r["tp"] for r in results] == [(2, 0), (2, 1), (2, 0), (2, 1)]
    assert [r["tp_sum"] for r in results] == [1, 1, 5, 5]
    assert all(r["first"] and r["last"] for r in results)
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_mesh()
