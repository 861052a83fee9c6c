"""``paraloom plan --calibrate [--nprocs R] [--out FILE.toml]``: measure this machine as plan
hardware (:mod:`paraloom.measure.calibrate`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..measure.calibrate import calibrate, to_toml

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="paraloom plan --calibrate",
                                 description="measure this machine as plan hardware")
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--nprocs", type=int, default=2,
                    help="ranks measuring at once: the world size you will train with")
    ap.add_argument("--repeat", type=int, default=7, help="timed repeats (medians)")
    ap.add_argument("--out", default=None, help="write the hardware as TOML here")
    a = ap.parse_args(argv)
    if a.nprocs < 1 or a.repeat < 1:
        print(f"paraloom plan: error: --nprocs and --repeat must be >= 1, got {a.nprocs} and "
              f"{a.repeat}", file=sys.stderr)
        return 2
    hw, _ = calibrate(a.nprocs, a.repeat)
    text = to_toml(hw)
    print(f"GEMM peak {hw.peak_flops / 1e9:.1f} GFLOP/s per rank (half-efficiency dimension "
          f"{hw.gemm_half_dim:.0f}), memory {hw.hbm_bw / 1e9:.1f} GB/s, op overhead "
          f"{hw.op_overhead * 1e6:.1f} us, gloo alpha {hw.intra_latency * 1e6:.0f} us, "
          f"beta {hw.intra_bw / 1e9:.2f} GB/s ({a.nprocs} ranks)")
    if a.out:
        Path(a.out).write_text(text)
        print(f"wrote {a.out} (paraloom plan --hardware {a.out} ...)")
    else:
        print(text, end="")
    return 0
