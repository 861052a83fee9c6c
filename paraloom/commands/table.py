"""``paraloom table`` (moving here from ``paraloom.report.table``)."""

from ..report.table import table_main as main

__all__ = ["main"]
