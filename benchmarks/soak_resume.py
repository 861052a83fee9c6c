"""Soak test of crash and resume: random ``kill -9`` of one rank, automatic ``--resume RUN``.

Trains a small GPT twice with the same flags: once without interruption, once with ``--kills``
random SIGKILLs, each of a random rank at a random point after a random number of steps; after
every kill the run is continued by ``paraloom train --resume RUN`` with no other flag, until it
finishes. Then it compares the two runs' metrics step for step (loss, grad_norm, lr must be
bitwise equal: same layout, fp32 on CPU, dropout on) and prints what each kill cost::

    python benchmarks/soak_resume.py --steps 60 --save-every 5 --kills 3 --seed 0

Exit code 0 when every step matches. Not part of the test suite (tests/test_resume.py has the
one-kill version).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from paraloom.run_folder import read_json_lines

ROOT = Path(__file__).resolve().parents[1]


def _metrics(run: Path) -> list[dict]:
    return read_json_lines(run / "metrics.jsonl", strict=False)  # a line being written: skipped


def _ranks_of(pid: int) -> list[int]:
    """The rank processes of a ``paraloom train`` process, in start order (its children, less
    multiprocessing's resource tracker)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return sorted(c for c in children
                  if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes())


def _train(argv: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "paraloom", "train", *argv],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def _checkpoints(run: Path) -> list[int]:
    folder = run / "checkpoints"
    return sorted(int(p.name[5:]) for p in folder.glob("step_*") if p.name[5:].isdigit())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="seeds the choice of kills")
    p.add_argument("--out", default="runs/soak_resume")
    p.add_argument("--layout", default="--tp 2 --pp 1 --dp 2",
                   help="layout flags for paraloom train")
    args = p.parse_args(argv)
    if not 0 <= args.kills <= args.steps - args.save_every - 2:
        p.error(f"--kills {args.kills}: need 0 <= kills <= steps - save_every - 2 = "
                f"{args.steps - args.save_every - 2}")
    rng = random.Random(args.seed)
    out = Path(args.out)
    flags = [*args.layout.split(), "--layers", "2", "--hidden", "32", "--heads", "4",
             "--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2",
             "--dropout", "0.1", "--steps", str(args.steps), "--save-every",
             str(args.save_every), "--timeout", "30", "--ledger-steps", "1"]
    straight, soak = out / "straight", out / "soak"
    tic = time.time()
    ref = _train([*flags, "--out", str(straight)])
    if ref.wait() != 0:
        print(ref.stderr.read(), file=sys.stderr)
        return 1
    t_straight = time.time() - tic
    targets = sorted(rng.sample(range(args.save_every + 1, args.steps - 1), args.kills))
    tic, log, proc = time.time(), [], _train([*flags, "--out", str(soak)])
    for target in targets:
        while proc.poll() is None and len(_metrics(soak)) < target:
            time.sleep(0.005)
        if proc.poll() is not None:
            print(f"the run ended before step {target}: {proc.stderr.read()}", file=sys.stderr)
            return 1
        time.sleep(rng.uniform(0.0, 0.05))  # somewhere inside the next step
        ranks = _ranks_of(proc.pid)
        victim = rng.randrange(len(ranks))
        done = len(_metrics(soak))
        os.kill(ranks[victim], signal.SIGKILL)
        code, err = proc.wait(), proc.stderr.read()
        resumed_from = _checkpoints(soak)[-1]
        log.append((done, victim, code, err.strip().splitlines()[-1] if err.strip() else "",
                    resumed_from))
        proc = _train(["--resume", str(soak)])
    if proc.wait() != 0:
        print(proc.stderr.read(), file=sys.stderr)
        return 1
    t_soak = time.time() - tic
    want, got = _metrics(straight), _metrics(soak)
    keys = ("loss", "grad_norm", "lr")
    steps_ok = [m["step"] for m in got] == list(range(args.steps))
    pairs = list(zip(got, want, strict=False))
    diff = max((abs(a[k] - b[k]) for a, b in pairs for k in keys), default=0.0)
    same = steps_ok and len(got) == len(want) and all(
        all(a[k] == b[k] for k in keys) for a, b in pairs)
    print(f"soak: {args.steps} steps, layout {args.layout}, checkpoint every {args.save_every}, "
          f"dropout 0.1, {args.kills} kills (seed {args.seed})")
    for i, (done, victim, code, last, resumed_from) in enumerate(log):
        print(f"  kill {i + 1}: rank {victim} SIGKILLed with {done} steps in metrics.jsonl; "
              f"paraloom train exit {code} ({last}); resumed from step {resumed_from}, "
              f"{done - resumed_from} step(s) redone")
    print(f"uninterrupted: {t_straight:.1f} s; with kills and resumes: {t_soak:.1f} s")
    print(f"metrics step for step: {'identical' if same else 'DIFFERENT'} (steps 0..{len(got) - 1}"
          f", max |difference| of loss, grad_norm, lr = {diff:.3g})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
