"""``paraloom trace RUN_DIR``: rebuild RUN_DIR/trace.json from its ledger
(:mod:`paraloom.report.trace`); exit 2 naming a missing or unreadable ledger."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..report.trace import write_trace
from ..run_folder import LEDGER, read_ledger

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="paraloom trace", description="Chrome/Perfetto trace of a "
                                 "run's ledger: one process per rank, compute and one track per "
                                 "parallel kind.")
    ap.add_argument("run_dir", metavar="RUN_DIR")
    args = ap.parse_args(argv)
    run = Path(args.run_dir)
    ledger = run / LEDGER
    try:
        if not ledger.is_file():
            raise ValueError(f"no ledger at {ledger} (RUN_DIR {args.run_dir!r} must hold "
                             f"ledger.jsonl)")
        events = read_ledger(ledger)
        if not events:
            raise ValueError(f"{ledger} holds no events")
        path = write_trace(events, run / "trace.json")
    except (ValueError, KeyError) as err:
        print(f"paraloom trace: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({len(events)} ledger events); open it in ui.perfetto.dev")
    return 0
