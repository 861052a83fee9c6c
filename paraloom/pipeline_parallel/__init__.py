"""Pipeline parallelism: p2p between neighbouring stages, schedules, and the layer split.

* :mod:`.p2p` — send/recv of activations and gradients (combined ops, optional shape exchange).
* :mod:`.timetable` — schedules as pure data (per-stage orders, unit-time timetables).
* :mod:`.plans` — the p2p plan each stage executes (and the proof that a set cannot deadlock).
* :mod:`.schedules` — the schedules with Megatron's ``forward_backward_func`` signature.
* :mod:`.runtime` — the engine they share: one stage executing its p2p plan.
* :mod:`.stage` — which layers (and the embedding / loss) live on which stage and chunk.
"""

from .schedules import (
                        PipelineStats,
                        forward_backward_gpipe,
                        forward_backward_no_pipelining,
                        forward_backward_pipelining_with_interleaving,
                        forward_backward_pipelining_without_interleaving,
                        forward_backward_zero_bubble,
                        get_forward_backward_func,
)
from .stage import StageRole, layer_names, layer_range, stage_layers, stage_role

__all__ = ["PipelineStats", "forward_backward_gpipe", "forward_backward_no_pipelining",
           "forward_backward_pipelining_with_interleaving",
           "forward_backward_pipelining_without_interleaving", "forward_backward_zero_bubble",
           "get_forward_backward_func",
           "StageRole", "layer_names", "layer_range", "stage_layers", "stage_role"]
