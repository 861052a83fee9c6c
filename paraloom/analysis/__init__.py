"""The analytical model, pure formulas only (nothing here starts a rank or reads a run): what a
layout communicates (:mod:`.formulas`, with :mod:`.layout`, :mod:`.cp_formulas`,
:mod:`.moe_formulas`), stores (:mod:`.memory_formulas`) and computes (:mod:`.flops`); how long a
step takes on described hardware (:mod:`.steptime`, :mod:`.costs`, :mod:`.hardware`); the plan
and search built on it (:mod:`.plan`, :mod:`.search`); a run as the formulas see it
(:mod:`.view`). The shared data types are :mod:`.spec`.

Its two neighbours: :mod:`paraloom.verify` checks recorded runs and published runs against these
formulas; :mod:`paraloom.measure` measures this machine and a layer's saved tensors."""

from .formulas import expected_comm
from .plan import plan
from .spec import Architecture, CommConfig

__all__ = ["CommConfig", "Architecture", "expected_comm", "plan"]
