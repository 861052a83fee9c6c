"""``paraloom preprocess``: text -> token ids -> a Megatron indexed dataset ``P.bin`` + ``P.idx``.

As Megatron-LM's ``tools/preprocess_data.py`` (one dataset per call, written as ``P.bin`` and
``P.idx`` where Megatron writes ``P_text_document.*``)::

    paraloom preprocess --input docs.jsonl --tokenizer tok/ --output-prefix data/docs --append-eod
    paraloom train --data-path data/docs --tokenizer tok/

How documents are read and encoded: :mod:`paraloom.data.preprocess`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..data.preprocess import preprocess, read_documents
from ..data.tokenizer import load_tokenizer

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paraloom preprocess", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, metavar="FILE",
                   help=".jsonl (a JSON object per line) or .txt, optionally .gz")
    p.add_argument("--tokenizer", "--tokenizer-model", dest="tokenizer", required=True,
                   metavar="DIR", help="a local Hugging Face tokenizer folder (tokenizer.json)")
    p.add_argument("--output-prefix", required=True, metavar="P",
                   help="writes P.bin and P.idx (the folder must exist)")
    p.add_argument("--append-eod", action="store_true",
                   help="end every document with the tokenizer's end-of-document token")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                   help="the .jsonl field holding the text (one key; default: text)")
    p.add_argument("--txt-documents", choices=["paragraph", "line", "file"], default="paragraph",
                   help="how a .txt file splits into documents (default: paragraph)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if len(args.json_keys) != 1:
            raise ValueError(f"--json-keys {' '.join(args.json_keys)}: paraloom writes one "
                             f"dataset per call (P.bin + P.idx); give one key")
        tokenizer = load_tokenizer(args.tokenizer)
        if args.append_eod and tokenizer.eod is None:
            raise ValueError(f"--append-eod: --tokenizer {args.tokenizer!r} has no "
                             f"end-of-document token (no eos_token in tokenizer_config.json, "
                             f"no <|endoftext|> or </s>)")
        folder = Path(args.output_prefix).parent
        if os.path.basename(args.output_prefix) in ("", ".", ".."):
            example = str(Path(args.output_prefix) / "docs")
            raise ValueError(f"--output-prefix {args.output_prefix!r} names a folder, not a "
                             f"dataset: give the file name too ({example!r} writes docs.bin "
                             f"and docs.idx)")
        if not folder.is_dir():
            raise ValueError(f"--output-prefix {args.output_prefix!r}: the folder "
                             f"{str(folder)!r} does not exist")
        docs = read_documents(args.input, args.json_keys[0], args.txt_documents)
        if not docs:
            raise ValueError(f"--input {args.input!r} holds no documents (no text)")
        counts = preprocess(docs, tokenizer, args.output_prefix, args.append_eod)
    except ValueError as err:
        print(f"paraloom preprocess: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"paraloom preprocess: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output_prefix}.bin and {args.output_prefix}.idx: {counts['documents']} "
          f"documents, {counts['tokens']} tokens as {counts['dtype']} (vocabulary "
          f"{tokenizer.vocab_size}{', EOD appended' if args.append_eod else ''})")
    return 0
