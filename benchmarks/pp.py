"""Pipeline schedules: paraloom's 1F1B and ZB-H1 against torch.distributed.pipelining, side by side.

What it measures
    A stack of 8 residual MLP blocks ``x + fc2(gelu(fc1(x)))`` (h=256, ffn=1024) over p=2 ranks,
    m=8 microbatches of s=64 x b=4 tokens, MSE loss on the last stage, fp32 on CPU over gloo, one
    intra-op thread per rank, ranks forked by :func:`paraloom.launch.spawn`. Every run holds the
    same weights and computes the same gradients (checked first, block by block):

    * ``paraloom 1F1B``: ``forward_backward_pipelining_without_interleaving`` on ``nn.Linear``
      blocks (4 per stage), p2p overlapped with compute (the default on gloo);
    * ``paraloom 1F1B blocking``: the same with ``overlap_p2p_comm=False``;
    * ``paraloom 1F1B, own layers``: the same schedule on paraloom's Column/RowParallelLinear
      (tp = 1): what ZB-H1 runs on, so the two differ by the schedule alone;
    * ``paraloom ZB-H1``: ``forward_backward_zero_bubble`` on those layers: each backward split
      into B (input gradient, sent on at once) and W (the weight-gradient GEMMs, run where 1F1B
      idles);
    * ``torch 1F1B``: ``PipelineStage`` + ``Schedule1F1B`` on the ``nn.Linear`` blocks, the
      baseline of every ratio;
    * ``torch ZBV`` and ``torch interleaved ZB``: PyTorch's zero-bubble schedules,
      ``ScheduleZBVZeroBubble`` (V-shaped: rank 0 holds stages 0 and 3) and
      ``ScheduleInterleavedZeroBubble`` (rank r holds stages r and r + 2), 4 stages of 2 blocks
      (they need two stages per rank); their backward is split by autograd into input and
      weight parts.

    Runs take turns every iteration (order rotated); each timed step starts after a barrier and
    its time is the slower rank's. For the 1F1B runs the compute of each stage is measured from
    inside the model (forward timed directly; backward from the first gradient reaching the
    stage output to the last parameter gradient accumulated) and idle = step - compute; the
    ideal idle share of 1F1B is the bubble (p-1)/(m+p-1) = 1/9 = 0.11. Last, one 1F1B and one
    ZB-H1 step are recorded in a ledger and drawn (``--picture``), with the bubble measured from
    their compute spans.

How to run
    ``.venv/bin/python benchmarks/pp.py`` (``--iters 20 --picture pp_schedule.png``,
    ``--microbatches 4`` for a pipeline whose bubble weighs more); only rank 0 prints.

Goal
    paraloom 1F1B / torch 1F1B <= 0.95 and paraloom ZB-H1 / torch 1F1B <= 0.90 (medians of the
    paired ratios).
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
from torch.distributed.pipelining.schedules import (
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from paraloom.device import tune_allocator
from paraloom.launch import spawn
from paraloom.ledger import Ledger, recording
from paraloom.mesh import ParallelMesh
from paraloom.pipeline_parallel import forward_backward_pipelining_without_interleaving
from paraloom.pipeline_parallel.schedules import forward_backward_zero_bubble
from paraloom.pipeline_parallel.stage import layer_range
from paraloom.tensor_parallel import ColumnParallelLinear, RowParallelLinear

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


class OwnBlock(nn.Module):
    """The same block from paraloom's parallel layers at tp = 1 (what ZB-H1 defers W in)."""

    def __init__(self, mesh: ParallelMesh, i: int, split: bool) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(H, FFN, mesh=mesh, name=f"layers.{i}.fc1",
                                        own_backward=split)
        self.fc2 = RowParallelLinear(FFN, H, input_is_parallel=True, mesh=mesh,
                                     name=f"layers.{i}.fc2", own_backward=split)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)[0]))[0]


def blocks(ids, mesh: ParallelMesh | None = None, split: bool = False) -> nn.ModuleDict:
    """Blocks ``ids`` of the stack (seeded: the same weights in every run); ``mesh``: built from
    paraloom's layers (``split``: for a zero-bubble schedule), else
    ``nn.Sequential(Linear, GELU, Linear)``."""
    torch.manual_seed(0)
    full = [nn.Sequential(nn.Linear(H, FFN), nn.GELU(), nn.Linear(FFN, H)) for _ in range(L)]
    if mesh is None:
        return nn.ModuleDict({str(i): full[i] for i in ids})
    own = nn.ModuleDict({str(i): OwnBlock(mesh, i, split) for i in ids})
    with torch.no_grad():
        for i in ids:
            for a, b in zip(own[str(i)].parameters(), full[i].parameters(), strict=True):
                a.copy_(b)
    return own


class Stage(nn.Module):
    """Blocks of one stage; input via ``set_input_tensor`` (paraloom) or the argument (torch)."""

    def __init__(self, layers: nn.ModuleDict, timer: Timer) -> None:
        super().__init__()
        self.layers, self.timer, self.input_tensor = layers, timer, None
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


class _TorchStage(nn.Module):
    """torch feeds one microbatch ``[1, s, b, h]``: drop the split dim around the same blocks."""

    def __init__(self, inner: Stage) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.squeeze(0)).unsqueeze(0)


def data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g))
            for _ in range(M)]


def _paraloom(schedule, model, mesh, batches, **kw):
    def forward_step(it, chunk):
        x, target = next(it)
        return chunk(x), lambda out: F.mse_loss(out, target)

    return lambda: schedule(forward_step, iter(batches), model, M, S, B, mesh=mesh,
                            hidden_size=H, **kw)


def _torch(schedule, first: bool, last: bool, batches):
    # torch splits dim 0 into microbatches: stack the [s, b, h] microbatches along a new dim 0
    x = torch.stack([b[0] for b in batches])  # [m, s, b, h]
    target = torch.stack([b[1] for b in batches])

    def step():
        args = (x,) if first else ()
        kwargs = dict(target=target, losses=[]) if last else {}
        schedule.step(*args, **kwargs)
    return step


def _loss(out, target):
    return F.mse_loss(out.squeeze(0), target.squeeze(0))


class _Blocks(nn.Module):
    """The blocks on torch's ``[1, s, b, h]`` microbatch as it is (no view at the output: the
    zero-bubble schedules detach stage outputs in place)."""

    def __init__(self, layers: nn.ModuleDict) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x):
        for block in self.layers.values():
            x = x + block(x)
        return x


def _torch_multi(cls, rank: int, mesh: ParallelMesh, style: str, batches):
    """A torch schedule over 4 stages of 2 blocks, two per rank (``v``: 0,3 | 1,2; ``loop``:
    0,2 | 1,3). Returns (step, parameters by block index)."""
    ids = {"v": [(0, 3), (1, 2)], "loop": [(0, 2), (1, 3)]}[style][rank]
    stages, params = [], {}
    for index in ids:
        module = _Blocks(blocks(range(2 * index, 2 * index + 2)))
        params.update({int(k): list(b.parameters()) for k, b in module.layers.items()})
        stages.append(PipelineStage(module, index, 2 * P, torch.device("cpu"),
                                    group=mesh.pp.group))
    schedule = cls(stages, n_microbatches=M, loss_fn=_loss)
    return _torch(schedule, 0 in ids, 2 * P - 1 in ids, batches), params


def _timed(fn, params, timer):
    for p in params:
        p.grad = None
    if timer is not None:
        timer.total = 0.0
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    if timer is not None:
        timer.close_backward()
    elapsed = time.perf_counter() - t0
    stats = torch.tensor([elapsed, timer.total if timer else 0.0], dtype=torch.float64)
    gathered = [torch.zeros_like(stats) for _ in range(P)]
    dist.all_gather(gathered, stats)
    return max(g[0].item() for g in gathered), [(g[0].item(), g[1].item()) for g in gathered]


def _check_same_grads(runs, rank) -> None:
    """Every run's gradient of every block equals torch 1F1B's (rtol 1e-4)."""
    mine = {name: {i: [p.grad.clone() for p in ps] for i, ps in run[1].items()}
            for name, run in runs.items()}
    every = [None] * P
    dist.all_gather_object(every, mine)
    if rank != 0:
        return
    merged = {name: {i: g for part in every for i, g in part[name].items()} for name in runs}
    want = merged["torch 1F1B"]
    for name, grads in merged.items():
        for i, ref in want.items():
            for a, b in zip(grads[i], ref, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6,
                                           msg=lambda m, n=name, i=i: f"{n}, block {i}: {m}")


def main(rank: int, world: int, iters: int, picture: str | None, tuned: bool = False) -> None:
    if tuned:  # what `paraloom train` does in its ranks; every run here shares the process
        tune_allocator()
    mesh = ParallelMesh(pp=P)
    ids = layer_range(L, P, rank)
    batches = data()
    runs = {}  # name -> (step, {block: params}, timer or None)

    def stage(own: bool, split: bool = False):
        timer = Timer()
        model = Stage(blocks(ids, mesh if own else None, split), timer)
        return model, timer, {int(k): list(b.parameters()) for k, b in model.layers.items()}

    ours, ours_t, ours_p = stage(False)
    runs["paraloom 1F1B"] = (_paraloom(forward_backward_pipelining_without_interleaving, ours,
                                       mesh, batches), ours_p, ours_t)
    blocking, blocking_t, blocking_p = stage(False)
    runs["paraloom 1F1B blocking"] = (_paraloom(
        forward_backward_pipelining_without_interleaving, blocking, mesh, batches,
        overlap_p2p_comm=False), blocking_p, blocking_t)
    own, own_t, own_p = stage(True)
    runs["paraloom 1F1B, own layers"] = (_paraloom(
        forward_backward_pipelining_without_interleaving, own, mesh, batches), own_p, own_t)
    zb, _, zb_p = stage(True, split=True)
    runs["paraloom ZB-H1"] = (_paraloom(forward_backward_zero_bubble, zb, mesh, batches), zb_p,
                              None)
    theirs, theirs_t, theirs_p = stage(False)
    one = Schedule1F1B(PipelineStage(_TorchStage(theirs), rank, P, torch.device("cpu"),
                                     group=mesh.pp.group), n_microbatches=M, loss_fn=_loss)
    runs["torch 1F1B"] = (_torch(one, rank == 0, rank == P - 1, batches), theirs_p, theirs_t)
    step, params = _torch_multi(ScheduleZBVZeroBubble, rank, mesh, "v", batches)
    runs["torch ZBV"] = (step, params, None)
    step, params = _torch_multi(ScheduleInterleavedZeroBubble, rank, mesh, "loop", batches)
    runs["torch interleaved ZB"] = (step, params, None)
    flat = {name: [p for ps in run[1].values() for p in ps] for name, run in runs.items()}
    for name, run in runs.items():  # warm up (torch infers shapes on its first step)
        _timed(run[0], flat[name], run[2])
    _check_same_grads(runs, rank)
    times = {name: [] for name in runs}
    per_rank = {name: [] for name in runs}
    names = list(runs)
    for it in range(iters):
        for name in names[it % len(names):] + names[:it % len(names)]:
            t, ranks = _timed(runs[name][0], flat[name], runs[name][2])
            times[name].append(t)
            per_rank[name].append(ranks)
    recorded = {}
    for name, model, schedule in (("1F1B", ours, forward_backward_pipelining_without_interleaving),
                                  ("ZB-H1", zb, forward_backward_zero_bubble)):
        ledger = Ledger(rank)
        with recording(ledger):
            _paraloom(schedule, model, mesh, batches)()
        every = [None] * P
        dist.all_gather_object(every, ledger.events)
        recorded[name] = [e for events in every for e in events]
    if rank != 0:
        return
    base = times["torch 1F1B"]
    print(f"pp={P}, m={M}, 8 blocks h={H} ffn={FFN}, s={S}, b={B}, fp32 gloo, {iters} iters")
    print(f"{'':27}{'median step':>12}{'/ torch 1F1B':>14}{'stage':>7}{'compute':>10}"
          f"{'idle share':>12}")
    for name in runs:
        med = statistics.median(times[name])
        ratio = statistics.median(a / b for a, b in zip(times[name], base, strict=True))
        head = f"{name:27}{med * 1e3:>10.1f}ms{ratio:>14.3f}"
        if runs[name][2] is None:
            print(f"{head}{'':>7}{'(backward split: not measured)':>22}")
            continue
        for r in range(P):
            compute = statistics.median(x[r][1] for x in per_rank[name])
            print(f"{head if r == 0 else '':53}{r:>7}{compute * 1e3:>8.1f}ms"
                  f"{(med - compute) / med:>12.3f}")
    print(f"ideal idle share of 1F1B: {(P - 1) / (M + P - 1):.3f}; goals: paraloom 1F1B <= 0.95, "
          f"paraloom ZB-H1 <= 0.90 (medians of paired ratios to torch 1F1B)")
    from paraloom.report import plots

    for name, events in recorded.items():
        blocks_, rows = plots.ledger_blocks(json.loads(json.dumps(events)))
        bubble = plots.bubble_of(blocks_, len(rows))
        line = f"recorded paraloom {name} step: bubble {bubble:.3f} from the ledger's compute spans"
        if picture:
            out = picture if name == "1F1B" else picture.replace(".png", "_zb.png")
            plots.draw_schedule(blocks_, rows, out, time_unit="seconds",
                                title=f"paraloom {name}, pp={P}, m={M} (recorded), "
                                      f"bubble {bubble:.3f}")
            line += f"; picture {out}"
        print(line)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--picture", default="pp_schedule.png")
    parser.add_argument("--tuned-malloc", action="store_true",
                        help="paraloom.device.tune_allocator in both ranks (shared by all runs)")
    parser.add_argument("--microbatches", type=int, default=M,
                        help=f"m (default {M}; the goals are stated for it)")
    args = parser.parse_args()
    M = args.microbatches  # the forked ranks inherit it
    spawn(main, P, args.iters, args.picture or None, args.tuned_malloc)
