"""``paraloom schedule``: the pipeline timetable as a picture, or a run's recorded one.

    paraloom schedule --pp 4 --microbatches 8 --vpp 2     # interleaved 1F1B, bubble printed
    paraloom schedule RUN_DIR [--step N]                   # what the run really did
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import default_schedule
from ..pipeline_parallel import timetable as tt
from ..report import plots
from ..run_folder import read_ledger

__all__ = ["main"]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    cmd = argparse.ArgumentParser(
        prog="paraloom schedule", description="Draw the pipeline timetable for "
        "--pp/--microbatches[/--vpp], or the real one recorded in RUN_DIR/ledger.jsonl.")
    cmd.add_argument("run_dir", nargs="?", help="a run folder (or a ledger.jsonl) to draw from")
    cmd.add_argument("--pp", "--pipeline-model-parallel-size", type=_positive, default=4)
    cmd.add_argument("--microbatches", "--num-microbatches", type=_positive, default=8)
    cmd.add_argument("--vpp", "--virtual-pipeline-model-parallel-size", type=_positive,
                     default=1)
    cmd.add_argument("--schedule", choices=["1f1b", "gpipe", "interleaved", "none", "zb-h1"],
                     help="default: interleaved with --vpp > 1, none with --pp 1, else 1f1b")
    cmd.add_argument("--step", type=int, help="step of the run to draw (default: the last)")
    cmd.add_argument("--out", default="sched.png", help="PNG to write (default sched.png)")
    return cmd


_MAX_DRAWN, _MAX_STAGES = 4096, 64
"""The largest ``pp * vpp * microbatches``, and ``pp``, ``paraloom schedule`` simulates and
draws."""


def _schedule(args) -> int:
    if args.run_dir:
        path = Path(args.run_dir)
        path = path / "ledger.jsonl" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"{args.run_dir!r} is neither a run folder with a ledger.jsonl nor "
                             f"a ledger file")
        blocks, rows = plots.ledger_blocks(read_ledger(path), args.step)
        bubble = plots.bubble_of(blocks, len(rows))
        title = f"recorded pipeline schedule ({path}), bubble {bubble:.3f}"
        unit = "seconds"
    else:
        p, m, v = args.pp, args.microbatches, args.vpp
        name = args.schedule or default_schedule(p, v)
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _schedule(args)
    except (ValueError, OSError) as err:
        print(f"paraloom schedule: error: {err}", file=sys.stderr)
        return 2
