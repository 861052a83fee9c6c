"""The step-time model against published Megatron throughput, and the fit of what hardware
descriptions cannot know.

Rows (all GPT, ``s = 2048``, ``V = 51200``, A100 80GB SXM in DGX A100 nodes: 8 GPUs, NVSwitch,
8 x 200 Gb/s HDR InfiniBand):

* ``narayanan-*``: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC'21, Table 1 (weak scaling, 1.7B to 1T parameters) — achieved
  TFLOP/s per GPU counted with their eq. (3), i.e. with full recomputation; fp16 with the
  gradients all-reduced in fp16 (Megatron-LM's default then) after backward (no overlap);
  scatter/gather of the inter-node p2p tensors. Not in the table, assumed here: micro batch 1 and
  the plain 1F1B schedule (no interleaving).
* ``korthikanti-*``: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models", MLSys 2023, Table 3 configurations and the model FLOPs utilisation they report (also in
  Megatron-LM's README: 22B 41.5%, 175B 51.4%, 530B 56.0%, 1T 56.3%): sequence parallelism +
  selective recomputation, data-parallel size 1, micro batch 1.

Calibrated (only these three numbers of :class:`~paraloom.analysis.hardware.Hardware`):
``gemm_efficiency``, ``gemm_half_dim`` (the GEMM efficiency curve) and ``link_efficiency``
(achievable share of NVLink / InfiniBand bandwidth), by :func:`fit` on the rows in
:data:`CALIBRATION_ROWS`; every other row is a prediction. The a100-80gb preset carries the fitted
values, and the other presets reuse them (no published rows of the same kind for them here).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

from ..analysis.formulas import CommConfig
from ..analysis.hardware import GPUS, Hardware
from ..analysis.steptime import Options, step_time

__all__ = ["Row", "ROWS", "CALIBRATION_ROWS", "predict_row", "validate", "fit",
           "explain_row", "summary"]


@dataclass(frozen=True)
class Row:
    """One published run: the layout and the figure it achieved."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    published: float
    """Narayanan: TFLOP/s per GPU (eq. (3)); Korthikanti: MFU in percent."""
    source: str


_N = "Narayanan et al. SC'21 Table 1"
_K = "Korthikanti et al. 2022 (MFU; Megatron-LM README)"
ROWS = (
    Row("narayanan-1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, _N),
    Row("narayanan-3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, _N),
    Row("narayanan-7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, _N),
    Row("narayanan-18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, _N),
    Row("narayanan-39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, _N),
    Row("narayanan-76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, _N),
    Row("narayanan-145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, _N),
    Row("narayanan-310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, _N),
    Row("narayanan-529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, _N),
    Row("narayanan-1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, _N),
    Row("korthikanti-22B", 64, 6144, 48, 8, 1, 8, 4, 41.5, _K),
    Row("korthikanti-175B", 96, 12288, 96, 8, 8, 64, 64, 51.4, _K),
    Row("korthikanti-530B", 128, 20480, 105, 8, 35, 280, 280, 56.0, _K),
    Row("korthikanti-1T", 160, 25600, 128, 8, 64, 512, 512, 56.3, _K),
)
CALIBRATION_ROWS = ("narayanan-1.7B", "narayanan-18.4B", "narayanan-1008.0B",
                    "korthikanti-175B")
"""The rows :func:`fit` sees; the other ten are predictions."""


def _layout(row: Row) -> tuple[CommConfig, Options]:
    dp = row.gpus // (row.tp * row.pp)
    common = dict(layers=row.layers, hidden=row.hidden, heads=row.heads, seq_len=2048,
                  vocab=51200, tp=row.tp, pp=row.pp, dp=dp, micro_batch=1,
                  num_microbatches=row.batch // dp, dtype_bytes=2, buckets=(1,))
    if row.name.startswith("narayanan"):
        return (CommConfig(recompute="full", overlap_grad_reduce=False, grad_bytes=2, **common),
                Options(early_stop=False, recompute_comm=1.0, p2p_scatter_gather=True))
    return (CommConfig(recompute="selective", sequence_parallel=True, **common),
            Options(early_stop=False, recompute_comm=1.0))


def _figure(row: Row, r: dict) -> float:
    """A step-time prediction ``r`` as the row's figure (its unit)."""
    if row.name.startswith("narayanan"):
        return r["hardware_tflops_per_gpu"]
    return 100 * r["mfu"]


def predict_row(row: Row, hw: Hardware) -> float:
    """The model's figure for a row, in the row's unit."""
    config, options = _layout(row)
    return _figure(row, step_time(config, hw, options))


def explain_row(name: str, hw: Hardware | None = None) -> dict:
    """One row's prediction next to its publication: the layout, both figures, the step time
    the published figure implies (the figure is work over time, the work the model's), the gap,
    and per part of the predicted step the factor it alone would need to close the gap."""
    rows = {r.name: r for r in ROWS}
    if name not in rows:
        raise ValueError(f"no published row {name!r}; the rows: {', '.join(rows)}")
    row, hw = rows[name], hw or GPUS["a100-80gb"]
    config, options = _layout(row)
    r = step_time(config, hw, options)
    predicted = _figure(row, r)
    total = r["step_time_s"]
    published_s = total * predicted / row.published
    gap = total - published_s  # negative: the model is too fast
    parts = [{"part": k, "seconds": v, "share": v / total, "alone": (v - gap) / v}
             for k, v in r["breakdown_s"].items() if v > 0]
    return {"row": row.name, "source": row.source, "calibration": name in CALIBRATION_ROWS,
            "unit": "TFLOP/s per GPU" if row.name.startswith("narayanan") else "MFU %",
            "layout": {"layers": row.layers, "hidden": row.hidden, "heads": row.heads,
                       "seq_len": 2048, "vocab": 51200, "tp": row.tp, "pp": row.pp,
                       "dp": config.dp, "gpus": row.gpus, "global_batch": row.batch,
                       "microbatches": config.num_microbatches, "micro_batch": 1,
                       "recompute": config.recompute,
                       "sequence_parallel": config.sequence_parallel,
                       "overlap_grad_reduce": config.overlap_grad_reduce},
            "hardware": hw.name, "published": row.published, "predicted": predicted,
            "error": predicted / row.published - 1, "published_step_s": published_s,
            "predicted_step_s": total, "gap_s": gap, "parts": parts}


def summary(rows: list[dict]) -> dict:
    """Mean and worst relative error of :func:`validate`'s rows not used for calibration."""
    held = [r for r in rows if not r["calibration"]]
    worst = max(held, key=lambda r: abs(r["error"]))
    return {"rows": len(held), "mean_abs_error": sum(abs(r["error"]) for r in held) / len(held),
            "worst_abs_error": abs(worst["error"]), "worst_row": worst["row"]}


def validate(hw: Hardware | None = None) -> list[dict]:
    """Predicted vs published, per row, with the relative error and whether it was fitted."""
    hw = hw or GPUS["a100-80gb"]
    out = []
    for row in ROWS:
        pred = predict_row(row, hw)
        out.append({"row": row.name, "source": row.source, "published": row.published,
                    "predicted": pred, "error": pred / row.published - 1,
                    "calibration": row.name in CALIBRATION_ROWS})
    return out


def fit(hw: Hardware | None = None) -> tuple[Hardware, float]:
    """Grid search of (gemm_efficiency, gemm_half_dim, link_efficiency) minimising the largest
    relative error on :data:`CALIBRATION_ROWS`; returns the fitted hardware and that error."""
    hw = hw or GPUS["a100-80gb"]
    rows = [r for r in ROWS if r.name in CALIBRATION_ROWS]
    best = (float("inf"), hw)
    for eff, d0, link in product([x / 100 for x in range(70, 91)], (32, 64, 96, 128, 192),
                                 [x / 20 for x in range(10, 19)]):
        cand = replace(hw, gemm_efficiency=eff, gemm_half_dim=float(d0), link_efficiency=link)
        worst = max(abs(predict_row(r, cand) / r.published - 1) for r in rows)
        if worst < best[0] - 1e-12:
            best = (worst, cand)
    return best[1], best[0]
