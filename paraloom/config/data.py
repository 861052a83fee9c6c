"""What a run reads: :class:`DataConfig` (a text file, or a tokenizer and its data)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .fields import option

__all__ = ["DataConfig", "split_weights", "split_parts"]


def split_weights(text: str) -> tuple[float, float, float]:
    """Megatron's ``--split`` (``"949,50,1"``, also ``/``-separated; fewer than three weights
    are padded with 0) as the three fractions train, validation, test; ``ValueError`` naming the
    value unless it is one to three non-negative numbers with a positive sum."""
    parts = [p.strip() for p in re.split(r"[,/]", text)]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or not all(math.isfinite(w) and w >= 0 for w in weights) \
            or sum(weights) <= 0:
        raise ValueError(f"--split {text!r}: give the train, validation and test weights as "
                         f"Megatron does, e.g. 949,50,1 (one to three non-negative numbers, "
                         f"not all 0)")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return weights[0] / total, weights[1] / total, weights[2] / total


def split_parts(split: str | None) -> dict:
    """The token stream's parts under ``--split`` as :class:`~paraloom.data.Corpus` takes them:
    ``holdout`` (the fraction after the training part) and ``heldout_end`` (where the held-out
    part ends); empty for ``None`` (the default: the last 5% held out)."""
    if split is None:
        return {}
    train, valid, _ = split_weights(split)
    return {"holdout": 1.0 - train, "heldout_end": min(1.0, train + valid)}


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What the run reads: a text file (bytes are tokens), or a tokenizer and its data."""

    file: str | None = option(None, "--data", metavar="FILE",
                              help="text file, bytes are tokens, .gz decompressed (default: the "
                                   "bundled corpus)")
    """Training text file; ``None`` for the bundled corpus. Stored absolute."""
    data_path: str | None = option(None, "--data-path", metavar="PREFIX",
                                   help="a Megatron indexed dataset PREFIX.bin + PREFIX.idx "
                                        "(paraloom preprocess or Megatron's preprocess_data.py); "
                                        "needs --tokenizer")
    """Prefix of a Megatron indexed dataset ``P.bin``/``P.idx``, read instead of ``file``; its
    documents are joined with the tokenizer's end-of-document token between."""
    tokenizer: str | None = option(None, "--tokenizer", "--tokenizer-model", metavar="DIR",
                                   help="a local Hugging Face tokenizer folder (tokenizer.json); "
                                        "the vocabulary size comes from it (default: bytes, "
                                        "vocabulary 256)")
    """A local Hugging Face tokenizer folder; ``None``: tokens are bytes."""
    split: str | None = option(None, "--split", metavar="A,B,C",
                               help="Megatron's train, validation, test weights (e.g. 949,50,1):"
                                    " training samples the first A/(A+B+C) of the tokens, the "
                                    "held-out loss reads the next B/(A+B+C), nothing reads the "
                                    "last C/(A+B+C) (default: the last 5%% held out)")
    """Megatron's ``--split`` weights as given; ``None``: the last
    :data:`~paraloom.data.corpus.HOLDOUT` of the tokens is held out. Megatron splits documents
    (then shuffles them); paraloom's data are one token stream (documents joined), so the split
    is of that stream, in order."""

    def __post_init__(self) -> None:
        if self.file is not None and self.data_path is not None:
            raise ValueError(f"--data {self.file!r} (a text file) and --data-path "
                             f"{self.data_path!r} (an indexed dataset) both given: give one")
        if self.split is not None:
            train, valid, _ = split_weights(self.split)
            if train == 0 or valid == 0:
                part = "training" if train == 0 else "the held-out loss (validation)"
                raise ValueError(f"--split {self.split!r} leaves nothing for {part}: paraloom "
                                 f"trains on the first part and scores the held-out loss on the "
                                 f"second before and after training; give both a weight > 0")

    def split_parts(self) -> dict:
        """:func:`split_parts` of this run's ``--split``."""
        return split_parts(self.split)
