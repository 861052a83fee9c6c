"""Llama-family models: RMSNorm, rotary positions, SwiGLU, grouped-query attention, untied output
layer, no biases, and ``sdpa`` attention, under every layout and against ``transformers``.

Two oracles: paraloom's own single-process model (the counter-based init builds the same weights
in every layout) and a randomly initialised ``transformers.LlamaForCausalLM`` saved to a
temporary folder (4 heads, 2 key/value heads, untied, vocabulary 300 -> 384 padded). No network.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import checkpoint_folder, real_rows, run_training
from transformers import LlamaConfig, LlamaForCausalLM

from paraloom import comm
from paraloom.commands import main
from paraloom.config import ModelConfig, ParallelConfig, TrainConfig
from paraloom.mesh import ParallelMesh
from paraloom.models.gpt import GPTModel, ParallelOptions
from paraloom.models.hf import load_hf_weights, model_config_from_hf, read_hf_config

LLAMA = ModelConfig(vocab_size=200, hidden_size=32, num_layers=2, num_attention_heads=4,
                    num_query_groups=2, ffn_hidden_size=48, seq_length=16,
                    normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                    untie_embeddings_and_output_weights=True, add_bias_linear=False)
B, SEQ = 2, 32


def full_grads(model, mesh) -> dict:
    """Every parameter's gradient assembled to its full (tp=1) shape (SwiGLU's fc1, split with
    stride 2, as ``[gate; up]``)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if getattr(p, "sequence_parallel", False):
            g = comm.all_reduce(g.clone(), mesh.tp, phase="backward", kind="sp", site="test")
        if getattr(p, "tensor_model_parallel", False) and p.partition_dim == 1:
            g = comm.all_gather(g, mesh.tp, dim=1, phase="backward", kind="tp", site="test")
        elif getattr(p, "tensor_model_parallel", False):  # rows; stride 2: [gate_r; up_r]
            stride = getattr(p, "partition_stride", 1)
            g = comm.all_gather(g.reshape(stride, -1, *g.shape[1:]), mesh.tp, dim=1,
                                phase="backward", kind="tp", site="test").flatten(0, 1)
        out[name] = real_rows(g, p)
    return out


def _batch(cfg=LLAMA):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (B, cfg.seq_length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss_and_grads(cfg, mesh, opt=None, position_ids=None):
    model = GPTModel(cfg, mesh, options=opt)
    tokens, labels = _batch(cfg)
    loss = model(tokens, labels, position_ids=position_ids).mean()
    loss.backward()
    return loss.detach(), full_grads(model, mesh)


def model_layouts(attention):
    cfg = replace(LLAMA, attention=attention)
    out = []
    for tp, sp, recompute in ((2, False, "none"), (2, True, "selective"), (2, True, "full"),
                              (4, True, "none")):
        groups = 4 if tp == 4 else 2  # tp = 4 needs 4 key/value groups (one per rank)
        opt = ParallelOptions(sequence_parallel=sp, recompute=recompute)
        c = replace(cfg, num_query_groups=groups)
        out.append(((tp, sp, recompute, groups), _loss_and_grads(c, ParallelMesh(tp=tp,
                                                                 dp=4 // tp), opt)))
    return out


def test_llama_layers_match_one_process_and_sdpa_matches_core(world4):
    refs = {g: _loss_and_grads(replace(LLAMA, num_query_groups=g), ParallelMesh())
            for g in (2, 4)}
    for attention in ("core", "sdpa"):
        for (tp, sp, recompute, g), (loss, grads) in world4.run(model_layouts, attention)[0]:
            ref_loss, ref_grads = refs[g]
            where = f"{attention} tp={tp} sp={sp} recompute={recompute} groups={g}"
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0, msg=where)
            assert grads.keys() == ref_grads.keys()
            for name, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name, w=where: f"{w} {n}: {m}")
    # global positions index the rotary angles (relative: a shift changes nothing, a stretch
    # does); [s] and [b, s] positions agree
    shifted = _loss_and_grads(LLAMA, ParallelMesh(), position_ids=torch.arange(16) + 5)[0]
    stretched = _loss_and_grads(LLAMA, ParallelMesh(), position_ids=torch.arange(16) * 2)[0]
    batched = _loss_and_grads(LLAMA, ParallelMesh(),
                              position_ids=torch.arange(16).expand(B, 16))[0]
    assert batched == refs[2][0] and stretched != refs[2][0]
    torch.testing.assert_close(shifted, refs[2][0], rtol=1e-5, atol=0)


def test_swiglu_fc1_holds_gate_and_up_of_the_rank():
    full = GPTModel(LLAMA, ParallelMesh()).layers["0"].mlp.fc1.weight     # [gate; up] = [96, 32]
    gate, up = full.detach().chunk(2, 0)
    # rank 1 of tp = 2: rows 48..96 of the stride-2 split are gate[24:] and up[24:]
    from paraloom.models.layers import SwiGLUInit
    from paraloom.tensor_parallel.init import CounterInit
    init = SwiGLUInit(CounterInit(1234, 0.02))
    rank1 = init("layers.0.mlp.fc1.weight", (96, 32), ((48, 96), (0, 32)))
    assert torch.equal(rank1, torch.cat([gate[24:], up[24:]]))


# ---------------------------------------------------------------- transformers' Llama
def _make_hf(path) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms away from one, weights away from the HF init
            p.add_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.05))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return str(path), _make_hf(path)


def _windows() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (4, SEQ + 1), generator=g)


def hf_losses(hf_dir, windows):
    from paraloom.training.train import build, evaluate
    model = model_config_from_hf(read_hf_config(hf_dir), seq_length=SEQ)
    out = []
    for tp, pp, sp in ((1, 1, False), (2, 1, True), (1, 2, False), (2, 2, True)):
        parallel = ParallelConfig(tp=tp, pp=pp, dp=4 // (tp * pp), sequence_parallel=sp)
        cfg = TrainConfig().replace(model=model, parallel=parallel, global_batch_size=4,
                          micro_batch_size=1, schedule="1f1b" if pp > 1 else "none")
        run = build(cfg, ParallelMesh(parallel), None, init_from_hf=hf_dir)
        out.append(evaluate(run, [(windows[:, :-1], windows[:, 1:])]))
    return out


def test_every_layout_gives_transformers_llama_loss(world4, hf):
    folder, model = hf
    cfg = model_config_from_hf(read_hf_config(folder))
    assert (cfg.query_groups, cfg.padded_vocab(1), cfg.ffn) == (2, 384, 96)
    windows = _windows()
    with torch.no_grad():
        want = model(windows, labels=windows).loss.item()
    for losses in world4.run(hf_losses, folder, windows):
        for got in losses:
            assert got == pytest.approx(want, rel=1e-5)


def test_llama_import_train_export(hf, tmp_path):
    from paraloom.training.hf_export import load_full_params
    folder, original = hf
    run, out = tmp_path / "run", tmp_path / "exported"
    assert main(["train", "--init-from-hf", folder, "--tp", "2", "--pp", "2", "--dp", "1",
                 "--seq-len", str(SEQ), "--global-batch-size", "4", "--micro-batch-size", "1",
                 "--steps", "3", "--warmup-steps", "1", "--lr", "1e-3", "--save-every", "3",
                 "--ledger-steps", "1", "--out", str(run)]) == 0
    assert main(["export-hf", str(run), str(out)]) == 0
    exported = LlamaForCausalLM.from_pretrained(out).eval()
    cfg, params, _ = load_full_params(run)
    ours = GPTModel(cfg, ParallelMesh())
    ours.load_state_dict({k: v.reshape(ours.get_parameter(k).shape) for k, v in params.items()})
    windows = _windows()[:, :SEQ]
    with torch.no_grad():
        want = ours(windows).transpose(0, 1)[..., : cfg.vocab_size]
        got, before = exported(windows).logits, original(windows).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - before).abs().max() > 1e-3  # the three steps moved the weights
    # import of the export is the identity on the weights
    again = GPTModel(cfg, ParallelMesh())
    load_hf_weights([again], out, cfg, 0)
    for name, p in again.named_parameters():
        assert torch.equal(p, ours.get_parameter(name)), name


def test_tied_llama_round_trips(tmp_path):
    """A Llama with tie_word_embeddings (no lm_head in the file) imports tied and exports tied."""
    from paraloom.models.hf import hf_config_from_model, to_hf_state_dict
    torch.manual_seed(3)
    theirs = LlamaForCausalLM(LlamaConfig(
        vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)).eval()
    theirs.save_pretrained(tmp_path)
    cfg = model_config_from_hf(read_hf_config(tmp_path))
    assert not cfg.untie_embeddings_and_output_weights and cfg.norm_epsilon == 1e-6
    ours = GPTModel(cfg, ParallelMesh())
    load_hf_weights([ours], tmp_path, cfg, 0)
    windows = _windows()[:, :16]
    with torch.no_grad():
        torch.testing.assert_close(ours(windows).transpose(0, 1)[..., :260],
                                   theirs(windows).logits, rtol=1e-5, atol=1e-5)
    assert hf_config_from_model(cfg)["tie_word_embeddings"] is True
    back = to_hf_state_dict(dict(ours.named_parameters()), cfg)
    assert "lm_head.weight" not in back and torch.equal(
        back["model.layers.1.mlp.up_proj.weight"], theirs.model.layers[1].mlp.up_proj.weight)


def test_unsupported_llama_configs_are_refused(hf):
    hf_cfg = read_hf_config(hf[0])
    for key, value in (("hidden_act", "gelu"), ("attention_bias", True), ("mlp_bias", True),
                       ("head_dim", 32),
                       ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5})):
        with pytest.raises(ValueError, match=key.split("_")[0]):
            model_config_from_hf({**hf_cfg, key: value})
    with pytest.raises(ValueError, match="max_position_embeddings = 64"):
        model_config_from_hf(hf_cfg, seq_length=65)
    with pytest.raises(ValueError, match="gpt2: GPT2LMHeadModel, llama: LlamaForCausalLM"):
        import pathlib
        folder = pathlib.Path(hf[0]).parent / "mistral"
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps({**hf_cfg, "model_type": "mistral"}))
        read_hf_config(folder)


# ---------------------------------------------------------------- --arch llama training
def _train(path, *, tp=1, pp=1, dp=1, sp=False, vpp=None, zero=False, attention="core"):
    model = replace(LLAMA, vocab_size=256, num_layers=4, attention=attention,
                    ffn_hidden_size=None)
    schedule = "interleaved" if vpp else ("1f1b" if pp > 1 else "none")
    cfg = TrainConfig().replace(model=model, parallel=ParallelConfig(tp=tp, pp=pp, dp=dp, vpp=vpp,
                                                           sequence_parallel=sp),
                      global_batch_size=8, micro_batch_size=1, steps=3, warmup_steps=1,
                      save_every=0, ledger_steps=1, timeout_s=60, schedule=schedule,
                      distributed_optimizer=zero, out=str(path))
    return run_training(cfg)


LAYOUTS = [dict(tp=2, pp=2, sp=True, vpp=2), dict(tp=2, dp=2, sp=True),
           dict(pp=2, dp=2, zero=True), dict(tp=2, pp=2), dict(dp=4, zero=True, attention="sdpa")]


def test_arch_llama_trains_the_same_model_in_every_layout_and_check_agrees(tmp_path, capsys):
    want = _train(tmp_path / "ref")
    assert want[-1]["loss"] < want[0]["loss"]
    for i, layout in enumerate(LAYOUTS):
        got = _train(tmp_path / f"run{i}", **layout)
        for a, b in zip(got, want, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (layout, a, b)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (layout, a, b)
        assert main(["check", str(tmp_path / f"run{i}")]) == 0, (layout, capsys.readouterr().out)


def test_arch_llama_flags(tmp_path, capfd):

    from paraloom.commands.train import parser
    from paraloom.commands.train_flags import config_from_args
    parse = parser().parse_args
    model = config_from_args(parse(["--arch", "llama", "--tp", "2", "--pp", "1", "--dp", "1",
                                    "--group-query-attention", "--num-query-groups", "2",
                                    "--attention", "sdpa"]))[0].model
    assert (model.normalization, model.swiglu, model.position_embedding_type,
            model.untie_embeddings_and_output_weights, model.add_bias_linear, model.attention,
            model.query_groups, model.ffn) == ("RMSNorm", True, "rope", True, False, "sdpa", 2,
                                               128)
    assert config_from_args(parse(["--tp", "2", "--pp", "1", "--dp", "1"]))[0].model == \
        ModelConfig(vocab_size=256, hidden_size=64, num_layers=4, num_attention_heads=4,
                    seq_length=64)  # the GPT-2 default is unchanged
    for extra, message in ((["--num-query-groups", "2"], "needs --group-query-attention"),
                           (["--group-query-attention", "--num-query-groups", "3"],
                            "not divisible by num_query_groups = 3"),
                           (["--group-query-attention", "--num-query-groups", "1"],
                            "num_query_groups = 1 is not divisible by tp = 2")):
        assert main(["train", "--arch", "llama", "--tp", "2", "--pp", "1", "--dp", "1",
                     "--out", str(tmp_path / "never"), *extra]) == 2
        assert message in capfd.readouterr().err
    assert not (tmp_path / "never").exists()
    # train --resume refills the architecture from the saved config.json
    for i, model in enumerate((LLAMA, replace(LLAMA, num_query_groups=None, attention="sdpa"),
                               ModelConfig())):
        model = replace(model, vocab_size=256)  # bytes
        saved = TrainConfig().replace(model=model, parallel=ParallelConfig(tp=2))
        run = checkpoint_folder(tmp_path / f"saved{i}", saved)
        resumed, _ = config_from_args(parse(["--resume", str(run), "--steps", "2"]))
        assert resumed.model == model and resumed.parallel == saved.parallel
        # --arch naming the checkpoint's architecture is accepted; the other one is refused
        same, other = ("gpt2", "llama") if model.normalization == "LayerNorm" \
            else ("llama", "gpt2")
        assert config_from_args(parse(["--resume", str(run), "--arch", same]))[0].model == model
        assert main(["train", "--resume", str(run), "--arch", other]) == 2
        assert f"--arch {other} contradicts --resume" in capfd.readouterr().err
        assert main(["eval", "--resume", str(run), "--arch", other]) == 2
        assert "the checkpoint fixes the architecture" in capfd.readouterr().err


def test_formulas_know_the_llama_parameters_and_sdpa_memory():
    from paraloom.analysis.arch import Architecture
    from paraloom.analysis.formulas import CommConfig
    from paraloom.analysis.layout import chunk_params
    from paraloom.analysis.plan import plan
    from paraloom.analysis.view import comm_view
    from paraloom.commands.plan import config_of, parser
    from paraloom.measure.memory import expected_saved_bytes, saved_bytes_per_layer
    arch = Architecture(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                        num_query_groups=2, untie_embeddings_and_output_weights=True,
                        add_bias_linear=False)
    c = CommConfig(layers=2, hidden=32, heads=4, seq_len=16, vocab=256, ffn=48, pp=2, arch=arch)
    cfg = replace(LLAMA, vocab_size=256)
    for pp_rank, layers in ((0, [0]), (1, [1])):
        model = GPTModel(cfg, ParallelMesh(), layer_ids=layers, pre_process=pp_rank == 0,
                         post_process=pp_rank == 1)
        assert [(p.name, p.numel) for p in chunk_params(c, pp_rank)] == \
            [(n, p.numel()) for n, p in model.named_parameters()]
    # Llama-3-8B's shape: 8,030,261,248 parameters
    argv = ("--layers 32 --hidden 4096 --heads 32 --seq-len 8192 --global-batch-size 8 "
            "--micro-batch-size 1 --tp 8 --pp 1 --dp 1 --vocab 128256 "
            "--make-vocab-size-divisible-by 1 --arch llama --group-query-attention "
            "--num-query-groups 8 --ffn 14336").split()
    view = comm_view(config_of(parser().parse_args(argv), argv))
    assert plan(view)["parameters"]["total"] == 8_030_261_248
    # sdpa keeps no s x s tensor: measured == accounted, and less than core
    gpt = ModelConfig(hidden_size=64, num_attention_heads=4, seq_length=32)
    opt = ParallelOptions(params_dtype=torch.bfloat16)
    for attention in ("core", "sdpa"):
        got = saved_bytes_per_layer(replace(gpt, attention=attention), ParallelMesh(), opt, 32, 2)
        want = expected_saved_bytes(32, 2, 64, 4, dropout=False, attention=attention)
        assert got == sum(want.values()), (attention, got, want)
    assert sum(expected_saved_bytes(32, 2, 64, 4, attention="sdpa").values()) < \
        sum(expected_saved_bytes(32, 2, 64, 4).values())
