"""What a run reads: :class:`DataConfig` (a text file, or a tokenizer and its data)."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import option

__all__ = ["DataConfig"]


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

    def __post_init__(self) -> None:
        if self.file is not None and self.data_path is not None:
            raise ValueError(f"--data {self.file!r} (a text file) and --data-path "
                             f"{self.data_path!r} (an indexed dataset) both given: give one")
