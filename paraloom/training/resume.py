"""Continuing a run on the ranks (the flag side is ``paraloom.commands.resume``).

In the run's own folder the metrics after the checkpoint's step (written before a crash) are
dropped, so they are replaced rather than duplicated; the ledger keeps the events of earlier
steps when the layout is unchanged (and records the same steps an uninterrupted run would),
otherwise it starts again for the new layout. Each rank's dropout RNG streams are restored from
the checkpoint when the layout is the same (:attr:`~paraloom.config.ParallelConfig.layout`: tp,
cp, ep, dp, pp and vpp); they are per rank, so under another layout they are re-seeded from
``(seed, step)`` instead: the continuation is then a valid run, but not bitwise the
uninterrupted one.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from ..config import ParallelConfig
from ..run_folder import METRICS, rank_ledgers, read_ledger, read_metrics, write_json_lines
from ..tensor_parallel.random import load_rng_state_dict, reseed_for_step
from .checkpoint import read_rank_state, run_folder

__all__ = ["continue_folder", "continue_ledger", "restore_rng", "same_layout", "same_run"]

def same_layout(meta: dict, cfg) -> bool:
    """Whether the checkpoint was written by the same layout (tp, cp, ep, dp, pp, vpp): only
    then does rank r hold the same part of the model and draw from the same RNG streams as the
    writer's rank r."""
    return ParallelConfig(**meta["config"]["parallel"]).layout == cfg.parallel.layout


def restore_rng(ckpt: Path, meta: dict, run, rank: int, start: int) -> bool:
    """Restore this rank's dropout RNG streams from ``ckpt``; re-seed them from ``(seed, start)``
    where that is impossible (another layout, device type, or an older checkpoint without them).
    Returns whether the streams were restored."""
    state = read_rank_state(ckpt, rank) if same_layout(meta, run.cfg) else None
    if state is not None and state.get("device_type") == run.device.type:
        load_rng_state_dict(state, run.device)
        return True
    reseed_for_step(run.cfg.seed, start, run.mesh.tp.rank, run.device)
    return False


def same_run(out: Path, ckpt: Path) -> bool:
    """Whether ``out`` is the run folder ``ckpt`` belongs to (a continuation, not a branch)."""
    home = run_folder(ckpt)
    return home is not None and home.resolve() == Path(out).resolve()


def continue_folder(out: Path, start: int, same: bool, keep_ledger: bool, world: int) -> None:
    """Rank 0, before the ranks write: keep the metrics of steps ``1 .. start`` (none in a
    branch), remove the ledger files that the continuation does not extend, and move aside the
    run's checkpoints after ``start`` (when resuming from an earlier one than its newest), or all
    of them when this is not a continuation of the folder's run (a new run, or a branch)."""
    metrics = out / METRICS
    kept = [line for line in read_metrics(metrics, strict=False)
            if same and line.get("step", start + 1) <= start]
    write_json_lines(metrics, kept)
    for rank, stale in rank_ledgers(out).items():
        if not keep_ledger or rank >= world:
            stale.unlink()
    # checkpoints of the replaced steps (resuming from an earlier one than the newest), or of an
    # earlier run in this folder (a new run, or a branch from another): kept aside, never picked
    # by --resume RUN again
    moved = []
    for ckpt in sorted((out / "checkpoints").glob("step_*"), key=lambda c: c.name):
        if ckpt.name[5:].isdigit() and (not same or int(ckpt.name[5:]) > start):
            aside = ckpt.with_name("superseded_" + ckpt.name)
            shutil.rmtree(aside, ignore_errors=True)
            ckpt.rename(aside)
            moved.append(ckpt.name)
    if moved:
        whose = "the steps now replaced" if same else "an earlier run in this folder"
        print(f"note: {out / 'checkpoints'} held {len(moved)} checkpoint(s) of {whose} "
              f"({', '.join(moved)}): renamed superseded_step_N, so --resume {out} continues "
              f"this run", file=sys.stderr, flush=True)


def continue_ledger(ledger_file: Path, start: int, keep_ledger: bool) -> tuple[int, float]:
    """Every rank, its own ledger file: the events of steps ``0 .. start`` (setup, then the
    steps the checkpoint holds) when the ledger is kept, else nothing. Returns the next ``seq``
    and the last ``t_end`` of the kept events, so the continuation's events follow them in
    order and in time."""
    kept = read_ledger(ledger_file, strict=False) if keep_ledger else []
    events = [e for e in kept if e.get("step", 0) <= start]
    write_json_lines(ledger_file, events)
    return (max((e["seq"] for e in events), default=-1) + 1,
            max((e["t_end"] for e in events), default=0.0))

