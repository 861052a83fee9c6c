"""Megatron-LM's training loop on CPU ranks: the patches ``--megatron-on-cpu`` adds for
``megatron.training`` (Megatron-LM's ``pretrain``), next to megatron-core's
(:mod:`.megatron_core_cpu`).

``megatron.training`` is Megatron-LM's driver: arguments, ``initialize_megatron``, ``pretrain``,
``train_step``, ``training_log``, timers, the rerun state machine. It assumes one CUDA device
per rank. Each patch serves the lines named in :data:`PATCHES`; none changes what is
communicated (the recorder sees exactly Megatron-LM's collectives):

* ``typing.override`` on Python < 3.12 (``training/models/gpt.py``, ``hybrid.py`` import it):
  the identity decorator of PEP 698.
* CUDA as one device: for :data:`CUDA_MODULES` ``torch`` is megatron_core_cpu's CPU stand-in, whose
  ``torch.cuda`` here also says one device is there (``is_available``, ``device_count`` = 1,
  ``set_device``, ``get_device_properties`` with compute capability 9.0, ``empty_cache``,
  memory statistics 0, the RNG state the CPU's). ``initialize.py`` skips
  ``initialize_model_parallel`` and the model-parallel seed when ``device_count() == 0``: with
  the stand-in it never sees 0 (and :func:`install` sets ``CUDA_DEVICE_MAX_CONNECTIONS=1``,
  which ``arguments.py`` requires with tp > 1).
* ``compile_helpers`` (``initialize.py`` -> ``core/datasets/utils.py``) runs ``make`` in a
  folder the wheel ships without a Makefile; it is skipped when the compiled helper module is
  importable already (the wheel ships it).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
import typing

import torch

from . import megatron_core_cpu, on_import

__all__ = ["install", "PATCHES", "CUDA_MODULES"]

CUDA_MODULES = (
    "megatron.training.arguments", "megatron.training.initialize", "megatron.training.training",
    "megatron.training.utils.common_utils", "megatron.training.utils.utils",
    "megatron.training.models.dist_utils", "megatron.training.checkpointing",
    "megatron.training.global_vars", "megatron.training.theoretical_memory_usage",
    "megatron.core.timers", "megatron.core.rerun_state_machine",
)
"""Modules of Megatron-LM's loop whose ``torch`` (and so ``torch.cuda``) is the CPU stand-in."""
PATCHES = {
    "typing.override": "training/models/gpt.py:5, hybrid.py:5: from typing import override "
                       "(Python 3.12)",
    "one CUDA device": ", ".join(m.removeprefix("megatron.") for m in CUDA_MODULES)
                       + ": is_available, device_count, set_device, get_device_properties, "
                         "empty_cache, memory statistics, CUDA RNG state, device='cuda'",
    "compile_helpers": "training/initialize.py -> core/datasets/utils.py compile_helpers: make "
                       "in a folder without a Makefile",
}
"""Every patch and the lines of Megatron-LM's loop it serves (README)."""


class _Properties:
    """``torch.cuda.get_device_properties`` of the CPU presented as one device."""
    major, minor, name, total_memory, multi_processor_count = 9, 0, "cpu", 0, 1


_ONE_DEVICE = {
    "is_available": lambda: True,
    "device_count": lambda: 1,
    "set_device": lambda *_a, **_k: None,
    "get_device_properties": lambda *_a, **_k: _Properties(),
    "get_device_capability": lambda *_a, **_k: (9, 0),
    "get_device_name": lambda *_a, **_k: "cpu",
    "empty_cache": lambda: None,
    "memory_allocated": lambda *_a, **_k: 0,
    "max_memory_allocated": lambda *_a, **_k: 0,
    "memory_reserved": lambda *_a, **_k: 0,
    "max_memory_reserved": lambda *_a, **_k: 0,
    "reset_peak_memory_stats": lambda *_a, **_k: None,
    "memory_stats": lambda *_a, **_k: {},
    "mem_get_info": lambda *_a, **_k: (0, 0),
    "get_rng_state": lambda *_a, **_k: torch.get_rng_state(),
    "set_rng_state": lambda *_a, **_k: None,
    "manual_seed": lambda *_a, **_k: None,
    "manual_seed_all": lambda *_a, **_k: None,
    "is_initialized": lambda: True,
}


def _override(func):
    """PEP 698's ``typing.override``: marks and returns ``func``."""
    try:
        func.__override__ = True
    except (AttributeError, TypeError):
        pass
    return func


def _skip_compile_helpers(module) -> None:
    compile_helpers = getattr(module, "compile_helpers", None)
    if compile_helpers is None:
        return

    def compile_or_skip(*args, **kwargs):
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
            return None  # the wheel ships the compiled helper
        return compile_helpers(*args, **kwargs)
    module.compile_helpers = compile_or_skip


def patch_module(module, torch_on_cpu) -> None:
    """What a just-executed module of Megatron-LM's loop gets (``torch_on_cpu``: megatron_core_cpu's
    stand-in ``torch``, extended with one device)."""
    name = module.__name__
    if name in CUDA_MODULES and getattr(module, "torch", None) is torch:
        module.torch = torch_on_cpu
    if name == "megatron.core.datasets.utils":
        _skip_compile_helpers(module)
    if name == "megatron.training.initialize":
        # imported by name: compile_helpers was bound before our patch of its home module
        helpers = sys.modules.get("megatron.core.datasets.utils")
        if helpers is not None and hasattr(module, "compile_helpers"):
            module.compile_helpers = helpers.compile_helpers


def _one_device_torch() -> types.ModuleType:
    """megatron_core_cpu's ``torch`` stand-in whose ``torch.cuda`` is one device."""
    stand_in = megatron_core_cpu.torch_on_cpu()
    stand_in.cuda.__dict__.update(_ONE_DEVICE)
    return stand_in


_INSTALLED = False


def install() -> None:
    """Apply the patches in this process (a recorded rank), after :func:`megatron_core_cpu.install`
    and before the program imports Megatron-LM's loop."""
    global _INSTALLED
    if _INSTALLED or torch.cuda.is_available():
        return
    if not hasattr(typing, "override"):
        typing.override = _override
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    stand_in = _one_device_torch()
    on_import.after_import("megatron.", lambda module: patch_module(module, stand_in))
    _INSTALLED = True
