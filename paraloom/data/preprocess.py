"""Text -> token ids -> a Megatron indexed dataset ``P.bin`` + ``P.idx`` (``paraloom preprocess``).

As Megatron-LM's ``tools/preprocess_data.py`` (one dataset per call, written as ``P.bin`` and
``P.idx`` where Megatron writes ``P_text_document.*``)::

    paraloom preprocess --input docs.jsonl --tokenizer tok/ --output-prefix data/docs --append-eod
    paraloom train --data-path data/docs --tokenizer tok/

Documents: a ``.jsonl`` file has one JSON object per line and its ``"text"`` field is a document
(a list of strings is one document of several sequences, Megatron's sentences). A ``.txt`` file
is split by ``--txt-documents``: ``paragraph`` (default; blank lines separate documents),
``line`` or ``file``. A ``.gz`` ending is decompressed first. Each document is encoded with the
tokenizer; ``--append-eod`` ends every non-empty document with its end-of-document token. An
empty document stays an empty document, as Megatron writes it. The token dtype follows the
vocabulary size as Megatron chooses it: uint16 below 65500 tokens, else int32.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .corpus import read_bytes
from .indexed_dataset import IndexedDatasetWriter, optimal_dtype

__all__ = ["read_documents", "preprocess"]

_BATCH = 256
"""Documents encoded per ``encode_batch`` call."""


def _text_of(path: Path) -> str:
    raw = read_bytes(path, "--input")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--input {str(path)!r} is not UTF-8 text (byte {err.start} is "
                         f"0x{raw[err.start]:02x})") from None


def read_documents(path: str | Path, key: str = "text", txt_documents: str = "paragraph"
                   ) -> list[list[str]]:
    """The documents of ``path``, each a list of texts (its sequences); ``ValueError`` names
    the file and the line of anything malformed."""
    path = Path(path)
    kind = path.suffixes[-2] if path.suffix == ".gz" and len(path.suffixes) > 1 else path.suffix
    if kind not in (".jsonl", ".json", ".txt"):
        raise ValueError(f"--input {str(path)!r}: the name must end in .jsonl or .txt (or "
                         f"those + .gz), got {kind or 'no suffix'!r}")
    text = _text_of(path)
    if kind == ".txt":
        if txt_documents == "file":
            return [[text]] if text.strip() else []
        parts = text.splitlines() if txt_documents == "line" else re.split(r"\n\s*\n", text)
        return [[part.strip("\n")] for part in parts if part.strip()]
    docs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"--input {str(path)!r} line {number} is not JSON ({err.msg} at "
                             f"column {err.colno})") from None
        value = obj.get(key) if isinstance(obj, dict) else None
        if isinstance(value, str):
            value = [value]
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            if isinstance(obj, dict) and key in obj:
                why = f"its {key!r} is {type(obj[key]).__name__}, not a string or strings"
            else:
                has = ", ".join(list(obj)[:6]) if isinstance(obj, dict) else type(obj).__name__
                why = f"no field {key!r} (it has {has or 'nothing'}); --json-keys names the field"
            raise ValueError(f"--input {str(path)!r} line {number}: {why}")
        docs.append(value)
    return docs


def preprocess(documents: list[list[str]], tokenizer, prefix: str, append_eod: bool) -> dict:
    """Encode ``documents`` with ``tokenizer`` and write ``prefix.bin``/``prefix.idx``;
    returns counts for the summary line."""
    dtype = optimal_dtype(tokenizer.vocab_size)
    tokens = 0
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for lo in range(0, len(documents), _BATCH):
            batch = documents[lo:lo + _BATCH]
            flat = tokenizer.encode_batch([s for doc in batch for s in doc])
            at = 0
            for doc in batch:
                seqs = [ids for ids in flat[at:at + len(doc)] if ids]  # Megatron drops empties
                at += len(doc)
                if seqs and append_eod:
                    seqs[-1] = [*seqs[-1], tokenizer.eod]
                writer.add_document([t for ids in seqs for t in ids], [len(s) for s in seqs])
                tokens += sum(len(s) for s in seqs)
    return {"documents": len(documents), "tokens": tokens, "dtype": str(dtype.__name__)}
