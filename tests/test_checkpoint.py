"""Checkpoints: global names, resharding across (tp, pp, dp), atomic saves, safe loading."""

from __future__ import annotations

import pickle

import pytest
import torch

from paraloom.config import ModelConfig
from paraloom.mesh import ParallelMesh
from paraloom.models.gpt import GPTModel
from paraloom.training.checkpoint import Entry, latest_checkpoint, load_checkpoint, save_checkpoint

CFG = ModelConfig(vocab_size=32, hidden_size=16, num_layers=4, num_attention_heads=4,
                  seq_length=8)


def _stage_model(tp, pp, dp):
    mesh = ParallelMesh(tp=tp, pp=pp, dp=dp)
    per = CFG.num_layers // pp
    s = mesh.pp.rank
    model = GPTModel(CFG, mesh, layer_ids=range(s * per, (s + 1) * per),
                     pre_process=mesh.is_first_stage, post_process=mesh.is_last_stage)
    return mesh, model


def _entries(model):
    return {n: Entry(p.data, p.partition_dim if getattr(p, "tensor_model_parallel", False)
                     else None, getattr(p, "vocab_rows", None))
            for n, p in model.named_parameters()}


def _global(full, p, mesh):
    """``full`` (a vocabulary table: its real rows) padded as this layout pads it."""
    rows = getattr(p, "vocab_rows", None)
    if rows is None:
        return full
    padding = torch.full((p.shape[0] * mesh.tp.size - rows, *full.shape[1:]), 7.0)
    return torch.cat([full, padding])


def _local(full, p, mesh):
    full = _global(full, p, mesh)
    if getattr(p, "tensor_model_parallel", False):
        return full.chunk(mesh.tp.size, p.partition_dim)[mesh.tp.rank]
    return full


def save_layout(path, tp, pp, dp, full):
    mesh, model = _stage_model(tp, pp, dp)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(_local(full[n], p, mesh))
    save_checkpoint(path, _entries(model), {"step": 3}, mesh)


def load_layout(path, tp, pp, dp):
    mesh, model = _stage_model(tp, pp, dp)
    fresh = {n: p.detach().clone() for n, p in model.named_parameters()}
    meta = load_checkpoint(path, _entries(model), mesh)
    return meta, mesh.tp.rank, mesh.tp.size, {n: (p.detach().clone(), getattr(
        p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False) else None,
        getattr(p, "vocab_rows", None), fresh[n]) for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def full_params():
    model = GPTModel(CFG, ParallelMesh())
    g = torch.Generator().manual_seed(5)
    return {n: (p.detach() + torch.randn(p.shape, generator=g))[
        : getattr(p, "vocab_rows", None)] for n, p in model.named_parameters()}


def test_save_under_one_layout_load_under_others(world4, tmp_path, full_params):
    """Saved at tp 2 (the vocabulary of 32 padded to 256 rows, Megatron-LM's 128 * tp), loaded
    at tp 1 (128 rows) and tp 4 (512 rows): the real rows come from the file, each layout's own
    padding rows are left as it initialised them (at tp 2 the whole table is read back)."""
    path = tmp_path / "checkpoints" / "step_3"
    world4.run(save_layout, str(path), 2, 2, 1, full_params)
    assert latest_checkpoint(tmp_path) == path
    assert not (tmp_path / "checkpoints" / "step_3.tmp").exists()
    padded = set()
    for layout in ((1, 1, 4), (4, 1, 1), (1, 4, 1), (2, 1, 2)):
        seen = set()
        for meta, tp_rank, tp, params in world4.run(load_layout, str(path), *layout):
            assert meta == {"step": 3}
            for n, (value, dim, vocab, fresh) in params.items():
                if vocab is not None:  # rows [tp_rank * local, ...) of the padded table
                    local = value.shape[0]
                    real = max(0, min(local, vocab - tp_rank * local))
                    want = full_params[n][tp_rank * local: tp_rank * local + real]
                    assert torch.equal(value[:real], want), (layout, n)
                    kept = torch.full_like(value[real:], 7.0) if local * tp == 256 else \
                        fresh[real:]  # same padding as the file: all of it read back
                    assert torch.equal(value[real:], kept), (layout, n)
                    padded.add((tp, local * tp))
                else:
                    want = full_params[n] if dim is None else \
                        full_params[n].chunk(tp, dim)[tp_rank]
                    assert torch.equal(value, want), (layout, n)
                seen.add(n)
        assert seen == set(full_params), layout  # every parameter lives on some stage
    assert padded == {(1, 128), (4, 512), (2, 256)}


def test_latest_checkpoint_ignores_incomplete_saves(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step_2", "step_10", "step_12.tmp", "step_11"):
        (root / name).mkdir(parents=True)
    for name in ("step_2", "step_10", "step_12.tmp"):
        (root / name / ".metadata").write_bytes(b"")
        (root / name / "meta.json").write_text("{}")
    # step_11 has no files (crashed before writing), step_12.tmp is not renamed yet
    assert latest_checkpoint(tmp_path) == root / "step_10"
    assert latest_checkpoint(tmp_path / "nothing") is None


class _Evil:
    def __reduce__(self):
        return (print, ("owned",))


def test_metadata_with_code_is_refused(world4, tmp_path, full_params):
    path = tmp_path / "step_1"
    world4.run(save_layout, str(path), 1, 1, 4, full_params)
    (path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(AssertionError, match="refusing to load it"):
        world4.run(load_layout, str(path), 1, 1, 4)
