"""``paraloom train``: flags -> :class:`~paraloom.config.TrainConfig` -> ranks.

The configuration is validated before any rank starts; a bad value is reported with what is
valid and exit code 2. Without ``torchrun`` the command forks ``tp * cp * pp * dp`` local gloo
ranks; under ``torchrun`` it joins the given world::

    paraloom train                                   # tp=2, pp=2, dp=2 on 8 local ranks
    torchrun --nproc-per-node 4 -m paraloom train --tp 2 --pp 2 --dp 1

Every flag has its Megatron-LM long name as an alias (``--tensor-model-parallel-size`` for
``--tp``, ``--train-iters`` for ``--steps``, ...).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .. import launch
from ..config import TrainConfig
from ..device import default_backend
from ..diagnose.evidence import load
from ..diagnose.render import render
from ..diagnose.verdict import diagnose
from ..diagnose.watch import HANG_EXIT, after_run, checker
from ..report.run_reports import write_reports
from ..report.table import numbered_steps, render_table
from ..run_folder import written
from ..training import multinode
from ..training.loop import run_rank
from ..training.preflight import check_inputs
from .megatron_lm_flags import megatron_lm_notes, megatron_lm_spellings
from .megatron_lm_refused import not_built
from .resume import resume_notes
from .train_flags import add_train_flags, config_from_args

__all__ = ["main", "parser", "train_main"]

_PROG = "paraloom train"


def parser() -> argparse.ArgumentParser:
    """The ``paraloom train`` parser (every default absent: see :mod:`.flags`)."""
    ap = argparse.ArgumentParser(prog=_PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_flags(ap)
    return ap


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"  # once under torchrun


def _note(text: str) -> None:
    print(f"{_PROG}: note: {text}", file=sys.stderr)


def _check(cfg: TrainConfig) -> None:
    for note in check_inputs(cfg):
        _note(note)


def _rank(rank: int, world: int, cfg: TrainConfig, t0: float) -> None:
    summary = run_rank(cfg, t0)
    if summary is None:
        return
    out = Path(cfg.run.out)
    events = summary.pop("events")
    for problem in write_reports(out, events):
        print(problem, file=sys.stderr)
    steps = numbered_steps([e for e in events if e["rank"] == 0])
    if steps:  # rank 0 communicated in a recorded step (one rank alone does not)
        # the steady state when it was recorded: a run's first step is Megatron's first
        # iteration (buckets launched at the end, a one-off flag), in comm_table.md
        step = steps[1] if len(steps) > 1 else steps[0]
        what = "steady-state" if len(steps) > 1 else "first recorded"
        print(f"\nCommunication order, rank 0, step {step} ({what}; layers folded; "
              f"comm_table.md has the first step in full):\n"
              + render_table(events, rank=0, step=step, group=True))
    print(f"held-out loss: {summary['held_out_loss_before']:.4f} before -> "
          f"{summary['held_out_loss_after']:.4f} after {summary['steps']} steps")
    print(f"run folder: {out.resolve()}  ({written(out, RUN_FILES)})")


RUN_FILES = ("report.html", "metrics.jsonl", "ledger.jsonl", "trace.json", "comm_table.md",
             "loss.png", "config.json", "checkpoints/")
"""What a run folder may hold, as the last line lists it (only those that exist)."""


def _world_checks(cfg: TrainConfig, nprocs: int | None) -> None:
    c = cfg.parallel
    layout = f"tp*cp*pp*dp = {c.tp}*{c.cp}*{c.pp}*{c.dp} = {c.world_size}"
    if launch.under_torchrun():
        if cfg.overlap_p2p_comm and c.pp > 1 and default_backend() == "nccl":
            raise ValueError(
                "--overlap-p2p-communication is for gloo (CPU); under torchrun with CUDA the "
                "ranks use NCCL, which runs a pair of stages' sends and receives in the order "
                "they were posted, so a receive posted ahead would wait for a peer that waits "
                "on its send. Leave the flag out (off on CUDA) or pass "
                "--no-overlap-p2p-communication")
        nprocs, where = int(os.environ["WORLD_SIZE"]), "torchrun's WORLD_SIZE"
        if nprocs % c.cp:
            raise ValueError(f"--cp {c.cp} does not divide the world of {nprocs} ranks ({where}); "
                             f"choose a --cp that divides {nprocs}")
        if nprocs != c.world_size:
            raise ValueError(f"torchrun started WORLD_SIZE = {nprocs} ranks but {layout}")
    elif nprocs is not None:
        if nprocs % c.cp:
            raise ValueError(f"--cp {c.cp} does not divide the world of {nprocs} ranks "
                             f"(--nprocs); choose a --cp that divides {nprocs}")
        if nprocs != c.world_size:
            raise ValueError(f"--nprocs {nprocs} does not match {layout}")


def train_main(args: argparse.Namespace) -> int:
    """Validate, then train on local ranks or in the torchrun world; returns the exit code."""
    timeout = getattr(args, "run.timeout_s", TrainConfig().run.timeout_s)
    try:
        if getattr(args, "model.num_experts", None) is None and _rank0() \
                and getattr(args, "run.resume", None) is None:  # resumed: the checkpoint's
            moe = sorted(f for f in vars(args) if f.startswith("model.moe_"))
            if moe:
                flags = ", ".join("--" + f[len("model."):].replace("_", "-") for f in moe)
                _note(f"{flags} ha{'s' if len(moe) == 1 else 've'} no effect without "
                      f"--num-experts (the model is dense)")
        cfg, resumed = config_from_args(args)
        if _rank0():
            for note in megatron_lm_notes(args):
                _note(note)
            hf = cfg.run.init_from_hf
            if hf and getattr(args, "data.tokenizer", None) is None and cfg.data.tokenizer \
                    and os.path.samefile(cfg.data.tokenizer, hf):
                _note(f"--init-from-hf {hf!r} holds its tokenizer (tokenizer.json): the data "
                      f"are read as its tokens (give --tokenizer for another)")
            applied = getattr(args, "megatron_lm_defaults", None)
            if applied:
                spelt = ", ".join(args.megatron_lm_spelt[:3])
                more = ", ..." if len(args.megatron_lm_spelt) > 3 else ""
                _note(f"a Megatron-LM command line ({spelt}{more}): Megatron-LM's defaults: "
                      f"{'; '.join(applied)}")
        if resumed is not None and _rank0():
            for note in resume_notes(cfg, resumed):
                _note(note)
        if not launch.under_torchrun():  # under torchrun every rank checks what it can read
            _check(cfg)
        _world_checks(cfg, args.nprocs)
    except ValueError as err:
        if launch.under_torchrun():  # the other ranks may see no problem: tell them, not hang
            return multinode.refuse_under_torchrun(_PROG, str(err), timeout)
        print(f"{_PROG}: error: {err}", file=sys.stderr)
        return 2
    world = cfg.parallel.world_size
    if launch.under_torchrun():
        return multinode.run_under_torchrun(
            _PROG, cfg.run.timeout_s, lambda: _check(cfg),
            lambda: _rank(int(os.environ["RANK"]), world, cfg, multinode.shared_clock()),
            resume=cfg.run.resume)
    try:
        launch.spawn(_rank, world, cfg, time.time(), timeout_s=cfg.run.timeout_s,
                     threads=launch.local_threads(world),
                     check=checker(cfg.run.out, cfg.run.hang_after))
    except launch.Hung:
        print(f"{_PROG}: every rank was blocked {cfg.run.hang_after:g} s (--hang-after) and "
              f"they disagree: stopped them", file=sys.stderr)
        after_run(cfg.run.out, dict.fromkeys(range(world), -9), set(range(world)), _PROG)
        return HANG_EXIT
    except RuntimeError as err:
        print(f"{_PROG}: {err}", file=sys.stderr)
        try:
            diagnosis = diagnose(load(cfg.run.out))
        except ValueError:  # it failed before any rank wrote a ledger
            return 1
        if diagnosis.verdict in ("mismatch", "hang"):  # ranks disagreed: say who and where
            print(f"{_PROG}: diagnosis:\n{render(diagnosis)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    refused = not_built(argv)
    if refused:  # a Megatron-LM feature paraloom does not have: named, before parsing
        print(f"{_PROG}: error: {refused}", file=sys.stderr)
        return 2
    flags = parser()
    args = flags.parse_args(argv)
    args.megatron_lm_spelt = megatron_lm_spellings(flags, argv)
    return train_main(args)
