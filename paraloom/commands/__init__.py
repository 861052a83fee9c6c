"""The ``paraloom`` command line: ``paraloom train | record | table | check | plan | ...``.

All command-line code lives in this package and nothing in the library imports it. Each command
is one module here, named after it (``paraloom export-hf`` is :mod:`.export_hf`), with a
``main(argv) -> int`` that parses its flags, calls the library and returns the exit code: 0 ok,
2 bad input (one line naming the value and what is valid), 1 a failure while running.
"""

from __future__ import annotations

import argparse
import importlib
import keyword
import os
import sys

__all__ = ["main", "COMMANDS"]

COMMANDS = {
    "train": "train a GPT (default: the bundled corpus, tp=pp=dp=2)",
    "eval": "loss of a checkpoint on held-out text, under any layout",
    "record": "run any PyTorch program (DDP, FSDP2, DTensor, Megatron) with its "
              "communication on the record",
    "table": "the communication order table of a run (en/zh, md/csv/json)",
    "trace": "(re)build a run's Perfetto trace.json from its ledger",
    "report": "one self-contained HTML page of a run (config, check, curves, table, timeline)",
    "schedule": "draw a pipeline schedule (PNG) and print its bubble",
    "check": "compare a run's recorded communication with the analytical model",
    "diff": "do two runs communicate identically? every divergence, rank by rank",
    "diagnose": "why a run hung or broke: the rank whose program diverged, where, and why",
    "import": "a job's profiler traces or Flight Recorder dumps as a run folder",
    "plan": "extrapolate memory, communication, bubble and FLOPs to any model and cluster",
    "explain": "read parallel-training source: where it splits and communicates",
    "doctor": "diagnose the LLM provider setup used by explain --ask",
    "export-hf": "write a run's checkpoint as a Hugging Face GPT-2 folder",
    "preprocess": "tokenize text into a Megatron indexed dataset (P.bin + P.idx)",
}
"""Every command and its one-line help (``paraloom --help``)."""


def main(argv: list[str] | None = None) -> int:
    """The ``paraloom`` command; Ctrl-C ends it with 130 and one line, and a closed output pipe
    (``paraloom plan ... | head``) quietly, instead of a traceback."""
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:
        print("\nparaloom: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away: nothing more to say to it
        try:  # and Python's own flush at exit must not find the broken pipe either
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout without a file descriptor
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - until the process ends
        return 141


def _main(argv: list[str]) -> int:
    if argv and argv[0] in COMMANDS:
        name = argv[0].replace("-", "_")
        name += "_" if keyword.iskeyword(name) else ""  # paraloom import: import_.py
        module = importlib.import_module(f"{__name__}.{name}")
        return module.main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="paraloom", description="Megatron-style parallel training for PyTorch, every "
        "communication on the record. Each command has its own --help.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    parser.parse_args(argv)  # --help, or an unknown command: argparse says so and exits
    return 2
