"""The training loop on one rank, and the run folder it writes (DESIGN.md, "Run folder").

Rank 0 writes ``config.json`` and ``metrics.jsonl`` (one flushed line per step); every rank
appends its recorded ledger events to ``ledger/rank_N.jsonl`` after each recorded step, so a
crash keeps what was done (on each node, local rank 0 creates the folder: ``nodes.py``). At the
end rank 0 merges them into ``ledger.jsonl`` and writes ``trace.json``, ``comm_table.md``,
``loss.png``, ``summary.json`` (held-out loss before and after) and ``report.html`` (all of it on
one page). With ``--tensorboard-dir``, rank 0 also writes TensorBoard scalars
(``tensorboard.py``). Checkpoints go to ``checkpoints/step_N/`` (atomically, see
``checkpoint.py``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from .. import comm
from ..launch import timing_event_type, tune_allocator
from ..ledger import Ledger, merge, recording
from ..mesh import ParallelMesh
from ..tensor_parallel.random import rng_state_dict
from .checkpoint import FORMAT, find_checkpoint, load_checkpoint, save_checkpoint
from .data import Corpus, eval_batches, load_tokens
from .nodes import needs_shared_folder, prepare_run_folder
from .progress import show_progress
from .resume import continue_folder, continue_ledger, restore_rng, same_layout, same_run
from .state import state_entries
from .train import build, evaluate, train_step

__all__ = ["run_rank", "config_dict", "EVAL_BATCHES"]

EVAL_BATCHES = 2
"""Held-out global batches evaluated before and after training."""


def config_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _resume(run, path: str) -> tuple[int, Path, dict]:
    ckpt, meta = find_checkpoint(path)  # the model shape was compared before ranks started
    entries, finish = state_entries(run, for_save=False)
    load_checkpoint(ckpt, entries, run.mesh)
    finish(meta)
    run.tokens = int(meta["tokens"])
    start = int(meta["step"])
    # under another layout the flags' check already said so (resume.resume_args)
    if not restore_rng(ckpt, meta, run, dist.get_rank(), start) and run.cfg.model.dropout > 0 \
            and dist.get_rank() == 0 and same_layout(meta, run.cfg):
        print(f"note: dropout RNG streams re-seeded from (seed, step {start}): the checkpoint "
              f"has none for this rank", file=sys.stderr, flush=True)
    return start, ckpt, meta


def _save(run, out: Path, step: int) -> None:
    entries, _ = state_entries(run, for_save=True)
    meta = {"step": step, "tokens": run.tokens, "optimizer_steps": run.optimizers[0].step_count,
            "config": config_dict(run.cfg), "format": FORMAT}
    save_checkpoint(out / "checkpoints" / f"step_{step}", entries, meta, run.mesh,
                    rank_state=rng_state_dict(run.device))


def run_rank(cfg, t0: float, init_from_hf: str | None = None) -> dict | None:
    """Train ``cfg`` on this rank (the world is initialised); rank 0 returns the summary.
    ``init_from_hf``: start from a Hugging Face GPT-2 checkpoint folder's weights."""
    tune_allocator()
    out = Path(cfg.out)
    rank = dist.get_rank()
    mesh = ParallelMesh(cfg.parallel)
    folder = prepare_run_folder(out, mesh.world)  # on every node; who sees rank 0's folder
    needs_shared_folder(folder, cfg.save_every)
    corpus = Corpus(load_tokens(cfg.data, cfg.data_path, cfg.tokenizer), cfg.model.seq_length,
                    cfg.seed)
    run = build(cfg, mesh, corpus, init_from_hf=init_from_hf or cfg.init_from_hf)
    start, ckpt, meta = _resume(run, cfg.resume) if cfg.resume else (0, None, None)
    # continuing in the run's own folder with the same layout keeps its ledger of earlier steps
    # and records the steps an uninterrupted run records; otherwise the ledger starts again
    same = ckpt is not None and same_run(out, ckpt)
    keep_ledger = same and same_layout(meta, cfg)
    if rank == 0:
        (out / "config.json").write_text(json.dumps(config_dict(cfg), indent=1))
        continue_folder(out, start, same, keep_ledger, mesh.world.size)
    comm.barrier(mesh.world, site="run_rank:setup")
    held_out = eval_batches(corpus, cfg.global_batch_size, EVAL_BATCHES)
    val_before = evaluate(run, held_out)
    ledger_file = out / "ledger" / f"rank_{rank}.jsonl"
    next_seq, kept_until = continue_ledger(ledger_file, start, keep_ledger)
    if keep_ledger:  # the continuation's times follow the kept events' on the trace
        last = torch.tensor([kept_until], dtype=torch.float64, device=run.device)
        comm.all_reduce(last, mesh.world, phase="setup", kind="world", op="max",
                        site="run_rank:resumed_ledger_time")
        t0 -= float(last.item())
    ledger = Ledger(rank=rank, t0=t0, event_type=timing_event_type(run.device))
    ledger.next_seq = next_seq
    first_recorded = 0 if keep_ledger else start
    bad = 0
    scalars = None
    if rank == 0 and cfg.tensorboard_dir:
        from .tensorboard import ScalarLog
        scalars = ScalarLog(cfg.tensorboard_dir, cfg.log_interval, cfg.steps)
    for step in range(start, cfg.steps):
        record = cfg.ledger_steps < 0 or step - first_recorded < cfg.ledger_steps
        ledger.events.clear()
        tic = time.time()
        with recording(ledger) if record else nullcontext(), ledger.at(step=step):
            metrics = train_step(run, step)
        elapsed = time.time() - tic
        if record:
            ledger.dump(ledger_file, mode="a")
        if rank == 0:
            line = {"step": step, **metrics, "tokens": run.tokens, "time_s": elapsed}
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
            tokens = cfg.global_batch_size * cfg.model.seq_length
            show_progress(step, cfg.steps, metrics, tokens / max(elapsed, 1e-9))
            if scalars is not None:
                scalars.step(step, metrics, tokens / max(elapsed, 1e-9),
                             ledger.events if record else None)
            if metrics.get("skipped"):
                print(f"step {step}: non-finite loss ({metrics['loss']}) or gradient norm "
                      f"({metrics['grad_norm']}): update skipped", file=sys.stderr, flush=True)
        bad = bad + 1 if metrics.get("skipped") else 0
        if bad >= cfg.max_bad_steps:
            raise FloatingPointError(
                f"stopping at step {step}: {bad} consecutive steps with a non-finite loss or "
                f"gradient (max_bad_steps = {cfg.max_bad_steps}); lower --lr, check the data, "
                f"or resume from the last checkpoint")
        if cfg.save_every and ((step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps):
            _save(run, out, step + 1)
    if scalars is not None:
        scalars.close()
    val_after = evaluate(run, held_out)
    summary = {"held_out_loss_before": val_before, "held_out_loss_after": val_after,
               "steps": cfg.steps, "start_step": start, "tokens": run.tokens}
    from ..ledger import load
    events = comm.gather_objects(load(ledger_file), mesh.world)
    if rank == 0:
        if not folder.shared:
            summary["ranks_elsewhere"] = folder.elsewhere()
            print(f"note: {folder.describe()}", file=sys.stderr, flush=True)
        _write_reports(out, merge(events), summary)
        return summary
    return None


def _write_reports(out: Path, events: list[dict], summary: dict) -> None:
    from ..report.table import render_table
    from ..report.trace import write_trace
    with open(out / "ledger.jsonl", "w") as f:
        for event in events:
            f.write(json.dumps(event) + "\n")
    write_trace(events, out / "trace.json")
    if events:
        (out / "comm_table.md").write_text(render_table(events, rank=0) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    try:
        from ..report.plots import plot_loss
        plot_loss(out / "metrics.jsonl", out / "loss.png")
        from ..report.expert_load import plot_expert_load
        plot_expert_load(out / "metrics.jsonl", out / "expert_load.png")  # MoE runs only
    except ImportError as err:  # matplotlib missing: everything else is written
        print(f"loss.png not written: {err}", file=sys.stderr)
    from ..report.html import write_report
    try:
        write_report(out)
    except (ValueError, KeyError, TypeError, OSError) as err:  # the run itself is done
        print(f"report.html not written: {err}", file=sys.stderr)
