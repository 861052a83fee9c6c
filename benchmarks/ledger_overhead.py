"""What recording the ledger costs: the GPT's forward + backward with the ledger on vs off.

What it measures
    :class:`paraloom.models.gpt.GPTModel` at tp=2 over gloo (fp32, CPU, one intra-op thread per
    rank, 2 ranks forked by :func:`paraloom.launch.spawn`), one iteration = forward + loss +
    backward, gradients set to ``None`` between iterations. The two variants alternate inside the
    same processes (paired A/B, the order swapped every iteration); each timed region starts
    after a barrier and an iteration's time is the slower rank's. "on" runs inside
    ``with recording(Ledger(rank))`` (events cleared every iteration, as a per-step flush would);
    it records every collective and the fprop/dgrad/wgrad spans of each parallel linear.

    Two sizes: ``small`` (L=2, h=64, s=32, b=2: per-call overhead dominates, the worst case for
    the ledger) and ``medium`` (L=4, h=256, s=128, b=4: closer to a real step).

How to run
    ``.venv/bin/python benchmarks/ledger_overhead.py [--iters 60] [--sizes small,medium]``.
    Only rank 0 prints: the median step time off and on, and the median of the paired
    per-iteration ratios on/off (which cancels most of the machine's drift).

Goal
    ledger on costs <= 5% step time (ratio <= 1.05). "Off" is the ordinary code path: comm.py
    asks ``ledger.active()`` once per call and the spans are a shared ``nullcontext``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from paraloom import comm
from paraloom.config import ModelConfig
from paraloom.launch import spawn
from paraloom.ledger import Ledger, recording
from paraloom.mesh import ParallelMesh
from paraloom.models.gpt import GPTModel

TP = 2
SIZES = {  # name: (layers, hidden, heads, seq, micro batch, vocab, warm-up iterations)
    "small": (2, 64, 4, 32, 2, 256, 10),
    "medium": (4, 256, 8, 128, 4, 1024, 3),
}


def _measure(rank: int, size: str, iters: int, mesh: ParallelMesh) -> tuple[torch.Tensor, int]:
    layers, h, a, s, b, vocab, warmup = SIZES[size]
    cfg = ModelConfig(vocab_size=vocab, hidden_size=h, num_layers=layers, num_attention_heads=a,
                      seq_length=s)
    model = GPTModel(cfg, mesh)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    ledger = Ledger(rank)

    def step() -> float:
        for p in model.parameters():
            p.grad = None
        comm.barrier(mesh.tp, site="bench")
        t = time.perf_counter()
        model(inputs, labels).mean().backward()
        return time.perf_counter() - t

    def on() -> float:
        with recording(ledger):
            ledger.events.clear()
            return step()

    runs = (step, on)
    times = torch.zeros(iters, 2, dtype=torch.float64)
    for i in range(-warmup, iters):
        for k in ((0, 1) if i % 2 == 0 else (1, 0)):
            dt = runs[k]()
            if i >= 0:
                times[i, k] = dt
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # an iteration lasts until the slower rank ends
    return times, len(ledger.events)


def _main(rank: int, world: int, sizes: list[str], iters: int) -> None:
    mesh = ParallelMesh(tp=TP)
    med = statistics.median
    lines = [f"{'size':<40} {'events':>6} {'off ms':>9} {'on ms':>9} {'on/off':>7}", "-" * 75]
    for size in sizes:
        times, events = _measure(rank, size, iters, mesh)
        off, on = times[:, 0].tolist(), times[:, 1].tolist()
        ratio = med(x / y for x, y in zip(on, off, strict=True))
        layers, h, _, s, b, _, _ = SIZES[size]
        label = f"{size} (L={layers}, h={h}, s={s}, b={b})"
        lines.append(f"{label:<40} {events:>6} {med(off) * 1e3:>9.3f} {med(on) * 1e3:>9.3f} "
                     f"{ratio:>7.3f}")
    if rank == 0:
        print(f"GPT tp={TP}, gloo, fp32, 1 thread/rank, fwd+bwd per iteration; medians over "
              f"{iters} paired iterations; on/off = median of paired ratios (goal <= 1.05)")
        print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--sizes", default="small,medium", help="comma-separated: small,medium")
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or not sizes:
        parser.error(f"--sizes: unknown {unknown}; choose from {sorted(SIZES)}")
    if args.iters < 1:
        parser.error(f"--iters must be >= 1, got {args.iters}")
    spawn(_main, TP, sizes, args.iters)


if __name__ == "__main__":
    main()
