"""The token stream training and evaluation sample windows from (:mod:`.batches`).

Three sources, one result: a 1-D tensor of token ids that every rank builds identically, so the
batches cut from it stay layout-independent.

* ``--data FILE`` (or the bundled corpus) without ``--tokenizer``: the file's bytes (uint8).
* ``--data FILE --tokenizer DIR``: the file's text encoded as one document.
* ``--data-path P --tokenizer DIR``: the documents of the indexed dataset ``P.bin``/``P.idx``
  (paraloom's or Megatron's) joined in order, with the tokenizer's end-of-document token (EOD)
  between neighbours; a document that already ends in EOD (``preprocess --append-eod``) gets no
  second one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .corpus import load_corpus
from .indexed_dataset import IndexedDataset
from .tokenizer import EOD_NAMES, load_tokenizer

__all__ = ["join_documents", "load_tokens", "check_token_ids"]


def _inner_ends(dataset: IndexedDataset) -> np.ndarray:
    """Token offsets where a non-empty document ends and another one follows."""
    bounds = np.concatenate([[0], np.cumsum(dataset.sequence_lengths.astype(np.int64))])
    ends = bounds[dataset.document_indices]  # [0, end of doc 0, end of doc 1, ...]
    return ends[1:][np.diff(ends) > 0][:-1]


def join_documents(dataset: IndexedDataset, eod: int) -> np.ndarray:
    """All documents of ``dataset`` in order, ``eod`` between neighbours (int32: check the ids
    with :func:`check_token_ids` first)."""
    tokens = np.asarray(dataset.tokens).astype(np.int32)
    inner = _inner_ends(dataset)
    inner = inner[tokens[inner - 1] != eod]
    return np.insert(tokens, inner, eod)


def check_token_ids(tokens: np.ndarray, vocab_size: int, what: str, tokenizer: str) -> None:
    """``ValueError`` if a token id is outside ``[0, vocab_size)`` (a dataset made with
    another tokenizer)."""
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"{what} holds token ids {int(tokens.min())}..{int(tokens.max())}, but "
                         f"--tokenizer {tokenizer!r} has a vocabulary of {vocab_size}: the "
                         f"dataset was made with another tokenizer")


_CACHE: dict = {}
"""The last stream built, keyed by its inputs and their files' sizes and times: the check
before ranks start builds it, and forked ranks inherit it instead of tokenizing again."""


def _signature(*paths) -> tuple:
    out = []
    for path in paths:
        try:
            st = Path(path).stat()
            out.append((str(path), st.st_size, st.st_mtime_ns))
        except (OSError, TypeError):
            out.append((path, None))
    return tuple(out)


def load_tokens(data: str | None = None, data_path: str | None = None,
                tokenizer: str | None = None) -> torch.Tensor:
    """The token stream of ``data`` (a file, default the bundled corpus) or ``data_path`` (an
    indexed dataset prefix), tokenized with ``tokenizer`` (a folder; ``None``: bytes).
    ``ValueError`` names the flag and the value for every bad input."""
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
    files = [data, *(Path(tokenizer) / name for name in names if tokenizer)]
    if data_path is not None:
        files += [f"{data_path}.idx", f"{data_path}.bin"]
    key = (data, data_path, tokenizer, _signature(*files))
    if key not in _CACHE:
        tokens = _build(data, data_path, tokenizer)
        _CACHE.clear()
        _CACHE[key] = tokens
    return _CACHE[key]


def _build(data: str | None, data_path: str | None, tokenizer: str | None) -> torch.Tensor:
    if data is not None and data_path is not None:
        raise ValueError(f"--data {data!r} (a text file) and --data-path {data_path!r} (an "
                         f"indexed dataset) both given: give one of them")
    if data_path is not None:
        if tokenizer is None:
            raise ValueError(f"--data-path {data_path!r} needs --tokenizer DIR (the tokenizer "
                             f"that made it: the vocabulary size and end-of-document token "
                             f"come from it)")
        tok = load_tokenizer(tokenizer)
        dataset = IndexedDataset(data_path)
        if dataset.dtype.kind not in "iu":
            raise ValueError(f"--data-path {data_path!r} holds {dataset.dtype} values, not "
                             f"integer token ids")
        if tok.eod is None and len(_inner_ends(dataset)):
            raise ValueError(f"--tokenizer {tokenizer!r} has no end-of-document token (no "
                             f"eos_token in tokenizer_config.json, none of "
                             f"{', '.join(EOD_NAMES)}) to put between the documents of "
                             f"--data-path {data_path!r}")
        check_token_ids(dataset.tokens, tok.vocab_size, f"--data-path {data_path!r}", tokenizer)
        return torch.from_numpy(join_documents(dataset, -1 if tok.eod is None else tok.eod))
    raw = load_corpus(data)
    if tokenizer is None:
        return raw
    tok = load_tokenizer(tokenizer)
    name = "the bundled corpus" if data is None else f"--data {data!r}"
    try:
        text = raw.numpy().tobytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{name} is not UTF-8 text (byte {err.start} is "
                         f"0x{err.object[err.start]:02x}); --tokenizer reads text") from None
    return torch.tensor(tok.encode(text), dtype=torch.int32)
