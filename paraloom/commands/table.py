"""``paraloom table RUN_DIR [--lang en|zh] [--format md|csv|json] [--rank R] [--step N|setup]
[--group]``:
print the communication order table of a run (:mod:`paraloom.report.table`); exit 2, naming the
bad value, on a missing ledger, an unknown rank or step."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..report.table import HEADINGS, render_table
from ..run_folder import LEDGER, read_ledger

__all__ = ["main"]


def _step(text: str):
    if text == "setup":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a step number nor 'setup'") \
            from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="paraloom table", description="The communication order "
                                 "table: what one rank communicated in one step, in execution "
                                 "order.")
    ap.add_argument("run_dir", metavar="RUN_DIR")
    ap.add_argument("--lang", choices=sorted(HEADINGS), default="en")
    ap.add_argument("--format", choices=("md", "csv", "json"), default="md", dest="fmt")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--step", type=_step, default=None,
                    help="a step number, or setup (what came before the first iteration); "
                         "default: the first step")
    ap.add_argument("--group", action="store_true", help="fold repeated layers")
    args = ap.parse_args(argv)
    path = Path(args.run_dir) / LEDGER
    try:
        if not path.is_file():
            raise ValueError(f"no ledger at {path} (RUN_DIR {args.run_dir!r} must hold "
                             f"ledger.jsonl, written by paraloom train or paraloom record)")
        text = render_table(read_ledger(path), rank=args.rank, step=args.step,
                            lang=args.lang, fmt=args.fmt, group=args.group)
    except (ValueError, KeyError) as err:
        print(f"paraloom table: error: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0
