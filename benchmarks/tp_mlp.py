"""Tensor-parallel MLP block: paraloom against PyTorch's DTensor tensor parallelism, side by side.

What it measures
    One transformer MLP block, ``x -> fc1 (h -> ffn, split on the output dim) -> GeLU -> fc2
    (ffn -> h, split on the input dim) -> y``, at tp=2 over gloo (fp32, CPU, one intra-op thread
    per rank, ranks forked by :func:`paraloom.launch.spawn`):

    * paraloom: ``ColumnParallelLinear(gather_output=False)`` + GeLU +
      ``RowParallelLinear(input_is_parallel=True)``, with the ledger off, and on (inside
      ``with recording(Ledger(rank)):``, its events cleared every iteration);
    * DTensor: ``nn.Sequential(Linear, GELU, Linear)`` through ``parallelize_module`` with
      ``ColwiseParallel`` / ``RowwiseParallel`` on a 2-rank CPU ``DeviceMesh``.

    Both communicate the same thing: an all-reduce of the fc2 partial outputs in forward and of
    the input gradient in backward (the input requires grad, as inside a transformer). One
    iteration is forward + backward with a fixed upstream gradient, gradients set to ``None``
    between iterations. The variants alternate inside the same rank processes (paired A/B, order
    rotated every iteration); each timed region starts after a barrier, and an iteration's time
    is the slower rank's. Before timing, both implementations run once from the same weights and
    their outputs and gradients are checked equal.

    Two sizes: ``tiny`` (h=64, ffn=256, s=8, b=2), where per-call overhead dominates, and ``full``
    (h=512, ffn=2048, s=128, b=8), where the GEMMs dominate. The table shows median times, the
    ratio paraloom / DTensor (median of the per-iteration paired ratios, which cancels most of the
    machine's drift) and the ledger-on / ledger-off ratio (paired the same way).

How to run
    ``.venv/bin/python benchmarks/tp_mlp.py`` (``--iters-tiny 200 --iters-full 30 --sizes
    tiny,full``). Only rank 0 prints.

Goals
    * tiny block: paraloom <= 0.5x DTensor's time;
    * full block: paraloom <= 0.95x DTensor's time;
    * ledger on costs <= 5% (ledger-on / ledger-off <= 1.05).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from paraloom import comm
from paraloom.launch import spawn
from paraloom.ledger import Ledger, recording
from paraloom.mesh import ParallelMesh
from paraloom.tensor_parallel import ColumnParallelLinear, RowParallelLinear

TP = 2
SIZES = {  # name: (h, ffn, s, b, warm-up iterations)
    "tiny": (64, 256, 8, 2, 30),
    "full": (512, 2048, 128, 8, 3),
}
VARIANTS = ("paraloom", "paraloom+ledger", "dtensor")


class ParaloomMLP(nn.Module):
    def __init__(self, h: int, ffn: int, mesh: ParallelMesh, async_ar: bool) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(h, ffn, gather_output=False, mesh=mesh, name="mlp.fc1",
                                        async_grad_allreduce=async_ar)
        self.fc2 = RowParallelLinear(ffn, h, input_is_parallel=True, mesh=mesh, name="mlp.fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.fc1(x)  # [s, b, ffn/tp]
        y, _ = self.fc2(F.gelu(y))  # [s, b, h]
        return y


def _build(h: int, ffn: int, mesh: ParallelMesh, device_mesh, async_ar: bool):
    torch.manual_seed(0)  # same full weights on every rank
    ref = nn.Sequential(nn.Linear(h, ffn), nn.GELU(), nn.Linear(ffn, h))
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.02)
    ours = ParaloomMLP(h, ffn, mesh, async_ar)
    r = mesh.tp.rank
    with torch.no_grad():
        ours.fc1.weight.copy_(ref[0].weight.chunk(TP, 0)[r])
        ours.fc1.bias.copy_(ref[0].bias.chunk(TP, 0)[r])
        ours.fc2.weight.copy_(ref[2].weight.chunk(TP, 1)[r])
        ours.fc2.bias.copy_(ref[2].bias)
    theirs = parallelize_module(ref, device_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return ours, theirs


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _check_same(ours, theirs, x, grad_out, mesh) -> None:
    """One fwd+bwd of each from the same weights: outputs and gradients must match."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    ya.backward(grad_out)
    yb.backward(grad_out)
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ya, _local(yb), **tol, msg=lambda m: f"output differs: {m}")
    torch.testing.assert_close(xa.grad, xb.grad, **tol, msg=lambda m: f"input grad differs: {m}")
    pairs = [(ours.fc1.weight, theirs[0].weight), (ours.fc1.bias, theirs[0].bias),
             (ours.fc2.weight, theirs[2].weight), (ours.fc2.bias, theirs[2].bias)]
    for i, (a, b) in enumerate(pairs):
        torch.testing.assert_close(a.grad, _local(b.grad), **tol,
                                   msg=lambda m, i=i: f"parameter {i} grad differs: {m}")


def _step(model, x, grad_out) -> None:
    """Forward + backward with a fixed upstream gradient; gradients cleared first."""
    for p in model.parameters():
        p.grad = None
    x.grad = None
    model(x).backward(grad_out)


def _measure(rank: int, size: str, iters: int, mesh: ParallelMesh, device_mesh,
             async_ar: bool):
    h, ffn, s, b, warmup = SIZES[size]
    ours, theirs = _build(h, ffn, mesh, device_mesh, async_ar)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(s, b, h, generator=g)  # [s, b, h], the same on every rank
    grad_out = torch.randn(s, b, h, generator=g)
    _check_same(ours, theirs, x, grad_out, mesh)
    x = x.requires_grad_()
    ledger = Ledger(rank)

    def paraloom_off() -> float:
        comm.barrier(mesh.tp, site="bench")
        t = time.perf_counter()
        _step(ours, x, grad_out)
        return time.perf_counter() - t

    def paraloom_on() -> float:
        comm.barrier(mesh.tp, site="bench")
        with recording(ledger):
            ledger.events.clear()
            t = time.perf_counter()
            _step(ours, x, grad_out)
            dt = time.perf_counter() - t
        return dt

    def dtensor() -> float:
        dist.barrier()
        t = time.perf_counter()
        _step(theirs, x, grad_out)
        return time.perf_counter() - t

    runs = (paraloom_off, paraloom_on, dtensor)
    times = torch.zeros(iters, len(runs), dtype=torch.float64)
    for i in range(-warmup, iters):
        order = [(i + k) % len(runs) for k in range(len(runs))]  # rotate who goes first
        for k in order:
            dt = runs[k]()
            if i >= 0:
                times[i, k] = dt
    assert len(ledger.events) > 0, "the ledger recorded nothing"
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # an iteration lasts until the slower rank ends
    return times


def _row(size: str, times: torch.Tensor) -> list[str]:
    h, ffn, s, b, _ = SIZES[size]
    off, on, dt = (times[:, k].tolist() for k in range(3))
    med = statistics.median
    label = f"{size} (h={h}, ffn={ffn}, s={s}, b={b})"
    rows = []
    for name, ours in (("off", off), ("on", on)):
        ratio = med(a / d for a, d in zip(ours, dt, strict=True))
        rows.append(f"{label:<34} {name:>6} {med(ours) * 1e3:>11.3f} {med(dt) * 1e3:>11.3f} "
                    f"{ratio:>9.3f}")
    ledger_cost = med(a / b for a, b in zip(on, off, strict=True))
    rows.append(f"{'':<34} {'on/off':>6} {'':>11} {'':>11} {ledger_cost:>9.3f}")
    return rows


def _main(rank: int, world: int, sizes: list[str], iters: dict[str, int],
          async_ar: bool) -> None:
    mesh = ParallelMesh(tp=TP)
    device_mesh = init_device_mesh("cpu", (TP,))
    lines = [f"{'size':<34} {'ledger':>6} {'paraloom ms':>11} {'DTensor ms':>11} {'ratio':>9}",
             "-" * 75]
    for size in sizes:
        times = _measure(rank, size, iters[size], mesh, device_mesh, async_ar)
        lines += _row(size, times)
    if rank == 0:
        print(f"tp={TP}, gloo, fp32, 1 thread/rank, async_grad_allreduce={async_ar}, "
              "fwd+bwd per iteration; medians over "
              + ", ".join(f"{iters[s]} {s}" for s in sizes) + " iterations; ratio = median of "
              "paired per-iteration ratios (paraloom / DTensor; last row ledger on / off)")
        print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters-tiny", type=int, default=200)
    parser.add_argument("--iters-full", type=int, default=30)
    parser.add_argument("--sizes", default="tiny,full", help="comma-separated: tiny,full")
    parser.add_argument("--async-grad-allreduce", action=argparse.BooleanOptionalAction,
                        default=True, help="overlap the column layer's input-grad all-reduce "
                        "with its wgrad GEMM (Megatron's default for tp > 1; default: on)")
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or not sizes:
        parser.error(f"--sizes: unknown {unknown}; choose from {sorted(SIZES)}")
    iters = {"tiny": args.iters_tiny, "full": args.iters_full}
    if any(n < 1 for n in iters.values()):
        parser.error("--iters-tiny and --iters-full must be >= 1")
    spawn(_main, TP, sizes, iters, args.async_grad_allreduce)


if __name__ == "__main__":
    main()
