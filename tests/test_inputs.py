"""Data and layout problems are found before any rank starts: exit 2, the file and the numbers.

``launch.spawn`` is replaced by a function that fails the test, so "before any rank starts" is
checked, not assumed. The one case that must run (``eval --split all`` on a file of exactly
``seq_len + 1`` bytes: one window) is compared with ``transformers`` on that window.
"""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from paraloom import launch
from paraloom.commands import main
from paraloom.data import Corpus, check_data, eval_batches, load_corpus, min_bytes

SEQ = 64


@pytest.fixture
def no_ranks(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a rank was started for input that should be refused before")
    monkeypatch.setattr(launch, "spawn", refuse)


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


def test_binary_data_is_noted_not_refused(tmp_path):
    data = bytearray((TEXT * 20)[:min_bytes(SEQ, "train")])
    data[300] = 0xFF
    path = _file(tmp_path, "binary.bin", bytes(data))
    notes = check_data(path, SEQ, "train")
    assert len(notes) == 1 and "not UTF-8 text (byte 300 is 0xff)" in notes[0]


@pytest.mark.parametrize("command", ["train", "eval"])
def test_resume_of_a_missing_path_or_an_empty_folder_is_told_apart(tmp_path, capsys, no_ranks,
                                                                   command):
    missing, empty = tmp_path / "nope", tmp_path / "empty"
    empty.mkdir()
    assert main([command, "--resume", str(missing)]) == 2
    assert f"--resume {str(missing)!r} does not exist" in capsys.readouterr().err
    assert main([command, "--resume", str(empty)]) == 2
    assert f"--resume {str(empty)!r}: no complete paraloom checkpoint there" in (
        capsys.readouterr().err)


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
    explicit, _ = loss("--data", str(home / "notes.txt"))
    assert implicit == explicit
    assert implicit["windows"] < 10  # the file's held-out 5 %, not the bundled corpus's
