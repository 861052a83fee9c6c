"""paraloom's diagnosis side by side with PyTorch's Flight Recorder, on the failure classes of
``tests/_diagnose_cases.py`` (4 gloo ranks each).

For every case, three diagnoses, each scored on the culprit rank (right when the named culprits
are exactly the case's) and the divergent line (right when it is named):

* **paraloom live**: ``paraloom record --nproc 4 --hang-after 3`` -- seconds from the start to
  the verdict (the command's exit), then ``paraloom diagnose --json`` of the run;
* **Flight Recorder + fr_trace**: the same program with ``TORCH_FR_BUFFER_SIZE`` set, every
  rank dumping its buffer after 3 s (as a watchdog would at its timeout, 10-30 min by default),
  then ``python -m torch.distributed.flight_recorder.fr_trace`` on the dumps -- given its best
  chance: the dumps' default-group name fixed first (gloo writes ``''`` in ``pg_config`` and
  ``'0'`` in the entries; unfixed, the analyser stops with ``KeyError``) and
  ``--allow-incomplete-ranks`` when a rank left no dump. Its culprits are the ranks of its first
  ``Culprit rank N`` report, else the missing ranks of its first "Not all ranks joining
  collective"; its line, the case's line in that report's stack trace;
* **paraloom on the FR dumps**: ``paraloom diagnose`` of the raw dumps (nothing fixed).

    python benchmarks/diagnose_vs_fr.py [--cases skip,order] [--out DIR]

Every program runs in its own process group and is killed as a tree when its time is up.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "_diagnose_cases.py"
sys.path.insert(0, str(ROOT / "tests"))
from _diagnose_cases import CULPRIT, marker  # noqa: E402

DUMP_AFTER = 3


def _run(cmd: list[str], timeout: float, **kw) -> tuple[int, str, float]:
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=ROOT, **kw)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return 124, out, time.time() - t0
    return proc.returncode, out, time.time() - t0


def _score(culprits, sites: str, case: str) -> tuple[str, str]:
    want = CULPRIT[case]
    right = sorted(culprits or []) == ([] if want is None else [want])
    line = f"_diagnose_cases.py:{marker(case)}" if want is not None else None
    return ("yes" if right else "no"), ("-" if line is None else
                                        "yes" if line in sites else "no")


def paraloom_live(case: str, out: Path) -> tuple[str, str, float]:
    run = out / f"{case}-rec"
    _, _, seconds = _run([sys.executable, "-m", "paraloom", "record", "--nproc", "4",
                          "--hang-after", "3", "--timeout", "60", "--out", str(run), "--",
                          str(CASES), case], 180)
    _, text, _ = _run([sys.executable, "-m", "paraloom", "diagnose", str(run), "--json"], 60)
    try:
        d = json.loads(text)
    except ValueError:
        return "error", "error", seconds
    rows = json.dumps((d.get("divergence") or {}).get("ranks", {})) + d.get("explanation", "")
    return (*_score(d.get("culprits"), rows, case), seconds)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fr_dumps(case: str, out: Path) -> tuple[Path, float]:
    """The case's raw dumps (4 ranks, env rendezvous), and the seconds until they were all
    written (or the ranks ended)."""
    folder, port, procs = out / f"{case}-fr", _port(), []
    t0 = time.time()
    for rank in range(4):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_FR_BUFFER_SIZE="2000",
                   CASE_DUMP_AFTER=str(DUMP_AFTER))
        procs.append(subprocess.Popen([sys.executable, str(CASES), case, "--fr", str(folder)],
                                      env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
    while time.time() - t0 < 60 and len(list(folder.glob("fr_*"))) < 4 \
            and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    seconds = time.time() - t0
    time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    return folder, seconds


def fr_trace(case: str, folder: Path, out: Path) -> tuple[str, str, float]:
    fixed = out / f"{case}-fr-fixed"
    fixed.mkdir(exist_ok=True)
    files = sorted(folder.glob("fr_*")) if folder.is_dir() else []
    for f in files:
        dump = pickle.loads(f.read_bytes())
        config = dump["pg_config"]
        if "" in config and "0" not in config:
            config["0"] = config.pop("")
        (fixed / f.name).write_bytes(pickle.dumps(dump))
    if not files:
        return "no dump", "no dump", 0.0
    cmd = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(fixed),
           "-p", "fr_"] + (["--allow-incomplete-ranks"] if len(files) < 4 else [])
    code, text, seconds = _run(cmd, 120)
    if code != 0:
        return "error", "error", seconds
    culprits = None
    blocks = re.split(r"\n(?=group info:|Not all ranks joining)", text)
    for block in blocks:
        named = [int(r) for r in re.findall(r"Culprit rank (\d+)", block)]
        missing = re.search(r"missing ranks: \{([\d, ]*)\}", block)
        if named or missing:
            culprits = named or [int(r) for r in missing.group(1).split(",") if r.strip()]
            return (*_score(sorted(set(culprits)), block, case), seconds)
    return (*_score([], "", case), seconds)


def paraloom_on_dumps(case: str, folder: Path) -> tuple[str, str]:
    _, text, _ = _run([sys.executable, "-m", "paraloom", "diagnose", str(folder), "--json"], 60)
    try:
        d = json.loads(text)
    except ValueError:
        return "error", "error"
    rows = json.dumps((d.get("divergence") or {}).get("ranks", {})) + d.get("explanation", "")
    culprits = d.get("culprits") if d.get("decided", True) else None
    return _score(culprits, rows, case)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CULPRIT), help="comma list (default: all)")
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temp folder)")
    args = ap.parse_args(argv)
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CULPRIT]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; valid: {', '.join(CULPRIT)}")
    out = Path(args.out or tempfile.mkdtemp(prefix="diagnose_vs_fr_"))
    out.mkdir(parents=True, exist_ok=True)
    print("| case | culprit | paraloom live: culprit / line / s | FR + fr_trace: culprit / "
          "line / s | paraloom on the FR dumps: culprit / line |")
    print("|---|---|---|---|---|")
    score = {"live": 0, "fr": 0, "dumps": 0}
    for case in cases:
        lc, ll, ls = paraloom_live(case, out)
        folder, dump_s = fr_dumps(case, out)
        fc, fl, fs = fr_trace(case, folder, out)
        dc, dl = paraloom_on_dumps(case, folder) if folder.is_dir() else ("no dump", "no dump")
        for key, (c, line) in (("live", (lc, ll)), ("fr", (fc, fl)), ("dumps", (dc, dl))):
            score[key] += (c == "yes") + (line in ("yes", "-"))
        want = "none" if CULPRIT[case] is None else CULPRIT[case]
        print(f"| {case} | {want} | {lc} / {ll} / {ls:.1f} | {fc} / {fl} / "
              f"{dump_s + fs:.1f} | {dc} / {dl} |", flush=True)
    total = 2 * len(cases)
    print(f"\nscore (culprit + line, of {total}): paraloom live {score['live']}, "
          f"Flight Recorder + fr_trace {score['fr']}, paraloom on the FR dumps {score['dumps']}")
    print(f"runs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
