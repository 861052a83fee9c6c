"""A BPE tokenizer trained here with ``tokenizers`` on the bundled corpus goes through
``paraloom preprocess`` -> ``train --data-path`` -> ``eval --data-path``.

The run's vocabulary is the tokenizer's (300, padded to 384); its config.json records the
tokenizer and the dataset; ``eval`` of the checkpoint, reading the same dataset into the same
held-out batches under another layout, gives the held-out loss the run reported after training;
and the token stream is the tokenizer's own ids of the documents with EOD between them.
``--tokenizer`` also reads a plain ``--data`` text file; bad tokenizer folders and inputs are
refused with the value named and exit code 2.
"""

from __future__ import annotations

import gzip
import json

import pytest
from conftest import checkpoint_folder
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from paraloom.commands import main
from paraloom.commands.train import parser as train_parser
from paraloom.commands.train_flags import config_from_args
from paraloom.config import TrainConfig
from paraloom.data import DEFAULT_CORPUS
from paraloom.data.preprocess import read_documents
from paraloom.data.stream import load_tokens
from paraloom.data.tokenizer import HFTokenizer

SEQ = 32


@pytest.fixture(scope="module")
def corpus_docs():
    """The bundled corpus's first modules, one document each (split at their headers)."""
    text = gzip.decompress(DEFAULT_CORPUS.read_bytes()).decode()
    return ["# ===== " + part for part in text.split("# ===== ")[1:7]]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory, corpus_docs):
    """A byte-level BPE with 300 tokens (``<|endoftext|>`` included), trained on them."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus_docs, trainer)
    folder = tmp_path_factory.mktemp("bpe")
    tok.save(str(folder / "tokenizer.json"))
    return folder, tok


def test_bpe_preprocess_train_eval(tmp_path, bpe, corpus_docs, capfd):
    folder, tok = bpe
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus_docs))
    prefix = str(tmp_path / "docs")
    assert main(["preprocess", "--input", str(jsonl), "--tokenizer", str(folder),
                 "--output-prefix", prefix, "--append-eod"]) == 0
    eod = tok.token_to_id("<|endoftext|>")
    want = [t for d in corpus_docs for t in tok.encode(d).ids + [eod]]
    assert load_tokens(data_path=prefix, tokenizer=str(folder)).tolist() == want
    out = tmp_path / "run"
    model = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", str(SEQ)]
    assert main(["train", "--data-path", prefix, "--tokenizer", str(folder), *model,
                 "--tp", "2", "--pp", "1", "--dp", "1", "--global-batch-size", "4",
                 "--steps", "3", "--save-every", "3", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["data"]["tokenizer"] == str(folder) and config["data"]["data_path"] == prefix
    assert config["model"]["vocab_size"] == 300
    summary = json.loads((out / "summary.json").read_text())
    assert main(["train", "--data-path", prefix, "--tokenizer", str(folder), *model,
                 "--tp", "1", "--pp", "2", "--dp", "1", "--global-batch-size", "4",
                 "--steps", "3", "--save-every", "0", "--out", str(tmp_path / "pp2")]) == 0
    for name in ("loss", "grad_norm"):  # the same batches under another layout
        assert [m[name] for m in _metrics(tmp_path / "pp2")] == pytest.approx(
            [m[name] for m in _metrics(out)], rel=1e-5)
    capfd.readouterr()
    assert main(["eval", "--resume", str(out), "--data-path", prefix, "--dp", "2",
                 "--global-batch-size", "4", "--micro-batch-size", "2", "--batches", "2"]) == 0
    line = [x for x in capfd.readouterr().out.splitlines() if x.startswith("{")][-1]
    assert json.loads(line)["loss"] == pytest.approx(summary["held_out_loss_after"], rel=1e-5)
    capfd.readouterr()  # export-hf takes the tokenizer along: transformers reads its tokens
    assert main(["export-hf", str(out), str(tmp_path / "hf")]) == 0
    assert "tokenizer files from" in capfd.readouterr().out
    import transformers
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert hf_tok(corpus_docs[0]).input_ids == tok.encode(corpus_docs[0]).ids
    assert transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf")).config.vocab_size >= len(hf_tok)
    # the exported folder holds its tokenizer: eval --hf and train --init-from-hf read it
    capfd.readouterr()
    assert main(["eval", "--hf", str(tmp_path / "hf"), "--data-path", prefix, "--dp", "2",
                 "--global-batch-size", "4", "--micro-batch-size", "2", "--batches", "2"]) == 0
    printed, err = capfd.readouterr()
    assert "holds its tokenizer (tokenizer.json): the data are read as its tokens" in err, err
    line = [x for x in printed.splitlines() if x.startswith("{")][-1]
    assert json.loads(line)["loss"] == pytest.approx(summary["held_out_loss_after"], rel=1e-5)
    assert main(["train", "--init-from-hf", str(tmp_path / "hf"), "--tp", "1", "--pp", "1",
                 "--dp", "1", "--global-batch-size", "2", "--steps", "1", "--save-every", "0",
                 "--out", str(tmp_path / "from_hf")]) == 0
    assert "holds its tokenizer" in capfd.readouterr().err
    config = json.loads((tmp_path / "from_hf" / "config.json").read_text())
    assert config["data"]["tokenizer"] == str(tmp_path / "hf")
    assert config["model"]["vocab_size"] >= 300
    # --resume takes the tokenizer back; --data replaces the saved --data-path
    for argv, data, data_path in ((["--resume", str(out)], None, prefix),
                                  (["--resume", str(out), "--data", str(jsonl)], str(jsonl), None)):
        cfg, _ = config_from_args(train_parser().parse_args([*argv, "--steps", "99"]))
        assert (cfg.data.tokenizer, cfg.data.file, cfg.data.data_path) == (
            str(folder), data, data_path)
        assert cfg.model.vocab_size == 300


@pytest.mark.parametrize("split, want", [("paragraph", [["a\nb"], ["c"], ["d"]]),
                                         ("line", [["a"], ["b"], ["c"], ["d"]]),
                                         ("file", [["a\nb\n\nc\n \n\nd\n"]])])
def test_txt_documents(tmp_path, split, want):
    path = tmp_path / "t.txt"
    path.write_text("a\nb\n\nc\n \n\nd\n")
    assert read_documents(path, txt_documents=split) == want


def _metrics(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_tokenizer_reads_plain_text(tmp_path, bpe, corpus_docs):
    folder, tok = bpe
    path = tmp_path / "one.txt"
    path.write_text(corpus_docs[1])
    assert load_tokens(str(path), tokenizer=str(folder)).tolist() == tok.encode(
        corpus_docs[1]).ids
    path.write_text(corpus_docs[2])  # the stream is cached for forked ranks, never stale
    assert load_tokens(str(path), tokenizer=str(folder)).tolist() == tok.encode(
        corpus_docs[2]).ids
    assert HFTokenizer(folder).vocab_size == 300


def test_a_transformers_folder_reads_as_megatron_reads_it(tmp_path, bpe, corpus_docs):
    """Megatron's ``HuggingFaceTokenizer`` is ``AutoTokenizer``: vocabulary ``len(tokenizer)``,
    EOD its ``eos_token_id``, ids ``tokenizer(text).input_ids``. A folder saved by transformers
    (another eos_token, an added token, a BOS post-processor) reads the same here."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    folder, tok = bpe
    assert HFTokenizer(folder).eod == tok.token_to_id("<|endoftext|>")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                       special_tokens=[("<|endoftext|>", 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=tok.id_to_token(260),
                                 additional_special_tokens=["<|pad|>"])
    hf.save_pretrained(tmp_path / "hf")
    mine = HFTokenizer(tmp_path / "hf")
    assert (mine.vocab_size, mine.eod) == (len(hf), hf.eos_token_id) == (301, 260)
    assert mine.encode(corpus_docs[2]) == hf(corpus_docs[2]).input_ids
    assert mine.encode(corpus_docs[2])[0] == 0  # the BOS of the post-processor


def _openai_gpt2_encode(vocab: dict, merges: list, text: str) -> list[int]:
    """GPT-2's own encoder (OpenAI's encoder.py, which Megatron's GPT2BPETokenizer is): bytes
    mapped to printable characters, the GPT-2 split pattern, then the lowest-ranked merge
    first, written out here as an independent reference."""
    import regex
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    ranks = {tuple(m.split()): i for i, m in enumerate(merges)}
    pattern = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"""
                            r"""|\s+(?!\S)|\s+""")
    ids = []
    for piece in pattern.findall(text):
        word = [chars[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pairs = [(ranks.get((word[i], word[i + 1]), len(ranks)), i)
                     for i in range(len(word) - 1)]
            rank, i = min(pairs)
            if rank == len(ranks):
                break
            first, second = word[i], word[i + 1]
            merged, j = [], 0
            while j < len(word):  # every occurrence of the pair, left to right
                if j + 1 < len(word) and (word[j], word[j + 1]) == (first, second):
                    merged.append(first + second)
                    j += 2
                else:
                    merged.append(word[j])
                    j += 1
            word = merged
        ids += [vocab[w] for w in word]
    return ids


def test_gpt2_vocab_and_merges_read_as_gpt2_encoder(tmp_path, bpe, corpus_docs):
    """A folder with GPT-2's vocab.json + merges.txt (Megatron's GPT2BPETokenizer files) gives
    the ids of GPT-2's own encoder; EOD is its <|endoftext|>."""
    _, tok = bpe
    tok.model.save(str(tmp_path))
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    merges = [m for m in (tmp_path / "merges.txt").read_text().splitlines()
              if m and not m.startswith("#version")]
    mine = HFTokenizer(tmp_path)
    text = corpus_docs[3][:6000] + " héllo  wörld 12345\n\t<|endoftext|>  x "
    assert mine.encode(text) == _openai_gpt2_encode(vocab, merges, text)
    assert (mine.vocab_size, mine.eod) == (len(vocab), vocab["<|endoftext|>"]) == (300, 0)


def test_bad_tokenizers_and_inputs_exit_2(tmp_path, bpe, capsys, no_ranks):
    folder, _ = bpe
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    for bad, message in (("empty", "has no tokenizer.json"), ("broken", "not a valid tokenizer"),
                         ("missing", "is not a folder (missing)")):
        assert main(["train", "--tokenizer", str(tmp_path / bad), "--tp", "1"]) == 2
        err = capsys.readouterr().err
        assert f"--tokenizer {str(tmp_path / bad)!r}" in err and message in err, err
    assert main(["train", "--tokenizer", str(folder), "--vocab", "256", "--tp", "1"]) == 2
    assert "--vocab 256" in capsys.readouterr().err
    lines = {"bad.jsonl": ('{"text": 1}\n', "line 1: its 'text' is int"),
             "nojson.jsonl": ('{"text": "a"}\nnope\n', "line 2 is not JSON"),
             "blank.txt": ("\n\n", "holds no documents"),
             "doc.md": ("text", "must end in .jsonl or .txt")}
    for name, (text, message) in lines.items():
        (tmp_path / name).write_text(text)
        assert main(["preprocess", "--input", str(tmp_path / name), "--tokenizer", str(folder),
                     "--output-prefix", str(tmp_path / "p")]) == 2
        err = capsys.readouterr().err
        assert str(tmp_path / name) in err and message in err, err
    assert main(["preprocess", "--input", str(tmp_path / "bad.jsonl"), "--tokenizer",
                 str(folder), "--output-prefix", str(tmp_path / "nowhere" / "p")]) == 2
    assert "does not exist" in capsys.readouterr().err
    for prefix in (str(tmp_path) + "/", str(tmp_path) + "/."):
        assert main(["preprocess", "--input", str(tmp_path / "bad.jsonl"), "--tokenizer",
                     str(folder), "--output-prefix", prefix]) == 2
        assert "names a folder, not a dataset" in capsys.readouterr().err
    assert not list(tmp_path.glob(".bin")) and not list(tmp_path.glob("*.idx"))


def test_export_says_when_the_tokenizer_is_not_there(tmp_path, bpe):
    from paraloom.training.hf_export import _copy_tokenizer
    folder, _ = bpe
    assert "byte-level" in _copy_tokenizer(None, tmp_path)
    assert "NOT copied" in _copy_tokenizer(str(tmp_path / "gone"), tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()
    assert _copy_tokenizer(str(folder), tmp_path).endswith(": tokenizer.json")
    assert (tmp_path / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()


def test_resume_with_another_tokenizer_names_the_checkpoint(bpe, tmp_path, monkeypatch):
    """The vocabulary of a resumed run is the checkpoint's, not a --vocab flag."""
    folder, _ = bpe
    monkeypatch.chdir(tmp_path)
    checkpoint_folder("old-run", TrainConfig())  # byte-level: a vocabulary of 256
    args = train_parser().parse_args(["--resume", "old-run", "--tokenizer", str(folder)])
    with pytest.raises(ValueError, match=r"--resume 'old-run' holds a model with a vocabulary "
                                         r"of 256, but --tokenizer .* has 300 tokens"):
        config_from_args(args)


def test_export_refuses_a_file_as_out_dir_and_names_moe(tmp_path, capsys):
    from paraloom.config import ModelConfig
    from paraloom.models.hf import hf_config_from_model
    target = tmp_path / "model.bin"
    target.write_text("not a folder")
    assert main(["export-hf", str(tmp_path / "run"), str(target)]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err
    moe = ModelConfig(vocab_size=256, hidden_size=32, num_layers=2, num_attention_heads=4,
                      seq_length=16, num_experts=4)
    with pytest.raises(ValueError, match="mixture-of-experts model .num_experts = 4."):
        hf_config_from_model(moe)
