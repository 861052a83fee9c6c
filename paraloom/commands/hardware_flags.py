"""The hardware flags of ``paraloom plan`` (and ``--search``): ``--gpu``, ``--hardware FILE.toml``
and one override flag per :class:`~paraloom.analysis.hardware.Hardware` field."""

from __future__ import annotations

import argparse

from ..analysis.hardware import FLAGS, GPUS, Hardware, hardware_from

__all__ = ["add_hardware_args", "hardware_from_args"]


def add_hardware_args(ap: argparse.ArgumentParser) -> None:
    """``--gpu``, ``--hardware FILE.toml`` and one override flag per :class:`Hardware` field."""
    g = ap.add_argument_group("hardware (step time, --search)")
    g.add_argument("--gpu", choices=sorted(GPUS), default=None,
                   help="GPU preset (default a100-80gb); see README, Predicting step time")
    g.add_argument("--hardware", metavar="FILE.toml", default=None,
                   help="a TOML hardware description (keys as the flags below, plus gpu)")
    for name in FLAGS:
        kind = int if name == "gpus_per_node" else float
        g.add_argument("--" + name.replace("_", "-"), type=kind, default=None)


def hardware_from_args(a: argparse.Namespace) -> Hardware:
    """The hardware the flags describe (``ValueError`` names a bad one)."""
    return hardware_from(a.gpu or "a100-80gb", a.hardware,
                         **{name: getattr(a, name) for name in FLAGS})
