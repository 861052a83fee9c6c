"""The analytical model: what a layout communicates (:mod:`.formulas`, with :mod:`.layout`,
:mod:`.cp_formulas`, :mod:`.moe_formulas`), stores (:mod:`.memory_formulas`; per tensor:
:mod:`.memory`) and computes (:mod:`.flops`); how long a step takes on described hardware
(:mod:`.steptime`, :mod:`.costs`, :mod:`.hardware`, :mod:`.calibrate`, :mod:`.validation`); a
recorded run checked against it (:mod:`.check`); and the plan and search built on it
(:mod:`.plan`, :mod:`.search`). The shared data types are :mod:`.spec`."""

from .check import check_run, compare, config_from_run, render_diff
from .formulas import expected_comm
from .plan import plan
from .spec import Architecture, CommConfig

__all__ = ["CommConfig", "Architecture", "expected_comm", "plan", "check_run", "compare",
           "render_diff", "config_from_run"]
