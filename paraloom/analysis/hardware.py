"""Hardware descriptions for ``paraloom plan``: what a GPU computes and how its links carry bytes.

A :class:`Hardware` is one GPU type in one kind of node: peak dense 16-bit tensor FLOP/s, HBM
capacity and bandwidth, GPUs per node, and two links — inside a node (NVLink / NVSwitch) and
between nodes (InfiniBand, one NIC per GPU on the DGX-class systems) — each an alpha-beta pair:
``alpha`` seconds of latency per message step, ``beta`` bytes/s one GPU can push in each
direction. The data-sheet numbers are peaks; what the step-time model uses is peak times the
*achievable* fractions below (``gemm_efficiency``, ``link_efficiency``), the only numbers fitted
to published runs (see :mod:`paraloom.verify.validation`).

Data-sheet sources (dense BF16 tensor FLOP/s; the sheets print the sparse figure as well, twice
as large; NVLink figures there are bidirectional totals, halved here per direction):

* A100 80GB SXM: 312 TFLOP/s, 80 GB HBM2e at 2,039 GB/s, NVLink 3 600 GB/s (NVIDIA A100 Tensor
  Core GPU data sheet); DGX A100: 8 x 200 Gb/s HDR InfiniBand compute NICs (DGX A100 data sheet).
  A100 40GB: 40 GB at 1,555 GB/s.
* H100 SXM5: 989 TFLOP/s, 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s (NVIDIA H100 Tensor Core
  GPU data sheet); DGX H100: 8 x 400 Gb/s NDR ConnectX-7 (DGX H100 data sheet).
* H200 SXM: 989 TFLOP/s, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s (NVIDIA H200 data sheet);
  DGX H200: 8 x 400 Gb/s.
* B200 (HGX/DGX B200): 2.25 PFLOP/s dense (4.5 sparse), 180 GB HBM3e at 8 TB/s per GPU
  (DGX B200: 1,440 GB total), NVLink 5 1.8 TB/s; DGX B200: 8 x 400 Gb/s ConnectX-7.

Latencies are typical NCCL figures, not data-sheet values: a few microseconds per hop inside a
node, about ten across InfiniBand. Everything can be overridden by flags or a TOML file::

    # my-cluster.toml  (paraloom plan --hardware my-cluster.toml)
    gpu = "h100-sxm"            # start from a preset (optional)
    gpus_per_node = 8
    peak_flops = 989e12
    inter_bw = 50e9             # bytes/s per GPU per direction
    inter_latency = 10e-6
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

import tomllib

__all__ = ["Hardware", "GPUS", "FLAGS", "hardware_from"]


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One GPU type in one node type; rates per GPU."""

    name: str
    peak_flops: float
    """Peak dense 16-bit tensor FLOP/s (BF16/FP16, no sparsity)."""
    hbm_bytes: float
    """Memory capacity per GPU (bytes)."""
    hbm_bw: float
    """Memory bandwidth (bytes/s): the bound of the element-wise kernels and the optimizer."""
    gpus_per_node: int = 8
    intra_bw: float
    """Bytes/s per GPU per direction inside a node (NVLink / NVSwitch)."""
    intra_latency: float = 5e-6
    inter_bw: float
    """Bytes/s per GPU per direction between nodes (one InfiniBand NIC per GPU)."""
    inter_latency: float = 10e-6
    gemm_efficiency: float = 0.85
    """Best fraction of ``peak_flops`` a large GEMM reaches (fitted, see validation)."""
    gemm_half_dim: float = 192.0
    """A GEMM dimension ``d`` costs a factor ``d / (d + gemm_half_dim)`` of efficiency: small
    hidden-per-tp or few tokens make small, inefficient GEMMs (fitted)."""
    link_efficiency: float = 0.90
    """Achievable fraction of a link's bandwidth in NCCL collectives (fitted)."""
    mem_efficiency: float = 0.70
    """Achievable fraction of ``hbm_bw`` for element-wise kernels and the optimizer."""
    overlap_efficiency: float = 1.0
    """Fraction of the communication the schedule hides (async dgrad, sp overlap, dp buckets
    under backward, posted p2p) that really hides: 1 where the network works beside the SMs;
    0 for gloo on a CPU, whose communication thread competes with compute for the cores."""
    gather_factor: float = 1.0
    """All-gather and reduce-scatter take this times the ring algorithm's time (1 for NCCL;
    gloo's are not bandwidth-optimal: measured by ``--calibrate``)."""
    op_overhead: float = 0.0
    """Seconds of fixed cost per kernel (launch, Python dispatch): negligible on GPUs at scale,
    what dominates tiny models on a CPU (measured by ``paraloom plan --calibrate``)."""
    cores: int = 0
    """CPU only: cores the ranks of one machine share (0: each rank has its own device)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "name":
                continue
            flag = f"hardware {f.name} (--{f.name.replace('_', '-')})"
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value):
                raise ValueError(f"{flag} must be a finite number, got {value!r}")
            if f.name in ("op_overhead", "cores", "overlap_efficiency"):
                if value < 0:
                    raise ValueError(f"{flag} must be >= 0, got {value!r}")
            elif value <= 0:
                raise ValueError(f"{flag} must be a positive number, got {value!r}")
        if not 0 <= self.overlap_efficiency <= 1:
            raise ValueError(f"hardware overlap_efficiency is a fraction in [0, 1], got "
                             f"{self.overlap_efficiency}")
        for name in ("gemm_efficiency", "link_efficiency", "mem_efficiency"):
            if getattr(self, name) > 1:
                raise ValueError(f"hardware {name} is a fraction of the peak (<= 1), got "
                                 f"{getattr(self, name)}")

    def link(self, spans_nodes: bool, lanes: int = 1) -> tuple[float, float]:
        """``(alpha seconds, achievable bytes/s)`` of the link a group uses. A ring that leaves
        the node with ``lanes`` of its ranks in each node runs that many channels side by side,
        each through its own GPU's NIC: the node's ``lanes`` NICs carry the traffic together,
        up to what NVLink feeds them."""
        if spans_nodes:
            bw = min(self.intra_bw, lanes * self.inter_bw)
            return self.inter_latency, bw * self.link_efficiency
        return self.intra_latency, self.intra_bw * self.link_efficiency

    def to_dict(self) -> dict:
        return asdict(self)


GB = 1e9
H100_GEMM_EFFICIENCY = 0.57
"""The H100's ``gemm_efficiency``, fitted on one published H100 row (the other fitted numbers
are the A100's); H200 and B200 reuse it, no published rows of theirs being in the fit."""
GPUS: dict[str, Hardware] = {h.name: h for h in (
    Hardware(name="a100-40gb", peak_flops=312e12, hbm_bytes=40e9, hbm_bw=1555 * GB,
             intra_bw=300 * GB, inter_bw=25 * GB),
    Hardware(name="a100-80gb", peak_flops=312e12, hbm_bytes=80e9, hbm_bw=2039 * GB,
             intra_bw=300 * GB, inter_bw=25 * GB),
    Hardware(name="h100-sxm", peak_flops=989e12, hbm_bytes=80e9, hbm_bw=3350 * GB,
             intra_bw=450 * GB, inter_bw=50 * GB, gemm_efficiency=H100_GEMM_EFFICIENCY),
    Hardware(name="h200", peak_flops=989e12, hbm_bytes=141e9, hbm_bw=4800 * GB,
             intra_bw=450 * GB, inter_bw=50 * GB, gemm_efficiency=H100_GEMM_EFFICIENCY),
    Hardware(name="b200", peak_flops=2250e12, hbm_bytes=180e9, hbm_bw=8000 * GB,
             intra_bw=900 * GB, inter_bw=50 * GB, gemm_efficiency=H100_GEMM_EFFICIENCY),
)}
"""The presets of ``--gpu`` (DGX-class nodes of 8 GPUs)."""

FLAGS = ("gpus_per_node", "peak_flops", "hbm_bytes", "hbm_bw", "intra_bw", "intra_latency",
          "inter_bw", "inter_latency", "gemm_efficiency", "gemm_half_dim", "link_efficiency",
          "mem_efficiency", "overlap_efficiency", "gather_factor", "op_overhead")


def hardware_from(gpu: str = "a100-80gb", path: str | None = None, **overrides) -> Hardware:
    """A preset, then a TOML file's keys, then explicit overrides (``None`` ones ignored)."""
    values: dict = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                values = tomllib.load(f)
        except OSError as err:
            raise ValueError(f"--hardware {path!r}: {err.strerror}") from None
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"--hardware {path!r} is not valid TOML: {err}") from None
        gpu = values.pop("gpu", gpu)
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is not known; known: {', '.join(GPUS)} (or describe "
                         f"it with --hardware FILE.toml)")
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--hardware {path!r}: unknown keys {unknown}; known: {sorted(known)}")
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "name" not in values and (path or overrides):
        values["name"] = gpu + (" (modified)" if set(values) - {"name"} else "")
    return replace(GPUS[gpu], **values)
