"""Megatron's indexed dataset format: paraloom's files are megatron-core 0.19.2's, byte for byte.

* ``paraloom preprocess`` on a ``.jsonl`` gives the same ``P.bin``/``P.idx`` as megatron-core's
  ``IndexedDatasetBuilder`` fed the token ids that the ``tokenizers`` library itself gives for
  the same texts, for a small vocabulary (uint16, Megatron's choice below 65500) and a large one
  (int32);
* megatron-core's ``IndexedDataset`` reads paraloom's files, paraloom's reader reads
  megatron-core's (documents of several sequences, empty documents);
* malformed files are refused with the file and what is wrong, and ``train`` refuses them (and
  tiny or empty datasets, or ids beyond the tokenizer's vocabulary) before any rank starts.

Importing megatron-core's datasets package needs the test-side triton stand-in
(``_megatron_shim.preload``), as the other Megatron tests.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from _megatron_shim import preload
from tokenizers import Tokenizer, models, pre_tokenizers

from paraloom.commands import main
from paraloom.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, optimal_dtype
from paraloom.data.stream import join_documents

preload()
from megatron.core.datasets import indexed_dataset as mcore  # noqa: E402

pytestmark = pytest.mark.filterwarnings(  # megatron-core's, on CPU without torch.distributed
    "ignore:__array__ implementation:DeprecationWarning",
    "ignore:Could not determine rank:UserWarning")

TEXTS = ["w1 w2 w3", "", "w7", "w60000 w69999 w2 w2", "w5 w6"]


def _word_tokenizer(folder, vocab_size: int) -> Tokenizer:
    """A word-level tokenizer ``w0 .. w{n-3}``, ``[UNK]`` and ``<|endoftext|>``, saved."""
    vocab = {f"w{i}": i for i in range(vocab_size - 2)}
    vocab.update({"[UNK]": vocab_size - 2, "<|endoftext|>": vocab_size - 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return tok


@pytest.mark.parametrize("vocab_size, dtype", [(300, np.uint16), (70_000, np.int32)])
def test_preprocess_is_byte_identical_to_megatron_builder(tmp_path, vocab_size, dtype):
    tok = _word_tokenizer(tmp_path / "tok", vocab_size)
    texts = TEXTS if vocab_size > 60_000 else [t.replace("w6", "w") for t in TEXTS]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prefix = str(tmp_path / "ours")
    assert main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--tokenizer",
                 str(tmp_path / "tok"), "--output-prefix", prefix, "--append-eod"]) == 0
    assert mcore.DType.optimal_dtype(vocab_size) is dtype is optimal_dtype(vocab_size)
    eod = tok.token_to_id("<|endoftext|>")
    builder = mcore.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=dtype)
    for text in texts:  # Megatron's preprocess_data.py: EOD on non-empty documents
        ids = tok.encode(text).ids
        ids = ids + [eod] if ids else ids
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)] if ids else [])
    builder.finalize(str(tmp_path / "theirs.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"ours.{ext}").read_bytes() == (tmp_path / f"theirs.{ext}").read_bytes()
    assert IndexedDataset(prefix).dtype == np.dtype(dtype)
    m = mcore.IndexedDataset(prefix)  # and megatron-core reads what preprocess wrote
    assert [m[i].tolist() for i in range(len(m))] == [
        tok.encode(t).ids + [eod] for t in texts if t]


DOCS = [[[5, 6, 7], [8]], [], [[1]], [[9, 9, 9, 9], [2, 3], [4]], [[0, 1]]]
"""Documents as lists of sequences: several sequences, an empty document, single tokens."""


def _write_megatron(prefix: str, dtype) -> None:
    builder = mcore.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in DOCS:
        for seq in doc:
            builder.add_item(torch.tensor(seq, dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_megatron_reads_ours_and_we_read_megatrons(tmp_path, dtype):
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    with IndexedDatasetWriter(ours, dtype) as writer:
        for doc in DOCS:
            writer.add_document([t for seq in doc for t in seq], [len(s) for s in doc])
    _write_megatron(theirs, dtype)
    seqs = [seq for doc in DOCS for seq in doc]
    bounds = np.cumsum([0] + [len(doc) for doc in DOCS])
    m = mcore.IndexedDataset(ours)  # megatron-core reads paraloom's
    assert len(m) == len(seqs) and m.index.dtype == dtype
    assert list(m.document_indices) == list(bounds)
    for i, seq in enumerate(seqs):
        assert m[i].tolist() == seq and m[i].dtype == dtype
    p = IndexedDataset(theirs)  # paraloom reads megatron-core's
    assert len(p) == len(seqs) and p.num_documents == len(DOCS) and p.dtype == dtype
    assert list(p.document_indices) == list(bounds)
    assert [p[i].tolist() for i in range(len(p))] == seqs
    assert [p.document(j).tolist() for j in range(len(DOCS))] == [
        [t for seq in doc for t in seq] for doc in DOCS]


def test_documents_are_joined_with_one_eod_between(tmp_path):
    eod = 3  # doc 2 ends in it already (``--append-eod``): no second one; empty doc: nothing
    with IndexedDatasetWriter(tmp_path / "d", np.uint16) as w:
        for doc in ([5, 6], [], [7, 3], [8], [9, 9]):
            w.add_document(doc)
    got = join_documents(IndexedDataset(tmp_path / "d"), eod).tolist()
    assert got == [5, 6, 3, 7, 3, 8, 3, 9, 9]
    for suffix in (".bin", ".idx"):  # a file of the dataset given instead of its prefix
        with pytest.raises(ValueError, match=f"give the prefix without '\\{suffix}': "):
            IndexedDataset(f"{tmp_path / 'd'}{suffix}")


def _corrupt(prefix, how):
    idx, binf = prefix.with_suffix(".idx"), prefix.with_suffix(".bin")
    raw = bytearray(idx.read_bytes())
    if how == "magic":
        raw[:4] = b"NOPE"
    elif how == "version":
        raw[9:17] = struct.pack("<Q", 2)
    elif how == "dtype":
        raw[17] = 9
    elif how == "truncated":
        raw = raw[:-5]
    elif how == "pointers":
        raw[34 + 4 * 2 + 8] ^= 1  # sequence 1's pointer
    elif how == "bin":
        binf.write_bytes(binf.read_bytes()[:-2])
    idx.write_bytes(bytes(raw))


BAD = [("magic", "not b'MMIDIDX"), ("version", "version 2"), ("dtype", "dtype code 9"),
       ("truncated", "truncated"), ("pointers", "pointers"), ("bin", "index says 4 tokens")]


@pytest.mark.parametrize("how, message", BAD, ids=[b[0] for b in BAD])
def test_malformed_files_are_refused_before_ranks(tmp_path, capsys, no_ranks, how, message):
    _word_tokenizer(tmp_path / "tok", 300)
    prefix = tmp_path / "d"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_document([1, 2])
        w.add_document([3, 4])
    _corrupt(prefix, how)
    with pytest.raises(ValueError, match="--data-path"):
        IndexedDataset(prefix)
    assert main(["train", "--data-path", str(prefix), "--tokenizer", str(tmp_path / "tok"),
                 "--tp", "1", "--pp", "1", "--dp", "1"]) == 2
    err = capsys.readouterr().err
    assert str(prefix) in err and message in err, err


def test_tiny_empty_and_foreign_datasets_are_refused_before_ranks(tmp_path, capsys, no_ranks):
    _word_tokenizer(tmp_path / "tok", 300)
    flags = ["--tokenizer", str(tmp_path / "tok"), "--seq-len", "16", "--tp", "1", "--pp", "1",
             "--dp", "1"]
    cases = {"tiny": ([[1] * 10, [2] * 5], "has 16 tokens"), "empty": ([], "has 0 tokens"),
             "foreign": ([[299, 4000] * 20], "token ids 299..4000")}
    for name, (docs, message) in cases.items():
        with IndexedDatasetWriter(tmp_path / name, np.uint16) as w:
            for doc in docs:
                w.add_document(doc)
        assert main(["train", "--data-path", str(tmp_path / name), *flags]) == 2
        err = capsys.readouterr().err
        assert str(tmp_path / name) in err and message in err, err
    assert main(["train", "--data-path", str(tmp_path / "tiny"), "--tp", "1"]) == 2
    assert "needs --tokenizer" in capsys.readouterr().err
