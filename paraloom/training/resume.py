"""``paraloom train --resume RUN``: continue *that* run, in its own folder, from its newest
checkpoint.

Before ranks start (:func:`resume_args`), the run's settings come from the checkpoint's own
config, as Megatron's ``--use-checkpoint-args`` does: model, layout, learning-rate schedule
(``--steps`` is the schedule's length), data, seed. A flag typed on the command line overrides
the saved value (the layout, ``--steps`` to extend the run, ...); the printed note lists every
setting that differs from the checkpoint's. Model-shape flags that contradict the checkpoint are
refused later by the model comparison. The output goes to the run's folder unless ``--out``
names another one, which starts a *branch*: nothing is copied there, its metrics begin at the
checkpoint's step.

On the ranks (:func:`continue_folder`, :func:`restore_rng`): in the run's own folder the metrics
after the checkpoint's step (written before a crash) are dropped, so they are replaced rather than
duplicated; the ledger keeps the events of earlier steps when the layout is unchanged (and records
the same steps an uninterrupted run would), otherwise it starts again for the new layout. Each
rank's dropout RNG streams are restored from the checkpoint when the layout is the same; they are
per rank, so under another layout they are re-seeded from ``(seed, step)`` instead: the
continuation is then a valid run, but not bitwise the uninterrupted one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

__all__ = ["explicit_dests", "resume_args", "read_json_lines", "continue_folder",
           "continue_ledger", "restore_rng", "same_layout", "same_run"]

_FIELDS = {
    "tp": "parallel.tp", "pp": "parallel.pp", "dp": "parallel.dp", "vpp": "parallel.vpp",
    "sequence_parallel": "parallel.sequence_parallel",
    "async_grad_allreduce": "parallel.async_grad_allreduce",
    "grad_accum_fusion": "parallel.gradient_accumulation_fusion",
    "cp": "parallel.cp", "cp_comm_type": "parallel.cp_comm_type",
    "seq_len": "model.seq_length", "layers": "model.num_layers", "hidden": "model.hidden_size",
    "heads": "model.num_attention_heads", "ffn": "model.ffn_hidden_size",
    "vocab": "model.vocab_size", "dropout": "model.dropout",
    "ep": "parallel.ep", **{f: f"model.{f}" for f in (
        "num_experts", "moe_router_topk", "moe_aux_loss_coeff", "moe_z_loss_coeff",
        "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_layer_freq",
        "moe_pad_expert_input_to_capacity")},
    **{name: name for name in (
        "global_batch_size", "micro_batch_size", "steps", "lr", "min_lr", "warmup_steps",
        "weight_decay", "clip_grad", "seed", "dtype", "recompute", "schedule",
        "overlap_grad_reduce", "overlap_p2p_comm", "distributed_optimizer", "bucket_size", "data",
        "save_every", "tokenizer", "data_path",
        "ledger_steps", "timeout_s", "max_bad_steps")},
}
"""argparse destination -> TrainConfig field (dotted into the nested configs)."""

_LAYOUT = ("tp", "pp", "dp", "cp")
_NEWER = ("cp", "cp_comm_type")
"""Flags a checkpoint written before they existed does not have (their defaults apply)."""


def explicit_dests(argv: list[str] | None, args: argparse.Namespace) -> set[str]:
    """The argparse destinations typed on the command line (not left at their defaults).

    ``argv`` (the ``train`` arguments) is parsed again with every default suppressed, so a flag
    given with its default value still counts as given. Without ``argv`` (a caller that only has
    the namespace), a value differing from the parser's default counts as given."""
    from .command import add_train_parser
    parser = argparse.ArgumentParser(add_help=False)
    cmd = add_train_parser(parser.add_subparsers(dest="command"))
    if argv is None:
        return {a.dest for a in cmd._actions
                if hasattr(args, a.dest) and getattr(args, a.dest) != a.default}
    for action in cmd._actions:
        action.default = argparse.SUPPRESS
    return set(vars(cmd.parse_args(argv))) - {"command"}


def _get(config: dict, path: str):
    for key in path.split("."):
        config = config.get(key)  # None: a field newer than the checkpoint
    return config


def resume_args(args: argparse.Namespace, explicit: set[str]) -> list[str]:
    """Fill ``args`` from the checkpoint ``args.resume`` points at, keeping explicit flags;
    returns the notes to print."""
    from .checkpoint import find_checkpoint, run_folder
    ckpt, meta = find_checkpoint(args.resume)
    saved, step = meta["config"], int(meta["step"])
    for dest, path in _FIELDS.items():
        if dest not in explicit:
            try:
                setattr(args, dest, _get(saved, path))
            except KeyError:  # a checkpoint from before the setting existed: keep the default
                pass
    from ..commands.arch_flags import flags_of_model
    for dest, value in flags_of_model(saved["model"]).items():  # the architecture
        if dest not in explicit:
            setattr(args, dest, value)
    if "tokenizer" not in explicit and args.tokenizer and not Path(args.tokenizer).is_dir():
        raise ValueError(f"--resume {str(ckpt)!r} was trained with --tokenizer "
                         f"{args.tokenizer!r}, which is not a folder here; give --tokenizer DIR")
    for mine, other in (("data", "data_path"), ("data_path", "data")):
        if mine in explicit and other not in explicit:
            setattr(args, other, None)  # the data given replaces the checkpoint's
    if "pp" in explicit and "vpp" not in explicit and args.pp != saved["parallel"]["pp"]:
        args.vpp = None  # the saved virtual stages belong to the saved pipeline depth
    if explicit & {"pp", "vpp"} and "schedule" not in explicit:
        args.schedule = None  # derived from the new pipeline layout
    home = run_folder(ckpt)
    if "out" not in explicit and home is not None:
        args.out = str(home)
    return _notes(args, saved, ckpt, step, home)


_NOT_SETTINGS = ("out", "resume", "init_from_hf", "tensorboard_dir", "log_interval")
"""Where a run writes or starts from, not how it trains: never a "changed" setting."""


def _notes(args, saved: dict, ckpt: Path, step: int, home: Path | None) -> list[str]:
    from .command import config_from_args
    now = dataclasses.asdict(config_from_args(args))
    before, after = _flat(saved), _flat(now)
    changed = [f"{key} {before.get(key)} -> {value}" for key, value in after.items()
               if key not in _NOT_SETTINGS and before.get(key) != value]
    where = Path(args.out)
    if home is not None and where.resolve() == home.resolve():
        notes = [f"resuming {str(home)!r} at step {step} of {args.steps}, in the same folder "
                 f"(settings from {str(ckpt)!r}; metrics after step {step} are replaced)"]
    else:
        notes = [f"branching: {str(where)!r} starts from {str(ckpt)!r} at step {step} of "
                 f"{args.steps} (nothing is copied there; its metrics begin at step {step})"]
    notes.append("changed from the checkpoint: " + ", ".join(changed) if changed
                 else "no setting changed from the checkpoint")
    layout = [(saved["parallel"].get(k, 1), now["parallel"][k]) for k in _LAYOUT]
    if any(a != b for a, b in layout) and now["model"]["dropout"] > 0:
        notes.append("dropout RNG streams are per rank and do not carry over to another "
                     "layout: they are re-seeded from (seed, step), so the continuation is not "
                     "bitwise the run's own (resume under the same layout for that)")
    return notes


def _flat(config: dict, prefix: str = "") -> dict:
    """``{"parallel.tp": 2, ...}``: every setting, also ones this module has no flag for."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def same_layout(meta: dict, cfg) -> bool:
    """Whether the checkpoint was written by the same (tp, pp, dp) grid: only then does rank r
    hold the same part of the model and draw from the same RNG streams as the writer's rank r."""
    saved = meta["config"]["parallel"]
    return all(saved.get(k, 1) == getattr(cfg.parallel, k) for k in _LAYOUT)


def restore_rng(ckpt: Path, meta: dict, run, rank: int, start: int) -> bool:
    """Restore this rank's dropout RNG streams from ``ckpt``; re-seed them from ``(seed, start)``
    where that is impossible (another layout, device type, or an older checkpoint without them).
    Returns whether the streams were restored."""
    from ..tensor_parallel.random import load_rng_state_dict, model_parallel_seed
    from .checkpoint import read_rank_state
    state = read_rank_state(ckpt, rank) if same_layout(meta, run.cfg) else None
    if state is not None and state.get("device_type") == run.device.type:
        load_rng_state_dict(state, run.device)
        return True
    model_parallel_seed(run.cfg.seed + 1_000_003 * start, run.mesh.tp.rank, run.device)
    return False


def same_run(out: Path, ckpt: Path) -> bool:
    """Whether ``out`` is the run folder ``ckpt`` belongs to (a continuation, not a branch)."""
    from .checkpoint import run_folder
    home = run_folder(ckpt)
    return home is not None and home.resolve() == Path(out).resolve()


def continue_folder(out: Path, start: int, same: bool, keep_ledger: bool, world: int) -> None:
    """Rank 0, before the ranks write: keep the metrics of steps before ``start`` (none in a
    branch), remove the ledger files that the continuation does not extend, and move aside the
    run's checkpoints after ``start`` (when resuming from an earlier one than its newest), or all
    of them when this is not a continuation of the folder's run (a new run, or a branch)."""
    metrics = out / "metrics.jsonl"
    kept = [line for line in read_json_lines(metrics) if same and line.get("step", start) < start]
    metrics.write_text("".join(json.dumps(line) + "\n" for line in kept))
    folder = out / "ledger"
    for stale in folder.glob("rank_*.jsonl") if folder.is_dir() else ():
        if not keep_ledger or int(stale.stem[5:]) >= world:
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
    """Every rank, its own ledger file: the events of steps before ``start`` when the ledger is
    kept, else nothing. Returns the next ``seq`` and the last ``t_end`` of the kept events, so
    the continuation's events follow them in order and in time."""
    kept = read_json_lines(ledger_file) if keep_ledger else []
    events = [e for e in kept if e.get("step", 0) < start]
    ledger_file.write_text("".join(json.dumps(e) + "\n" for e in events))
    return (max((e["seq"] for e in events), default=-1) + 1,
            max((e["t_end"] for e in events), default=0.0))


def read_json_lines(path: Path) -> list[dict]:
    """The JSON lines of ``path`` that parse (a line cut short by a crash is dropped)."""
    if not path.is_file():
        return []
    out = []
    for text in path.read_text().splitlines():
        try:
            out.append(json.loads(text))
        except json.JSONDecodeError:
            continue
    return out
