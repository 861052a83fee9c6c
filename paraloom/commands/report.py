"""``paraloom report RUN [--out FILE.html] [--lang zh]``: one self-contained HTML page of a run
(:mod:`paraloom.report.html`); exit 2 naming a missing ledger."""

from __future__ import annotations

import argparse
import sys

from ..report.html import write_report

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="paraloom report", description="One self-contained HTML "
                                 "page per run, to open from disk.")
    ap.add_argument("run", metavar="RUN", help="a run folder (train --out or record --out)")
    ap.add_argument("--out", default=None, help="HTML file to write (default RUN/report.html)")
    ap.add_argument("--lang", choices=("en", "zh"), default="en", help="language at opening")
    args = ap.parse_args(argv)
    try:
        path = write_report(args.run, args.out, args.lang)
    except (ValueError, KeyError, OSError) as err:
        print(f"paraloom report: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({path.stat().st_size:,} bytes); open it in a browser")
    return 0
