"""``paraloom diff`` (moving here from ``paraloom.record.diff``)."""

from ..record.diff import diff_main as main

__all__ = ["main"]
