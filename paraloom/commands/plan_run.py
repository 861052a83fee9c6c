"""``paraloom plan RUN_FOLDER [--gpu ...]``: plan the run a folder holds, at its own size.

The model and the layout come from ``RUN_FOLDER/config.json`` read as ``--resume`` reads it
(:meth:`~paraloom.config.TrainConfig.from_dict`), through the one view the formulas have of a run
(:func:`~paraloom.analysis.view.comm_view`: the same ``CommConfig`` ``paraloom check`` proves
against the run's ledger); only the hardware flags, ``--json``, ``--require-fit`` and
``--table [--rank R]`` are taken beside it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..analysis.hardware import Hardware
from ..config import TrainConfig
from ..run_folder import CONFIG, read_json
from .hardware_flags import add_hardware_args, hardware_from_args

__all__ = ["is_run_folder", "from_run_folder"]


def is_run_folder(typed: list[str]) -> bool:
    """Whether the command line starts with a folder (``paraloom plan RUN ...``)."""
    return bool(typed) and not typed[0].startswith("-") and Path(typed[0]).is_dir()


def from_run_folder(typed: list[str]) -> tuple[TrainConfig, Hardware, argparse.Namespace, str]:
    """The run's configuration, the hardware, the output flags and a note on where the model
    came from; ``ValueError`` naming what is wrong (a folder without config.json, model or
    layout flags given beside it)."""
    ap = argparse.ArgumentParser(prog="paraloom plan RUN_FOLDER",
                                 description="plan the run a folder holds")
    ap.add_argument("run", metavar="RUN_FOLDER")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--require-fit", action="store_true")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--format", choices=("md", "csv", "json"), default="md")
    ap.add_argument("--lang", choices=("en", "zh"), default="en")
    add_hardware_args(ap)
    args, rest = ap.parse_known_args(typed)
    if rest:
        raise ValueError(f"{' '.join(rest)}: with a run folder the model and the layout come from "
                         f"its config.json; give only hardware flags, --json, --require-fit or "
                         f"--table [--rank R] (or plan from flags without the folder)")
    saved = read_json(Path(args.run) / CONFIG, "a run configuration")
    if saved is None:
        raise ValueError(f"{args.run!r} has no {CONFIG} (give a folder written by paraloom "
                         f"train)")
    cfg = TrainConfig.from_dict(saved)
    m = cfg.model
    note = (f"model and layout from {Path(args.run) / CONFIG}: vocabulary {m.vocab_size}"
            + (f", padded to {cfg.padded_vocab_size} rows (a multiple of "
               f"{m.make_vocab_size_divisible_by} x tp {cfg.parallel.tp}, as Megatron-LM pads it)"
               if cfg.padded_vocab_size != m.vocab_size else ""))
    return cfg, hardware_from_args(args), args, note
