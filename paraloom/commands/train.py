"""``paraloom train`` (moving here from ``paraloom.training.command``)."""

from __future__ import annotations

import argparse

from ..training.command import add_train_parser, train_main

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paraloom", add_help=False)
    cmd = add_train_parser(parser.add_subparsers(dest="command"))
    args = cmd.parse_args(argv)
    return train_main(args, list(argv or []))
