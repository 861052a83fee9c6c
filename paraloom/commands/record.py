"""``paraloom record``: run any PyTorch program with its communication on the record.

    paraloom record --nproc 2 --out rec -- train.py --lr 3e-4     # local ranks (torchrun env)
    paraloom record --nproc 2 -m my_package.train                 # a module instead of a file
    torchrun --nproc-per-node 8 -m paraloom record --out rec -- train.py   # join a given world

With ``--nproc N`` the launcher starts N fresh interpreters with torchrun's variables (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); the
program calls ``init_process_group`` itself. Without it, this process is one rank of the world
its environment describes. The output folder is a run folder (``ledger.jsonl`` of all ranks,
``comm_table.md`` in English and Chinese, ``trace.json``, ``report.html``; ``ledger/rank_R.jsonl``
per rank), so
``paraloom table | trace | schedule | diff`` read it. A program that raises, exits non-zero or is
killed keeps its partial ledger; ``record`` exits with the program's code and names the rank.
A local run stopped at ``--timeout`` exits 124, one stopped by a signal to the launcher 128 + its
number; either names the ranks that were still running. Ranks that hang (every running rank
blocked ``--hang-after`` seconds in communication they disagree on) are stopped with a
diagnosis (``paraloom diagnose``; ``diagnosis.json``), exit 3; a failed run is diagnosed too.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import signal
import sys
from pathlib import Path

from ..diagnose.watch import HANG_EXIT, after_run, checker, watch_in_rank_0
from ..launch import skip_finalization
from ..ledger import merge
from ..record import bootstrap, launcher
from ..record.launcher import KILL_S, culprit, launch_ranks, status, wait_for_statuses
from ..report.run_reports import write_reports
from ..run_folder import check_out, rank_ledgers, read_json_lines, write_events, written

__all__ = ["main", "finish"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="paraloom record", description=__doc__.splitlines()[0],
        usage="paraloom record [--nproc N] [--out DIR] [--steps K] [--compute] "
              "[--megatron-on-cpu] [--timeout S] -- (SCRIPT.py | -m MODULE) [ARGS...]")
    ap.add_argument("--nproc", type=int, help="local ranks to start (default: join the world "
                                              "of torchrun's environment)")
    ap.add_argument("--out", default="record", help="output folder (default: record)")
    ap.add_argument("--steps", type=int, help="record K whole training-loop iterations (steps "
                                              "1..K; see paraloom.record.tracking)")
    ap.add_argument("--megatron-on-cpu", action="store_true",
                    help="run a megatron-core program on CPU ranks (gloo): opt-in run-time "
                         "patches for what megatron-core asks of CUDA (paraloom.record."
                         "megatron_core_cpu; README, 'Record Megatron-Core itself')")
    ap.add_argument("--compute", action="store_true",
                    help="also record leaf modules' forward/backward compute spans")
    ap.add_argument("--hang-after", type=float, default=60.0, metavar="S",
                    help="when every running rank has been blocked in communication S seconds "
                         "and they disagree, stop them, print the diagnosis (paraloom diagnose) "
                         f"and exit {HANG_EXIT} (default 60; 0 turns it off)")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds before a local run is stopped (default 1800; it then "
                         "exits 124)")
    return ap


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    if "-m" in argv:
        i = argv.index("-m")
        return argv[:i], argv[i:]
    for i, arg in enumerate(argv):  # the first argument that is not an option or its value
        if arg.endswith(".py"):
            return argv[:i], argv[i:]
    return argv, []


def _check(args, target: list[str]) -> str | None:
    if not target or (target[0] == "-m" and len(target) < 2):
        return "no program given: paraloom record [options] -- SCRIPT.py [ARGS] (or -m MODULE)"
    if target[0] != "-m" and not Path(target[0]).is_file():
        return f"program {target[0]!r} is not a file (give a script path, or -m MODULE)"
    if args.nproc is not None and args.nproc < 1:
        return f"--nproc must be a positive integer, got {args.nproc}"
    if args.steps is not None and args.steps < 1:
        return f"--steps must be a positive integer (iterations), got {args.steps}"
    if not (math.isfinite(args.hang_after) and args.hang_after >= 0):
        return f"--hang-after must be 0 (off) or positive seconds, got {args.hang_after:g}"
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        return f"--timeout must be a positive number of seconds, got {args.timeout:g}"
    problem = _preflight(target)
    if problem:
        return problem
    if args.nproc is None and "RANK" not in os.environ:
        return ("no --nproc and no torchrun environment (RANK, WORLD_SIZE): give --nproc N "
                "for local ranks, or start it under torchrun")
    try:
        check_out(args.out, create=True)
    except ValueError as err:
        return str(err)
    return None


def _preflight(target: list[str]) -> str | None:
    """Catch what would fail identically on every rank before any rank starts: a script that
    does not compile, or a module that cannot be found."""
    if target[0] == "-m":
        sys.path.insert(0, os.getcwd())  # searched as python -m does: the working folder first
        try:
            found = importlib.util.find_spec(target[1])
        except (ImportError, ValueError) as err:
            found, why = None, f" ({err})"
        else:
            why = ""
        finally:
            sys.path.remove(os.getcwd())
        if found is None:
            return f"module {target[1]!r} cannot be found{why} in {os.getcwd()!r} or on " \
                   f"sys.path (give an importable -m MODULE)"
        return None
    try:
        compile(Path(target[0]).read_bytes(), target[0], "exec")
    except (SyntaxError, ValueError) as err:
        return f"program {target[0]!r} does not compile: {err}"
    return None


def finish(out: Path, ranks) -> list[dict]:
    """Merge ``out/ledger/rank_R.jsonl`` of ``ranks`` into ``out/ledger.jsonl`` (files of
    other ranks, left by an older record in the same folder, are not this run's) and write the
    table (en, zh), the trace and the HTML report; returns the merged events."""
    files = rank_ledgers(out)
    events = merge(read_json_lines(files[r], strict=False) for r in sorted(ranks) if r in files)
    write_events(out, events)
    for problem in write_reports(out, events, langs=("en", "zh"), empty=False):
        print(f"paraloom record: {problem}", file=sys.stderr)  # the record itself is done
    return events


def _unrecorded(statuses: dict[int, dict]) -> None:
    """A note for the collectives the program called inside ``torch.inference_mode``, which the
    recorder cannot see (per rank: how many of each, where the first was)."""
    parts = [f"rank {r}: " + ", ".join(f"{name} x{v['count']} at {v['site']}"
                                       for name, v in sorted(s["unrecorded"].items()))
             for r, s in sorted(statuses.items()) if s.get("unrecorded")]
    if parts:
        print(f"paraloom record: note: the program called collectives inside "
              f"torch.inference_mode ({'; '.join(parts)}); inference mode skips the dispatch "
              f"keys the recorder listens on, so they are not in the ledger (torch.no_grad() "
              f"is recorded)", file=sys.stderr)


def _report(out: Path, codes: dict[int, int], stop: dict | None = None,
            timeout: float | None = None) -> int:
    """Print what happened (naming the rank) and return the exit code of ``record``."""
    stop = stop or {"why": None, "ranks": set(), "killed": set()}
    statuses = {r: status(out, r) for r in codes}
    _unrecorded(statuses)
    if all(c == 0 for c in codes.values()):
        if not any(s.get("init") for s in statuses.values()):
            print("paraloom record: the program never created a torch.distributed process "
                  "group (init_process_group, init_device_mesh), so it did not communicate: "
                  "nothing to record", file=sys.stderr)
            if any(s.get("children") for s in statuses.values()):
                print("paraloom record: it started processes of its own (multiprocessing, "
                      "torch.multiprocessing.spawn): those are not recorded. Record the "
                      "worker instead: run it under paraloom record --nproc N, where each "
                      "rank calls init_process_group with torchrun's RANK, WORLD_SIZE, "
                      "MASTER_ADDR and MASTER_PORT", file=sys.stderr)
            return 2
        return 0
    if stop["why"] not in (None, "failure"):
        cause = f"stopped after --timeout {timeout:g} s" if stop["why"] == "timeout" else \
            f"stopped by {stop['why']} to the launcher"
        killed = f", then SIGKILL: {_who(stop['killed'])} did not exit within {KILL_S:g} s" \
            if stop["killed"] else ""
        print(f"paraloom record: the run was {cause}; {_who(stop['ranks'])} still running "
              f"got SIGTERM{killed}; the partial ledger is in {out}", file=sys.stderr)
        if all(codes[r] == 0 or r in stop["ranks"] for r in codes):  # no rank failed first
            return 124 if stop["why"] == "timeout" else 128 + signal.Signals[stop["why"]]
    rank = culprit(codes, statuses, stop["ranks"])
    code = codes[rank]
    if code < 0:
        what = f"was killed by {signal.Signals(-code).name}"
    else:
        error = statuses[rank].get("error")
        what = f"exited with code {code}" + (f" ({error})" if error else "")
    print(f"paraloom record: rank {rank} {what}; the partial ledger is in {out}",
          file=sys.stderr)
    return code if code > 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    options, target = _split(argv)
    ap = _parser()
    args = ap.parse_args(options)
    problem = _check(args, target)
    if problem:
        print(f"paraloom record: error: {problem}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.nproc is None:  # one rank of a world started elsewhere (torchrun)
        return _join(args, target, out)
    for old in (out / "ledger").glob("rank_*"):
        old.unlink()
    codes, stop = launch_ranks(args.nproc, target, out, steps=args.steps, compute=args.compute,
                               timeout=args.timeout, megatron_on_cpu=args.megatron_on_cpu,
                               hang_after=args.hang_after,
                               check=checker(out, args.hang_after))
    events = finish(out, codes)
    if stop["why"] == "hang":
        print(f"paraloom record: every running rank was blocked {args.hang_after:g} s "
              f"(--hang-after) and they disagree: stopped them", file=sys.stderr)
        after_run(out, codes, stop["ranks"], "paraloom record", stop.get("diagnosis"))
        return HANG_EXIT
    code = _report(out, codes, stop, args.timeout)
    if code not in (0, 2):
        after_run(out, codes, stop["ranks"], "paraloom record")
    _summary(out, events, len(codes), code)
    return code


def _summary(out: Path, events: list[dict], ranks: int, code: int) -> None:
    """The last line of a successful record."""
    if code == 0 and not events:
        print("paraloom record: the program initialised a process group but issued no "
              f"communication: {out}/ledger.jsonl is empty (no table or trace)")
    elif code == 0:
        print(f"paraloom record: {len(events)} events from {ranks} ranks -> {out} "
              f"({written(out, ('report.html', 'ledger.jsonl', 'comm_table.md', 'trace.json'))})")


def _join(args, target: list[str], out: Path) -> int:
    """Record this rank; rank 0 then waits (bounded) for every rank's status and merges the
    ranks below ``WORLD_SIZE`` that left one. Each rank removes its own older status before
    its program starts (:func:`paraloom.record.bootstrap.run_program`), so a status from an
    earlier record into the same folder cannot be taken for this run's: a program's
    ``init_process_group`` waits for every rank, hence for every removal."""
    rank, world = int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", "1"))
    if rank == 0 and args.hang_after > 0:
        watch_in_rank_0(out, world, args.hang_after, "paraloom record")
    code = bootstrap.run_program(str(out), args.steps, args.compute, target,
                                 megatron_on_cpu=args.megatron_on_cpu,
                                 hang_after=args.hang_after)
    skip_finalization()  # the program's groups must not abort the exit (as local ranks do)
    if rank != 0:
        return code
    missing = wait_for_statuses(out, world)
    if missing:  # another node with its own --out, or ranks that never got to write
        print(f"paraloom record: {len(missing)} of {world} ranks ({_ranks(missing)}) left no "
              f"status in {out}/ledger within {launcher.JOIN_WAIT_S:g} s; the merged ledger "
              f"holds the {world - len(missing)} ranks whose files are here. Ranks on other nodes "
              f"write into their node's --out: give a folder every node shares to merge them all",
              file=sys.stderr)
    codes = {r: status(out, r).get("exit", 1) for r in range(world) if r not in missing}
    events = finish(out, codes)
    code = _report(out, codes) or code
    if code not in (0, 2):
        after_run(out, codes, set(), "paraloom record")
    _summary(out, events, len(codes), code)
    return code


def _who(ranks) -> str:
    """``rank 3`` or ``ranks 0-2``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + _ranks(sorted(ranks))


def _ranks(ranks: list[int]) -> str:
    """``0-3, 6`` for ``[0, 1, 2, 3, 6]``."""
    spans, start = [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            spans.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(spans)
