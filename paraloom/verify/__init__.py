"""The formulas of :mod:`paraloom.analysis` held against what happened: a recorded run's ledger,
row by row and byte for byte (:mod:`.check`, ``paraloom check``), and published Megatron runs'
step times (:mod:`.validation`, the ``plan`` accuracy table)."""

from .check import check_run, compare, config_from_run, render_diff

__all__ = ["check_run", "compare", "render_diff", "config_from_run"]
