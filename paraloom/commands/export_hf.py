"""``paraloom export-hf`` (moving here from ``paraloom.training.hf_export``)."""

from ..training.hf_export import export_hf_main as main

__all__ = ["main"]
