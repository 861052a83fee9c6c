"""The ``paraloom`` command line: ``paraloom train | table | check | plan | explain | ...``."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_schedule(sub) -> None:
    cmd = sub.add_parser("schedule", help="draw a pipeline schedule (PNG) and print its bubble",
                         description="Draw the pipeline timetable for --pp/--microbatches[/--vpp], "
                                     "or the real one recorded in RUN_DIR/ledger.jsonl.")
    cmd.add_argument("run_dir", nargs="?", help="a run folder (or a ledger.jsonl) to draw from")
    cmd.add_argument("--pp", "--pipeline-model-parallel-size", type=_positive, default=4)
    cmd.add_argument("--microbatches", "--num-microbatches", type=_positive, default=8)
    cmd.add_argument("--vpp", "--virtual-pipeline-model-parallel-size", type=_positive,
                     default=1)
    cmd.add_argument("--schedule", choices=["1f1b", "gpipe", "interleaved", "none", "zb-h1"],
                     help="default: interleaved with --vpp > 1, none with --pp 1, else 1f1b")
    cmd.add_argument("--step", type=int, help="step of the run to draw (default: the last)")
    cmd.add_argument("--out", default="sched.png", help="PNG to write (default sched.png)")


_MAX_DRAWN, _MAX_STAGES = 4096, 64
"""The largest ``pp * vpp * microbatches``, and ``pp``, ``paraloom schedule`` simulates and
draws."""


def _schedule(args) -> int:
    from pathlib import Path

    from .report import plots

    if args.run_dir:
        from . import ledger

        path = Path(args.run_dir)
        path = path / "ledger.jsonl" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"{args.run_dir!r} is neither a run folder with a ledger.jsonl nor "
                             f"a ledger file")
        blocks, rows = plots.ledger_blocks(ledger.load(path), args.step)
        bubble = plots.bubble_of(blocks, len(rows))
        title = f"recorded pipeline schedule ({path}), bubble {bubble:.3f}"
        unit = "seconds"
    else:
        from .pipeline_parallel import timetable as tt

        p, m, v = args.pp, args.microbatches, args.vpp
        name = args.schedule or ("none" if p == 1 else "interleaved" if v > 1 else "1f1b")
        if name == "interleaved" and v < 2:  # what train refuses, not drawn either
            raise ValueError("--schedule interleaved needs --vpp >= 2 (virtual stages per "
                             "pipeline rank)")
        if name == "zb-h1" and p < 2:
            raise ValueError(f"--schedule zb-h1 (zero bubble) needs --pp >= 2, got --pp {p}")
        if p > _MAX_STAGES:
            raise ValueError(f"--pp {p}: at most {_MAX_STAGES} stages are simulated and drawn "
                             f"(one row each); paraloom plan gives the bubble of big pipelines")
        if p * v * m > _MAX_DRAWN:
            raise ValueError(f"--pp {p} x --vpp {v} x --microbatches {m} = {p * v * m} "
                             f"forward steps: too many to simulate and draw (at most "
                             f"{_MAX_DRAWN}); paraloom plan gives the bubble of big pipelines")
        slots = tt.timetable(name, p, m, v)
        blocks, rows = plots.timetable_blocks(slots)
        bubble = tt.bubble_fraction(slots, p)
        factor = "v*" if v > 1 else "3*" if name == "zb-h1" else ""
        title = (f"{name} schedule: pp={p}, microbatches={m}" + (f", vpp={v}" if v > 1 else "")
                 + f" — bubble {bubble:.3f} = (p-1)/({factor}m+p-1)"
                 * (name != "none" and (name != "zb-h1" or m >= p)))
        unit = ("time slot (one forward, input-grad B or weight-grad W)" if name == "zb-h1"
                else "time slot (one chunk's forward or backward)")
    out = plots.draw_schedule(blocks, rows, args.out, title=title, time_unit=unit)
    print(f"bubble fraction: {bubble:.4f}")
    print(f"wrote {out}")
    return 0


_FORWARDED = {
    "table": ("paraloom.report.table", "table_main"),
    "trace": ("paraloom.report.trace", "trace_main"),
    "report": ("paraloom.report.html", "report_main"),
    "plan": ("paraloom.analysis.plan", "plan_main"),
    "check": ("paraloom.analysis.check", "check_main"),
    "eval": ("paraloom.training.evaluate", "eval_main"),
    "export-hf": ("paraloom.training.hf_export", "export_hf_main"),
    "explain": ("paraloom.explain", "explain_main"),
    "doctor": ("paraloom.explain", "doctor_main"),
    "diff": ("paraloom.record.diff", "diff_main"),
    "record": ("paraloom.record.command", "record_main"),
    "preprocess": ("paraloom.data.preprocess", "preprocess_main"),
}
"""Commands with their own argument parser: ``paraloom table RUN_DIR ...`` etc."""

_HELP = {
    "table": "the communication order table of a run (en/zh, md/csv/json)",
    "trace": "(re)build a run's Perfetto trace.json from its ledger",
    "report": "one self-contained HTML page of a run (config, check, curves, table, timeline)",
    "plan": "extrapolate memory, communication, bubble and FLOPs to any model and cluster",
    "check": "compare a run's recorded communication with the analytical model",
    "eval": "loss of a checkpoint on held-out text, under any layout",
    "export-hf": "write a run's checkpoint as a Hugging Face GPT-2 folder",
    "explain": "read parallel-training source: where it splits and communicates",
    "doctor": "diagnose the LLM provider setup used by explain --ask",
    "diff": "do two runs communicate identically? first divergence per rank",
    "record": "run any PyTorch program (DDP, FSDP2, DTensor, Megatron) with its "
              "communication on the record",
    "preprocess": "tokenize text into a Megatron indexed dataset (P.bin + P.idx)",
}


def main(argv: list[str] | None = None) -> int:
    """The ``paraloom`` command; Ctrl-C ends it with 130 and one line, and a closed output pipe
    (``paraloom plan ... | head``) quietly, instead of a traceback."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("\nparaloom: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away: nothing more to say to it
        try:  # and Python's own flush at exit must not find the broken pipe either
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout without a file descriptor
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - until the process ends
        return 141


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in _FORWARDED:
        import importlib
        module, fn = _FORWARDED[argv[0]]
        return getattr(importlib.import_module(module), fn)(argv[1:])
    from .training.command import add_train_parser, train_main

    parser = argparse.ArgumentParser(prog="paraloom", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_train_parser(sub)
    _add_schedule(sub)
    for name in _FORWARDED:
        sub.add_parser(name, help=_HELP.get(name, f"see paraloom {name} --help"), add_help=False)
    args = parser.parse_args(argv)
    if args.command == "train":
        return train_main(args, argv[1:])
    if args.command == "schedule":
        try:
            return _schedule(args)
        except (ValueError, OSError) as err:
            print(f"paraloom schedule: {err}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
