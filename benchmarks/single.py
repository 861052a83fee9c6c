"""paraloom's trivial layout (tp = pp = dp = 1) against a plain PyTorch training loop, side by side.

What it measures
    One optimizer step of the same GPT — 4 layers, h=256, 4 heads, s=128, b=8, the byte
    vocabulary (256, tied embeddings), learned positions, pre-LayerNorm, written-out causal
    attention, tanh-GeLU MLP — in one process with the same intra-op threads:

    * paraloom: ``training.train.build`` + ``train_step`` of a ``TrainConfig`` with one rank
      (the code ``paraloom train`` runs: the model from the parallel layers, the data-parallel
      wrapper and its fp32 gradient buffer, the grad-norm all-reduce (bypassed at size 1), the
      clipping and the AdamW update);
    * plain: the loop one writes without any framework, nanoGPT-style — batch-first blocks of
      ``nn.Linear``/``nn.LayerNorm``, ``F.cross_entropy``, ``zero_grad(set_to_none=True)``,
      ``clip_grad_norm_``, ``torch.optim.AdamW`` (its default implementation on CPU, or
      ``--plain-optimizer fused`` / ``foreach``).

    Both run in one process, under glibc's default allocator (``--tuned-malloc``: the settings
    ``paraloom train`` applies in its ranks, :func:`paraloom.device.tune_allocator`, for both).
    Both start from the same weights (copied from paraloom's model), read the same batches and
    use the same hyper-parameters (lr schedule, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on
    matrices and embeddings and none on biases and norms as in nanoGPT's two groups, clip 1.0);
    their losses are checked to agree before timing. Iterations alternate (paraloom first on even
    iterations), so both see the same machine state; the figure is the median of the paired
    ratios paraloom / plain.

How to run
    ``.venv/bin/python benchmarks/single.py`` (``--iters 30 --threads 2``); ``--profile``
    prints torch.profiler's table of one step of each.

Goal
    paraloom / plain <= 1.00.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from paraloom.config import ModelConfig, ParallelConfig, TrainConfig
from paraloom.data import Corpus, load_corpus
from paraloom.device import tune_allocator
from paraloom.mesh import ParallelMesh
from paraloom.training.lr_schedule import learning_rate
from paraloom.training.train import build, train_step


class Block(nn.Module):
    """nanoGPT's block, batch-first ``[b, s, h]``; QKV rows per head ``[q, k, v]`` as paraloom's
    (any layout costs the same; this one lets the weights be copied unchanged)."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x, mask):
        b, s, h = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, self.heads, 3, h // self.heads)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)          # [b, heads, s, d]
        att = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        h, v = m.hidden_size, m.padded_vocab(1)
        self.wte, self.wpe = nn.Embedding(v, h), nn.Embedding(m.seq_length, h)
        self.blocks = nn.ModuleList(Block(h, m.num_attention_heads) for _ in range(m.num_layers))
        self.ln_f = nn.LayerNorm(h)
        self.vocab = m.vocab_size
        mask = torch.ones(m.seq_length, m.seq_length, dtype=torch.bool).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, ids, targets):                               # [b, s]
        s = ids.shape[1]
        x = self.wte(ids) + self.wpe.weight[:s]
        for block in self.blocks:
            x = block(x, self.mask[:s, :s])
        logits = F.linear(self.ln_f(x), self.wte.weight)[..., :self.vocab]  # tied
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def load_from(self, chunk) -> None:
        """Copy paraloom's (1, 1, 1) model weights (global names) into this one."""
        ours = dict(chunk.named_parameters())
        names = {"wte.weight": "embedding.word_embeddings.weight",
                 "wpe.weight": "embedding.position_embeddings.weight",
                 "ln_f.weight": "final_layernorm.weight", "ln_f.bias": "final_layernorm.bias"}
        for i in range(len(self.blocks)):
            for mine, theirs in (("ln1", "ln1"), ("ln2", "ln2"), ("qkv", "attention.qkv"),
                                 ("proj", "attention.proj"), ("fc1", "mlp.fc1"),
                                 ("fc2", "mlp.fc2")):
                for kind in ("weight", "bias"):
                    names[f"blocks.{i}.{mine}.{kind}"] = f"layers.{i}.{theirs}.{kind}"
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(ours[names[name]])


def make(args):
    model = ModelConfig(hidden_size=args.hidden, num_layers=args.layers,
                        num_attention_heads=args.heads, seq_length=args.seq)
    cfg = TrainConfig().replace(model=model, parallel=ParallelConfig(),
                                global_batch_size=args.batch,
                      micro_batch_size=args.batch, steps=args.warmup + args.iters, lr=3e-4,
                      min_lr=3e-5, warmup_steps=2)
    corpus = Corpus(load_corpus(None), model.seq_length, cfg.seed)
    run = build(cfg, ParallelMesh(cfg.parallel), corpus)
    plain = PlainGPT(model)
    plain.load_from(run.chunks[0])
    impl = {"default": {}, "fused": {"fused": True}, "foreach": {"foreach": True}}
    params = list(plain.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2]},  # nanoGPT's configure_optimizers
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    o = cfg.optim
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                            weight_decay=o.weight_decay, **impl[args.plain_optimizer])
    return cfg, run, plain, opt


def plain_step(cfg, corpus, model, opt, step: int) -> dict:
    batch = corpus.global_batch(step, cfg.global_batch_size)
    ids, targets = batch[:, :-1], batch[:, 1:]
    for group in opt.param_groups:
        group["lr"] = learning_rate(step, lr=cfg.optim.lr, min_lr=cfg.optim.min_lr,
                                    warmup_steps=cfg.optim.warmup_steps, total_steps=cfg.steps)
    opt.zero_grad(set_to_none=True)
    loss = model(ids, targets)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)
    opt.step()
    return {"loss": loss.item(), "grad_norm": norm.item()}


def profile(fn, label: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof
    with prof(activities=[ProfilerActivity.CPU]) as p:
        fn()
    print(f"--- {label}")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plain-optimizer", choices=("default", "fused", "foreach"),
                    default="default", help="torch.optim.AdamW implementation of the plain loop")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--tuned-malloc", action="store_true",
                    help="apply paraloom.device.tune_allocator (as `paraloom train` does) to the "
                         "process both run in")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.tuned_malloc:  # what `paraloom train` does in every rank; the plain loop shares
        tune_allocator()   # this process, so it gets the same allocator
    cfg, run, plain, opt = make(args)
    ours = lambda s: train_step(run, s)  # noqa: E731
    theirs = lambda s: plain_step(cfg, run.corpus, plain, opt, s)  # noqa: E731
    for step in range(args.warmup):  # same model, same batches: the same losses
        a, b = ours(step), theirs(step)
        if not math.isclose(a["loss"], b["loss"], rel_tol=1e-4):
            raise SystemExit(f"step {step}: paraloom loss {a['loss']} != plain {b['loss']}")
        if not math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-3):
            raise SystemExit(f"step {step}: grad norm {a['grad_norm']} != {b['grad_norm']}")
    times = {"paraloom": [], "plain": []}
    for i in range(args.iters):
        step = args.warmup + i
        order = [("paraloom", ours), ("plain", theirs)]
        for name, fn in order if i % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            fn(step)
            times[name].append(time.perf_counter() - t0)
    if args.profile:
        profile(lambda: ours(args.warmup + args.iters), "paraloom")
        profile(lambda: theirs(args.warmup + args.iters), "plain")
    ratios = [a / b for a, b in zip(times["paraloom"], times["plain"], strict=True)]
    n = sum(p.numel() for p in plain.parameters())
    print(f"GPT: {args.layers} layers, h={args.hidden}, s={args.seq}, b={args.batch}, "
          f"{n / 1e6:.2f}M parameters; {args.threads} threads; plain AdamW: "
          f"{args.plain_optimizer}; {args.iters} alternating iterations")
    for name, v in times.items():
        v = sorted(v)
        print(f"  {name:9s} median step {statistics.median(v) * 1e3:7.1f} ms  "
              f"(min {v[0] * 1e3:.1f}, max {v[-1] * 1e3:.1f})")
    print(f"ratio paraloom / plain (median of paired ratios): {statistics.median(ratios):.3f}"
          f"  (goal <= 1.00)")


if __name__ == "__main__":
    main()
