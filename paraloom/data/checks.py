"""Is a run's data long enough? Checked before any rank starts, with the sizes in the message.

A window is ``seq_len + 1`` tokens (``seq_len`` inputs, each next token its label). Bytes are
tokens unless a tokenizer is given, then the same rules count the tokenizer's ids.
"""

from __future__ import annotations

from pathlib import Path

from ..config.data import split_parts, split_weights
from .corpus import HOLDOUT, first_non_utf8, load_corpus, min_bytes
from .stream import load_tokens

__all__ = ["check_data"]


def check_data(path: str | Path | None, seq_len: int, use: str, flag: str = "--data", *,
               data_path: str | None = None, tokenizer: str | None = None,
               split: str | None = None) -> list[str]:
    """Load ``path`` and check that it is long enough for ``use``; ``ValueError`` names the
    file, its size and the size needed. Returns notes worth printing (e.g. not UTF-8 text).
    With ``data_path`` (an indexed dataset prefix) or ``tokenizer`` (a folder) the same check
    counts tokens (:func:`load_tokens`).

    A window is ``seq_len + 1`` bytes (``seq_len`` inputs, each next byte its label).

    * ``all`` (``eval --split all``): at least one window, ``seq_len + 1`` bytes.
    * ``heldout`` (``eval``): the last 5 % of the bytes hold at least one window.
    * ``train``: the first 95 % hold at least one window (windows are drawn at random offsets
      ``0 .. split - seq_len - 1``, the last one included) and the last 5 % at least one window
      (the held-out loss before and after training).

    ``split``: Megatron's ``--split`` weights (:class:`~paraloom.config.DataConfig`): the
    training and held-out parts are its first two instead of 95 % and 5 %.
    """
    if data_path is not None or tokenizer is not None:
        return _check_tokens(path, seq_len, use, data_path, tokenizer, split)
    data = load_corpus(path, flag)
    n, need = len(data), min_bytes(seq_len, use, **split_parts(split))
    if n < need:
        name = "the bundled corpus" if path is None else repr(str(path))
        raise ValueError(f"{flag} {name} has {n} bytes (tokens are bytes); --seq-len {seq_len} "
                         f"needs at least {need}: {_needs(use, seq_len, 'bytes', split)}. Use a "
                         f"longer file or a shorter --seq-len")
    bad = None if path is None else first_non_utf8(data.numpy().tobytes())
    if bad is None:
        return []
    return [f"{flag} {str(path)!r} is not UTF-8 text (byte {bad[0]} is 0x{bad[1]:02x}); its raw "
            f"bytes are the tokens all the same"]


def _check_tokens(path, seq_len: int, use: str, data_path: str | None, tokenizer: str | None,
                  split: str | None) -> list[str]:
    tokens = load_tokens(path, data_path, tokenizer)
    n, need = len(tokens), min_bytes(seq_len, use, **split_parts(split))
    if n >= need:
        return []
    name = (f"--data-path {data_path!r} ({'its documents joined, ' * (n > 0)}EOD between them)"
            if data_path is not None else "the bundled corpus" if path is None
            else f"--data {str(path)!r}")
    how = f"tokenized with --tokenizer {tokenizer!r}" if tokenizer else "bytes"
    raise ValueError(f"{name} has {n} tokens ({how}); --seq-len {seq_len} needs at least "
                     f"{need}: {_needs(use, seq_len, 'tokens', split)}. Use more data or a "
                     f"shorter --seq-len")


def _needs(use: str, seq_len: int, unit: str, split: str | None = None) -> str:
    """Why ``use`` needs what :func:`~.corpus.min_bytes` says, in words."""
    if split is None:
        train, held = f"its first {1 - HOLDOUT:.0%}", f"its last {HOLDOUT:.0%}"
    else:
        weights = split_weights(split)
        train = f"its first {weights[0]:.1%} (--split {split})"
        held = f"the next {weights[1]:.1%}"
    return {"all": f"one window of seq_len + 1 = {seq_len + 1} tokens",
            "heldout": f"{held} (held out) to hold one window of seq_len + 1 "
                       f"= {seq_len + 1} tokens; --split all needs only {seq_len + 1}",
            "train": f"{train} (training) and {held} "
                     f"(held-out loss) to hold one window of seq_len + 1 = {seq_len + 1} "
                     f"{unit} each"}[use]
