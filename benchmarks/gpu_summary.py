"""Throughput and MFU of a finished ``paraloom train`` run, for ``benchmarks/gpu.sh``.

Reads the run folder (``config.json``, ``metrics.jsonl``, ``summary.json``) and prints:

* tokens/s: the global batch's tokens over the median step time after ``--warmup`` steps;
* model TFLOP/s per GPU and MFU: model FLOPs per step (``paraloom.analysis.flops.model_flops``,
  the count ``paraloom plan`` and ``check`` use; no recomputation) over the step time, the number
  of GPUs and the GPU's dense bf16 peak (``paraloom.analysis.hardware``: from the device name, or
  ``--peak-tflops``);
* the held-out loss before and after training.

It exits 1 when the run is not sound: a step skipped (NaN/Inf), a non-finite or non-decreasing
held-out loss, fewer timed steps than asked for.

    python benchmarks/gpu_summary.py runs/gpu --gpus 8 --device-name "NVIDIA H200" --warmup 5
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from paraloom.analysis.flops import model_flops
from paraloom.analysis.hardware import GPUS
from paraloom.verify.check import config_from_run

# device name fragment -> hardware preset (checked in order: "H100 PCIe" before "H100")
_NAMES = (("H200", "h200"), ("H100 PCIe", None), ("H100", "h100-sxm"), ("B200", "b200"),
          ("A100-SXM4-40GB", "a100-40gb"), ("A100-PCIE-40GB", "a100-40gb"), ("A100", "a100-80gb"))


def peak_of(device_name: str) -> tuple[str | None, float | None]:
    """``(preset, peak dense 16-bit FLOP/s)`` for a CUDA device name, or ``(None, None)``."""
    for fragment, preset in _NAMES:
        if fragment.lower() in device_name.lower():
            if preset is None:
                return None, None
            return preset, GPUS[preset].peak_flops
    return None, None


def summarize(run: Path, gpus: int, device_name: str, warmup: int,
              peak_tflops: float | None) -> tuple[list[str], list[str]]:
    """``(lines to print, problems)`` for the run folder ``run``."""
    cfg = json.loads((run / "config.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    summary = json.loads((run / "summary.json").read_text())
    problems = []
    skipped = [m["step"] for m in metrics if m.get("skipped")]
    if skipped:
        problems.append(f"steps {skipped} were skipped (non-finite loss or gradient norm)")
    timed = [m["time_s"] for m in metrics[warmup:]]
    if len(timed) < 3:
        problems.append(f"only {len(timed)} steps after {warmup} warm-up steps; need >= 3")
        return [], problems
    step_s = statistics.median(timed)
    tokens = cfg["global_batch_size"] * cfg["model"]["seq_length"]
    flops = model_flops(config_from_run(cfg))
    preset, peak = peak_of(device_name)
    if peak_tflops:
        preset, peak = "--peak-tflops", peak_tflops * 1e12
    p, m = cfg["parallel"], cfg["model"]
    peak_text = "unknown" if peak is None else f"{peak / 1e12:.0f}"
    lines = [
        f"device: {gpus} x {device_name} (peak {peak_text} TFLOP/s dense bf16"
        f"{f', {preset}' if preset else ''})",
        f"model: {m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_attention_heads']} "
        f"heads, seq {m['seq_length']}, attention {m.get('attention', 'core')}, {cfg['dtype']}; "
        f"layout tp={p['tp']} pp={p['pp']} dp={p['dp']} cp={p.get('cp', 1)}, micro batch "
        f"{cfg['micro_batch_size']}, global batch {cfg['global_batch_size']}",
        f"step time: median {step_s * 1e3:.1f} ms over {len(timed)} steps (after {warmup} "
        f"warm-up), min {min(timed) * 1e3:.1f}, max {max(timed) * 1e3:.1f}",
        f"tokens/s: {tokens / step_s:,.0f} ({tokens / step_s / gpus:,.0f} per GPU)",
        f"model FLOPs/step: {flops:.4g}; per GPU {flops / step_s / gpus / 1e12:.3g} TFLOP/s",
    ]
    if peak is not None:
        lines.append(f"MFU: {flops / step_s / gpus / peak:.1%}")
    else:
        lines.append("MFU: n/a (unknown device; pass --peak-tflops)")
    before = summary.get("held_out_loss_before")
    after = summary.get("held_out_loss_after")
    lines.append(f"held-out loss: {before:.4f} -> {after:.4f}")
    if not (math.isfinite(before) and math.isfinite(after) and after < before):
        problems.append(f"held-out loss did not decrease: {before} -> {after}")
    return lines, problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--device-name", required=True)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="dense bf16 peak per device (default: from the device name)")
    a = ap.parse_args(argv)
    lines, problems = summarize(a.run, a.gpus, a.device_name, a.warmup, a.peak_tflops)
    print("\n".join(lines))
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
