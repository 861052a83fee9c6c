"""The bundled corpus and a dataset that gives every parallel layout the same global batches.

Tokens are bytes (vocabulary 256) by default; with ``--tokenizer`` or ``--data-path`` (a
Megatron indexed dataset) they are the ids of :func:`paraloom.data.stream.load_tokens`, and
everything below is the same with "token" for "byte". Global batch ``step`` is
``global_batch_size`` windows of ``seq_len + 1`` bytes at offsets drawn from a generator seeded
by ``(seed, step)``, so it depends on nothing about the layout. A data-parallel rank takes a
contiguous slice of the rows and cuts it into microbatches; the union over ranks and
microbatches is always the whole global batch, so the mean loss (every microbatch has the same
number of tokens) is layout-independent.

The last ``holdout`` fraction of the bytes is never sampled for training: :func:`eval_batches`
reads it for held-out loss.
"""

from __future__ import annotations

import codecs
import gzip
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ..utils import divide

__all__ = ["DEFAULT_CORPUS", "HOLDOUT", "load_corpus", "load_tokens", "check_data", "min_bytes",
           "Corpus", "microbatches", "eval_batches"]

DEFAULT_CORPUS = Path(__file__).with_name("corpus") / "python_stdlib.txt.gz"
HOLDOUT = 0.05
"""The last fraction of the bytes, never sampled for training (held-out loss)."""


def load_corpus(path: str | Path | None = None, flag: str = "--data") -> torch.Tensor:
    """Bytes of ``path`` (any file; ``.gz`` is decompressed), or of the bundled corpus, as uint8.

    Tokens are bytes, so any content is valid; what is refused (``ValueError`` naming ``flag``
    and the file) is a path that is not a readable file, an empty one, and a ``.gz`` file that
    does not decompress."""
    path = Path(path) if path is not None else DEFAULT_CORPUS
    if not path.is_file():
        what = "a folder" if path.is_dir() else "missing"
        raise ValueError(f"{flag} {str(path)!r} is not a readable file ({what})")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ValueError(f"{flag} {str(path)!r} cannot be read: {err.strerror}") from None
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as err:
            raise ValueError(f"{flag} {str(path)!r} ends in .gz but is not a valid gzip file "
                             f"({err}); give the text itself or a complete .gz") from None
    if not raw:
        after = " after gunzip" if path.suffix == ".gz" else ""
        raise ValueError(f"{flag} {str(path)!r} is empty (0 bytes{after})")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _fits(n: int, seq_len: int, use: str, holdout: float = HOLDOUT) -> bool:
    split = int(n * (1.0 - holdout))
    if use == "all":
        return n >= seq_len + 1
    if use == "heldout":
        return n - split >= seq_len + 1
    return split >= seq_len + 2 and n - split >= seq_len + 1


def min_bytes(seq_len: int, use: str, holdout: float = HOLDOUT) -> int:
    """The fewest bytes a file needs for ``use`` (``train``, ``heldout`` or ``all``) at
    ``seq_len``: see :func:`check_data`."""
    if use not in ("train", "heldout", "all"):
        raise ValueError(f"use must be train, heldout or all, got {use!r}")
    n = seq_len + 1
    while not _fits(n, seq_len, use, holdout):
        n += 1
    return n


def load_tokens(path: str | Path | None = None, data_path: str | None = None,
                tokenizer: str | None = None) -> torch.Tensor:
    """The token stream of ``--data path`` / ``--data-path data_path`` with ``--tokenizer``
    (:func:`paraloom.data.stream.load_tokens`); the bytes of ``path`` without either."""
    if data_path is None and tokenizer is None:
        return load_corpus(path)
    from ..data.stream import load_tokens as tokens_of
    return tokens_of(None if path is None else str(path), data_path, tokenizer)


def check_data(path: str | Path | None, seq_len: int, use: str, flag: str = "--data", *,
               data_path: str | None = None, tokenizer: str | None = None) -> list[str]:
    """Load ``path`` and check that it is long enough for ``use``; ``ValueError`` names the
    file, its size and the size needed. Returns notes worth printing (e.g. not UTF-8 text).
    With ``data_path`` (an indexed dataset prefix) or ``tokenizer`` (a folder) the same check
    counts tokens (:func:`load_tokens`).

    A window is ``seq_len + 1`` bytes (``seq_len`` inputs, each next byte its label).

    * ``all`` (``eval --split all``): at least one window, ``seq_len + 1`` bytes.
    * ``heldout`` (``eval``): the last 5 % of the bytes hold at least one window.
    * ``train``: the first 95 % hold at least ``seq_len + 2`` bytes (windows are drawn at random
      offsets below ``split - seq_len - 1``) and the last 5 % at least one window (the held-out
      loss before and after training).
    """
    if data_path is not None or tokenizer is not None:
        return _check_tokens(path, seq_len, use, data_path, tokenizer)
    data = load_corpus(path, flag)
    n, need = len(data), min_bytes(seq_len, use)
    if n < need:
        name = "the bundled corpus" if path is None else repr(str(path))
        why = {"all": f"one window of seq_len + 1 = {seq_len + 1} tokens",
               "heldout": f"its last {HOLDOUT:.0%} (held out) to hold one window of seq_len + 1 "
                          f"= {seq_len + 1} tokens; --split all needs only {seq_len + 1}",
               "train": f"its first {1 - HOLDOUT:.0%} (training) to hold at least seq_len + 2 = "
                        f"{seq_len + 2} bytes and its last {HOLDOUT:.0%} (held-out loss) one "
                        f"window of seq_len + 1 = {seq_len + 1}"}[use]
        raise ValueError(f"{flag} {name} has {n} bytes (tokens are bytes); --seq-len {seq_len} "
                         f"needs at least {need}: {why}. Use a longer file or a shorter "
                         f"--seq-len")
    bad = None if path is None else _first_non_utf8(data.numpy().tobytes())
    if bad is None:
        return []
    return [f"{flag} {str(path)!r} is not UTF-8 text (byte {bad[0]} is 0x{bad[1]:02x}); its raw "
            f"bytes are the tokens all the same"]


def _check_tokens(path, seq_len: int, use: str, data_path: str | None, tokenizer: str | None
                  ) -> list[str]:
    tokens = load_tokens(path, data_path, tokenizer)
    n, need = len(tokens), min_bytes(seq_len, use)
    if n >= need:
        return []
    name = (f"--data-path {data_path!r} ({'its documents joined, ' * (n > 0)}EOD between them)"
            if data_path is not None else "the bundled corpus" if path is None
            else f"--data {str(path)!r}")
    how = f"tokenized with --tokenizer {tokenizer!r}" if tokenizer else "bytes"
    split = {"all": f"one window of seq_len + 1 = {seq_len + 1} tokens",
             "heldout": f"its last {HOLDOUT:.0%} (held out) to hold one window of seq_len + 1 "
                        f"= {seq_len + 1} tokens; --split all needs only {seq_len + 1}",
             "train": f"its first {1 - HOLDOUT:.0%} (training) to hold at least seq_len + 2 = "
                      f"{seq_len + 2} tokens and its last {HOLDOUT:.0%} (held-out loss) one "
                      f"window of seq_len + 1 = {seq_len + 1}"}[use]
    raise ValueError(f"{name} has {n} tokens ({how}); --seq-len {seq_len} needs at least "
                     f"{need}: {split}. Use more data or a shorter --seq-len")


def _first_non_utf8(raw: bytes, chunk: int = 1 << 20) -> tuple[int, int] | None:
    """Offset and value of the first byte that is not valid UTF-8 (``None`` if it is text),
    decoded a chunk at a time so that a large file is never held as one ``str``."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    for lo in range(0, len(raw), chunk):
        piece = raw[lo:lo + chunk]
        try:
            decoder.decode(piece, final=lo + chunk >= len(raw))
        except UnicodeDecodeError as err:  # err.object: the bytes held over, then ``piece``
            at = lo - (len(err.object) - len(piece)) + err.start
            return at, raw[at]
    return None


@dataclass
class Corpus:
    """Samples fixed-length windows of a byte corpus, deterministically per step."""

    data: torch.Tensor
    seq_len: int
    seed: int = 1234
    holdout: float = HOLDOUT

    def __post_init__(self) -> None:
        self.split = int(len(self.data) * (1.0 - self.holdout))
        if len(self.data) < self.seq_len + 1:
            raise ValueError(f"the corpus has {len(self.data)} bytes; seq_len = {self.seq_len} "
                             f"needs at least one window of seq_len + 1 = {self.seq_len + 1}")

    def global_batch(self, step: int, global_batch_size: int) -> torch.Tensor:
        """``[global_batch_size, seq_len + 1]`` int64 tokens for ``step`` (the same for every
        layout)."""
        if self.split < self.seq_len + 2:  # check_data says so before ranks start
            raise ValueError(f"the corpus has {len(self.data)} bytes ({self.split} for training); "
                             f"training with seq_len = {self.seq_len} needs at least "
                             f"{self.seq_len + 2} there")
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.split - self.seq_len - 1, (global_batch_size,), generator=g)
        return self._windows(starts)

    def _windows(self, starts: torch.Tensor) -> torch.Tensor:
        idx = starts.unsqueeze(1) + torch.arange(self.seq_len + 1)
        return self.data[idx].long()


def microbatches(batch: torch.Tensor, dp_rank: int, dp: int, num_microbatches: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This dp rank's ``(tokens, labels)`` microbatches, each ``[micro_batch_size, seq_len]``."""
    rows = divide(batch.shape[0], dp, "global_batch_size")
    mine = batch[dp_rank * rows:(dp_rank + 1) * rows]
    size = divide(rows, num_microbatches, "global_batch_size / dp")
    return [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(size)]


def eval_batches(corpus: Corpus, batch_size: int, num_batches: int, *, start: int | None = None
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Evenly spaced windows from byte ``start`` on (default: the held-out part, never seen in
    training), as ``(tokens, labels)`` batches of ``batch_size``."""
    start = corpus.split if start is None else start
    span = len(corpus.data) - start - corpus.seq_len - 1
    if span < 0:  # span 0: exactly one window, every row reads it
        raise ValueError(f"the evaluated part ({len(corpus.data) - start} bytes) is shorter "
                         f"than seq_len + 1 = {corpus.seq_len + 1}")
    count = batch_size * num_batches
    starts = start + (torch.arange(count) * span) // max(count, 1)
    windows = corpus._windows(starts)
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]
