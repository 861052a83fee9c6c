"""The rank side of ``paraloom eval``: the loss of a checkpoint (paraloom or Hugging Face) on
held-out text, under any layout (checkpoints are stored under global names).

Rank 0 prints one JSON line (``paraloom.commands.eval`` is the command)::

    {"loss": 2.71, "tokens": 16384, "windows": 512, "checkpoint": "...", "step": 150,
     "split": "heldout"}
"""

from __future__ import annotations

import json

import torch.distributed as dist

from ..config import TrainConfig
from ..data import Corpus, eval_batches, load_tokens
from ..device import tune_allocator
from ..mesh import ParallelMesh
from .checkpoint import load_checkpoint
from .state import state_entries
from .train import build, evaluate

__all__ = ["evaluate_rank"]


def evaluate_rank(rank: int, world: int, cfg: TrainConfig, ckpt, split: str, batches: int,
                  hf: str | None = None) -> None:
    """Evaluate ``ckpt`` (a paraloom checkpoint folder) or ``hf`` (a Hugging Face folder) on
    ``batches`` global batches of ``split`` (``heldout`` or ``all``)."""
    tune_allocator()
    mesh = ParallelMesh(cfg.parallel)
    d = cfg.data
    corpus = Corpus(load_tokens(d.file, d.data_path, d.tokenizer), cfg.model.seq_length, cfg.seed,
                    **d.split_parts())
    run = build(cfg, mesh, corpus, init_from_hf=hf)
    meta = {"step": 0}
    if hf is None:
        entries = {k: e for k, e in state_entries(run, for_save=False)[0].items()
                   if k.startswith("model.")}  # parameters only: no optimizer state needed
        meta = load_checkpoint(ckpt, entries, mesh)
    start = 0 if split == "all" else None
    chosen = eval_batches(corpus, cfg.global_batch_size, batches, start=start)
    loss = evaluate(run, chosen)
    if dist.get_rank() == 0:
        # a short evaluated part repeats windows: "tokens" counts scored positions, "windows"
        # the distinct ones, so a 65-byte file does not read as thousands of tokens of text
        distinct = len({tuple(row.tolist()) for tokens, _ in chosen for row in tokens})
        tokens = batches * cfg.global_batch_size * cfg.model.seq_length
        print(json.dumps({"loss": loss, "tokens": tokens, "windows": distinct,
                          "checkpoint": str(ckpt or hf), "step": meta["step"], "split": split}),
              flush=True)
