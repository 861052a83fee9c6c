"""``paraloom report`` (moving here from ``paraloom.report.html``)."""

from ..report.html import report_main as main

__all__ = ["main"]
