"""``paraloom plan`` (moving here from ``paraloom.analysis.plan``)."""

from ..analysis.plan import plan_main as main

__all__ = ["main"]
