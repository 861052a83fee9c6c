"""``paraloom trace`` (moving here from ``paraloom.report.trace``)."""

from ..report.trace import trace_main as main

__all__ = ["main"]
