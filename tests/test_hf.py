"""Hugging Face GPT-2 interoperability: import under every layout, train, export, reload.

The oracle is ``transformers`` itself: a randomly initialised ``GPT2LMHeadModel`` (weights, biases
and LayerNorms all perturbed, so no mapping error hides behind zeros or ones) saved to a temporary
folder. No network.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from paraloom.commands import main
from paraloom.config import ModelConfig, ParallelConfig, TrainConfig
from paraloom.models.hf import (
    HFReader,
    load_hf_weights,
    model_config_from_hf,
    read_hf_config,
    to_hf_state_dict,
)

SEQ, B = 32, 4  # n_positions is 64: the import keeps the first 32 position rows
TEXT = (b"Every communication is on the record: tensor, sequence, pipeline and data parallel "
        b"ranks agree on one loss, whatever the layout, and give the weights back intact. ") * 2
LAYOUTS = [(tp, pp, sp) for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)) for sp in (False, True)]


def _windows() -> torch.Tensor:  # [B, SEQ + 1] fixed bytes
    data = torch.tensor(list(TEXT), dtype=torch.long)
    return torch.stack([data[i * 37: i * 37 + SEQ + 1] for i in range(B)])


def _make_hf(path, vocab: int) -> GPT2LMHeadModel:
    torch.manual_seed(vocab)
    cfg = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=vocab, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                     eos_token_id=None)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # the tied lm_head is wte: perturbed once
            p.add_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.1))
    model.save_pretrained(path)
    return model


@torch.no_grad()
def _hf_loss(model, windows: torch.Tensor) -> float:
    return model(windows, labels=windows).loss.item()  # transformers shifts the labels itself


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """``{vocab: (folder, model)}`` for vocab 256 (no padding rows used) and 300 (-> 384)."""
    return {v: (str(p), _make_hf(p, v))
            for v in (256, 300) for p in [tmp_path_factory.mktemp(f"hf{v}")]}


def hf_losses(hf_dir: str, windows: torch.Tensor) -> list[float]:
    """On every rank: paraloom's loss on ``windows`` for each layout, built with the HF init."""
    from paraloom.mesh import ParallelMesh
    from paraloom.training.train import build, evaluate
    model = model_config_from_hf(read_hf_config(hf_dir), seq_length=SEQ)
    out = []
    for tp, pp, sp in LAYOUTS:
        parallel = ParallelConfig(tp=tp, pp=pp, dp=4 // (tp * pp), sequence_parallel=sp)
        cfg = TrainConfig().replace(model=model, parallel=parallel, global_batch_size=B,
                          micro_batch_size=1, schedule="1f1b" if pp > 1 else "none")
        run = build(cfg, ParallelMesh(parallel), None, init_from_hf=hf_dir)
        out.append(evaluate(run, [(windows[:, :-1], windows[:, 1:])]))
    return out


@pytest.mark.parametrize("vocab", [256, 300])
def test_every_layout_gives_transformers_loss(world4, hf, vocab):
    folder, model = hf[vocab]
    windows = _windows()
    want = _hf_loss(model, windows)
    results = world4.run(hf_losses, folder, windows)
    for rank_losses in results:
        for (tp, pp, sp), got in zip(LAYOUTS, rank_losses, strict=True):
            assert got == pytest.approx(want, rel=1e-5), (tp, pp, sp, got, want)


def test_import_then_export_is_the_identity(hf, tmp_path):
    from paraloom.mesh import ParallelMesh
    from paraloom.models.gpt import GPTModel
    folder, model = hf[300]
    cfg = model_config_from_hf(read_hf_config(folder))  # all 64 positions
    ours = GPTModel(cfg, ParallelMesh())
    load_hf_weights([ours], folder, cfg, 0)
    assert ours.embedding.word_embeddings.weight[300:].abs().sum() == 0  # padding rows
    back = to_hf_state_dict(dict(ours.named_parameters()), cfg)
    theirs = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert back.keys() == theirs.keys()
    for k, v in theirs.items():
        assert torch.equal(back[k], v), k
    # a pytorch_model.bin folder reads the same slices (loaded with weights_only, memory-mapped)
    shutil.copy(f"{folder}/config.json", tmp_path / "config.json")
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    st, pt = HFReader(folder), HFReader(tmp_path)
    for name, rows, cols in (("h.1.attn.c_attn.weight", slice(0, 128), slice(64, 192)),
                             ("wte.weight", slice(128, 300), None), ("h.3.mlp.c_fc.bias",
                                                                     slice(256, 512), None)):
        assert torch.equal(st.get(name, rows, cols), pt.get(name, rows, cols)), name


def test_unsupported_configs_are_refused(hf):
    hf_cfg = read_hf_config(hf[256][0])
    assert model_config_from_hf(hf_cfg) == ModelConfig(
        vocab_size=256, hidden_size=128, num_layers=4, num_attention_heads=4, seq_length=64,
        init_std=0.02)
    for key, value in (("activation_function", "relu"), ("layer_norm_epsilon", 1e-6),
                       ("scale_attn_by_inverse_layer_idx", True),
                       ("reorder_and_upcast_attn", True), ("tie_word_embeddings", False)):
        with pytest.raises(ValueError, match=key):
            model_config_from_hf({**hf_cfg, key: value})
    with pytest.raises(ValueError, match="n_positions = 64"):
        model_config_from_hf(hf_cfg, seq_length=65)


def test_cli_rejects_shape_conflicts(hf, tmp_path, capfd):
    folder = hf[256][0]
    common = ["train", "--init-from-hf", folder, "--tp", "1", "--pp", "1", "--dp", "1",
              "--out", str(tmp_path / "never")]
    for extra, message in ((["--hidden", "64"], "--hidden 64 (the checkpoint has 128)"),
                           (["--seq-len", "128"], "n_positions = 64"),
                           (["--resume", str(tmp_path)], "give one of them")):
        assert main([*common, *extra]) == 2
        assert message in capfd.readouterr().err
    assert main(["eval", "--hf", str(tmp_path)]) == 2  # no config.json
    assert not (tmp_path / "never").exists()


def test_eval_hf_matches_transformers(hf, capfd):
    from paraloom.data import Corpus, eval_batches, load_corpus
    folder, model = hf[300]
    assert main(["eval", "--hf", folder, "--tp", "2", "--pp", "2", "--sequence-parallel",
                 "--seq-len", str(SEQ), "--batches", "1", "--global-batch-size", "4"]) == 0
    got = json.loads([x for x in capfd.readouterr().out.splitlines() if x.startswith("{")][-1])
    tokens, labels = eval_batches(Corpus(load_corpus(), SEQ), 4, 1)[0]
    want = _hf_loss(model, torch.cat([tokens, labels[:, -1:]], 1))
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    assert got["step"] == 0 and got["checkpoint"] == folder


def test_round_trip_train_export_reload(hf, tmp_path):
    from paraloom.data import Corpus, eval_batches, load_corpus
    from paraloom.mesh import ParallelMesh
    from paraloom.models.gpt import GPTModel
    from paraloom.training.hf_export import load_full_params
    from paraloom.training.loop import EVAL_BATCHES
    folder, original = hf[300]
    run, out = tmp_path / "run", tmp_path / "exported"
    assert main(["train", "--init-from-hf", folder, "--tp", "2", "--pp", "2", "--dp", "1",
                 "--sequence-parallel", "--seq-len", str(SEQ), "--global-batch-size", "4",
                 "--micro-batch-size", "1", "--steps", "3", "--warmup-steps", "1", "--lr", "1e-3",
                 "--save-every", "3", "--ledger-steps", "1", "--out", str(run)]) == 0
    corpus = Corpus(load_corpus(), SEQ)
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] == pytest.approx(_hf_loss(original, corpus.global_batch(0, 4)),
                                          rel=1e-5)  # the run started from the HF weights
    assert main(["export-hf", str(run), str(out)]) == 0
    exported = GPT2LMHeadModel.from_pretrained(out).eval()
    # paraloom's logits from the run's checkpoint, in this one process
    cfg, params, _ = load_full_params(run)
    ours = GPTModel(cfg, ParallelMesh())
    ours.load_state_dict(params, strict=True)
    windows = _windows()
    with torch.no_grad():
        want = ours(windows[:, :-1]).transpose(0, 1)[..., : cfg.vocab_size]  # [b, s, V]
        got = exported(windows[:, :-1]).logits
        before = original(windows[:, :-1]).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - before).abs().max() > 1e-3  # three steps of training did move the weights
    # the held-out loss the trained ranks measured, recomputed by transformers on the export
    summary = json.loads((run / "summary.json").read_text())
    held = eval_batches(corpus, 4, EVAL_BATCHES)
    with torch.no_grad():  # the export has n_positions = SEQ: score SEQ tokens, not SEQ + 1
        loss = sum(torch.nn.functional.cross_entropy(exported(t).logits.flatten(0, 1),
                                                     lab.flatten()).item()
                   for t, lab in held) / len(held)
    assert loss == pytest.approx(summary["held_out_loss_after"], rel=1e-5)
