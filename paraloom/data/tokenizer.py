"""Tokenizers: bytes (the default, vocabulary 256) or a local Hugging Face tokenizer folder.

``--tokenizer DIR`` names a folder with a ``tokenizer.json`` (what ``tokenizers`` and
``transformers`` save; read with the ``tokenizers`` library, never from the network), or with
GPT-2's ``vocab.json`` + ``merges.txt`` (Megatron's ``GPT2BPETokenizer`` files). Its
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
        gpt2 = [path / "vocab.json", path / "merges.txt"]
        if not file.is_file() and not all(f.is_file() for f in gpt2):
            has = sorted(p.name for p in path.iterdir())[:8]
            raise ValueError(f"{flag} {self.name!r} has no tokenizer.json, nor GPT-2's "
                             f"vocab.json + merges.txt (it holds {', '.join(has) or 'nothing'}); "
                             f"save the tokenizer with tokenizers' Tokenizer.save or "
                             f"transformers' save_pretrained")
        try:
            import tokenizers  # noqa: F401
        except ImportError as err:
            raise ValueError(f"{flag} needs the tokenizers library ({err}): pip install "
                             f"'paraloom[tokenizers]'") from None
        try:
            self._tok = _read(file) if file.is_file() else _gpt2(*gpt2)
        except Exception as err:  # tokenizers raises a bare Exception for a bad file
            bad = file if file.is_file() else " + ".join(str(f) for f in gpt2)
            raise ValueError(f"{flag} {self.name!r}: {bad} is not a valid tokenizer "
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


def _read(file: Path):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(file))


def _gpt2(vocab: Path, merges: Path):
    """GPT-2's byte-level BPE from its ``vocab.json`` + ``merges.txt`` (Megatron's
    ``GPT2BPETokenizer`` files; transformers' GPT-2 conversion builds the same)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def load_tokenizer(folder: str | Path | None, flag: str = "--tokenizer"):
    """:class:`HFTokenizer` for ``folder``, :class:`ByteTokenizer` for ``None``; a bad folder
    is a ``ValueError`` naming ``flag`` and the folder."""
    return ByteTokenizer() if folder is None else HFTokenizer(folder, flag)
