"""Field metadata: each configuration field carries its command-line flag, Megatron's alias and a
short help, so the parser, ``--resume`` and the documentation read one source.

    lr: float = option(3e-3, "--lr", help="peak learning rate (AdamW)")

``flags[0]`` is paraloom's flag, the others are aliases (Megatron-LM's long names); the value's
type and choices come from the annotation and ``choices``. A ``bool`` field is a switch
(``--flag``), or ``--flag/--no-flag`` with ``negatable=True``; ``inverse=True`` makes the flag set
the field to ``False`` (``--disable-bias-linear`` for ``add_bias_linear``). A ``tuple[int, ...]``
field takes ``nargs`` values (``--hierarchical-context-parallel-sizes 2 2``). A field without
``option`` (a plain default) has no flag.
"""

from __future__ import annotations

import dataclasses
import types
import typing

__all__ = ["option", "Flag", "flags_of", "nested_configs"]


def option(default, *flags: str, help: str, choices: tuple | None = None,  # noqa: A002
           metavar: str | None = None, negatable: bool = False, inverse: bool = False,
           nargs: str | None = None):
    """A dataclass field with its command-line flag(s) in the metadata."""
    if not flags or not all(f.startswith("--") for f in flags):
        raise ValueError(f"option needs --flag names, got {flags!r}")
    meta = {"flags": flags, "help": help, "choices": choices, "metavar": metavar,
            "negatable": negatable, "inverse": inverse, "nargs": nargs}
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class Flag:
    """One field's flag, as the parser needs it."""

    path: str
    """Dotted field path from the top configuration (``optim.lr``, ``parallel.tp``)."""
    flags: tuple[str, ...]
    help: str
    type: type
    """``int``, ``float``, ``str`` or ``bool`` (the annotation, ``None`` taken off; a tuple's
    element type)."""
    optional: bool
    """Whether ``None`` is a valid value (``int | None``)."""
    default: object
    choices: tuple | None = None
    metavar: str | None = None
    negatable: bool = False
    inverse: bool = False
    nargs: str | None = None
    """argparse's ``nargs`` of a tuple field (``"+"``), else ``None``."""


def _base_type(hint) -> tuple[type, bool]:
    """``int | None`` -> ``(int, True)``; ``bool`` -> ``(bool, False)``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base, optional = args[0], len(args) < len(typing.get_args(hint))
    else:
        base, optional = hint, False
    if typing.get_origin(base) is tuple:  # tuple[int, ...]: the flag takes several ints
        base = typing.get_args(base)[0]
    return base, optional


def nested_configs(cls) -> dict[str, type]:
    """``{field name: dataclass}`` of the fields of ``cls`` that are configurations themselves."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)
            if dataclasses.is_dataclass(hints[f.name])}


def flags_of(cls, prefix: str = "") -> list[Flag]:
    """Every flag of ``cls`` and of its nested configurations, in field order."""
    hints = typing.get_type_hints(cls)
    nested = nested_configs(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name in nested:
            out += flags_of(nested[f.name], f"{prefix}{f.name}.")
        elif "flags" in f.metadata:
            typ, optional = _base_type(hints[f.name])
            m = f.metadata
            out.append(Flag(f"{prefix}{f.name}", m["flags"], m["help"], typ, optional,
                            f.default, m["choices"], m["metavar"], m["negatable"], m["inverse"],
                            m.get("nargs")))
    return out
