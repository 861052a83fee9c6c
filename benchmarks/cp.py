"""Context parallelism on a long sequence: cp = 2 (the ring, the all-gather, Ulysses' all-to-all)
vs cp = 1, one transformer layer on gloo; with ``--cp 4`` also hierarchical a2a+p2p (2 x 2).

``--cp`` ranks run every layout, rotating the order every iteration so all see the same machine
state: cp = 1 is a (dp = cp) mesh, each rank the whole sequence; the others split one sequence
over every rank (load-balanced chunks) with ``--cp-comm-type p2p`` (ring), ``all_gather``,
``a2a`` (Ulysses: Q, K, V all-to-all'd to head shards, the model's attention kernel on the whole
sequence of a share of the heads, the output back) or, at cp = 4, ``a2a+p2p`` (Ulysses in pairs
of ranks, the ring across the pairs). Printed per layout: the bytes one training forward
of the layer saves for backward on a rank (:class:`paraloom.measure.memory.SavedTensors`:
storages, parameters excluded), and the median forward + backward time; then the ratios to
cp = 1 and Ulysses to the ring. With ``--attention core`` (written out) cp = 1 and Ulysses save
the ``s x s`` probabilities of their heads (Ulysses: half the heads, the whole sequence) and the
ring keeps only q, k, v, the output and its log-sum-exp; ``--attention sdpa`` (fused, as
Megatron's Transformer Engine attention) saves no ``s x s`` tensor anywhere.

    python benchmarks/cp.py                      # s = 4096, h = 256, 4 heads, b = 1, core
    python benchmarks/cp.py --attention sdpa --iters 5
    python benchmarks/cp.py --cp 4 --attention sdpa --iters 5   # + a2a+p2p 2 x 2
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


def layouts(cp: int) -> dict[str, tuple[int, str]]:
    """name -> (cp, comm type) of the layouts a run of ``cp`` ranks compares."""
    out = {"cp1": (1, "p2p"), "ring": (cp, "p2p"), "all_gather": (cp, "all_gather"),
           "a2a": (cp, "a2a")}
    if cp >= 4:
        out["a2a+p2p"] = (cp, "a2a+p2p")
    return out


def _mesh(cp: int, kind: str, world: int) -> ParallelMesh:
    if cp == 1:
        return ParallelMesh(ParallelConfig(dp=world))
    sizes = (2, cp // 2) if kind == "a2a+p2p" else None
    return ParallelMesh(ParallelConfig(cp=cp, cp_comm_type=kind, cp_sizes=sizes))


def _rank(rank: int, world: int, args) -> None:
    cfg = ModelConfig(hidden_size=args.hidden, num_attention_heads=args.heads,
                      seq_length=args.seq, num_layers=1, attention=args.attention)
    opt = ParallelOptions(recompute=args.recompute)
    plan = layouts(world)
    meshes = {name: _mesh(cp, kind, world) for name, (cp, kind) in plan.items()}
    saved = {name: layer_saved_tensors(cfg, m, opt, args.seq // plan[name][0],
                                       args.batch).nbytes for name, m in meshes.items()}
    layers = {name: TransformerLayer(cfg, m, 0, opt) for name, m in meshes.items()}
    gen = torch.Generator().manual_seed(rank)
    xs = {name: torch.randn(args.seq // plan[name][0], args.batch, args.hidden,
                            generator=gen, requires_grad=True) for name in meshes}
    names = list(plan)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.warmup + args.iters):
        for name in names[i % len(names):] + names[:i % len(names)]:  # rotated
            dt = _step(layers[name], xs[name])
            if i >= args.warmup:
                times[name].append(dt)
    if rank == 0:
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"s={args.seq} h={args.hidden} heads={args.heads} b={args.batch}, one layer, "
              f"attention {args.attention}, recompute {args.recompute}; {args.iters} rotated "
              f"iterations after {args.warmup} warm-up, 1 thread per rank")
        for name in names:
            print(f"{name:>10}: saved activations per rank {saved[name] / 2**20:9.2f} MiB   "
                  f"median forward+backward {med[name] * 1e3:8.1f} ms   vs cp1: saved "
                  f"{saved[name] / saved['cp1']:.3f}, time {med[name] / med['cp1']:.3f}")
        for name in [n for n in ("a2a", "a2a+p2p") if n in med]:
            print(f"{name} / ring (p2p): saved activations {saved[name] / saved['ring']:.3f}, "
                  f"time {med[name] / med['ring']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--attention", choices=("core", "sdpa"), default="core")
    ap.add_argument("--recompute", choices=("none", "selective"), default="none",
                    help="selective: the attention core is recomputed, so cp = 1 keeps no "
                         "s x s scores either and the comparison is of the other activations")
    ap.add_argument("--cp", type=int, choices=(2, 4), default=2,
                    help="ranks (the cp size); 4 adds hierarchical a2a+p2p 2 x 2")
    args = ap.parse_args()
    launch.spawn(_rank, args.cp, args, timeout_s=1800, threads=1)


if __name__ == "__main__":
    main()
