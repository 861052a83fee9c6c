"""Named configurations for ``paraloom explain --preset``: a few framework-level choices expanded
to the ``--set`` values of the attributes the framework's code tests, so a reader need not know
them.

``megatron:KEY=VALUE,...`` (Megatron-Core 0.19; keys and defaults below). Each value is derived
from the code that sets the attribute (``megatron/core/tensor_parallel/layers.py`` and
``model_parallel_config.py``):

* ``config.sequence_parallel`` = ``sp``; ``self.sequence_parallel`` = ``sp`` and ``tp > 1``
  (``ColumnParallelLinear.__init__`` turns it off when the tp world size is 1; the row layer
  copies ``config.sequence_parallel``).
* ``self.allreduce_dgrad`` = ``tp > 1 and not sequence_parallel and not disable_grad_reduce``
  (``ColumnParallelLinear.__init__``); ``self.disable_grad_reduce`` = False (the constructor's
  default).
* ``self.is_expert`` = ``expert``; ``self.expert_parallel`` = ``ep > 1``;
  ``self.explicit_expert_comm`` = ``is_expert and (tp > 1 or expert_parallel)`` (both layers).
* ``self.gradient_accumulation_fusion`` / ``config.gradient_accumulation_fusion`` = False and
  ``config.defer_embedding_wgrad_compute`` = False (``ModelParallelConfig`` defaults; the fusion
  needs APEX's CUDA extension).
* ``self.use_inference_optimized_all_gather`` / ``..._reduce_scatter`` = False (true only for
  ``transformer_impl == "inference_optimized"``); ``self.gtp_remat_size`` = 1 (no generalized
  tp remat group); ``config._cpu_offloading_context`` = None (default).
* ``weight.requires_grad`` = ``not frozen``; ``self.training`` = ``training``;
  ``tp_group.size()`` and ``get_tensor_model_parallel_world_size()`` = ``tp``.
"""

from __future__ import annotations

__all__ = ["expand", "describe", "PRESETS"]

_BOOL = {"on": True, "off": False, "true": True, "false": False, "1": True, "0": False,
         "yes": True, "no": False}


def _megatron(o: dict) -> dict:
    tp, ep, sp = o["tp"], o["ep"], o["sp"] and o["tp"] > 1
    expert = o["expert"]
    return {
        "config.sequence_parallel": o["sp"], "self.sequence_parallel": sp,
        "self.disable_grad_reduce": False, "self.allreduce_dgrad": tp > 1 and not sp,
        "self.is_expert": expert, "self.expert_parallel": ep > 1,
        "self.explicit_expert_comm": expert and (tp > 1 or ep > 1),
        "self.gradient_accumulation_fusion": False, "config.gradient_accumulation_fusion": False,
        "config.defer_embedding_wgrad_compute": False,
        "self.use_inference_optimized_all_gather": False,
        "self.use_inference_optimized_reduce_scatter": False,
        "self.gtp_remat_size": 1, "config._cpu_offloading_context": None,
        "weight.requires_grad": not o["frozen"], "self.training": o["training"],
        "tp_group.size()": tp, "get_tensor_model_parallel_world_size()": tp,
    }


PRESETS = {
    "megatron": ({"tp": 1, "sp": False, "ep": 1, "expert": False, "frozen": False,
                  "training": True}, _megatron,
                 "Megatron-Core's tensor_parallel layers"),
}


def describe() -> list[str]:
    return [f"{name}:" + ",".join(f"{k}={_show(v)}" for k, v in keys.items()) + f" ({what})"
            for name, (keys, _f, what) in PRESETS.items()]


def _show(v) -> str:
    return ("on" if v else "off") if isinstance(v, bool) else str(v)


def expand(spec: str) -> dict:
    """``"megatron:tp=2,sp=on"`` -> ``{name as written: value}``; ValueError names what is
    wrong and what is valid."""
    name, _, rest = spec.partition(":")
    if name not in PRESETS:
        raise ValueError(f"--preset {spec!r}: unknown framework {name!r}; known: "
                         + "; ".join(describe()))
    keys, build, _ = PRESETS[name]
    chosen = dict(keys)
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, text = item.partition("=")
        if key not in keys or not eq:
            raise ValueError(f"--preset {spec!r}: {item!r} is not KEY=VALUE with KEY one of "
                             f"{', '.join(keys)}")
        if isinstance(keys[key], bool):
            if text.lower() not in _BOOL:
                raise ValueError(f"--preset {spec!r}: {key}={text!r}: expected on or off")
            chosen[key] = _BOOL[text.lower()]
        else:
            try:
                chosen[key] = int(text)
            except ValueError:
                raise ValueError(f"--preset {spec!r}: {key}={text!r}: expected a whole "
                                 "number") from None
            if chosen[key] < 1:
                raise ValueError(f"--preset {spec!r}: {key}={text}: expected >= 1")
    return build(chosen)
