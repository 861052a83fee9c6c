"""The ``paraloom`` command line: ``paraloom train | table | check | plan | explain | ...``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paraloom", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="train a GPT on the bundled corpus (not yet available)")
    args = parser.parse_args(argv)
    if args.command == "train":
        print("paraloom train: not yet — the GPT model and the train command land with issue 5. "
              "The parallel layers are ready: see README.md and tests/.")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
