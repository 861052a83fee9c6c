"""The analytical model of a step (formulas), its check against a recorded ledger, and the
planner that extrapolates it to large layouts."""

from .check import check_main, check_run, compare, config_from_run, render_diff
from .formulas import CommConfig, expected_comm
from .plan import plan, plan_main

__all__ = ["CommConfig", "expected_comm", "compare", "check_run", "render_diff", "plan",
           "plan_main", "check_main", "config_from_run"]
