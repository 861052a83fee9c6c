"""An MoE training step at ep=2 vs ep=1 (dp=2 on gloo), and the token dispatcher's share of it.

Both layouts train the same MoE GPT (every layer an MoE layer, ``E`` experts, top-``k``) on the
same global batch in the same two processes: at ep=1 each rank holds all ``E`` experts and no
token leaves its rank; at ep=2 each rank holds ``E/2`` experts and the alltoall dispatcher sends
tokens to the rank of their expert and back. Iterations alternate between the two so both see
the same machine state; printed are the median step times and the ratio.

The dispatcher's share of a step is measured at both (at ep=1 it is the local permute and
unpermute alone, the all-to-alls being size-1 no-ops): the time inside ``token_permutation`` and
``token_unpermutation`` (permute, the count and token all-to-alls, regrouping, unpermute) plus the
backward all-to-alls, as a fraction of the step (permute/unpermute's own backward, an index
scatter/gather, is counted in the rest). Timings on a shared machine are noisy: medians of
alternating runs; read them as ratios.

    python benchmarks/moe.py                     # h=128, 4 layers, 8 experts, top-2
    python benchmarks/moe.py --hidden 256 --iters 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from paraloom import launch


def _timed(owner, name: str, acc: list) -> None:
    """Wrap ``owner.name`` so every call adds its seconds to ``acc[0]``."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        tic = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[0] += time.perf_counter() - tic
    setattr(owner, name, staticmethod(wrapper) if isinstance(
        owner.__dict__.get(name), staticmethod) else wrapper)


def _rank(rank, world, args) -> None:
    from paraloom.config import ModelConfig, ParallelConfig, TrainConfig
    from paraloom.data import Corpus, load_corpus
    from paraloom.mesh import ParallelMesh
    from paraloom.moe import token_dispatcher as td
    from paraloom.training.train import build, train_step

    torch.set_num_threads(args.threads)
    model = ModelConfig(hidden_size=args.hidden, num_attention_heads=4, num_layers=args.layers,
                        seq_length=args.seq_len, num_experts=args.experts,
                        moe_router_topk=args.topk)
    runs = {}
    for ep in (1, 2):
        cfg = TrainConfig().replace(model=model, parallel=ParallelConfig(dp=2, ep=ep),
                          global_batch_size=args.global_batch_size,
                          micro_batch_size=args.micro_batch_size, steps=10**6, save_every=0,
                          schedule="none")
        runs[ep] = build(cfg, ParallelMesh(cfg.parallel),
                         Corpus(load_corpus(None), args.seq_len, cfg.seed))
    acc = [0.0]
    cls = td.MoEAlltoAllTokenDispatcher
    _timed(cls, "token_permutation", acc)
    _timed(cls, "token_unpermutation", acc)
    _timed(td._AllToAll, "backward", acc)
    times = {1: [], 2: []}
    share = {1: [], 2: []}
    for it in range(args.warmup + args.iters):
        for ep in ((1, 2) if it % 2 else (2, 1)):
            torch.distributed.barrier()
            acc[0] = 0.0
            tic = time.perf_counter()
            train_step(runs[ep], it)
            dt = time.perf_counter() - tic
            if it >= args.warmup:
                times[ep].append(dt)
                share[ep].append(acc[0] / dt)
    # the step's time is the slowest rank's: max over ranks of each iteration's median
    med = torch.tensor([statistics.median(times[1]), statistics.median(times[2]),
                        statistics.median(share[1]), statistics.median(share[2])],
                       dtype=torch.float64)
    torch.distributed.all_reduce(med, op=torch.distributed.ReduceOp.MAX)
    if rank == 0:
        t1, t2, sh1, sh2 = med.tolist()
        tokens = args.global_batch_size * args.seq_len
        print(f"MoE GPT h={args.hidden} L={args.layers} E={args.experts} top-{args.topk}, "
              f"s={args.seq_len}, global batch {args.global_batch_size} "
              f"(micro {args.micro_batch_size}), dp=2, gloo, {args.threads} thread(s)/rank, "
              f"{args.iters} alternating iterations")
        print(f"  ep=1: {t1 * 1e3:8.1f} ms/step  ({tokens / t1:,.0f} tokens/s)")
        print(f"  ep=2: {t2 * 1e3:8.1f} ms/step  ({tokens / t2:,.0f} tokens/s)  "
              f"ratio ep2/ep1 = {t2 / t1:.2f}")
        print(f"  dispatcher share of the step (permute, all-to-alls, unpermute, backward "
              f"all-to-alls; medians): ep=2 {sh2:.1%}, ep=1 {sh1:.1%} (no all-to-all: the "
              f"local permute/unpermute only)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    launch.spawn(_rank, 2, args, timeout_s=600)


if __name__ == "__main__":
    main()
