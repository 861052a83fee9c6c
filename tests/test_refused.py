"""Bad input to ``paraloom train`` and ``eval`` is refused before any rank starts: exit 2 and one
line naming the value (the flag, the file, the numbers) and what would be valid.

The ``no_ranks`` fixture replaces ``launch.spawn`` with a function that fails the test, so
"before any rank starts" is checked, not assumed. Refusals of other commands live with them
(``record``, ``diff``, ``explain``, ``plan``). The one case that must run (``eval --split all``
on a file of exactly ``seq_len + 1`` bytes: one window) is compared with ``transformers`` on
that window.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from dataclasses import replace

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from paraloom.commands import main
from paraloom.data import Corpus, check_data, eval_batches, load_corpus, min_bytes

SEQ = 64


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random GPT-2 (4 layers, n_positions 64) saved as a Hugging Face folder."""
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=256, n_positions=SEQ,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                     eos_token_id=None)
    path = tmp_path_factory.mktemp("gpt2")
    model = GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(path)
    return str(path), model


def _file(tmp_path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


TEXT = bytes(range(32, 127))  # 95 printable bytes


def test_eval_all_on_exactly_one_window(hf_dir, tmp_path, capfd):
    folder, model = hf_dir
    one = _file(tmp_path, "one.txt", TEXT[:SEQ + 1])
    assert main(["eval", "--hf", folder, "--data", one, "--split", "all", "--seq-len", str(SEQ),
                 "--batches", "1", "--global-batch-size", "2"]) == 0
    got = json.loads([x for x in capfd.readouterr().out.splitlines() if x.startswith("{")][-1])
    window = torch.tensor(list(TEXT[:SEQ + 1]))
    with torch.no_grad():  # transformers scores SEQ predictions of the one window
        logits = model(window[None, :-1]).logits[0]
        want = torch.nn.functional.cross_entropy(logits, window[1:]).item()
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    assert got["windows"] == 1 and got["tokens"] == 2 * SEQ  # one window, read by both rows


def test_eval_refuses_short_files_before_ranks(hf_dir, tmp_path, capsys, no_ranks):
    folder, _ = hf_dir
    short = _file(tmp_path, "short.txt", TEXT[:SEQ])
    assert main(["eval", "--hf", folder, "--data", short, "--split", "all",
                 "--seq-len", str(SEQ)]) == 2
    err = capsys.readouterr().err
    assert short in err and f"has {SEQ} bytes" in err and f"at least {SEQ + 1}" in err
    one = _file(tmp_path, "one.txt", TEXT[:SEQ + 1])  # one window, but none held out
    assert main(["eval", "--hf", folder, "--data", one, "--seq-len", str(SEQ)]) == 2
    err = capsys.readouterr().err
    assert one in err and f"at least {min_bytes(SEQ, 'heldout')}" in err and "--split all" in err


def test_eval_names_the_layout_flags(hf_dir, capsys, no_ranks):
    folder, _ = hf_dir
    assert main(["eval", "--hf", folder, "--pp", "2", "--vpp", "3", "--seq-len", "16"]) == 2
    err = capsys.readouterr().err
    assert "--num-layers 4" in err and "--pp 2" in err and "--vpp 3" in err
    assert "--vpp can be 2" in err


BAD_DATA = [
    ("missing.txt", None, "missing"),
    ("folder", "dir", "a folder"),
    ("empty.txt", b"", "is empty (0 bytes)"),
    ("empty.gz", gzip.compress(b""), "is empty (0 bytes after gunzip)"),
    ("broken.gz", b"this is not gzip at all", "not a valid gzip file"),
    ("cut.gz", gzip.compress(TEXT * 40)[:-12], "not a valid gzip file"),
    ("short.txt", TEXT[:SEQ + 1], f"has {SEQ + 1} bytes"),
    ("almost.txt", (TEXT * 20)[:min_bytes(SEQ, "train") - 1],
     f"needs at least {min_bytes(SEQ, 'train')}"),
]


@pytest.mark.parametrize("name, data, message", BAD_DATA, ids=[b[0] for b in BAD_DATA])
def test_train_refuses_bad_data_before_ranks(tmp_path, capsys, no_ranks, name, data, message):
    path = tmp_path / name
    if data == "dir":
        path.mkdir()
    elif data is not None:
        path.write_bytes(data)
    assert main(["train", "--data", str(path), "--seq-len", str(SEQ), "--tp", "1", "--pp", "1",
                 "--dp", "1"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and message in err, err


def test_train_names_the_layout_flags(capsys, no_ranks):
    assert main(["train", "--num-layers", "4", "--pp", "2", "--vpp", "3"]) == 2
    err = capsys.readouterr().err
    assert "--num-layers 4" in err and "--pp 2 * --vpp 3 = 6" in err and "--vpp can be 2" in err
    assert main(["train", "--num-layers", "6", "--pp", "4", "--dp", "1"]) == 2
    err = capsys.readouterr().err
    assert "--num-layers 6 is not divisible by --pp 4" in err and "--pp can be 2, 3 or 6" in err


@pytest.mark.parametrize("seq", [1, 7, 64, 100])
@pytest.mark.parametrize("use", ["train", "heldout", "all"])
def test_min_bytes_is_exactly_what_the_loader_needs(tmp_path, seq, use):
    """At ``min_bytes`` the check passes and the loader reads its windows; one byte less, the
    check refuses. The check and the loader cannot drift apart."""
    need = min_bytes(seq, use)
    ok = _file(tmp_path, "ok.txt", (TEXT * 200)[:need])
    assert check_data(ok, seq, use) == []
    corpus = Corpus(load_corpus(ok), seq)
    if use == "train":
        assert corpus.global_batch(0, 4).shape == (4, seq + 1)
    windows = eval_batches(corpus, 2, 1, start=0 if use == "all" else None)[0][0]
    assert windows.shape == (2, seq)
    short = _file(tmp_path, "short.txt", (TEXT * 200)[:need - 1])
    with pytest.raises(ValueError, match=f"has {need - 1} bytes.*at least {need}"):
        check_data(short, seq, use)


def test_training_draws_every_window_of_its_part_the_last_one_included():
    """Offsets 0 .. split - seq_len - 1: the window ending at the training part's last token
    is drawn too (it never was: an off-by-one), and nothing reaches the held-out part."""
    seq = 8
    corpus = Corpus(torch.arange(200) % 256, seq)
    starts = {int(row[0]) for step in range(300) for row in corpus.global_batch(step, 4)}
    assert starts == set(range(corpus.split - seq)), sorted(set(range(corpus.split - seq))
                                                            - starts)
    one = Corpus(torch.arange(seq + 1 + 40) % 256, seq, holdout=40 / (seq + 41))
    assert one.split == seq + 1 and one.global_batch(0, 3)[:, 0].tolist() == [0, 0, 0]


def test_split_cuts_the_token_stream_in_order():
    """``--split A,B,C``: training windows lie in the first A/(A+B+C) of the tokens, the held-out
    ones in the next B/(A+B+C), and nothing reads the last C/(A+B+C); without it the last 5 %
    is held out to the end."""
    from paraloom.config import DataConfig
    tokens = torch.arange(1000)  # each token its own position
    corpus = Corpus(tokens, 16, **DataConfig(split="60/30/10").split_parts())
    trained = torch.cat([corpus.global_batch(step, 64) for step in range(50)])
    held = torch.cat([torch.cat([t, y], 1) for t, y in eval_batches(corpus, 8, 4)])
    assert trained.max() <= 599 and trained.max() >= 590  # the last window is drawn too
    assert held.min() == 600 and 880 <= held.max() <= 899
    default = Corpus(tokens, 16)
    assert 950 < torch.cat([y for _, y in eval_batches(default, 8, 4)]).max() <= 999
    assert DataConfig(split="949,50,1").split_parts() == pytest.approx(
        {"holdout": 0.051, "heldout_end": 0.999})


def test_split_names_itself_when_the_data_is_too_short(tmp_path):
    text = (TEXT * 20)[:min_bytes(SEQ, "train")]  # enough for the default 95/5
    path = _file(tmp_path, "short.txt", text)
    assert check_data(path, SEQ, "train") == []
    with pytest.raises(ValueError) as err:
        check_data(path, SEQ, "train", split="98,1,1")
    assert f"needs at least {min_bytes(SEQ, 'train', 0.02, 0.99)}" in str(err.value)
    assert "its first 98.0% (--split 98,1,1) (training) and the next 1.0%" in str(err.value)


def test_eval_resume_scores_the_held_out_part_of_the_runs_split(tmp_path, capfd):
    """A run trained with ``--split`` scores its held-out loss on the split's validation part,
    and ``eval --resume`` (which keeps the split) gives the same loss; the same file evaluated
    as other data (its last 5 %) gives another."""
    notes = _file(tmp_path, "notes.txt", bytes(range(32, 127)) * 6 + b"the end of notes\n" * 9)
    assert main(["train", "--data", notes, "--tp", "1", "--pp", "1", "--dp", "1",
                 "--layers", "1", "--hidden", "32", "--heads", "4", "--seq-len", "16",
                 "--global-batch-size", "2", "--micro-batch-size", "1", "--steps", "1",
                 "--split", "50,40,10", "--out", str(tmp_path / "run")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    capfd.readouterr()

    def loss(*extra) -> float:
        assert main(["eval", "--resume", str(tmp_path / "run"), *extra]) == 0
        out = capfd.readouterr().out
        return json.loads([x for x in out.splitlines() if x.startswith("{")][-1])["loss"]
    assert loss() == pytest.approx(summary["held_out_loss_after"], rel=1e-6)
    assert loss("--data", notes) != pytest.approx(summary["held_out_loss_after"], rel=1e-3)


def test_binary_data_is_noted_not_refused(tmp_path):
    data = bytearray((TEXT * 20)[:min_bytes(SEQ, "train")])
    data[300] = 0xFF
    path = _file(tmp_path, "binary.bin", bytes(data))
    notes = check_data(path, SEQ, "train")
    assert len(notes) == 1 and "not UTF-8 text (byte 300 is 0xff)" in notes[0]


def test_eval_resume_scores_the_runs_own_data_from_any_folder(tmp_path, capfd, monkeypatch):
    """A run trained on ``--data notes.txt`` (a relative path) stores the absolute path, and
    ``eval --resume RUN`` from another folder scores that file, not the bundled corpus."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    (home / "notes.txt").write_bytes(bytes(range(32, 127)) * 8 + b"the end of the notes\n" * 9)
    monkeypatch.chdir(home)
    assert main(["train", "--data", "notes.txt", "--tp", "1", "--pp", "1", "--dp", "1",
                 "--layers", "1", "--hidden", "32", "--heads", "4", "--seq-len", "16",
                 "--global-batch-size", "2", "--micro-batch-size", "1", "--steps", "1",
                 "--warmup-steps", "0", "--out", "run"]) == 0
    config = json.loads((home / "run" / "config.json").read_text())
    assert config["data"]["file"] == str(home / "notes.txt")
    monkeypatch.chdir(elsewhere)
    capfd.readouterr()

    def loss(*extra) -> tuple[float, str]:
        assert main(["eval", "--resume", str(home / "run"), "--batches", "1",
                     "--global-batch-size", "2", *extra]) == 0
        out = capfd.readouterr()
        return json.loads([x for x in out.out.splitlines() if x.startswith("{")][-1]), out.err

    implicit, notes = loss()
    assert f"scoring the run's own data, --data {str(home / 'notes.txt')!r}" in notes, notes
    # with no batch flags, eval scores what train scored: the held-out loss train printed
    assert main(["eval", "--resume", str(home / "run")]) == 0
    out = capfd.readouterr()
    default = json.loads([x for x in out.out.splitlines() if x.startswith("{")][-1])
    assert "2 global batches of 2 windows, as train scored its held-out loss" in out.err
    summary = json.loads((home / "run" / "summary.json").read_text())
    assert default["loss"] == pytest.approx(summary["held_out_loss_after"], rel=1e-6)
    explicit, _ = loss("--data", str(home / "notes.txt"))
    assert implicit == explicit
    assert implicit["windows"] < 10  # the file's held-out 5 %, not the bundled corpus's


BAD = [
    (["--tp", "3"], "hidden_size = 64 is not divisible by tp = 3"),
    (["--tp", "0"], "tp must be a positive integer, got 0"),
    (["--pp", "-1"], "pp must be a positive integer, got -1"),
    (["--dp", "0"], "dp must be a positive integer, got 0"),
    (["--heads", "3"], "hidden_size = 64 is not divisible by num_attention_heads = 3"),
    (["--tp", "8", "--heads", "4", "--pp", "1", "--dp", "1"],
     "num_attention_heads = 4 is not divisible by tp = 8"),
    (["--layers", "5"], "--num-layers 5 is not divisible by --pp 2"),
    (["--vpp", "3"], "--num-layers 4 is not divisible by --pp 2 * --vpp 3 = 6"),
    (["--vpp", "2", "--layers", "8", "--global-batch-size", "12", "--micro-batch-size", "2"],
     "(3) to be a multiple of pp = 2"),
    (["--sequence-parallel", "--seq-len", "63"], "seq_length = 63 is not divisible by tp = 2"),
    (["--sequence-parallel", "--async-grad-allreduce"], "cannot be combined"),
    (["--global-batch-size", "10"], "global_batch_size = 10 is not divisible by"),
    (["--micro-batch-size", "0"], "micro_batch_size must be a positive integer, got 0"),
    (["--steps", "0"], "steps must be a positive integer, got 0"),
    (["--seq-len", "0"], "seq_length must be a positive integer, got 0"),
    (["--hidden", "0"], "hidden_size must be a positive integer, got 0"),
    (["--vocab", "100"], "--vocab 100"),
    (["--dropout", "1.5"], "dropout must be in [0, 1), got 1.5"),
    (["--lr", "0"], "lr (--lr) must be a positive number, got 0.0"),
    (["--lr", "-1"], "lr (--lr) must be a positive number, got -1.0"),
    (["--lr", "nan"], "lr (--lr) must be a positive number, got nan"),
    (["--min-lr", "1"], "min_lr (--min-lr) must be between 0 and lr = 0.003"),
    (["--weight-decay", "-1"], "weight_decay (--weight-decay) must be >= 0, got -1.0"),
    (["--bucket-size", "0"], "bucket_size (--bucket-size, elements) must be a positive integer"),
    (["--ledger-steps", "0"], "(--ledger-steps) must be a positive number of steps or -1"),
    (["--ledger-steps", "-5"], "(--ledger-steps) must be a positive number of steps or -1"),
    (["--clip-grad", "nan"], "clip_grad (nan) must be >= 0"),
    (["--out", __file__], "exists and is not a folder"),
    (["--tp", "2", "--pp", "1", "--dp", "1", "--nprocs", "4"], "--nprocs 4 does not match"),
    (["--schedule", "none"], "schedule none (no pipelining) needs pp = 1, got pp = 2"),
    (["--schedule", "interleaved"],
     "needs vpp >= 2 (--vpp, virtual stages per pipeline rank), got no vpp"),
    (["--data", "/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
    (["--split", "100,0,0"], "--split '100,0,0' leaves nothing for the held-out loss"),
    (["--split", "0,5,5"], "--split '0,5,5' leaves nothing for training"),
    (["--split", "9,x"], "--split '9,x': give the train, validation and test weights"),
    (["--split", "1,2,3,4"], "(one to three non-negative numbers, not all 0)"),
    (["--resume", "/nonexistent/run"], "/nonexistent/run"),
    (["--max-bad-steps", "0"], "max_bad_steps must be a positive integer, got 0"),
    (["--timeout", "0"], "timeout_s (--timeout) must be a positive number of seconds, got 0.0"),
    (["--timeout", "nan"], "must be a positive number of seconds, got nan"),
    (["--hang-after", "-1"], "hang_after (--hang-after) must be 0 (off) or positive seconds"),
    (["--layers", "8", "--num-layers-per-virtual-pipeline-stage", "3"],
     "must split into virtual stages of 3 layers (layers must be a multiple of pp * 3 = 6)"),
    (["--layers", "8", "--num-layers-per-virtual-stage", "2", "--vpp", "4"],
     "means vpp = 2 (8 layers, pp = 2), but --vpp 4 was given"),
]


def test_layers_per_virtual_stage_means_megatron_lms_flag():
    """--num-layers-per-virtual-pipeline-stage N is layers per virtual stage (it once set vpp)."""
    import argparse

    from paraloom.commands.train_flags import add_train_flags, config_from_args

    def vpp(*argv):
        ap = argparse.ArgumentParser()
        add_train_flags(ap)
        return config_from_args(ap.parse_args(list(argv)))[0].parallel.vpp
    assert vpp("--layers", "8", "--pp", "2", "--num-layers-per-virtual-stage", "4") is None
    assert vpp("--layers", "8", "--pp", "2", "--num-layers-per-virtual-pipeline-stage", "2") == 2
    assert vpp("--layers", "12", "--pp", "2", "--num-layers-per-virtual-stage", "2") == 3


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_named_before_any_rank_starts(capsys, no_ranks, argv, message):
    tic = time.time()
    assert main(["train", *argv]) == 2
    assert time.time() - tic < 10
    err = capsys.readouterr().err
    assert message in err, err


def test_unknown_flag_and_foreign_resume_folder(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--tensor-parallel", "2"])
    assert exit_.value.code == 2
    assert "--tensor-parallel" in capsys.readouterr().err
    foreign = tmp_path / "checkpoints" / "step_3"
    foreign.mkdir(parents=True)
    (foreign / ".metadata").write_bytes(b"not ours")
    (foreign / "meta.json").write_text(json.dumps({"step": 3}))
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "is not a paraloom checkpoint" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["train", "--data", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err


def test_moe_flags_without_experts_are_noted(capsys):
    assert main(["train", "--moe-router-topk", "1", "--moe-aux-loss-coeff", "0.5",
                 "--moe-grouped-gemm", "--tp", "0"]) == 2  # stopped by --tp 0 after the flags
    err = capsys.readouterr().err
    assert ("--moe-aux-loss-coeff, --moe-grouped-gemm, --moe-router-topk have no effect "
            "without --num-experts" in err), err


@pytest.mark.parametrize("flags,message", [
    (["--dp", "4", "--ep", "4", "--num-experts", "6"],
     "num_experts = 6 is not divisible by ep = 4"),
    (["--num-experts", "4", "--moe-router-topk", "5"],
     "moe_router_topk = 5 is larger than num_experts = 4"),
    (["--dp", "2", "--ep", "4", "--num-experts", "4"], r"ep = 4 does not divide dp \* cp = 2"),
    (["--dp", "2", "--ep", "2"], "ep = 2 needs an MoE model"),
    (["--num-experts", "4", "--moe-shared-expert-intermediate-size", "64"],
     "moe_shared_expert_intermediate_size = 64 with add_bias_linear = True: shared experts "
     "have no biases"),
    (["--num-experts", "4", "--disable-bias-linear", "--moe-shared-expert-gate"],
     "moe_shared_expert_gate needs moe_shared_expert_intermediate_size"),
    (["--disable-bias-linear", "--moe-shared-expert-intermediate-size", "64"],
     "moe_shared_expert_intermediate_size = 64 and moe_shared_expert_gate = False need "
     "num_experts"),
    (["--num-experts", "4", "--disable-bias-linear", "--moe-shared-expert-intermediate-size",
      "0"], "moe_shared_expert_intermediate_size must be a positive integer, got 0"),
    (["--num-experts", "4", "--disable-bias-linear", "--moe-shared-expert-intermediate-size",
      "64", "--moe-shared-expert-overlap"],
     "moe_shared_expert_overlap runs the shared expert inside the alltoall dispatcher "
     r"\(Megatron: alltoall or flex only\), got moe_token_dispatcher_type = 'allgather'"),
    # a pipeline stage without a MoE layer: the expert grad norm's all-reduce would hang
    (["--num-experts", "4", "--moe-layer-freq", "2", "--layers", "4", "--pp", "4",
      "--nprocs", "4"],
     r"pipeline stage 1 holds no MoE layer \(layers 1..1, moe_layer_freq = 2\).*choose "
     r"--moe-layer-freq, --pp or --num-layers"),
])
def test_bad_moe_flags_exit_2_naming_the_values(tmp_path, capsys, no_ranks, flags, message):
    out = tmp_path / "bad"
    code = main(["train", "--tp", "1", "--pp", "1", "--dp", "1", "--out", str(out), *flags])
    assert code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["train", "--tp", "1", "--pp", "1", "--dp", "1", "--cp", "3", "--seq-len", "16"],
     r"seq_length = 16 is not divisible by 2 \* cp = 6"),
    (["train", "--tp", "1", "--pp", "1", "--dp", "2", "--cp", "4", "--nprocs", "6"],
     r"--cp 4 does not divide the world of 6 ranks \(--nprocs\)"),
    (["train", "--tp", "1", "--pp", "1", "--dp", "1", "--cp", "0"],
     r"cp must be a positive integer, got 0"),
    (["train", "--tp", "2", "--pp", "1", "--dp", "1", "--cp", "4", "--cp-comm-type", "a2a",
      "--heads", "4", "--seq-len", "16"],
     r"cp_comm_type a2a: num_attention_heads / tp = 4 / 2 = 2 is not divisible by cp = 4"),
    (["train", "--tp", "1", "--pp", "1", "--dp", "1", "--cp", "4", "--cp-comm-type", "a2a",
      "--arch", "llama", "--heads", "8", "--group-query-attention", "--num-query-groups", "2",
      "--seq-len", "16"],
     r"key/value heads \(num_query_groups\) / tp = 2 / 1 = 2 is not divisible by cp = 4"),
    # hierarchical cp (a2a inside the inner level, the ring across)
    (["train", "--tp", "1", "--pp", "1", "--dp", "1", "--cp", "4", "--cp-comm-type", "a2a+p2p",
      "--seq-len", "16"],
     r"--cp-comm-type a2a\+p2p needs --hierarchical-context-parallel-sizes A B .* got not given"),
    (["train", "--tp", "1", "--pp", "1", "--dp", "1", "--cp", "4", "--cp-comm-type", "a2a+p2p",
      "--hierarchical-context-parallel-sizes", "2", "3", "--seq-len", "16"],
     r"--hierarchical-context-parallel-sizes 2 3: the sizes must be positive integers whose "
     r"product is cp = 4"),
    (["train", "--tp", "1", "--pp", "1", "--dp", "1", "--cp", "4", "--cp-comm-type", "a2a+p2p",
      "--hierarchical-context-parallel-sizes", "4", "1", "--seq-len", "16"],
     r"needs --hierarchical-context-parallel-sizes A B \(two levels, A \* B = cp = 4, each at "
     r"least 2\), got 4 1; with one level use --cp-comm-type a2a or p2p"),
    (["train", "--tp", "2", "--pp", "1", "--dp", "1", "--cp", "4", "--cp-comm-type", "a2a+p2p",
      "--hierarchical-context-parallel-sizes", "2", "2", "--heads", "2", "--seq-len", "16"],
     r"cp_comm_type a2a\+p2p: num_attention_heads / tp = 2 / 2 = 1 is not divisible by the "
     r"inner hierarchical cp size = 2"),
    (["plan", "--layers", "2", "--hidden", "8", "--heads", "2", "--seq-len", "10",
      "--global-batch-size", "1", "--micro-batch-size", "1", "--cp", "2"],
     r"paraloom train would refuse this run: .*seq_length = 10 is not divisible by 2 \* cp = "
     r"4"),
])
def test_bad_cp_input_exits_2_before_ranks_start(capsys, no_ranks, argv, message):
    assert main(argv) == 2
    assert re.search(message, capsys.readouterr().err)


def test_zb_h1_refusals(capsys, no_ranks):
    def run(*flags):
        return main(["train", *flags])
    assert run("--schedule", "zb-h1", "--pp", "2", "--vpp", "2", "--nprocs", "4") == 2
    assert "vpp = 2 needs schedule interleaved, got 'zb-h1'" in capsys.readouterr().err
    assert run("--schedule", "zb-h1", "--pp", "1", "--nprocs", "1") == 2
    assert "schedule zb-h1 (zero bubble) needs pp >= 2, got pp = 1" in capsys.readouterr().err


MEGATRON_LM = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "32", "--max-position-embeddings", "32", "--mock-data",
               "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
               "--transformer-impl", "local", "--distributed-backend", "gloo",
               "--use-cpu-initialization", "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.mark.parametrize("extra, message", [
    (["--tokenizer-type", "GPT2BPETokenizer"], "--tokenizer-type GPT2BPETokenizer: paraloom "
     "takes NullTokenizer"),
    (["--max-position-embeddings", "64"], "--max-position-embeddings 64 must equal "
     "--seq-length 32"),
    (["--attention-dropout", "0.1"], "--attention-dropout 0.1 differs from --hidden-dropout 0"),
    (["--distributed-backend", "nccl"], "--distributed-backend nccl: this machine's ranks use "
     "gloo"),
    (["--nprocs", "6", "--tensor-model-parallel-size", "4"], "--nprocs 6 does not match"),
    # Megatron features paraloom does not have: named, with what it has
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "no_shard",
      "--num-distributed-optimizer-instances", "2", "--nprocs", "4"],
     "--use-megatron-fsdp --data-parallel-sharding-strategy no_shard with "
     "--num-distributed-optimizer-instances: Megatron-FSDP's hybrid sharding needs a sharding "
     "strategy"),
    (["--calculate-per-token-loss", "--num-experts", "4", "--tensor-model-parallel-size", "2",
      "--nprocs", "2"], "--calculate-per-token-loss with --num-experts and tp = 2 needs "
     "--sequence-parallel"),
    (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16: gradients reduced in bf16"),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins must be a positive number of "
     "minutes, got 0"),
    (["--log-timers-to-tensorboard"], "--log-timers-to-tensorboard: Megatron's timers"),
    (["--apply-layernorm-1p"], "--apply-layernorm-1p: Megatron's zero-centred LayerNorm"),
    (["--train-samples", "40"], "--train-samples: sample-based training is not built: give "
     "--train-iters"),
    (["--lr-warmup-samples", "4"], "give --lr-warmup-iters or --lr-warmup-fraction"),
    (["--rampup-batch-size", "16", "16", "5859375"], "--rampup-batch-size: a global batch that "
     "grows"),
    (["--kv-channels", "32"], "--kv-channels 32: paraloom's attention heads have --hidden-size "
     "/ --num-attention-heads = 64 / 4 channels"),
    (["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"],
     "--cross-entropy-fusion-impl te: Megatron-LM refuses it"),
    (["--rotary-percent", "0.5"], "--rotary-percent 0.5: partial rotary embeddings are not "
     "built"),
    (["--distributed-timeout-minutes", "2", "--timeout", "60"],
     "--distributed-timeout-minutes 2 contradicts --timeout 60"),
])
def test_megatron_lm_arguments_refused_by_name(capsys, no_ranks, extra, message):
    assert main(["train", *MEGATRON_LM, *extra]) == 2
    assert message in capsys.readouterr().err


def test_megatron_lm_layout_comes_from_the_world():
    """As Megatron-LM: tp, pp default to 1 and dp is the world over tp * pp (a world given by
    --nprocs or torchrun); without a world paraloom's own default layout stands."""
    import argparse

    from paraloom.commands.megatron_lm_flags import megatron_lm_notes
    from paraloom.commands.train_flags import add_train_flags, config_from_args

    def parse(*extra):
        ap = argparse.ArgumentParser()
        add_train_flags(ap)
        args = ap.parse_args([*MEGATRON_LM, *extra])
        c = config_from_args(args)[0].parallel
        return (c.tp, c.pp, c.dp, c.vpp), megatron_lm_notes(args)
    assert parse("--nprocs", "4")[0] == (1, 1, 4, None)
    assert parse("--nprocs", "4", "--tensor-model-parallel-size", "2")[0] == (2, 1, 2, None)
    assert parse("--nprocs", "4", "--pipeline-model-parallel-size", "4", "--num-layers", "8",
                 "--num-layers-per-virtual-pipeline-stage", "1")[0] == (1, 4, 1, 2)
    layout, notes = parse()
    assert layout == (2, 2, 2, None)
    accepted = ("--use-mcore-models", "--manual-gc", "--num-workers", "1", "--no-mmap-bin-files",
                "--data-cache-path", "/tmp/x", "--ckpt-format", "torch_dist", "--log-throughput",
                "--attention-softmax-in-fp32", "--kv-channels", "16", "--rotary-percent", "1.0",
                "--cross-entropy-fusion-impl", "native")
    assert any("--manual-gc" in n and "--ckpt-format torch_dist" in n
               and "--attention-softmax-in-fp32" in n for n in parse(*accepted)[1])
    ap = argparse.ArgumentParser()
    add_train_flags(ap)
    timed = config_from_args(ap.parse_args([*MEGATRON_LM, "--distributed-timeout-minutes",
                                            "1.5"]))[0]
    assert timed.run.timeout_s == 90.0
    assert any("--transformer-impl local" in n and "--use-cpu-initialization" in n
               for n in notes)
    assert any(n.startswith("--mock-data: training on the bundled corpus") for n in notes)


def test_folders_that_are_not_hugging_face_models(hf_dir, tmp_path, capsys, no_ranks):
    """A paraloom run folder, a config without model_type, a Llama config missing a key: exit 2
    before any rank, one line naming the file and what is wrong (no KeyError traceback)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": {}, "parallel": {}, "steps": 3}))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"n_embd": 32}))
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 256,
                                                   "hidden_size": 64}))
    for folder, words in ((run, "no model_type) (it is a paraloom run's config: did you mean "
                                "--resume?)"),
                          (bare, "is not a Hugging Face config (no model_type)"),
                          (llama, "a llama config without num_hidden_layers, "
                                  "num_attention_heads, intermediate_size")):
        for argv in (["train", "--init-from-hf", str(folder), "--out", str(tmp_path / "o")],
                     ["eval", "--hf", str(folder)]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert words in err and str(folder / "config.json") in err, err
            assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_tensorboard_dir_naming_a_file(tmp_path, capsys, no_ranks):
    taken = tmp_path / "board"
    taken.write_text("not a folder")
    assert main(["train", "--steps", "1", "--tensorboard-dir", str(taken),
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"--tensorboard-dir {str(taken)!r} is a file" in err and len(err.splitlines()) == 1


def test_settings_that_change_nothing_are_noted(tmp_path):
    from paraloom.config import ModelConfig, ParallelConfig, TrainConfig
    from paraloom.training.preflight import check_inputs
    base = TrainConfig().replace(run=replace(TrainConfig().run, out=str(tmp_path / "run")))
    cp1 = base.replace(parallel=ParallelConfig(tp=1, cp_comm_type="all_gather"))
    assert any("--cp-comm-type all_gather has no effect with cp = 1" in n
               for n in check_inputs(cp1)), check_inputs(cp1)
    ring = base.replace(parallel=ParallelConfig(tp=1, cp=2),
                        model=ModelConfig(attention="sdpa"))
    assert any("--attention sdpa has no effect with cp = 2" in n for n in check_inputs(ring))
    assert not any("no effect" in n for n in check_inputs(base))
