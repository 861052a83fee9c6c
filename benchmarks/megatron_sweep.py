"""Sweep the layout space: Megatron-Core's step recorded on CPU against ``paraloom train``.

    python benchmarks/megatron_sweep.py                  # every layout, two at a time
    python benchmarks/megatron_sweep.py --only pp3,small-buckets-dp4-distopt
    python benchmarks/megatron_sweep.py --list

For each layout, ``examples/megatron_gpt_step.py`` (megatron-core's own GPTModel, DDP,
optimizer and schedules, driven as Megatron-LM's ``train_step``) runs under ``paraloom record
--megatron-on-cpu``, ``paraloom train`` runs the same model and layout (blocking p2p batches, as
Megatron-Core), and ``paraloom diff --ignore-names`` compares step 2 (the steady state) and step 1
(the first iteration). One line per layout, then the total; exit 1 if any layout differs. The
run folders go to ``--out`` (a temporary folder by default, removed afterwards) and every rank
runs in its own process group, killed as a tree on time-out.

Needs megatron-core 0.19.2 (the README's test command installs it). On 2 cores one layout takes
about a minute; the whole grid about half an hour.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "megatron_gpt_step.py"
MODEL = "--hidden 64 --heads 4 --seq-len 32 --micro-batch-size 2"


def _layout(tp=1, pp=1, dp=1, vpp=None, layers=4, sp=False, distopt=False, recompute=False,
            bf16=False, bucket=None, overlap=True, align=True, microbatches=4, hidden=64,
            heads=4, opg=False, with_step=False, instances=1, fsdp=None):
    """(world size, the example's flags, paraloom train's flags) of one layout."""
    ex = [f"--tp {tp}", f"--pp {pp}", f"--layers {layers}", f"--microbatches {microbatches}",
          f"--hidden {hidden}", f"--heads {heads}"]
    ours = [f"--tp {tp}", f"--pp {pp}", f"--dp {dp}", f"--layers {layers}",
            f"--global-batch-size {2 * microbatches * dp}", f"--hidden {hidden}",
            f"--heads {heads}"]
    for on, e, o in ((vpp, f"--vpp {vpp}", f"--vpp {vpp}"),
                     (sp, "--sequence-parallel", "--sequence-parallel"),
                     (distopt, "--distributed-optimizer", "--distributed-optimizer"),
                     (opg, "--overlap-param-gather", "--overlap-param-gather"),
                     (with_step, "--overlap-param-gather-with-optimizer-step",
                      "--overlap-param-gather-with-optimizer-step"),
                     (recompute, "--recompute", "--recompute full"),
                     (bf16, "--bf16", "--dtype bf16"),
                     (bucket, f"--bucket-size {bucket}", f"--bucket-size {bucket}"),
                     (not overlap, "--no-overlap-grad-reduce", "--no-overlap-grad-reduce"),
                     (not align, "--no-align-grad-reduce", "--no-align-grad-reduce"),
                     (instances > 1, f"--num-distributed-optimizer-instances {instances}",
                      f"--num-distributed-optimizer-instances {instances}"),
                     (fsdp, f"--use-megatron-fsdp --data-parallel-sharding-strategy {fsdp}",
                      f"--use-megatron-fsdp --data-parallel-sharding-strategy {fsdp}")):
        if on:
            ex.append(e)
            ours.append(o)
    return tp * pp * dp, " ".join(ex), " ".join(ours)


LAYOUTS = {
    # the suite's six
    "tp2-pp2": _layout(tp=2, pp=2),
    "tp2-dp2-sp": _layout(tp=2, dp=2, sp=True),
    "pp2-dp2-distopt": _layout(pp=2, dp=2, distopt=True),
    "pp4-vpp2": _layout(pp=4, vpp=2, layers=8),
    "tp2-pp2-recompute": _layout(tp=2, pp=2, recompute=True),
    "tp2-dp2-sp-bf16": _layout(tp=2, dp=2, sp=True, bf16=True),
    # the three orders fixed
    "pp3": _layout(pp=3, layers=6),
    "pp4": _layout(pp=4),
    "pp4-m2": _layout(pp=4, microbatches=2),
    "pp3-dp1-m6": _layout(pp=3, layers=6, microbatches=6),
    "small-buckets-dp4-distopt": _layout(dp=4, distopt=True, bucket=3000),
    "small-buckets-dp4-distopt-h72": _layout(dp=4, distopt=True, bucket=3000, hidden=72,
                                             heads=6),
    "small-buckets-pp2-dp2": _layout(pp=2, dp=2, bucket=3000),
    "small-buckets-dp4": _layout(dp=4, bucket=3000),
    "tp2-sp-recompute": _layout(tp=2, dp=2, sp=True, recompute=True),
    "tp4-sp-recompute": _layout(tp=4, sp=True, recompute=True),
    "tp2-pp2-sp-recompute": _layout(tp=2, pp=2, sp=True, recompute=True),
    # tensor parallelism
    "tp4": _layout(tp=4),
    "tp2-dp2": _layout(tp=2, dp=2),
    "tp4-sp": _layout(tp=4, sp=True),
    "tp2-h72": _layout(tp=2, dp=2, hidden=72, heads=6),
    "tp2-dp2-distopt": _layout(tp=2, dp=2, distopt=True),
    "tp2-dp2-sp-distopt": _layout(tp=2, dp=2, sp=True, distopt=True),
    # pipelines
    "pp2": _layout(pp=2, dp=2),
    "pp2-m8": _layout(pp=2, dp=2, microbatches=8),
    "pp3-vpp2": _layout(pp=3, vpp=2, layers=6, microbatches=6),
    "pp4-vpp2-m8": _layout(pp=4, vpp=2, layers=8, microbatches=8),
    "pp4-vpp2-recompute": _layout(pp=4, vpp=2, layers=8, recompute=True),
    "pp2-tp2-sp": _layout(tp=2, pp=2, sp=True),
    "pp4-bf16": _layout(pp=4, bf16=True),
    # data parallelism and the optimizer
    "dp4": _layout(dp=4),
    "dp4-distopt": _layout(dp=4, distopt=True),
    "dp4-bf16-distopt": _layout(dp=4, distopt=True, bf16=True),
    "dp2-pp2-bf16": _layout(pp=2, dp=2, bf16=True),
    # buckets, overlap, align
    "dp4-one-bucket": _layout(dp=4, bucket=10**8),
    "dp4-no-overlap": _layout(dp=4, overlap=False),
    "pp2-dp2-no-overlap": _layout(pp=2, dp=2, overlap=False),
    "pp2-dp2-no-align": _layout(pp=2, dp=2, align=False),
    "pp2-dp2-distopt-no-align": _layout(pp=2, dp=2, distopt=True, align=False),
    "pp2-dp2-small-buckets-no-align": _layout(pp=2, dp=2, bucket=3000, align=False),
    "tp2-dp2-no-overlap-distopt": _layout(tp=2, dp=2, distopt=True, overlap=False),
    "dp2-tp2-small-buckets-sp": _layout(tp=2, dp=2, sp=True, bucket=3000),
    # --overlap-param-gather: the parameter all-gathers in the next forward
    "dp4-distopt-opg": _layout(dp=4, distopt=True, opg=True),
    "small-buckets-dp4-distopt-opg": _layout(dp=4, distopt=True, bucket=3000, opg=True),
    "pp2-dp2-distopt-opg": _layout(pp=2, dp=2, distopt=True, opg=True),
    "tp2-dp2-sp-distopt-opg": _layout(tp=2, dp=2, sp=True, distopt=True, opg=True),
    "dp4-bf16-distopt-opg": _layout(dp=4, distopt=True, bf16=True, opg=True),
    # six ranks: interleaving with dp and the distributed optimizer (Megatron's coalesced bucket
    # group on the stage holding the tied embedding)
    "pp3-vpp2-dp2-distopt": _layout(pp=3, vpp=2, dp=2, layers=6, microbatches=6,
                                    distopt=True),
    # chunk 0's parameter all-gather launched by its own optimizer step
    "pp3-vpp2-dp2-distopt-opg-with-step": _layout(pp=3, vpp=2, dp=2, layers=6, microbatches=6,
                                                  distopt=True, opg=True, with_step=True),
    # the schedule launches every chunk's parameter all-gathers (--align-param-gather)
    "pp3-vpp2-dp2-distopt-opg": _layout(pp=3, vpp=2, dp=2, layers=6, microbatches=6,
                                        distopt=True, opg=True),
    # the partial distributed optimizer: blocks of 2 dp ranks, the shards all-reduced across
    "small-buckets-dp4-distopt-instances2": _layout(dp=4, distopt=True, bucket=3000,
                                                    instances=2),
    "dp4-distopt-opg-instances2": _layout(dp=4, distopt=True, opg=True, instances=2),
    # Megatron-FSDP (its own layout; reductions when a bucket completes, ZeRO-2's per microbatch)
    "fsdp-optim_grads-dp4": _layout(dp=4, fsdp="optim_grads"),
    "fsdp-optim-dp2-bf16": _layout(dp=2, fsdp="optim", bf16=True),
    "fsdp-no_shard-dp4-small-buckets": _layout(dp=4, fsdp="no_shard", bucket=3000),
    # (with sp megatron-core's Megatron-FSDP leaves out finalize_model_grads' all-reduce of the
    # sequence-parallel gradients over tp, which paraloom keeps: README, Megatron-FSDP)
    "fsdp-optim_grads-tp2-dp2-buckets": _layout(tp=2, dp=2, fsdp="optim_grads", bucket=20000),
    "fsdp-optim-tp2-dp2-recompute": _layout(tp=2, dp=2, fsdp="optim", recompute=True),
    "fsdp-zero3-dp4": _layout(dp=4, fsdp="optim_grads_params"),
    "fsdp-zero3-tp2-dp2-bf16": _layout(tp=2, dp=2, fsdp="optim_grads_params", bf16=True),
    "fsdp-zero3-dp2-layers6-m3": _layout(dp=2, layers=6, microbatches=3,
                                         fsdp="optim_grads_params"),
    # Megatron-FSDP's own --overlap-param-gather (no communication changes)
    "fsdp-optim-dp2-small-buckets-opg": _layout(dp=2, fsdp="optim", bucket=3000, opg=True),
    "fsdp-zero3-tp2-dp2-opg": _layout(tp=2, dp=2, fsdp="optim_grads_params", opg=True),
    # hybrid sharding (--num-distributed-optimizer-instances): sharded within blocks of 2 ranks,
    # summed across them after the last microbatch (ZeRO-1: whole buckets)
    "fsdp-optim_grads-dp4-instances2": _layout(dp=4, fsdp="optim_grads", instances=2),
    "fsdp-optim-dp4-instances2-small-buckets": _layout(dp=4, fsdp="optim", instances=2,
                                                       bucket=3000),
    "fsdp-zero3-dp4-instances2-bf16": _layout(dp=4, fsdp="optim_grads_params", instances=2,
                                              bf16=True),
    # ZeRO-3 with full recomputation: the re-run forwards find their layer gathered
    # (with sp too, but for the sp gradients' all-reduce megatron-core's Megatron-FSDP omits)
    "fsdp-zero3-tp2-dp2-recompute": _layout(tp=2, dp=2, recompute=True,
                                            fsdp="optim_grads_params"),
    "fsdp-zero3-dp2-layers6-m3-recompute": _layout(dp=2, layers=6, microbatches=3,
                                                   recompute=True, fsdp="optim_grads_params"),
}


def _run(cmd: list[str], log: Path, timeout: float) -> int:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return 124


def _diff(a: Path, b: Path, step: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "paraloom", "diff", str(a), str(b),
                           "--step", step, "--ignore-names"], capture_output=True, text=True,
                          cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr


def one(name: str, out: Path, timeout: float) -> tuple[str, str, float]:
    """Record, train and diff one layout: (name, verdict, seconds)."""
    world, ex, ours = LAYOUTS[name]
    tic = time.time()
    meg, mine = out / f"megatron-{name}", out / f"paraloom-{name}"
    py = sys.executable
    code = _run([py, "-m", "paraloom", "record", "--megatron-on-cpu", "--nproc", str(world),
                 "--out", str(meg), "--timeout", str(timeout), "--", str(EXAMPLE),
                 *MODEL.split(), *ex.split()], out / f"{name}.record.log", timeout + 30)
    if code:
        return name, f"megatron record failed (exit {code}, {name}.record.log)", time.time() - tic
    code = _run([py, "-m", "paraloom", "train", *MODEL.split(), *ours.split(), "--steps", "2",
                 "--ledger-steps", "2", "--no-overlap-p2p-communication",
                 "--no-megatron-lm-loop", "--save-every", "0",
                 "--timeout", "120", "--out", str(mine)], out / f"{name}.train.log",
                timeout + 30)
    if code:
        return name, f"paraloom train failed (exit {code}, {name}.train.log)", time.time() - tic
    verdicts = []
    for step in ("2", "1"):
        code, text = _diff(meg, mine, step)
        (out / f"{name}.diff{step}.txt").write_text(text)
        if code:
            first = next((ln.strip() for ln in text.splitlines() if "different (" in ln), "")
            verdicts.append(f"step {step} DIFFERENT ({first})")
    return name, "; ".join(verdicts) or "equal (steps 2 and 1)", time.time() - tic


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated layout names (default: all)")
    ap.add_argument("--list", action="store_true", help="print the layouts and exit")
    ap.add_argument("--jobs", type=int, default=2, help="layouts at a time (default 2)")
    ap.add_argument("--out", help="keep the run folders and logs here")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    args = ap.parse_args(argv)
    if args.list:
        for name, (world, ex, ours) in LAYOUTS.items():
            print(f"{name:34s} {world} ranks | example: {ex} | train: {ours}")
        return 0
    names = args.only.split(",") if args.only else list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        print(f"unknown layout(s) {unknown}; --list shows them", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="megatron-sweep-"))
    out.mkdir(parents=True, exist_ok=True)
    equal = 0
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for name, verdict, seconds in pool.map(lambda n: one(n, out, args.timeout), names):
            equal += verdict.startswith("equal")
            print(f"{name:34s} {verdict}  [{seconds:.0f} s]", flush=True)
    print(f"total: {equal} of {len(names)} layouts equal")
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)
    return 0 if equal == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
