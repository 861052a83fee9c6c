"""Predicted vs measured step time of ``paraloom train`` on this machine, layout by layout.

For each round and each layout: calibrate this machine with the layout's world size
(:func:`paraloom.measure.calibrate.calibrate`: GEMM rate, element-wise rate, op overhead, gloo
alpha/beta, all ranks measuring at once), train the layout for a few steps and take the
median step time (the first ``--skip`` steps are warm-up and ledger recording), calibrate
again, and predict with each calibration (the mean of the two). Calibration and measurement
sit next to each other in time because the machine is shared: its load moves both.
The figures per layout are the medians over rounds; the error is the median over rounds of the
paired ratio predicted / measured - 1 (a round's prediction and measurement share its load).

    PYTHONPATH=. python benchmarks/plan_predict.py --rounds 3 --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["--layers", "4", "--hidden", "256", "--heads", "8", "--seq-len", "128",
         "--vocab", "256", "--global-batch-size", "16"]
LAYOUTS = {  # two ranks, one intra-op thread each (what train gives 2 ranks on 2 cores)
    "tp2 mb4": ["--tp", "2", "--pp", "1", "--dp", "1", "--micro-batch-size", "4"],
    "tp2 sp mb4": ["--tp", "2", "--pp", "1", "--dp", "1", "--micro-batch-size", "4",
                   "--sequence-parallel"],
    "tp2 mb4 full recompute": ["--tp", "2", "--pp", "1", "--dp", "1", "--micro-batch-size",
                               "4", "--recompute", "full"],
    "dp2 mb4": ["--tp", "1", "--pp", "1", "--dp", "2", "--micro-batch-size", "4"],
    "dp2 mb2 zero": ["--tp", "1", "--pp", "1", "--dp", "2", "--micro-batch-size", "2",
                     "--distributed-optimizer"],
    "pp2 mb2": ["--tp", "1", "--pp", "2", "--dp", "1", "--micro-batch-size", "2"],
    "pp2 vpp2 mb2": ["--tp", "1", "--pp", "2", "--dp", "1", "--vpp", "2",
                     "--micro-batch-size", "2"],
    # one rank gets two intra-op threads: on a loaded 2-core machine a stolen core stalls every
    # parallel region, so this one is the noisiest
    "tp1 mb4 (1 rank)": ["--tp", "1", "--pp", "1", "--dp", "1", "--micro-batch-size", "4"],
}


def _world(flags: list[str]) -> int:
    get = lambda name: int(flags[flags.index(name) + 1])
    return get("--tp") * get("--pp") * get("--dp")


def measure(flags: list[str], steps: int, skip: int) -> tuple[float, dict]:
    """Median step time of a real run, and its config.json."""
    with tempfile.TemporaryDirectory(prefix="plan-predict-") as out:
        cmd = [sys.executable, "-m", "paraloom", "train", *MODEL, *flags, "--steps",
               str(steps), "--ledger-steps", "1", "--save-every", "0", "--out", out]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
        lines = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()]
        cfg = json.loads(Path(out, "config.json").read_text())
    return statistics.median(x["time_s"] for x in lines[skip:]), cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None, help="layout names to run")
    ap.add_argument("--save", default=None, help="write the raw measurements (JSON) here")
    ap.add_argument("--replay", default=None,
                    help="predict again from saved measurements (no runs): the model changed")
    a = ap.parse_args()
    from paraloom.measure.calibrate import calibrate, fit_hardware, predict_run

    names = a.only or list(LAYOUTS)
    raw = json.loads(Path(a.replay).read_text()) if a.replay else []
    if a.replay:
        names = list(dict.fromkeys(x["name"] for x in raw))
    got: dict[str, dict[str, list]] = {n: {"measured": [], "predicted": []} for n in names}
    todo = raw if a.replay else [(r, name) for r in range(a.rounds) for name in names]
    for item in todo:
        if a.replay:
            r, name, measured, cfg = item["round"], item["name"], item["measured"], item["cfg"]
            world = _world(LAYOUTS[name])
            before, after = (fit_hardware(world, item[k]) for k in ("before", "after"))
        else:
            r, name = item
            flags = LAYOUTS[name]
            before, med_before = calibrate(_world(flags), repeat=5)
            measured, cfg = measure(flags, a.steps, a.skip)
            after, med_after = calibrate(_world(flags), repeat=5)
            raw.append({"round": r, "name": name, "measured": measured, "cfg": cfg,
                        "before": med_before, "after": med_after})
            if a.save:
                Path(a.save).write_text(json.dumps(raw))
        both = [predict_run(cfg, hw) for hw in (before, after)]
        predicted = statistics.mean(x["step_time_s"] for x in both)
        hw = before
        parts = {k: round(statistics.mean(x["breakdown_s"][k] for x in both), 3)
                 for k in both[0]["breakdown_s"] if both[0]["breakdown_s"][k] > 0}
        got[name]["measured"].append(measured)
        got[name]["predicted"].append(predicted)
        print(f"round {r} {name:<32} measured {measured:7.3f} s  predicted "
              f"{predicted:7.3f} s  (GEMM {hw.peak_flops / 1e9:.0f} GFLOP/s, gloo alpha "
              f"{hw.intra_latency * 1e6:.0f} us, beta {hw.intra_bw / 1e9:.2f} GB/s) {parts}",
              flush=True)
    print(f"\n{'layout':<32} {'measured s':>10} {'predicted s':>11} {'error':>7}  per round")
    within = 0
    for name in names:
        m = statistics.median(got[name]["measured"])
        p = statistics.median(got[name]["predicted"])
        ratios = [q / x for q, x in zip(got[name]["predicted"], got[name]["measured"],
                                        strict=True)]
        error = statistics.median(ratios) - 1  # median of the paired (same-round) ratios
        within += abs(error) <= 0.25
        print(f"{name:<32} {m:>10.3f} {p:>11.3f} {error:>+7.1%}  "
              + " ".join(f"{r - 1:+.0%}" for r in ratios))
    print(f"{within} of {len(names)} layouts within 25% (error: median over rounds of "
          f"predicted / measured - 1, both taken next to each other)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
