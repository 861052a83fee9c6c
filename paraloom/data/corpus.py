"""The bundled corpus and byte-level text files: reading them, and how much text a run needs.

Tokens are bytes (vocabulary 256) unless a tokenizer is given (:mod:`.stream`). The bundled corpus
(``bundled/python_stdlib.txt.gz``, see its README) ships with the package, so the default run
needs no download. The last :data:`HOLDOUT` fraction of a token stream is never sampled for
training (:mod:`.batches`): the held-out loss reads it.
"""

from __future__ import annotations

import codecs
import gzip
import zlib
from pathlib import Path

import torch

__all__ = ["DEFAULT_CORPUS", "HOLDOUT", "read_bytes", "load_corpus", "min_bytes",
           "first_non_utf8"]

DEFAULT_CORPUS = Path(__file__).with_name("bundled") / "python_stdlib.txt.gz"
HOLDOUT = 0.05
"""The last fraction of the bytes, never sampled for training (held-out loss)."""


def read_bytes(path: Path, flag: str) -> bytes:
    """The bytes of ``path``, decompressed if it ends in ``.gz``; ``ValueError`` naming ``flag``
    and the file when it is not a readable file or not valid gzip."""
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
    return raw


def load_corpus(path: str | Path | None = None, flag: str = "--data") -> torch.Tensor:
    """Bytes of ``path`` (any file; ``.gz`` is decompressed), or of the bundled corpus, as uint8.

    Tokens are bytes, so any content is valid; what is refused (``ValueError`` naming ``flag``
    and the file) is a path that is not a readable file, an empty one, and a ``.gz`` file that
    does not decompress."""
    path = Path(path) if path is not None else DEFAULT_CORPUS
    raw = read_bytes(path, flag)
    if not raw:
        after = " after gunzip" if path.suffix == ".gz" else ""
        raise ValueError(f"{flag} {str(path)!r} is empty (0 bytes{after})")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _fits(n: int, seq_len: int, use: str, holdout: float, heldout_end: float) -> bool:
    split = int(n * (1.0 - holdout))  # as :class:`~.batches.Corpus` cuts it
    end = n if heldout_end >= 1.0 else int(n * heldout_end)
    if use == "all":
        return n >= seq_len + 1
    if use == "heldout":
        return end - split >= seq_len + 1
    return split >= seq_len + 1 and end - split >= seq_len + 1


def min_bytes(seq_len: int, use: str, holdout: float = HOLDOUT, heldout_end: float = 1.0
              ) -> int:
    """The fewest bytes a file needs for ``use`` (``train``, ``heldout`` or ``all``) at
    ``seq_len``, its held-out part ``holdout`` of it from the training part's end to
    ``heldout_end`` (``--split``): see :func:`check_data`."""
    if use not in ("train", "heldout", "all"):
        raise ValueError(f"use must be train, heldout or all, got {use!r}")
    n = seq_len + 1
    while not _fits(n, seq_len, use, holdout, heldout_end):
        n += 1
    return n


def first_non_utf8(raw: bytes, chunk: int = 1 << 20) -> tuple[int, int] | None:
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
