"""Tokenizers: bytes (the default, vocabulary 256) or a local Hugging Face tokenizer folder.

``--tokenizer DIR`` names a folder with a ``tokenizer.json`` (what ``tokenizers`` and
``transformers`` save; read with the ``tokenizers`` library, never from the network). Its
vocabulary size counts the added tokens, as ``len(tokenizer)`` does in transformers; text is
encoded with the tokenizer's own post-processing (a Llama tokenizer adds its BOS), as
Megatron's ``HuggingFaceTokenizer.tokenize`` does. The end-of-document token (EOD) is the
``eos_token`` of ``tokenizer_config.json`` when the folder has one, else the first of the usual
end tokens (``<|endoftext|>``, ``</s>``, ...) in the vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer", "EOD_NAMES"]

EOD_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
"""End-of-document tokens looked up when ``tokenizer_config.json`` names no ``eos_token``."""


class ByteTokenizer:
    """Tokens are the UTF-8 bytes of the text: vocabulary 256, no end-of-document token."""

    name = "bytes"
    vocab_size = 256
    eod: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


class HFTokenizer:
    """A local Hugging Face tokenizer folder, read with the ``tokenizers`` library."""

    def __init__(self, folder: str | Path, flag: str = "--tokenizer") -> None:
        self.name = str(folder)
        path = Path(folder)
        if not path.is_dir():
            what = "a file" if path.exists() else "missing"
            raise ValueError(f"{flag} {self.name!r} is not a folder ({what}); give a local "
                             f"Hugging Face tokenizer folder holding tokenizer.json")
        file = path / "tokenizer.json"
        if not file.is_file():
            has = sorted(p.name for p in path.iterdir())[:8]
            raise ValueError(f"{flag} {self.name!r} has no tokenizer.json (it holds "
                             f"{', '.join(has) or 'nothing'}); save the tokenizer with "
                             f"tokenizers' Tokenizer.save or transformers' save_pretrained")
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise ValueError(f"{flag} needs the tokenizers library ({err}): pip install "
                             f"'paraloom[tokenizers]'") from None
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as err:  # tokenizers raises a bare Exception for a bad file
            raise ValueError(f"{flag} {self.name!r}: {file} is not a valid tokenizer file "
                             f"({str(err).splitlines()[0][:200]})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = self._find_eod(path, flag)

    def _find_eod(self, path: Path, flag: str) -> int | None:
        config = path / "tokenizer_config.json"
        if config.is_file():
            try:
                eos = json.loads(config.read_text()).get("eos_token")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
                raise ValueError(f"{flag} {self.name!r}: {config} is not a JSON object "
                                 f"({err})") from None
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str) and self._tok.token_to_id(eos) is not None:
                return self._tok.token_to_id(eos)
        for name in EOD_NAMES:
            if self._tok.token_to_id(name) is not None:
                return self._tok.token_to_id(name)
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]


def load_tokenizer(folder: str | Path | None, flag: str = "--tokenizer"):
    """:class:`HFTokenizer` for ``folder``, :class:`ByteTokenizer` for ``None``; a bad folder
    is a ``ValueError`` naming ``flag`` and the folder."""
    return ByteTokenizer() if folder is None else HFTokenizer(folder, flag)
