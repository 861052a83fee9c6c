"""The training loop on one rank, and the run data it writes (:mod:`paraloom.run_folder`).

Rank 0 writes ``config.json``; the last rank, which holds the step's loss (Megatron's
``print_rank_last``), writes ``metrics.jsonl`` (one flushed line per step) and the progress line;
every rank appends its recorded ledger events to ``ledger/rank_N.jsonl`` after each recorded step,
so a crash keeps what was done (on each node, local rank 0 creates the folder: :mod:`.multinode`).
At the end rank 0 merges them into ``ledger.jsonl`` (gathered over the network, so every rank's
events are there wherever they were written; so are the metrics, when the last rank's node does
not see rank 0's folder) and writes ``summary.json`` (held-out loss before and after); the reports
made from all that (table, trace, plots, ``report.html``) are :mod:`paraloom.report.run_reports`'
job. With ``--tensorboard-dir``, the last rank also writes TensorBoard scalars
(:mod:`.tensorboard`). Checkpoints go to ``checkpoints/step_N/``
(atomically, see :mod:`.checkpoint`).
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from .. import comm
from ..config import TrainConfig
from ..config.megatron_fsdp_checks import ddp_overlaps_param_gather
from ..data import Corpus, eval_batches, load_tokens
from ..data_parallel import force_param_sync
from ..device import get_device, timing_event_type, tune_allocator
from ..heartbeat import Heartbeat
from ..ledger import Ledger, merge, recording
from ..mesh import ParallelMesh
from ..run_folder import (
    CONFIG,
    METRICS,
    SUMMARY,
    rank_ledger,
    read_json_lines,
    write_events,
    write_json_lines,
)
from ..tensor_parallel.random import rng_state_dict
from . import megatron_lm_setup
from .checkpoint import FORMAT, find_checkpoint, load_checkpoint, save_checkpoint
from .multinode import checkpoint_interval, prepare_run_folder
from .progress import show_progress
from .resume import continue_folder, continue_ledger, restore_rng, same_layout, same_run
from .state import state_entries
from .tensorboard import ScalarLog
from .train import build, evaluate, train_step

__all__ = ["run_rank", "EVAL_BATCHES"]

EVAL_BATCHES = 2
"""Held-out global batches evaluated before and after training."""


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
    force_param_sync(run.ddps)  # Megatron-LM's, before a checkpoint
    entries, _ = state_entries(run, for_save=True)
    meta = {"step": step, "tokens": run.tokens, "optimizer_steps": run.optimizers[0].step_count,
            "config": run.cfg.to_dict(), "format": FORMAT}
    save_checkpoint(out / "checkpoints" / f"step_{step}", entries, meta, run.mesh,
                    rank_state=rng_state_dict(run.device))


def _set_up(cfg: TrainConfig, mesh: ParallelMesh, corpus: Corpus, t0: float):
    """Build the run, recording what it communicates (the ledger's ``setup`` section): the
    model's own set-up collectives, and with ``--megatron-lm-loop`` Megatron-LM's before and
    after them (:mod:`.megatron_lm_setup`). Returns the run and the ledger that holds them."""
    device = get_device()
    ledger = Ledger(rank=dist.get_rank(), t0=t0, event_type=timing_event_type(device))
    megatron_lm = cfg.megatron_lm_loop
    with recording(ledger):
        if megatron_lm:
            megatron_lm_setup.initialize(mesh, t0, device)
        run = build(cfg, mesh, corpus, init_from_hf=cfg.run.init_from_hf)
        if megatron_lm:
            megatron_lm_setup.param_groups(run.chunks, mesh, device)
            megatron_lm_setup.data_setup(mesh, len(run.chunks), t0, device,
                                         train=cfg.steps > 0, evaluate=True)
    return run, ledger


def run_rank(cfg: TrainConfig, t0: float) -> dict | None:
    """Train ``cfg`` on this rank (the world is initialised); rank 0 returns the summary (it
    also holds ``"events"``: every rank's ledger, merged)."""
    tune_allocator()
    r = cfg.run
    out = Path(r.out)
    rank = dist.get_rank()
    mesh = ParallelMesh(cfg.parallel)
    folder = prepare_run_folder(out, mesh.world)  # on every node; who sees rank 0's folder
    save_every, note = checkpoint_interval(folder, r.save_every)
    if note and rank == 0:
        print(f"paraloom train: note: {note}", file=sys.stderr, flush=True)
    d = cfg.data
    corpus = Corpus(load_tokens(d.file, d.data_path, d.tokenizer), cfg.model.seq_length, cfg.seed,
                    **d.split_parts())
    run, setup = _set_up(cfg, mesh, corpus, t0)
    start, ckpt, meta = _resume(run, r.resume) if r.resume else (0, None, None)
    run.first_step, run.started = start, t0
    # continuing in the run's own folder with the same layout keeps its ledger of earlier steps
    # and records the steps an uninterrupted run records; otherwise the ledger starts again
    same = ckpt is not None and same_run(out, ckpt)
    keep_ledger = same and same_layout(meta, cfg)
    if rank == 0:
        (out / CONFIG).write_text(json.dumps(cfg.to_dict(), indent=1))
        continue_folder(out, start, same, keep_ledger, mesh.world.size)
    comm.barrier(mesh.world, site="run_rank:setup")
    held_out = eval_batches(corpus, cfg.global_batch_size, EVAL_BATCHES)
    val_before = evaluate(run, held_out)
    ledger_file = rank_ledger(out, rank)
    ledger = _step_ledger(run, setup, ledger_file, start, keep_ledger, t0)
    written = _train_steps(run, ledger, ledger_file, start, 0 if keep_ledger else start,
                           save_every)
    val_after = evaluate(run, held_out)
    summary = {"held_out_loss_before": val_before, "held_out_loss_after": val_after,
               "steps": run.step, "start_step": start, "tokens": run.tokens}
    if run.step < cfg.steps:  # stopped early (--exit-duration-in-mins)
        summary["planned_steps"] = cfg.steps
    return _finish(run, folder, ledger_file, written, summary)


def _step_ledger(run, setup: Ledger, ledger_file: Path, start: int, keep_ledger: bool,
                 t0: float) -> Ledger:
    """The ledger the steps record into: the set-up's, written out first; or, continuing a
    kept ledger (which has its set-up section: the continuation records none), a new one whose
    events follow the kept ones in ``seq`` and, on the trace, in time."""
    rank = dist.get_rank()
    next_seq, kept_until = continue_ledger(ledger_file, start, keep_ledger)
    if not keep_ledger:
        setup.dump(ledger_file, mode="a")
        setup.events.clear()
        return setup
    last = torch.tensor([kept_until], dtype=torch.float64, device=run.device)
    comm.all_reduce(last, run.mesh.world, phase="setup", kind="world", op="max",
                    site="run_rank:resumed_ledger_time")
    ledger = Ledger(rank=rank, t0=t0 - float(last.item()),
                    event_type=timing_event_type(run.device))
    ledger.next_seq = next_seq
    return ledger


def _train_steps(run, ledger: Ledger, ledger_file: Path, start: int, first_recorded: int,
                 save_every: int) -> list[dict]:
    """Steps ``start + 1 .. cfg.steps``: each trained, recorded when ``--ledger-steps`` says so,
    its metrics line written by the last rank (returned: the lines this rank wrote), a
    checkpoint every ``save_every`` steps and at the end."""
    cfg, r, out = run.cfg, run.cfg.run, Path(run.cfg.run.out)
    bad = 0
    scalars = None
    writer = dist.get_rank() == run.mesh.world.size - 1  # it holds the loss: the last stage
    written: list[dict] = []  # the metric lines, for rank 0 if this node is not its folder's
    gathered = False  # under --overlap-param-gather: a checkpoint just gathered the parameters
    if writer and r.tensorboard_dir:
        scalars = ScalarLog(r.tensorboard_dir, r.tensorboard_log_interval, cfg.steps)
    beat = Heartbeat(ledger, out, unflushed=lambda: ledger.events).start() \
        if r.hang_after > 0 else None
    for step in range(start, cfg.steps):  # ``step`` optimizer steps done; iteration step + 1
        iteration = step + 1  # what every output calls the step: Megatron's numbers, from 1
        record = r.ledger_steps < 0 or step - first_recorded < r.ledger_steps
        ledger.events.clear()
        tic = time.time()
        try:
            with recording(ledger) if record else nullcontext(), ledger.at(step=iteration):
                metrics = train_step(run, step)
        except BaseException:
            if record:  # what the failed step launched, for paraloom diagnose
                ledger.dump(ledger_file, mode="a")
            raise
        elapsed = time.time() - tic
        if record:
            ledger.dump(ledger_file, mode="a")
        if writer:
            line = {"step": iteration, **metrics, "tokens": run.tokens, "time_s": elapsed}
            if step == start:  # Megatron's first iteration communicates differently
                line["first_of_process"] = True
            if gathered:  # the checkpoint before this step gathered the parameters
                line["params_gathered_at_save"] = True
            write_json_lines(out / METRICS, [line], mode="a")
            written.append(line)
            tok_s = cfg.tokens_per_step / max(elapsed, 1e-9)
            show_progress(iteration, cfg.steps, metrics, tok_s)
            if scalars is not None:
                scalars.step(iteration, metrics, tok_s, ledger.events if record else None)
            if metrics.get("skipped"):
                print(f"step {iteration}: non-finite gradient norm ({metrics['grad_norm']}; loss "
                      f"{metrics['loss']}): update skipped", file=sys.stderr, flush=True)
        if not metrics.get("skipped"):  # Megatron-LM: the pre-hooks on once a step succeeded
            for gather in [d.param_gather for d in run.ddps if d.param_gather is not None]:
                gather.enable()
        bad = bad + 1 if metrics.get("skipped") else 0
        if bad >= r.max_bad_steps:
            raise FloatingPointError(
                f"stopping at step {iteration}: {bad} consecutive steps with a non-finite loss "
                f"or gradient (max_bad_steps = {r.max_bad_steps}); lower --lr, check the data, "
                f"or resume from the last checkpoint")
        gathered = False
        stop = bool(metrics.get("exit"))  # --exit-duration-in-mins: every rank agreed
        if save_every and (iteration % save_every == 0 or iteration == cfg.steps or stop):
            _save(run, out, iteration)
            gathered = ddp_overlaps_param_gather(cfg)
        if stop:
            if writer:
                print(f"paraloom train: stopping after step {iteration}: "
                      f"--exit-duration-in-mins {r.exit_duration_mins:g} reached",
                      file=sys.stderr, flush=True)
            break
    if beat is not None:
        beat.stop()
    if scalars is not None:
        scalars.close()
    return written


def _finish(run, folder, ledger_file: Path, written: list[dict], summary: dict) -> dict | None:
    """Every rank's ledger (and the last rank's metrics, when its node does not see rank 0's
    folder) gathered to rank 0, which merges them into ``ledger.jsonl`` and writes
    ``summary.json``; rank 0 returns the summary with the merged events."""
    rank, out = dist.get_rank(), Path(run.cfg.run.out)
    elsewhere = bool(written) and not folder.sees_rank0[rank]
    gathered = comm.gather_objects((read_json_lines(ledger_file), written if elsewhere else None),
                                   run.mesh.world)
    if rank != 0:
        return None
    events = [ledger for ledger, _ in gathered]
    lines = gathered[-1][1]
    if lines is not None:  # the last rank wrote them on its own node: rank 0's copy
        write_json_lines(out / METRICS, lines, mode="a")
    if not folder.shared:
        summary["ranks_elsewhere"] = folder.elsewhere()
        print(f"note: {folder.describe()}", file=sys.stderr, flush=True)
    merged = merge(events)
    write_events(out, merged)
    (out / SUMMARY).write_text(json.dumps(summary, indent=1))
    return dict(summary, events=merged)
