"""Command-line flags generated from the configuration's field metadata (:mod:`paraloom.config`).

A flag's destination is its field's dotted path (``optim.lr``) and its default is *absent*: the
parsed namespace holds exactly the flags the user typed (:func:`given`), which is what ``--resume``
needs (a typed flag overrides the checkpoint's setting, an untyped one keeps it) and what lets a
preset (``--arch llama``) fill only the fields the user left alone. The help shows each field's
default, read from the configuration the command starts from.
"""

from __future__ import annotations

import argparse
import dataclasses

from ..config import Flag, TrainConfig, flags_of

__all__ = ["add_flags", "given", "flag_of", "apply", "TRAIN_FLAGS", "flag_name"]

TRAIN_FLAGS: dict[str, Flag] = {f.path: f for f in flags_of(TrainConfig)}
"""Every field with a flag, by dotted path."""


def flag_of(path: str) -> Flag:
    """The flag of the field at ``path`` (``KeyError`` naming it when it has none)."""
    try:
        return TRAIN_FLAGS[path]
    except KeyError:
        raise KeyError(f"no flag for the setting {path!r}") from None


def flag_name(path: str) -> str:
    """``--lr`` for ``optim.lr``: how a message names a setting to the user."""
    flag = TRAIN_FLAGS.get(path)
    return flag.flags[0] if flag is not None else path


def _get(config, path: str):
    for part in path.split("."):
        config = getattr(config, part)
    return config


def _shown(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, tuple | list):
        return " ".join(map(str, value))
    return "on" if value is True else "off" if value is False else f"{value:g}" \
        if isinstance(value, float) else str(value)


def add_flags(parser, paths, base, *, defaults: dict | None = None) -> None:
    """Add the flags of ``paths`` (dotted field paths, in that order) to ``parser`` (or an
    argument group). ``base`` is the configuration the command starts from: its values are the
    defaults the help shows (``defaults`` may override what is shown, e.g. ``"derived from
    --pp"``)."""
    defaults = defaults or {}
    for path in paths:
        flag = flag_of(path)
        shown = defaults.get(path)
        if shown is None:
            shown = _shown(_get(base, path))
        text = flag.help if "default" in flag.help or not shown else \
            f"{flag.help} (default: {shown})"
        kw = dict(dest=path, default=argparse.SUPPRESS, help=text.replace("%", "%%"))
        if flag.type is bool and flag.negatable:
            kw["action"] = argparse.BooleanOptionalAction
        elif flag.type is bool:
            kw.update(action="store_const", const=not flag.inverse)
        else:
            kw["type"] = flag.type
            if flag.nargs:
                kw["nargs"] = flag.nargs
            if flag.choices:
                kw["choices"] = flag.choices
            kw["metavar"] = flag.metavar or (None if flag.choices else
                                            flag.flags[0].lstrip("-").replace("-", "_").upper())
        parser.add_argument(*flag.flags, **kw)


def given(args: argparse.Namespace, paths=None) -> dict:
    """``{dotted path: value}`` of the configuration flags typed on the command line."""
    values = {k: v for k, v in vars(args).items() if "." in k or k in TRAIN_FLAGS}
    return values if paths is None else {k: v for k, v in values.items() if k in paths}


def apply(config: dict, values: dict) -> dict:
    """A copy of the nested ``config`` dict with ``values`` (dotted paths) set."""
    out = _copy(config)
    for path, value in values.items():
        *parents, leaf = path.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _copy(config: dict) -> dict:
    return {k: _copy(v) if isinstance(v, dict) else v for k, v in config.items()}


def fresh(base: TrainConfig | None = None) -> dict:
    """The nested dict a new run starts from: ``base`` (default ``TrainConfig()``) with the
    settings that follow from others (the schedule from the pipeline layout, ``min_lr`` from
    ``lr``, the warm-up from its fraction) left open, so the flags given decide them."""
    out = dataclasses.asdict(base or TrainConfig())
    out["schedule"] = None
    out["optim"]["min_lr"] = None
    out["optim"]["warmup_steps"] = None  # 5, or from --lr-warmup-fraction
    return out
