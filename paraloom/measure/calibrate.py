"""Describe *this* machine as hardware, by measuring it (``paraloom plan --calibrate``).

``R`` local gloo ranks (``--nprocs``, with the intra-op threads ``paraloom train`` gives them:
cores / R)
measure at the same time — so the numbers include what the ranks take from each other on shared
cores — and the medians over ranks and repeats give:

* ``peak_flops`` and ``gemm_half_dim``: fp32 GEMMs of ``(d, d, d)`` for several ``d``, fitted by
  ``t = 2 d^3 / (peak * (d/(d+d0))^2)`` (``gemm_efficiency`` = 1: the peak *is* the measurement);
* ``hbm_bw``: an element-wise add of 4M floats (12 bytes an element through memory);
* ``op_overhead``: the fixed cost of one tiny autograd op, forward and backward;
* ``intra_latency`` / ``intra_bw``: all-reduces of 1 to 1M floats through ``paraloom.comm``
  (gloo over loopback), fitted by least squares to ``2(R-1)(alpha + B/(R beta))``;
  ``inter_*`` are set equal (one machine); ``gather_factor``: a 1M-float all-gather and
  reduce-scatter against the ring time of their bytes (gloo's take about twice an all-reduce);
  ``overlap_efficiency`` 0: gloo's communication thread takes the cores compute needs, so
  nothing the schedule overlaps is taken as hidden.

The result is a :class:`~paraloom.analysis.hardware.Hardware` with ``gpus_per_node = R``, written
as TOML for ``paraloom plan --hardware FILE``; it describes runs of ``R`` ranks (measure again for
another world size: shared cores make the per-rank rate depend on it)::

    paraloom plan --calibrate --nprocs 2 --out local2.toml
    paraloom plan --hardware local2.toml --layers 4 --hidden 256 --heads 8 --seq-len 128 \\
        --global-batch-size 16 --micro-batch-size 4 --tp 2 --dtype fp32
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import comm
from ..analysis.costs import Options, collective_time, elementwise_bytes
from ..analysis.hardware import Hardware
from ..analysis.steptime import step_time
from ..config import ParallelConfig
from ..launch import local_threads, spawn
from ..mesh import ParallelMesh
from ..verify.check import config_from_run

__all__ = ["measure_rank", "calibrate", "fit_hardware", "to_toml", "predict_run"]

GEMM_SHAPES = ((512, 64, 256), (512, 256, 64), (512, 256, 256), (512, 768, 256),
               (512, 1024, 256), (512, 256, 1024), (128, 512, 512), (1024, 1024, 1024))
ELEM_TOKENS, ELEM_WIDTH, ELEM_SEQ, ELEM_PROBS = 512, 256, 128, 4 * 8 * 128 * 128
ELEM_BYTES = 3 * elementwise_bytes(ELEM_TOKENS, ELEM_TOKENS, ELEM_WIDTH, 4 * ELEM_WIDTH, 1,
                                   ELEM_PROBS, 4)
"""fp32 bytes the step-time model counts for the element-wise kernels of that reference layer,
forward and backward (:func:`paraloom.analysis.costs.elementwise_bytes`, times 3); calibrating
``hbm_bw`` against them makes it the machine's effective rate for exactly that mix."""
AR_ELEMS = (1, 4096, 65536, 1 << 20)


def _best(fn, repeat: int, window: float = 0.03, loops: int | None = None) -> float:
    """Median seconds of one ``fn`` call over ``repeat`` timed windows of at least ``window``
    seconds each (one warm-up): on shared cores a long window averages the stalls a training
    step sees too, where single short calls are all-or-nothing. Collectives pass ``loops``:
    every rank must run the same number."""
    tic = time.perf_counter()
    fn()
    loops = loops or max(1, int(window / max(time.perf_counter() - tic, 1e-6)))
    times = []
    for _ in range(repeat):
        tic = time.perf_counter()
        for _ in range(loops):
            fn()
        times.append((time.perf_counter() - tic) / loops)
    return statistics.median(times)


def _gemm_time(m: int, n: int, k: int, repeat: int) -> float:
    """Seconds of one ``(m, n, k)`` GEMM, averaged over the three ways a linear runs it:
    forward ``x W^T``, dgrad ``g W`` and wgrad ``g^T x``."""

    x, wt, g = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)

    def run():
        x @ wt.t()
        g @ wt
        g.t() @ x
    return _best(run, repeat) / 3


def _elementwise_time(repeat: int) -> float:
    """Seconds of the element-wise kernels of one reference layer, forward and backward
    (``T`` tokens, width ``h``, MLP ``4h``, ``probs`` attention scores; the GEMMs left out):
    two LayerNorms, the q/k/v head permutes, scale + causal mask + softmax, bias + tanh-GeLU,
    two residual adds — the mix the step-time model counts in bytes."""

    t, h = ELEM_TOKENS, ELEM_WIDTH
    heads = ELEM_PROBS // (ELEM_SEQ * ELEM_SEQ * (t // ELEM_SEQ))
    x = torch.randn(t, h, requires_grad=True)
    qkv = torch.randn(ELEM_SEQ, t // ELEM_SEQ, 3 * h, requires_grad=True)
    scores = torch.randn(t // ELEM_SEQ, heads, ELEM_SEQ, ELEM_SEQ, requires_grad=True)
    fc1 = torch.randn(t, 4 * h, requires_grad=True)
    bias = torch.randn(4 * h, requires_grad=True)
    mask = torch.ones(ELEM_SEQ, ELEM_SEQ, dtype=torch.bool).triu(1)

    def run():
        y = F.layer_norm(x, (h,)) + F.layer_norm(x, (h,))
        q, k, v = qkv.view(ELEM_SEQ, t // ELEM_SEQ, heads, -1).permute(1, 2, 0, 3) \
            .contiguous().chunk(3, -1)
        probs = (scores / 8.0).masked_fill(mask, float("-inf")).softmax(-1)
        act = F.gelu(fc1 + bias, approximate="tanh")
        out = (x + y).sum() + probs.sum() + act.sum() + (q.sum() + k.sum() + v.sum())
        out.backward()
    return _best(run, repeat)


def _allreduce_time(t, axis, repeat: int) -> float:
    """An all-reduce's cost as training sees it: each one follows ~1 ms of compute, so the
    ranks arrive as unevenly as a shared machine makes them (their wait is in the figure); the
    compute alone, timed the same way, is subtracted."""
    a = torch.randn(192, 192)
    loops = max(2, min(40, (1 << 20) // t.numel()))

    def work():
        for _ in range(4):
            a @ a

    def both():
        work()
        comm.all_reduce(t, axis, phase="setup", kind="world", site="calibrate")
    comm.barrier(axis)
    alone = _best(work, repeat, loops=loops)
    comm.barrier(axis)
    return max(_best(both, repeat, loops=loops) - alone, 1e-7)


def measure_rank(rank: int, world: int, out: str, repeat: int = 7) -> None:
    """One rank's measurements (all ranks at once), written as JSON to ``out``/rank.json."""
    mesh = ParallelMesh(ParallelConfig(dp=world))
    axis = mesh.world
    comm.barrier(axis)
    gemm = {f"{m},{n},{k}": _gemm_time(m, n, k, repeat) for m, n, k in GEMM_SHAPES}
    add = _elementwise_time(repeat)
    w = torch.randn(1, requires_grad=True)

    def tiny():
        z = w
        for _ in range(16):
            z = z * 1.0001
        z.sum().backward()
    op = _best(tiny, repeat) / (3 * 17)
    comm.barrier(axis)
    allreduce = {n: _allreduce_time(torch.ones(n), axis, repeat) for n in AR_ELEMS}
    big = torch.ones(AR_ELEMS[-1])
    gather = statistics.median([
        _best(lambda: comm.all_gather(big[: big.numel() // world], axis, phase="setup",
                                      kind="world", site="calibrate"), repeat, loops=4),
        _best(lambda: comm.reduce_scatter(big, axis, phase="setup", kind="world",
                                          site="calibrate"), repeat, loops=4)])
    Path(out, f"{rank}.json").write_text(json.dumps(
        {"gemm": gemm, "add": add, "op": op, "allreduce": allreduce, "gather": gather}))


def _fit_gemm(gemm: dict[str, float]) -> tuple[float, float]:
    """``(peak, d0)``: the half-dimension whose implied peaks agree best, and their median
    (``t = 2 m n k / (peak * m/(m+d0) * n/(n+d0))``, as the step-time model times a GEMM)."""
    best = (float("inf"), 0.0, 0.0)
    shapes = [(tuple(map(int, key.split(","))), t) for key, t in gemm.items()]
    for d0 in range(0, 129, 8):  # wider fits chase noise on a shared machine
        peaks = [2 * m * n * k / (t * m / (m + d0) * n / (n + d0)) for (m, n, k), t in shapes]
        mid = statistics.median(peaks)
        spread = sum(abs(p / mid - 1) for p in peaks)
        if spread < best[0]:
            best = (spread, mid, float(max(d0, 1)))
    return best[1], best[2]


def _fit_alpha_beta(world: int, allreduce: dict[int, float]) -> tuple[float, float]:
    """Least squares of ``t = 2(R-1) alpha + 2(R-1)/R * B / beta`` over the sizes."""
    xs = [2 * (world - 1) / world * 4 * n for n in allreduce]
    ts = list(allreduce.values())
    k = 2 * (world - 1)
    mx, mt = statistics.mean(xs), statistics.mean(ts)
    cov = sum((x - mx) * (t - mt) for x, t in zip(xs, ts, strict=True))
    slope = cov / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-12)
    alpha = max((mt - slope * mx) / k, 1e-7)
    return alpha, 1.0 / slope


def calibrate(nprocs: int = 2, repeat: int = 7) -> tuple[Hardware, dict]:
    """Measure with ``nprocs`` ranks; the hardware and the medians it was fitted from."""
    threads = local_threads(nprocs)  # as ``paraloom train`` gives its ranks
    with tempfile.TemporaryDirectory(prefix="paraloom-calibrate-") as out:
        spawn(measure_rank, nprocs, out, repeat, threads=threads)
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(nprocs)]
    med = {"gemm": {key: statistics.median(r["gemm"][key] for r in ranks)
                    for key in ranks[0]["gemm"]},
           "add": statistics.median(r["add"] for r in ranks),
           "op": statistics.median(r["op"] for r in ranks),
           "gather": statistics.median(r["gather"] for r in ranks),
           "allreduce": {int(n): statistics.median(r["allreduce"][str(n)] for r in ranks)
                         for n in map(str, AR_ELEMS)}}
    return fit_hardware(nprocs, med), med


def fit_hardware(nprocs: int, med: dict) -> Hardware:
    """The hardware that the medians of :func:`calibrate` describe (also from saved ones)."""
    peak, d0 = _fit_gemm(med["gemm"])
    allreduce = {int(n): t for n, t in med["allreduce"].items()}
    alpha, beta = (1e-5, 1e9) if nprocs == 1 else _fit_alpha_beta(nprocs, allreduce)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / nprocs
    except (ValueError, OSError):
        memory = 8e9
    hw = Hardware(name=f"this machine ({nprocs} gloo ranks)", peak_flops=peak,
                  hbm_bytes=float(memory), hbm_bw=ELEM_BYTES / med["add"],
                  gpus_per_node=nprocs, intra_bw=beta, intra_latency=alpha, inter_bw=beta,
                  inter_latency=alpha, gemm_efficiency=1.0, gemm_half_dim=d0,
                  link_efficiency=1.0, mem_efficiency=1.0, op_overhead=med["op"],
                  overlap_efficiency=0.0)
    if nprocs > 1:  # gloo's all-gather / reduce-scatter against the ring time of the same bytes
        ring = collective_time("all_gather", nprocs, 4 * AR_ELEMS[-1], hw, False)
        hw = replace(hw, gather_factor=max(1.0, med["gather"] / ring))
    return hw


def predict_run(cfg: dict, hw: Hardware) -> dict:
    """The step-time prediction for a ``paraloom train`` run from its ``config.json``, with
    paraloom's own switches: async tp all-reduce (its default: tp > 1 without sp), p2p posted
    ahead (gloo's default), a whole re-run under recomputation (as Megatron's),
    gradient-accumulation fusion as configured (off by default)."""
    c = config_from_run(cfg)
    p = cfg["parallel"]
    async_tp = p.get("async_grad_allreduce")
    overlap_p2p = cfg.get("overlap_p2p_comm")
    o = Options(async_tp=(c.tp > 1 and not c.sp) if async_tp is None else bool(async_tp),
                overlap_p2p=True if overlap_p2p is None else bool(overlap_p2p),
                early_stop=False, recompute_comm=1.0,
                grad_accum_fusion=bool(p.get("gradient_accumulation_fusion", False)))
    return step_time(c, hw, o)


def to_toml(hw: Hardware) -> str:
    """The hardware as a ``--hardware`` file."""
    lines = []
    for key, value in hw.to_dict().items():
        lines.append(f"{key} = " + (json.dumps(value) if isinstance(value, str) else repr(value)))
    return "\n".join(lines) + "\n"
