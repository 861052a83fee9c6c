"""``paraloom train`` with context parallelism trains the (1,1,1) model: losses and gradient norms
at rtol 1e-5 for cp in {2, 4} with tp+sp, pp, dp+ZeRO and the three comm types (ring,
all-gather, Ulysses all-to-all); a resume that changes
cp (DCP reshard cp=2 -> cp=1 and cp=1 -> cp=2) continues with the same losses; ``paraloom check``
is exact on a CP run's ledger; a Hugging Face GPT-2 evaluated under cp = 2 scores as transformers.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import assert_same_metrics, layout_config, run_training

from paraloom.commands.check import main as check_main
from paraloom.config import ModelConfig, ParallelConfig, TrainConfig

MODEL = ModelConfig(vocab_size=256, hidden_size=32, num_layers=2, num_attention_heads=4,
                    seq_length=16)
BASE = TrainConfig().replace(parallel=ParallelConfig(), model=MODEL,
                             global_batch_size=4, micro_batch_size=1, steps=4, lr=3e-3,
                   warmup_steps=1, save_every=0, ledger_steps=1, timeout_s=60)


def train(tmp_path, name, **layout) -> list[dict]:
    return run_training(layout_config(BASE, tmp_path / name, **layout))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ref")
    return folder, train(folder, "single", save_every=2)


@pytest.mark.parametrize("layout", [  # (tp, cp, pp, dp) = (1, 2, 1, 1): in the resume test
    dict(tp=2, cp=2, sp=True, comm="all_gather", recompute="selective"),
    dict(cp=2, pp=2, recompute="full"),
    dict(cp=2, dp=2, distributed_optimizer=True, comm="all_gather"),
    dict(cp=4),
    # Ulysses: Q, K, V all-to-all'd to head shards (heads / tp divisible by cp)
    dict(tp=2, cp=2, sp=True, comm="a2a", recompute="selective"),
    dict(cp=2, pp=2, comm="a2a", recompute="full"),
    dict(cp=4, comm="a2a"),
    dict(cp=2, dp=2, comm="a2a", model=replace(MODEL, attention="sdpa")),  # the fused kernel
], ids=lambda d: "-".join(v.attention if k == "model" else f"{k}{v}" for k, v in d.items()))
def test_cp_layouts_train_the_same_model(tmp_path, reference, layout):
    assert_same_metrics(train(tmp_path, "run", **layout), reference[1])
    assert check_main([str(tmp_path / "run"), "--only-diff"]) == 0  # the ledger, exactly
    events = [json.loads(x) for x in (tmp_path / "run" / "ledger.jsonl").read_text().split("\n")
              if x]
    grads = {len(e["group"]) for e in events if e["kind"] == "dp" and e["phase"] != "setup"}
    # Megatron's rule: one bucketed reduction over dp x cp (not one over dp and one over cp)
    assert grads == {layout.get("dp", 1) * layout["cp"]}


def test_hierarchical_cp_trains_the_same_model_and_reshards(tmp_path, reference):
    """a2a+p2p at cp = 4 = 2 x 2 with selective recomputation: the (1,1,1) model's losses, the
    ledger exact, the all-to-alls within pairs of consecutive cp ranks and the ring across them;
    its checkpoint resumes on one rank with the same losses."""
    folder, ref = reference
    run = layout_config(BASE, tmp_path / "hcp", cp=4, comm="a2a+p2p", cp_sizes=(2, 2),
                        recompute="selective", save_every=2)
    assert_same_metrics(run_training(run), ref)
    assert check_main([str(tmp_path / "hcp"), "--only-diff"]) == 0
    events = [json.loads(x) for x in (tmp_path / "hcp" / "ledger.jsonl").read_text().split("\n")
              if x]
    groups = {(e["op"], tuple(e["group"])) for e in events if e["kind"] == "cp"}
    assert groups == {("all_to_all", (0, 1)), ("all_to_all", (2, 3)), ("send", (0, 2)),
                      ("recv", (0, 2)), ("send", (1, 3)), ("recv", (1, 3))}
    down = train(tmp_path, "to-cp1", resume=str(tmp_path / "hcp" / "checkpoints" / "step_2"))
    assert_same_metrics(down, ref[2:])
    # from the command line, another cp: the saved levels (2 x 2) belong to cp 4 and are dropped
    from paraloom.commands import main
    assert main(["train", "--resume", str(tmp_path / "hcp" / "checkpoints" / "step_2"), "--cp",
                 "2", "--cp-comm-type", "p2p", "--out", str(tmp_path / "to-cp2")]) == 0
    ring = [json.loads(x) for x in (tmp_path / "to-cp2" / "metrics.jsonl").read_text()
            .splitlines()]
    assert_same_metrics(ring, ref[2:])


def test_resume_changing_cp_continues_the_same_losses(tmp_path, reference):
    folder, ref = reference
    straight = train(tmp_path, "cp2", cp=2, save_every=2)
    assert_same_metrics(straight, ref)
    assert check_main([str(tmp_path / "cp2"), "--only-diff"]) == 0
    down = train(tmp_path, "to-cp1", resume=str(tmp_path / "cp2" / "checkpoints" / "step_2"))
    assert_same_metrics(down, ref[2:])
    up = train(tmp_path, "to-cp2", cp=2, comm="all_gather",
               resume=str(folder / "single" / "checkpoints" / "step_2"))
    assert_same_metrics(up, ref[2:])


def test_hf_gpt2_under_cp_scores_like_transformers(tmp_path, capfd):
    from transformers import GPT2Config, GPT2LMHeadModel

    from paraloom.commands import main
    torch.manual_seed(0)
    seq = 16
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=256, n_positions=seq,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                     eos_token_id=None)
    model = GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(tmp_path / "gpt2")
    text = bytes(range(40, 40 + seq + 1))
    (tmp_path / "one.txt").write_bytes(text)
    assert main(["eval", "--hf", str(tmp_path / "gpt2"), "--data", str(tmp_path / "one.txt"),
                 "--split", "all", "--batches", "1", "--global-batch-size", "2", "--cp", "2",
                 "--cp-comm-type", "p2p"]) == 0
    got = json.loads([x for x in capfd.readouterr().out.splitlines() if x.startswith("{")][-1])
    window = torch.tensor(list(text))
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(model(window[None, :-1]).logits[0],
                                                 window[1:]).item()
    assert got["loss"] == pytest.approx(want, rel=1e-5)


LLAMA = replace(MODEL, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                num_query_groups=2, untie_embeddings_and_output_weights=True,
                add_bias_linear=False, ffn_hidden_size=64)


def test_llama_gqa_rope_under_cp_trains_the_same_model(tmp_path):
    """Rotary positions follow the load-balanced chunks and the ring carries g < a K/V heads."""
    want = train(tmp_path, "llama1", model=LLAMA)
    got = train(tmp_path, "llama-tp2-cp2", tp=2, cp=2, sp=True, model=LLAMA)
    assert_same_metrics(got, want)
    assert check_main([str(tmp_path / "llama-tp2-cp2"), "--only-diff"]) == 0
    # Ulysses with grouped-query attention: each cp rank gets one of the 2 K/V heads and the
    # 2 query heads it serves
    got = train(tmp_path, "llama-cp2-a2a", cp=2, comm="a2a", model=LLAMA)
    assert_same_metrics(got, want)
    assert check_main([str(tmp_path / "llama-cp2-a2a"), "--only-diff"]) == 0
