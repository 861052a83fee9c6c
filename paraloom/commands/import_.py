"""``paraloom import TRACES --out RUN``: a job's per-rank PyTorch profiler traces, or its Flight
Recorder dumps, as a run folder.

TRACES holds one Chrome trace per rank (``export_chrome_trace``; the rank is the number before
``.json``, ``.json.gz`` or ``.pt.trace.json``), or one Flight Recorder dump per rank
(:mod:`paraloom.diagnose.flight_recorder`). RUN gets the ledger (``ledger.jsonl``) that
``table``, ``diff``, ``report`` and ``diagnose`` read, so a production job's artefacts are
read without rerunning it (:mod:`paraloom.record.kineto` says what is taken from where). Exit 0,
or 2 for bad input (the file or folder named).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..diagnose.flight_recorder import dump_files, load_dumps
from ..ledger import merge
from ..record.kineto import events_of, read_trace, trace_files
from ..run_folder import RunFolderError, check_out, write_events


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="paraloom import",
        description="Turn per-rank PyTorch profiler (Kineto) Chrome traces, or PyTorch Flight "
        "Recorder dumps, into a run folder whose ledger table, diff, report and diagnose read. "
        "Exit 0, or 2 for bad input.")
    ap.add_argument("traces", help="a folder with one profiler trace per rank (*RANK.json, "
                                   ".json.gz, .pt.trace.json) or one Flight Recorder dump per "
                                   "rank (..._RANK)")
    ap.add_argument("--out", required=True, help="the run folder to write")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    folder = Path(args.traces)
    try:
        if not folder.is_dir():
            raise RunFolderError(f"{args.traces!r} is not a folder (of profiler traces or "
                                 f"Flight Recorder dumps)")
        files = trace_files(folder)
        per_rank, notes = [], []
        if files:
            for rank, path in files.items():
                events, said = events_of(read_trace(path), rank)
                per_rank.append(events)
                notes += said
        elif files := dump_files(folder):
            evidence = load_dumps(folder)
            notes = list(evidence.notes)
            per_rank = [ev.events for ev in evidence.ranks.values()]
            for e in (e for es in per_rank for e in es):
                e["phase"] = "unknown"  # a dump says no phase
        else:
            raise RunFolderError(f"{args.traces!r} holds no profiler trace (files named "
                                 f"...RANK.json, .json.gz or .pt.trace.json) and no Flight "
                                 f"Recorder dump (..._RANK)")
        check_out(args.out, create=True)
    except (RunFolderError, ValueError) as err:
        print(f"paraloom import: error: {err}", file=sys.stderr)
        return 2
    merged = merge(per_rank)
    write_events(args.out, merged)
    for note in notes:
        print(f"paraloom import: note: {note}", file=sys.stderr)
    print(f"paraloom import: {len(merged)} communications from {len(files)} ranks -> "
          f"{args.out} (ledger.jsonl)")
    return 0
