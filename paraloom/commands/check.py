"""``paraloom check RUN_DIR [--step N] [--only-diff]``: 0 if the ledger agrees exactly with the
formulas on every rank and recorded step, 1 (differences named) if not, 2 on a missing or
unreadable run folder or an unrecorded step (:mod:`paraloom.verify.check`)."""

from __future__ import annotations

import argparse
import sys

from ..report.table import FROM_ONE, numbered_steps
from ..verify.check import all_ok, check_run, config_from_run, load_run, render_diff, step_config

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``paraloom check RUN_DIR [--step N] [--only-diff]``: 0 if the ledger agrees exactly
    with the formulas on every rank and recorded step, 1 (differences named) if not, 2 on a
    missing or unreadable run folder or an unrecorded step."""
    ap = argparse.ArgumentParser(prog="paraloom check",
                                 description="Compare a run's ledger with the formulas.")
    ap.add_argument("run_dir", metavar="RUN_DIR")
    ap.add_argument("--step", type=int, default=None, help="one recorded step (default: all)")
    ap.add_argument("--only-diff", action="store_true", help="print the differing rows only")
    args = ap.parse_args(argv)
    try:
        cfg, events, metrics = load_run(args.run_dir)
        config = config_from_run(cfg)
        steps = numbered_steps(events)
        if args.step is not None and args.step not in steps:
            raise ValueError(f"step {args.step} is not in the ledger; recorded steps: {steps}"
                             + (FROM_ONE if args.step == 0 else ""))
        if not steps:
            raise ValueError(f"the ledger of {args.run_dir!r} holds no communication")
    except (ValueError, KeyError, TypeError) as err:
        print(f"paraloom check: error: {err}", file=sys.stderr)
        return 2
    ok = True
    for step in [args.step] if args.step is not None else steps:
        rows = check_run(step_config(config, step, metrics), events, step=step)
        print(f"## step {step}\n\n" + render_diff(rows, only_diff=args.only_diff))
        ok = ok and all_ok(rows)
    return 0 if ok else 1
