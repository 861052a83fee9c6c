"""``paraloom diagnose RUN [--json]``: why a run hung or broke, and which rank's program diverged.

RUN is a run folder (``record`` or ``train``: finished, failed or killed) or a folder of PyTorch
Flight Recorder dumps, one per rank (:mod:`paraloom.diagnose.flight_recorder`). Exit codes: 0
when the verdict is ``ok``, 1 when it is ``mismatch``, ``hang`` or ``failed``, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..diagnose.flight_recorder import load_any
from ..diagnose.render import render
from ..diagnose.verdict import diagnose
from ..run_folder import RunFolderError


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="paraloom diagnose",
        description="Name the culprit of a hang or a mismatched collective: the rank whose "
        "program diverged, where, and why. Reads a run folder (record/train) or a folder of "
        "PyTorch Flight Recorder dumps (one file per rank, named ..._RANK; pickle or JSON). "
        "Exit 0: ok; 1: mismatch, hang or failed; 2: bad input.")
    ap.add_argument("run", help="a record or train run folder, or a folder of Flight Recorder "
                                "dumps")
    ap.add_argument("--json", action="store_true",
                    help="print the diagnosis as JSON (keys: verdict, culprits, divergence, "
                    "explanation, decided, notes)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        ev = load_any(args.run)
    except (RunFolderError, ValueError) as err:
        print(f"paraloom diagnose: error: {err}", file=sys.stderr)
        return 2
    d = diagnose(ev)
    if args.json:
        print(json.dumps(d.as_json(), indent=2))
    else:
        print(render(d, ev))
    return 0 if d.verdict == "ok" else 1
