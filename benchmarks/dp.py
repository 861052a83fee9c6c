"""paraloom DistributedDataParallel vs torch.nn.parallel.DistributedDataParallel, dp=2 on gloo.

Both wrap identical copies of a small GPT-like model (pre-LN blocks: causal self-attention + GeLU
MLP) in the same two processes; iterations alternate between them so both see the same machine
state. One step = zero grads, forward, backward, gradient synchronisation and the AdamW update:

* paraloom: ``DistributedDataParallel`` (fp32 bucket buffer, overlapped bucket all-reduces),
  ``finalize_model_grads``, ``MainParamsOptimizer`` (torch's fused AdamW kernel on the main grads);
* torch: ``nn.parallel.DistributedDataParallel`` and ``torch.optim.AdamW`` as a user writes them
  (on CPU its default is the per-parameter loop; ``--torch-optimizer fused`` gives it the same
  fused kernel paraloom uses, ``none`` leaves the update out of both steps).

Both use the same bucket size and hyper-parameters. Before timing, the first step's gradients are
checked to be the same. Printed: median step time of each, the median of the paired ratios
paraloom / torch, and, from a few extra recorded iterations, when each bucket's reduction is
launched relative to the start of backward (paraloom: its ledger; torch: a comm hook that
timestamps, then runs the default all-reduce).

    python benchmarks/dp.py                       # h=256, 4 layers, 4 MB buckets
    python benchmarks/dp.py --iters 60 --torch-optimizer fused
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from paraloom import device, launch
from paraloom.data_parallel import (
    DistributedDataParallel,
    MainParamsOptimizer,
    finalize_model_grads,
)
from paraloom.ledger import Ledger, recording
from paraloom.mesh import ParallelMesh


class Block(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):  # [b, s, h]
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, h/heads]
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, h: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(h), nn.Linear(h, vocab, bias=False)

    def forward(self, ids, targets):  # [b, s]
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # [b, s, vocab]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _stamping_allreduce_hook(stamps: list):
    """torch DDP comm hook: record the launch time, then the default SUM + divide all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        stamps.append((time.perf_counter(), bucket.index(), bucket.buffer().numel()))
        return allreduce_hook(state, bucket)
    return hook


HP = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _step(model, ids, targets, zero, sync, update) -> tuple[float, float, float, float]:
    """Returns (t_step_start, t_backward_start, t_backward_end, t_sync_end), perf_counter s;
    the update (if any) runs after the sync and counts in the step's time only."""
    ts = time.perf_counter()
    zero()
    loss = model(ids, targets)
    t0 = time.perf_counter()
    loss.backward()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    update()
    return ts, t0, t1, t2


def bench(rank: int, world: int, args) -> None:
    if args.tuned_malloc:  # what `paraloom train` does in its ranks; both sides share the process
        device.tune_allocator()
    mesh = ParallelMesh(dp=world)
    torch.manual_seed(0)
    cfg = (args.vocab, args.hidden, args.layers, args.heads, args.seq)
    ours_model, theirs_model = TinyGPT(*cfg), TinyGPT(*cfg)
    theirs_model.load_state_dict(ours_model.state_dict())
    n = sum(p.numel() for p in ours_model.parameters())
    bucket_elems = args.bucket_mb * 2**20 // 4
    ours = DistributedDataParallel(ours_model, mesh, bucket_size=bucket_elems)
    theirs = nn.parallel.DistributedDataParallel(theirs_model, bucket_cap_mb=args.bucket_mb)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)

    ours_opt = MainParamsOptimizer(ours, **HP)
    kind = {"default": {}, "fused": {"fused": True}, "none": None}[args.torch_optimizer]
    theirs_opt = None if kind is None else torch.optim.AdamW(theirs_model.parameters(), **HP,
                                                             **kind)
    updates = {"paraloom": ours_opt.step if kind is not None else lambda: None,
               "torch": theirs_opt.step if kind is not None else lambda: None}

    def ours_step(update=True):
        return _step(ours, ids, targets, ours.zero_grad_buffer,
                     lambda: finalize_model_grads([ours], mesh),
                     updates["paraloom"] if update else lambda: None)

    def theirs_step(update=True):  # torch DDP's backward returns once its all-reduces are done
        return _step(theirs, ids, targets, lambda: theirs.zero_grad(set_to_none=True),
                     lambda: None, updates["torch"] if update else lambda: None)

    ours_step(False), theirs_step(False)
    for name, p in theirs_model.named_parameters():  # same model, same gradients
        torch.testing.assert_close(dict(ours_model.named_parameters())[name].main_grad, p.grad,
                                   rtol=1e-4, atol=1e-6)
    for _ in range(args.warmup):
        ours_step(), theirs_step()
    times = {"paraloom": [], "torch": []}
    for i in range(args.iters):
        order = [("paraloom", ours_step), ("torch", theirs_step)]
        for name, fn in order if i % 2 == 0 else order[::-1]:
            ts = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - ts)
    # launch timelines: a few recorded iterations each
    ledger, stamps = Ledger(rank=rank), []
    theirs.register_comm_hook(None, _stamping_allreduce_hook(stamps))
    lines = []
    for _ in range(3):
        ledger.events.clear()
        with recording(ledger):
            _, t0, t1, t2 = ours_step(False)
        base = time.time() - time.perf_counter()  # ledger times are time.time() - t0
        ours_launch = [(e["t_start"] + ledger.t0 - base - t0, e["bucket"], e["bytes"] // 4)
                       for e in ledger.events if e["kind"] == "dp"]
        stamps.clear()
        _, u0, u1, u2 = theirs_step(False)
        theirs_launch = [(t - u0, idx, numel) for t, idx, numel in stamps]
        lines = [("paraloom", ours_launch, t1 - t0, t2 - t0),
                 ("torch", theirs_launch, u1 - u0, u2 - u0)]
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"model: h={args.hidden} layers={args.layers} seq={args.seq} batch/rank={args.batch}"
              f" params={n / 1e6:.2f}M; dp={world} gloo, {torch.get_num_threads()} thread/rank, "
              f"bucket {args.bucket_mb} MB ({bucket_elems} elements)")
        print(f"iterations: {args.iters} alternating (after {args.warmup} warm-up); AdamW: "
              f"paraloom fused, torch {args.torch_optimizer}")
        for k in ("paraloom", "torch"):
            v = sorted(times[k])
            print(f"  {k:9s} median step {med[k] * 1e3:8.1f} ms  (min {v[0] * 1e3:.1f}, "
                  f"max {v[-1] * 1e3:.1f})")
        ratios = [a / b for a, b in zip(times["paraloom"], times["torch"], strict=True)]
        print(f"  ratio paraloom / torch (median of paired ratios) = "
              f"{statistics.median(ratios):.3f}  (goal <= 0.95)")
        print("bucket reduction launches, ms after backward start (last recorded iteration):")
        for name, launches, bwd, end in lines:
            marks = ", ".join(f"b{idx}({numel / 1e6:.2f}M)@{t * 1e3:.1f}"
                              for t, idx, numel in sorted(launches))
            print(f"  {name:9s} backward {bwd * 1e3:6.1f} ms, synced {end * 1e3:6.1f} ms: {marks}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--bucket-mb", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--torch-optimizer", choices=("default", "fused", "none"), default="default",
                    help="torch side's AdamW (default: torch.optim.AdamW's CPU default, the "
                         "per-parameter loop; fused: the kernel paraloom uses; none: no update)")
    ap.add_argument("--tuned-malloc", action="store_true",
                    help="apply paraloom.device.tune_allocator in every rank (both sides share it)")
    args = ap.parse_args()
    launch.spawn(bench, args.dp, args)


if __name__ == "__main__":
    main()
