"""Configuration: frozen, keyword-only dataclasses, one docstring per field, validated on creation.

Every error names the offending value and what would be valid, so a bad layout is rejected before
any process group or rank is started. Each field also carries its command-line flag, Megatron's
alias and a short help (:mod:`.fields`): the command-line parser and ``--resume`` are generated
from them, so the defaults of ``paraloom train`` are the defaults here.

* :mod:`.parallel`: :class:`ParallelConfig` (the layout), :func:`default_schedule`;
* :mod:`.model`: :class:`ModelConfig` (the GPT's shape), :func:`check_layout`;
* :mod:`.train`: :class:`TrainConfig`, with its parts in :mod:`.optim` (:class:`OptimConfig`),
  :mod:`.data` (:class:`DataConfig`) and :mod:`.run` (:class:`RunConfig`).
"""

from .data import DataConfig
from .fields import Flag, flags_of, option
from .model import LLAMA, ModelConfig, check_layout
from .optim import DEFAULT_MIN_LR, OptimConfig
from .parallel import SCHEDULES, ParallelConfig, default_schedule, positive_int
from .run import RunConfig
from .train import TrainConfig

__all__ = ["ParallelConfig", "ModelConfig", "TrainConfig", "OptimConfig", "DataConfig",
           "RunConfig", "check_layout", "default_schedule", "positive_int", "SCHEDULES", "LLAMA",
           "DEFAULT_MIN_LR", "Flag", "flags_of", "option"]
