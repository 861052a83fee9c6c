"""``paraloom check`` (moving here from ``paraloom.analysis.check``)."""

from ..analysis.check import check_main as main

__all__ = ["main"]
