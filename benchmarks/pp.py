"""Pipeline 1F1B: paraloom against ``torch.distributed.pipelining.Schedule1F1B``, side by side.

What it measures
    A stack of 8 residual MLP blocks ``x + fc2(gelu(fc1(x)))`` (h=256, ffn=1024) split over
    p=2 stages (4 blocks each), m=8 microbatches of s=64 x b=4 tokens, MSE loss on the last stage,
    fp32 on CPU over gloo, one intra-op thread per rank, ranks forked by
    :func:`paraloom.launch.spawn`:

    * paraloom: ``forward_backward_pipelining_without_interleaving`` (ledger off), overlapping
      p2p with compute (the default on gloo);
    * paraloom-blocking: the same with ``overlap_p2p_comm=False`` (blocking p2p batches);
    * PyTorch: ``PipelineStage`` + ``Schedule1F1B`` (``step(x)`` / ``step(target=...)``).

    All run the same weights in the same processes, taking turns every iteration (order rotated);
    each timed step starts after a barrier and its time is the slower rank's. Compute time per
    stage is measured the same way for both, from inside the model: forward by timing the stage
    module's forward, backward from the first gradient reaching the stage output to the last
    parameter gradient accumulated; idle = step time - compute. The ideal idle share of stage 0
    is the bubble (p-1)/(m+p-1) = 1/9 = 0.11. Before timing, the two are checked to give the
    same parameter gradients. Last, one paraloom step is recorded in a ledger and drawn as
    ``pp_schedule.png`` (``--picture``), with the bubble measured from its compute spans.

How to run
    ``.venv/bin/python benchmarks/pp.py`` (``--iters 20 --picture pp_schedule.png``); only
    rank 0 prints.

Goal
    paraloom / torch median step time <= 0.95.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from paraloom.launch import spawn
from paraloom.ledger import Ledger, recording
from paraloom.mesh import ParallelMesh
from paraloom.pipeline_parallel import forward_backward_pipelining_without_interleaving
from paraloom.pipeline_parallel.stage import layer_range

P, M, L, H, FFN, S, B = 2, 8, 8, 256, 1024, 64, 4


class Timer:
    """Compute time of one stage: forwards timed directly, backwards from first to last grad."""

    def __init__(self) -> None:
        self.total, self.bwd_start, self.bwd_end = 0.0, None, None

    def close_backward(self) -> None:
        if self.bwd_start is not None and self.bwd_end is not None:
            self.total += max(self.bwd_end - self.bwd_start, 0.0)
        self.bwd_start = self.bwd_end = None


class _BackwardStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, timer):
        ctx.timer = timer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.timer.close_backward()
        ctx.timer.bwd_start = time.perf_counter()
        return grad, None


class Stage(nn.Module):
    """Blocks of one stage; input via ``set_input_tensor`` (paraloom) or the argument (torch)."""

    def __init__(self, layers: range, timer: Timer) -> None:
        super().__init__()
        torch.manual_seed(0)
        full = [nn.Sequential(nn.Linear(H, FFN), nn.GELU(), nn.Linear(FFN, H)) for _ in range(L)]
        self.layers = nn.ModuleDict({str(i): full[i] for i in layers})
        self.timer, self.input_tensor = timer, None
        for p in self.parameters():
            p.register_post_accumulate_grad_hook(lambda _: setattr(timer, "bwd_end",
                                                                   time.perf_counter()))

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def forward(self, x):
        t0 = time.perf_counter()
        self.timer.close_backward()
        h = x if self.input_tensor is None else self.input_tensor
        for block in self.layers.values():
            h = h + block(h)
        out = _BackwardStart.apply(h, self.timer) if torch.is_grad_enabled() else h
        self.timer.total += time.perf_counter() - t0
        return out


def data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g))
            for _ in range(M)]


def _step_paraloom(model, mesh, batches, overlap=None):
    def forward_step(it, chunk):
        x, target = next(it)
        return chunk(x), lambda out: F.mse_loss(out, target)

    return forward_backward_pipelining_without_interleaving(
        forward_step, iter(batches), model, M, S, B, mesh=mesh, hidden_size=H,
        overlap_p2p_comm=overlap)


def _step_torch(schedule, rank, batches):
    # torch splits dim 0 into microbatches: stack the [s, b, h] microbatches along a new dim 0
    x = torch.stack([b[0] for b in batches])  # [m, s, b, h]
    target = torch.stack([b[1] for b in batches])
    if rank == 0:
        schedule.step(x)
    else:
        losses = []
        schedule.step(target=target, losses=losses)


class _TorchStage(nn.Module):
    """torch feeds one microbatch ``[1, s, b, h]``: drop the split dim around the same blocks."""

    def __init__(self, inner: Stage) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.squeeze(0)).unsqueeze(0)


def _timed(fn, timer):
    for p in timer_params[id(timer)]:
        p.grad = None
    timer.total = 0.0
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    timer.close_backward()
    elapsed = time.perf_counter() - t0
    stats = torch.tensor([elapsed, timer.total], dtype=torch.float64)
    gathered = [torch.zeros_like(stats) for _ in range(P)]
    dist.all_gather(gathered, stats)
    return max(g[0].item() for g in gathered), [(g[0].item(), g[1].item()) for g in gathered]


timer_params: dict[int, list] = {}


def main(rank: int, world: int, iters: int, picture: str | None) -> None:
    mesh = ParallelMesh(pp=P)
    layers = layer_range(L, P, rank)
    ours_t, blocking_t, theirs_t = Timer(), Timer(), Timer()
    ours, blocking = Stage(layers, ours_t), Stage(layers, blocking_t)
    theirs = Stage(layers, theirs_t)
    for timer, model in ((ours_t, ours), (blocking_t, blocking), (theirs_t, theirs)):
        timer_params[id(timer)] = list(model.parameters())
    loss_fn = lambda out, target: F.mse_loss(out.squeeze(0), target.squeeze(0))  # noqa: E731
    stage = PipelineStage(_TorchStage(theirs), rank, P, torch.device("cpu"),
                          group=mesh.pp.group)
    schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=loss_fn)
    batches = data()
    runs = {"paraloom": (lambda: _step_paraloom(ours, mesh, batches), ours_t),
            "paraloom-blocking": (lambda: _step_paraloom(blocking, mesh, batches, False),
                                  blocking_t),
            "torch": (lambda: _step_torch(schedule, rank, batches), theirs_t)}
    for name in runs:  # warm up (torch infers shapes on its first step) and check equality
        _timed(*runs[name])
    for (n, a), b, c in zip(ours.named_parameters(), theirs.parameters(), blocking.parameters(),
                            strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=f"grad of {n}")
        torch.testing.assert_close(a.grad, c.grad, rtol=0, atol=0, msg=f"grad of {n}")
    times = {name: [] for name in runs}
    per_rank = {name: [] for name in runs}
    names = list(runs)
    for it in range(iters):
        for name in names[it % len(names):] + names[:it % len(names)]:
            step, ranks = _timed(*runs[name])
            times[name].append(step)
            per_rank[name].append(ranks)
    ledger = Ledger(rank)
    with recording(ledger):
        _step_paraloom(ours, mesh, batches)
    spans = [None] * P
    dist.all_gather_object(spans, ledger.events)
    if rank != 0:
        return
    ratios = [a / b for a, b in zip(times["paraloom"], times["torch"], strict=True)]
    blocking_ratios = [a / b for a, b in zip(times["paraloom-blocking"], times["torch"],
                                             strict=True)]
    overlap_ratios = [a / b for a, b in zip(times["paraloom"], times["paraloom-blocking"],
                                            strict=True)]
    print(f"pp={P}, m={M}, 8 blocks h={H} ffn={FFN}, s={S}, b={B}, fp32 gloo, {iters} iters")
    print(f"{'':18}{'median step':>13}{'stage':>7}{'compute':>10}{'idle':>9}{'idle share':>12}")
    for name in runs:
        med = statistics.median(times[name])
        for r in range(P):
            compute = statistics.median(x[r][1] for x in per_rank[name])
            idle = med - compute
            print(f"{name if r == 0 else '':18}{med * 1e3 if r == 0 else float('nan'):>11.1f}ms"
                  .replace("nanms", "     ") + f"{r:>7}{compute * 1e3:>8.1f}ms{idle * 1e3:>7.1f}ms"
                  f"{idle / med:>12.3f}")
    print(f"ratio paraloom / torch (median of paired ratios): {statistics.median(ratios):.3f}"
          f"  (goal <= 0.95); ideal idle share of stage 0: {(P - 1) / (M + P - 1):.3f}")
    print(f"ratio paraloom-blocking / torch: {statistics.median(blocking_ratios):.3f}; "
          f"paraloom / paraloom-blocking: {statistics.median(overlap_ratios):.3f}")
    if picture:
        from paraloom.report import plots

        events = [e for rank_events in spans for e in rank_events]
        blocks, rows = plots.ledger_blocks(json.loads(json.dumps(events)))
        bubble = plots.bubble_of(blocks, len(rows))
        plots.draw_schedule(blocks, rows, picture, time_unit="seconds",
                            title=f"paraloom 1F1B, pp={P}, m={M} (recorded), bubble {bubble:.3f}")
        print(f"recorded step: bubble {bubble:.3f} from the ledger's compute spans; "
              f"picture {picture}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--picture", default="pp_schedule.png")
    args = parser.parse_args()
    spawn(main, P, args.iters, args.picture or None)
