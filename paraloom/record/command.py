"""``paraloom record``: run any PyTorch program with its communication on the record.

    paraloom record --nproc 2 --out rec -- train.py --lr 3e-4     # local ranks (torchrun env)
    paraloom record --nproc 2 -m my_package.train                 # a module instead of a file
    torchrun --nproc-per-node 8 -m paraloom record --out rec -- train.py   # join a given world

With ``--nproc N`` the launcher starts N fresh interpreters with torchrun's variables (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); the
program calls ``init_process_group`` itself. Without it, this process is one rank of the world
its environment describes. The output folder is a run folder (``ledger.jsonl`` of all ranks,
``comm_table.md`` in English and Chinese, ``trace.json``, ``report.html``; ``ledger/rank{R}.jsonl``
per rank), so
``paraloom table | trace | schedule | diff`` read it. A program that raises, exits non-zero or is
killed keeps its partial ledger; ``record`` exits with the program's code and names the rank.
A local run stopped at ``--timeout`` exits 124, one stopped by a signal to the launcher 128 + its
number; either names the ranks that were still running.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..ledger import load, merge

__all__ = ["record_main", "finish"]

_GRACE_S = 5.0
"""How long the other ranks may go on after one failed before the launcher stops them."""
_KILL_S = 2.0
"""How long a rank the launcher stopped (SIGTERM) has to flush its ledger before SIGKILL: a rank
deadlocked in C++ holding the GIL never runs its Python SIGTERM handler."""
_JOIN_WAIT_S = 60.0
"""How long rank 0 of a joined (torchrun) record waits for the other ranks' status files."""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="paraloom record", description=__doc__.splitlines()[0],
        usage="paraloom record [--nproc N] [--out DIR] [--steps K] [--compute] "
              "[--timeout S] -- (SCRIPT.py | -m MODULE) [ARGS...]")
    ap.add_argument("--nproc", type=int, help="local ranks to start (default: join the world "
                                              "of torchrun's environment)")
    ap.add_argument("--out", default="record", help="output folder (default: record)")
    ap.add_argument("--steps", type=int, help="stop recording after K optimizer steps")
    ap.add_argument("--compute", action="store_true",
                    help="also record leaf modules' forward/backward compute spans")
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
        return f"--steps must be a positive integer (optimizer steps), got {args.steps}"
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        return f"--timeout must be a positive number of seconds, got {args.timeout:g}"
    problem = _preflight(target)
    if problem:
        return problem
    if args.nproc is None and "RANK" not in os.environ:
        return ("no --nproc and no torchrun environment (RANK, WORLD_SIZE): give --nproc N "
                "for local ranks, or start it under torchrun")
    return _writable(Path(args.out))


def _writable(out: Path) -> str | None:
    """Whether ``--out`` can hold the record (creates ``out/ledger``, as every rank would)."""
    if out.exists() and not out.is_dir():
        return f"--out {str(out)!r} is an existing file, not a folder (give a folder path)"
    try:
        (out / "ledger").mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"--out {str(out)!r} cannot be created ({err.strerror or err}): give a " \
               f"writable folder path"
    if not os.access(out / "ledger", os.W_OK | os.X_OK):
        return f"--out {str(out)!r} is not writable (give a writable folder path)"
    return None


def _preflight(target: list[str]) -> str | None:
    """Catch what would fail identically on every rank before any rank starts: a script that
    does not compile, or a module that cannot be found."""
    import importlib.util

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_launcher(launcher: int):
    """``preexec_fn`` of a rank: on Linux the kernel sends it SIGTERM when the launcher dies,
    even by SIGKILL (``PR_SET_PDEATHSIG``); if the launcher is already gone, stop now."""
    def arm():
        if sys.platform.startswith("linux"):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
            if os.getppid() != launcher:  # died between fork and prctl
                os.kill(os.getpid(), signal.SIGTERM)
    return arm


def _catch_signals(stop: dict) -> None:
    """SIGTERM / SIGINT to the launcher: note it; the launcher's loop stops the ranks (see
    :func:`_stop_ranks`), then merges what they left. A second one kills them at once."""
    def caught(signum, frame):
        stop["signal"] = signal.Signals(signum).name
        stop["count"] = stop.get("count", 0) + 1

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, caught)


def _stop_ranks(procs: dict, stop: dict) -> None:
    """SIGTERM to every running rank (each flushes its ledger), SIGKILL to those still running
    :data:`_KILL_S` later (or at a second signal); notes them in ``stop``."""
    running = [r for r, p in procs.items() if p.poll() is None]
    stop["ranks"] = set(running)
    for r in running:
        procs[r].send_signal(signal.SIGTERM)
    deadline, count = time.monotonic() + _KILL_S, stop.get("count", 0)
    while time.monotonic() < deadline and stop.get("count", 0) <= count \
            and any(procs[r].poll() is None for r in running):
        time.sleep(0.05)
    for r in running:
        if procs[r].poll() is None:
            stop["killed"].add(r)
            procs[r].kill()


def _launch(args, target: list[str], out: Path) -> tuple[dict[int, int], dict]:
    """Start ``--nproc`` ranks and wait; returns each rank's exit code (negative: signal) and
    why the launcher stopped ranks: ``{"why": None | "failure" | "timeout" | "SIGTERM" |
    "SIGINT", "ranks": the ranks it stopped, "killed": those it had to SIGKILL}``."""
    env = dict(os.environ, WORLD_SIZE=str(args.nproc), LOCAL_WORLD_SIZE=str(args.nproc),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               PARALOOM_RECORD_T0=repr(time.time()))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "paraloom.record.bootstrap", str(out), str(args.steps or 0),
           "1" if args.compute else "0", *target]
    arm = _die_with_launcher(os.getpid())
    procs = {r: subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                 preexec_fn=arm)
             for r in range(args.nproc)}
    stop = {"why": None, "ranks": set(), "killed": set()}
    _catch_signals(stop)
    deadline, first_fail = time.monotonic() + args.timeout, None
    while any(p.poll() is None for p in procs.values()):
        now = time.monotonic()
        failed = [r for r, p in procs.items() if p.returncode not in (None, 0)]
        if failed and first_fail is None:
            first_fail = now
        if "signal" in stop:
            stop["why"] = stop["signal"]
        elif now > deadline:
            stop["why"] = "timeout"
        elif first_fail is not None and now - first_fail > _GRACE_S:
            stop["why"] = "failure"
        if stop["why"]:
            _stop_ranks(procs, stop)
            break
        time.sleep(0.05)
    return {r: p.wait() for r, p in procs.items()}, stop


def finish(out: Path, ranks) -> list[dict]:
    """Merge ``out/ledger/rank{R}.jsonl`` of ``ranks`` into ``out/ledger.jsonl`` (files of
    other ranks, left by an older record in the same folder, are not this run's) and write the
    table (en, zh), the trace and the HTML report; returns the merged events."""
    from ..report.table import render_table
    from ..report.trace import write_trace

    files = [out / "ledger" / f"rank{r}.jsonl" for r in sorted(ranks)]
    events = merge(load(f) for f in files if f.is_file())
    with open(out / "ledger.jsonl", "w") as f:
        for event in events:
            f.write(json.dumps(event) + "\n")
    if events:
        rank = min(e["rank"] for e in events)
        parts = [render_table(events, rank=rank, lang=lang) for lang in ("en", "zh")]
        (out / "comm_table.md").write_text("\n".join(parts))
        write_trace(events, out / "trace.json")
        from ..report.html import write_report
        try:
            write_report(out)
        except (ValueError, KeyError, TypeError, OSError) as err:  # the record itself is done
            print(f"paraloom record: report.html not written: {err}", file=sys.stderr)
    return events


def _status(out: Path, rank: int) -> dict:
    path = out / "ledger" / f"rank{rank}.status.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _culprit(codes: dict[int, int], statuses: dict[int, dict], stopped: set[int]) -> int:
    """The rank to blame: its own error first (earliest), then one killed from outside, then
    one that chose its own non-zero exit (``sys.exit(3)``, no error), then one that only saw a
    peer go away (the peer may be the one that exited), then any other non-zero exit."""
    from ..launch import _PEER_GONE

    def secondary(r: int) -> bool:
        return any(s in (statuses[r].get("error") or "").lower() for s in _PEER_GONE)

    bad = [r for r, c in codes.items() if c != 0]
    tiers = ([r for r in bad if statuses[r].get("error") and not secondary(r)],
             [r for r in bad if codes[r] < 0 and r not in stopped],
             [r for r in bad if codes[r] > 0 and r not in stopped and statuses[r]
              and not statuses[r].get("error")],
             [r for r in bad if statuses[r].get("error")],
             [r for r in bad if r not in stopped], bad)
    tier = next(t for t in tiers if t)
    return min(tier, key=lambda r: (statuses[r].get("time", float("inf")), r))


def _report(out: Path, codes: dict[int, int], stop: dict | None = None,
            timeout: float | None = None) -> int:
    """Print what happened (naming the rank) and return the exit code of ``record``."""
    stop = stop or {"why": None, "ranks": set(), "killed": set()}
    statuses = {r: _status(out, r) for r in codes}
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
        killed = f", then SIGKILL: {_who(stop['killed'])} did not exit within {_KILL_S:g} s" \
            if stop["killed"] else ""
        print(f"paraloom record: the run was {cause}; {_who(stop['ranks'])} still running "
              f"got SIGTERM{killed}; the partial ledger is in {out}", file=sys.stderr)
        if all(codes[r] == 0 or r in stop["ranks"] for r in codes):  # no rank failed first
            return 124 if stop["why"] == "timeout" else 128 + signal.Signals[stop["why"]]
    rank = _culprit(codes, statuses, stop["ranks"])
    code = codes[rank]
    if code < 0:
        what = f"was killed by {signal.Signals(-code).name}"
    else:
        error = statuses[rank].get("error")
        what = f"exited with code {code}" + (f" ({error})" if error else "")
    print(f"paraloom record: rank {rank} {what}; the partial ledger is in {out}",
          file=sys.stderr)
    return code if code > 0 else 128 - code


def record_main(argv: list[str] | None = None) -> int:
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
    for old in (out / "ledger").glob("rank*"):
        old.unlink()
    codes, stop = _launch(args, target, out)
    events = finish(out, codes)
    code = _report(out, codes, stop, args.timeout)
    _summary(out, events, len(codes), code)
    return code


def _summary(out: Path, events: list[dict], ranks: int, code: int) -> None:
    """The last line of a successful record."""
    if code == 0 and not events:
        print("paraloom record: the program initialised a process group but issued no "
              f"communication: {out}/ledger.jsonl is empty (no table or trace)")
    elif code == 0:
        print(f"paraloom record: {len(events)} events from {ranks} ranks -> {out} "
              f"(report.html, ledger.jsonl, comm_table.md, trace.json)")


def _join(args, target: list[str], out: Path) -> int:
    """Record this rank; rank 0 then waits (bounded) for every rank's status and merges the
    ranks below ``WORLD_SIZE`` that left one. Each rank removes its own older status before
    its program starts (:func:`.bootstrap.run_program`), so a status from an earlier record
    into the same folder cannot be taken for this run's: a program's ``init_process_group``
    waits for every rank, hence for every removal."""
    from ..launch import skip_finalization
    from .bootstrap import run_program
    code = run_program(str(out), args.steps, args.compute, target)
    skip_finalization()  # the program's groups must not abort the exit (as local ranks do)
    rank, world = int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", "1"))
    if rank != 0:
        return code
    deadline = time.monotonic() + _JOIN_WAIT_S

    def absent() -> list[int]:
        return [r for r in range(world) if not (out / "ledger" / f"rank{r}.status.json").exists()]
    while time.monotonic() < deadline and absent():
        time.sleep(0.2)
    missing = absent()
    if missing:  # another node with its own --out, or ranks that never got to write
        print(f"paraloom record: {len(missing)} of {world} ranks ({_ranks(missing)}) left no "
              f"status in {out}/ledger within {_JOIN_WAIT_S:g} s; the merged ledger holds the "
              f"{world - len(missing)} ranks whose files are here. Ranks on other nodes write "
              f"into their node's --out: give a folder every node shares to merge them all",
              file=sys.stderr)
    codes = {r: _status(out, r).get("exit", 1) for r in range(world) if r not in missing}
    events = finish(out, codes)
    code = _report(out, codes) or code
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
