"""paraloom's Megatron-FSDP ZeRO-3 vs torch FSDP2, dp=2 on gloo: step time and peak memory.

Both shard identical copies of the GPT-like model of ``benchmarks/dp.py`` (pre-LN blocks) per
transformer block:

* paraloom: ``FullyShardedDataParallel(..., data_parallel_sharding_strategy="optim_grads_params",
  units=blocks)`` (Megatron-FSDP's ZeRO-3: each block gathered before its forward and backward,
  released after, reduce-scatters per block, every bucket gathered after the update) and
  ``DistributedOptimizer`` (each rank's 1/dp pieces; torch's fused AdamW kernel);
* torch: ``fully_shard`` on every block and on the model (FSDP2) and ``torch.optim.AdamW`` on its
  DTensor parameters (``--torch-optimizer fused`` gives it the fused kernel too).

Step time: the two alternate in the same two processes, medians of the paired ratios (the
warm-up steps check that both train the same model: equal losses). Peak
memory: each side alone in fresh processes (``--memory``), the growth of the ranks' peak resident
set from before the model is built to after the last step (what a CPU shows: parameters,
gradients, optimizer state, activations, the allocator's slack), rank 0's.

    python benchmarks/fsdp.py                       # h=512, 6 layers, timing
    python benchmarks/fsdp.py --memory              # then each side's peak memory
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from paraloom import launch
from paraloom.data_parallel import DistributedOptimizer, finalize_model_grads
from paraloom.data_parallel.megatron_fsdp import FullyShardedDataParallel
from paraloom.mesh import ParallelMesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dp import HP, TinyGPT  # noqa: E402


def _build(side: str, args, mesh):
    torch.manual_seed(0)
    model = TinyGPT(args.vocab, args.hidden, args.layers, args.heads, args.seq)
    if side == "paraloom":
        ddp = FullyShardedDataParallel(model, mesh, units=list(model.blocks),
                                       data_parallel_sharding_strategy="optim_grads_params")
        opt = DistributedOptimizer(ddp, **HP)

        def step(ids, targets):
            ddp.zero_grad_buffer()
            loss = model(ids, targets)
            loss.backward()
            finalize_model_grads([ddp], mesh)
            opt.step()
            return loss.item()
        return model, step
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    kind = {"default": {}, "fused": {"fused": True}}[args.torch_optimizer]
    opt = torch.optim.AdamW(model.parameters(), **HP, **kind)

    def step(ids, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(ids, targets)
        loss.backward()
        opt.step()
        return loss.item()
    return model, step


def _data(rank: int, args):
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return ids, torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)


def timing(rank: int, world: int, args) -> None:
    mesh = ParallelMesh(dp=world)
    ids, targets = _data(rank, args)
    steps = {side: _build(side, args, mesh)[1] for side in ("paraloom", "torch")}
    for _ in range(max(2, args.warmup)):  # the same model: the same losses, step after step
        losses = [fn(ids, targets) for fn in steps.values()]
        assert abs(losses[0] - losses[1]) <= 1e-4 * abs(losses[1]), losses
    times = {side: [] for side in steps}
    for i in range(args.iters):
        order = list(steps.items())
        for side, fn in order if i % 2 == 0 else order[::-1]:
            t = time.perf_counter()
            fn(ids, targets)
            times[side].append(time.perf_counter() - t)
    if rank == 0:
        n = sum(p.numel() for p in TinyGPT(args.vocab, args.hidden, args.layers, args.heads,
                                           args.seq).parameters())
        print(f"model: h={args.hidden} layers={args.layers} seq={args.seq} batch/rank="
              f"{args.batch} params={n / 1e6:.1f}M; dp={world} gloo, {args.iters} alternating "
              f"iterations after {args.warmup}; torch AdamW {args.torch_optimizer}")
        for side, v in times.items():
            print(f"  {side:9s} median step {statistics.median(v) * 1e3:8.1f} ms")
        ratios = [a / b for a, b in zip(times["paraloom"], times["torch"], strict=True)]
        print(f"  ratio paraloom / torch FSDP2 (median of paired ratios) = "
              f"{statistics.median(ratios):.3f}")


def memory(rank: int, world: int, args) -> None:
    mesh = ParallelMesh(dp=world)
    ids, targets = _data(rank, args)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _, step = _build(args.side, args, mesh)
    for _ in range(args.warmup + 2):
        step(ids, targets)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    if rank == 0:
        print(f"  {args.side:9s} peak resident set grew by {grown / 1024:8.1f} MB (rank 0)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--torch-optimizer", choices=("default", "fused"), default="fused")
    ap.add_argument("--memory", action="store_true",
                    help="also each side's peak memory, alone in fresh processes")
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        launch.spawn(memory, args.dp, args)
        return
    launch.spawn(timing, args.dp, args)
    if args.memory:
        import subprocess
        for side in ("paraloom", "torch"):
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--side", side],
                           check=True, start_new_session=True, timeout=1200)


if __name__ == "__main__":
    main()
