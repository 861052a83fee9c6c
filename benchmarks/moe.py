"""An MoE training step at ep=2, with each of Megatron's two token dispatchers, vs ep=1 (dp=2 on
gloo), and the dispatcher's share of each step.

The three runs train the same MoE GPT (every layer an MoE layer, ``E`` experts, top-``k``) on the
same global batch in the same two processes: at ep=1 each rank holds all ``E`` experts and no
token leaves its rank; at ep=2 each rank holds ``E/2`` experts and either the allgather
dispatcher (Megatron's default: every token of both ranks gathered, the outputs reduce-scattered)
or the alltoall dispatcher (tokens and probabilities sent to the rank of their expert and back)
moves them. Iterations rotate between the runs so all see the same machine state; printed are
the median step times and the ratios.

The dispatcher's share of a step: the time inside ``token_permutation`` and
``token_unpermutation`` (permute, the exchanges, regrouping, unpermute) plus the backward
exchanges, as a fraction of the step (the local permute/unpermute's own backward, an index
scatter/gather, is counted in the rest). Timings on a shared machine are noisy: medians of
rotating runs; read them as ratios.

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


RUNS = (("ep=1", 1, "alltoall"), ("ep=2 allgather", 2, "allgather"),
        ("ep=2 alltoall", 2, "alltoall"))
"""(name, ep, dispatcher) of each run (at ep=1 the dispatcher moves nothing)."""


def _rank(rank, world, args) -> None:
    from paraloom.config import ModelConfig, ParallelConfig, TrainConfig
    from paraloom.data import Corpus, load_corpus
    from paraloom.mesh import ParallelMesh
    from paraloom.moe import allgather_dispatcher as ag
    from paraloom.moe import token_dispatcher as td
    from paraloom.training.train import build, train_step

    torch.set_num_threads(args.threads)
    runs = {}
    for name, ep, way in RUNS:
        model = ModelConfig(hidden_size=args.hidden, num_attention_heads=4,
                            num_layers=args.layers, seq_length=args.seq_len,
                            num_experts=args.experts, moe_router_topk=args.topk,
                            moe_token_dispatcher_type=way)
        cfg = TrainConfig().replace(model=model, parallel=ParallelConfig(dp=2, ep=ep),
                                    global_batch_size=args.global_batch_size,
                                    micro_batch_size=args.micro_batch_size, steps=10**6,
                                    save_every=0, schedule="none")
        runs[name] = build(cfg, ParallelMesh(cfg.parallel),
                           Corpus(load_corpus(None), args.seq_len, cfg.seed))
    acc = [0.0]
    for cls in (td.MoEAlltoAllTokenDispatcher, ag.MoEAllGatherTokenDispatcher):
        _timed(cls, "token_permutation", acc)
        _timed(cls, "token_unpermutation", acc)
    _timed(td._Exchange, "backward", acc)
    names = [name for name, _, _ in RUNS]
    times = {n: [] for n in names}
    share = {n: [] for n in names}
    for it in range(args.warmup + args.iters):
        for name in names[it % 3:] + names[:it % 3]:
            torch.distributed.barrier()
            acc[0] = 0.0
            tic = time.perf_counter()
            train_step(runs[name], it)
            dt = time.perf_counter() - tic
            if it >= args.warmup:
                times[name].append(dt)
                share[name].append(acc[0] / dt)
    # the step's time is the slowest rank's: max over ranks of each run's median
    med = torch.tensor([statistics.median(times[n]) for n in names]
                       + [statistics.median(share[n]) for n in names], dtype=torch.float64)
    torch.distributed.all_reduce(med, op=torch.distributed.ReduceOp.MAX)
    if rank == 0:
        values = med.tolist()
        t, sh = dict(zip(names, values[:3], strict=True)), dict(zip(names, values[3:], strict=True))
        tokens = args.global_batch_size * args.seq_len
        print(f"MoE GPT h={args.hidden} L={args.layers} E={args.experts} top-{args.topk}, "
              f"s={args.seq_len}, global batch {args.global_batch_size} "
              f"(micro {args.micro_batch_size}), dp=2, gloo, {args.threads} thread(s)/rank, "
              f"{args.iters} rotating iterations")
        for n in names:
            print(f"  {n:15s} {t[n] * 1e3:8.1f} ms/step  ({tokens / t[n]:,.0f} tokens/s)  "
                  f"vs ep=1 {t[n] / t['ep=1']:.2f}  dispatcher share {sh[n]:.1%}")
        print(f"  allgather / alltoall at ep=2: "
              f"{t['ep=2 allgather'] / t['ep=2 alltoall']:.2f}")


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
