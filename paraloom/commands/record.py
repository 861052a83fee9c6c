"""``paraloom record`` (moving here from ``paraloom.record.command``)."""

from ..record.command import record_main as main

__all__ = ["main"]
