"""Context parallelism on a long sequence: cp = 2 vs cp = 1, one transformer layer on gloo.

Two ranks run both layouts, alternating iterations so both see the same machine state: cp = 1 is
a (dp = 2) mesh, each rank the whole sequence; cp = 2 is one sequence split over both ranks
(load-balanced chunks, ring attention or ``--cp-comm-type all_gather``). Printed per layout:
the bytes one training forward of the layer saves for backward on a rank
(:class:`paraloom.measure.memory.SavedTensors`: storages, parameters excluded), and the median
forward + backward time; then the ratios cp2 / cp1. cp = 1 runs paraloom's ``CoreAttention``,
which saves the ``s x s`` probabilities; the ring keeps only q, k, v, the output and its
log-sum-exp, so the saved-bytes ratio is far below 1/cp unless ``--recompute selective`` takes
the attention core out of both.

    python benchmarks/cp.py                      # s = 4096, h = 256, 4 heads, b = 1
    python benchmarks/cp.py --seq 8192 --iters 5 --cp-comm-type all_gather
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from paraloom import launch
from paraloom.config import ModelConfig, ParallelConfig
from paraloom.measure.memory import layer_saved_tensors
from paraloom.mesh import ParallelMesh
from paraloom.models.gpt import ParallelOptions, TransformerLayer


def _step(layer, x) -> float:
    tic = time.perf_counter()
    layer(x).sum().backward()
    return time.perf_counter() - tic


def _rank(rank: int, world: int, args) -> None:
    cfg = ModelConfig(hidden_size=args.hidden, num_attention_heads=args.heads,
                      seq_length=args.seq, num_layers=1)
    opt = ParallelOptions(recompute=args.recompute)
    meshes = {1: ParallelMesh(ParallelConfig(dp=2)),
              2: ParallelMesh(ParallelConfig(cp=2, cp_comm_type=args.cp_comm_type))}
    saved = {cp: layer_saved_tensors(cfg, m, opt, args.seq // cp, args.batch).nbytes
             for cp, m in meshes.items()}
    layers = {cp: TransformerLayer(cfg, m, 0, opt) for cp, m in meshes.items()}
    gen = torch.Generator().manual_seed(rank)
    xs = {cp: torch.randn(args.seq // cp, args.batch, args.hidden, generator=gen,
                          requires_grad=True) for cp in meshes}
    times: dict[int, list[float]] = {1: [], 2: []}
    for i in range(args.warmup + args.iters):
        for cp in (1, 2) if i % 2 == 0 else (2, 1):
            dt = _step(layers[cp], xs[cp])
            if i >= args.warmup:
                times[cp].append(dt)
    if rank == 0:
        med = {cp: statistics.median(t) for cp, t in times.items()}
        print(f"s={args.seq} h={args.hidden} heads={args.heads} b={args.batch}, one layer, "
              f"cp comm {args.cp_comm_type}, recompute {args.recompute}; {args.iters} "
              f"alternating iterations after {args.warmup} warm-up, 1 thread per rank")
        for cp in (1, 2):
            print(f"cp={cp}: saved activations per rank {saved[cp] / 2**20:9.2f} MiB   "
                  f"median forward+backward {med[cp] * 1e3:8.1f} ms")
        print(f"ratio cp2/cp1: saved activations {saved[2] / saved[1]:.3f}, "
              f"time {med[2] / med[1]:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--cp-comm-type", choices=("p2p", "all_gather"), default="p2p")
    ap.add_argument("--recompute", choices=("none", "selective"), default="none",
                    help="selective: the attention core is recomputed, so cp = 1 keeps no "
                         "s x s scores either and the comparison is of the other activations")
    args = ap.parse_args()
    launch.spawn(_rank, 2, args, timeout_s=1800, threads=1)


if __name__ == "__main__":
    main()
