"""``paraloom train --resume RUN``: the settings come from the checkpoint, the typed flags win.

Before ranks start, the run's settings are the checkpoint's own config, as Megatron's
``--use-checkpoint-args`` does: model, layout, learning-rate schedule (``--steps`` is the
schedule's length), data, seed. A flag typed on the command line overrides the saved value (the
layout, ``--steps`` to extend the run, ...); the printed note lists every setting that differs
from the checkpoint's. Model-shape flags that contradict the checkpoint are refused later by the
model comparison (:func:`paraloom.training.preflight.check_resumable`). The output goes to the
run's folder unless ``--out`` names another one, which starts a *branch*: nothing is copied
there, its metrics begin at the checkpoint's step. The rank side (what is kept of the folder,
the RNG streams) is :mod:`paraloom.training.resume`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import TrainConfig
from ..config.train import migrate
from ..training.checkpoint import find_checkpoint, run_folder
from ..training.resume import same_layout

__all__ = ["Resumed", "resume_base", "resume_notes"]

_NOT_SETTINGS = ("run.out", "run.resume", "run.init_from_hf", "run.tensorboard_dir",
                 "run.log_interval", "run.tensorboard_log_interval")
"""Where a run writes or starts from, not how it trains: never a "changed" setting."""


@dataclass
class Resumed:
    """The checkpoint a resumed run starts from."""

    ckpt: Path
    step: int
    saved: dict
    """Its configuration (this version's nested layout)."""
    home: Path | None
    """The run folder it belongs to (``None`` for a checkpoint folder outside a run)."""


def resume_base(values: dict) -> tuple[dict, Resumed]:
    """The nested settings a resumed run starts from (the checkpoint's, adjusted to what the
    typed ``values`` change), and the checkpoint; ``ValueError`` for an unusable one."""
    ckpt, meta = find_checkpoint(values["run.resume"])
    saved = migrate(meta["config"])
    base = {k: (dict(v) if isinstance(v, dict) else v) for k, v in saved.items()}
    data = dict(base.get("data", {}))
    tokenizer = data.get("tokenizer")
    if "data.tokenizer" not in values and tokenizer and not Path(tokenizer).is_dir():
        raise ValueError(f"--resume {str(ckpt)!r} was trained with --tokenizer {tokenizer!r}, "
                         f"which is not a folder here; give --tokenizer DIR")
    for mine, other in (("file", "data_path"), ("data_path", "file")):
        if f"data.{mine}" in values and f"data.{other}" not in values:
            data[other] = None  # the data given replaces the checkpoint's
    base["data"] = data
    parallel = dict(base["parallel"])
    if "parallel.pp" in values and "parallel.vpp" not in values \
            and values["parallel.pp"] != parallel["pp"]:
        parallel["vpp"] = None  # the saved virtual stages belong to the saved pipeline depth
    if "parallel.cp" in values and "parallel.cp_sizes" not in values \
            and values["parallel.cp"] != parallel.get("cp", 1):
        parallel["cp_sizes"] = None  # the saved hierarchical levels split the saved cp
    base["parallel"] = parallel
    if ("parallel.pp" in values or "parallel.vpp" in values) and "schedule" not in values:
        base["schedule"] = None  # derived from the new pipeline layout
    home = run_folder(ckpt)
    run = dict(base.get("run", {}))
    if "run.out" not in values and home is not None:
        run["out"] = str(home)
    base["run"] = run
    return base, Resumed(ckpt, int(meta["step"]), saved, home)


def _flat(config: dict, prefix: str = "") -> dict:
    """``{"parallel.tp": 2, "run.out": ...}``: every setting, nested keys dotted."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _named(path: str) -> str:
    """How a note names a setting: ``parallel.tp``, ``model.hidden_size``; the optimiser's,
    data's and run's settings by their own name (``lr``, ``ledger_steps``)."""
    head, _, rest = path.partition(".")
    return rest if head in ("optim", "data", "run") and rest else path


def resume_notes(cfg: TrainConfig, resumed: Resumed) -> list[str]:
    """What to tell the user about the resumed run: where it continues, what changed."""
    before, after = _flat(resumed.saved), _flat(cfg.to_dict())
    changed = [f"{_named(key)} {before.get(key)} -> {value}" for key, value in after.items()
               if key not in _NOT_SETTINGS and key in before and before[key] != value]
    where, home, step = Path(cfg.run.out), resumed.home, resumed.step
    if home is not None and where.resolve() == home.resolve():
        notes = [f"resuming {str(home)!r} after step {step} of {cfg.steps}, in the same folder "
                 f"(settings from {str(resumed.ckpt)!r}; metrics after step {step} are replaced)"]
    else:
        notes = [f"branching: {str(where)!r} starts from {str(resumed.ckpt)!r} after step {step} "
                 f"of {cfg.steps} (nothing is copied there; its metrics begin at step {step + 1})"]
    notes.append("changed from the checkpoint: " + ", ".join(changed) if changed
                 else "no setting changed from the checkpoint")
    if not same_layout({"config": resumed.saved}, cfg) and cfg.model.dropout > 0:
        notes.append("dropout RNG streams are per rank and do not carry over to another "
                     "layout: they are re-seeded from (seed, step), so the continuation is not "
                     "bitwise the run's own (resume under the same layout for that)")
    return notes
