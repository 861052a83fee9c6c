"""Megatron-FSDP on CPU ranks: what ``record --megatron-on-cpu`` adds for megatron-core's FSDP.

megatron-core's Megatron-FSDP (``distributed/fsdp``: ``mcore_fsdp_adapter``'s
``FullyShardedDataParallel`` around ``megatron_fsdp.MegatronFSDP``) names its device
``torch.device(f"cuda:{current_device()}")``, builds its device meshes with
``DeviceMesh.from_group(..., device_type="cuda")``, and runs its all-gathers and reduce-scatters
on side streams. On a CPU :data:`FSDP_MODULES` see a ``torch`` whose ``device("cuda...")`` is the
CPU (and every factory, stream and event of :mod:`.cuda_on_cpu`), and ``DeviceMesh.from_group``
builds CPU meshes. Nothing else changes: the collectives are Megatron-FSDP's own, recorded as it
issues them, but for one reduction gloo lacks: its gradient reduce-scatter averages with NCCL's
``PREMUL_SUM`` (the factor 1/dp inside the reduction, ``gradient_reduce_div_fusion``); on gloo
the gradients are scaled first and summed, what Megatron-FSDP itself does without the fusion
(same operation, shape and bytes).
"""

from __future__ import annotations

import torch

from .cuda_on_cpu import torch_on_cpu

__all__ = ["FSDP_MODULES", "patch_module", "PATCHES"]

_SRC = "megatron.core.distributed.fsdp.src.megatron_fsdp."
FSDP_MODULES = ("megatron.core.distributed.fsdp.mcore_fsdp_adapter", _SRC + "megatron_fsdp",
                _SRC + "param_and_grad_buffer", _SRC + "utils", _SRC + "uneven_dtensor",
                _SRC + "mixed_precision")
"""Modules whose ``torch`` is the CPU stand-in with CUDA device names mapped to the CPU."""
PATCHES = {
    "Megatron-FSDP on CPU": "distributed/fsdp: mcore_fsdp_adapter, megatron_fsdp, "
                            "param_and_grad_buffer, utils, uneven_dtensor, mixed_precision: "
                            "torch.device('cuda:N'), DeviceMesh.from_group(device_type='cuda'), "
                            "side streams, torch.cuda.get/set_rng_state (tp > 1)",
    "PREMUL_SUM on gloo": "distributed/fsdp/.../param_and_grad_buffer.py: "
                          "gradient_reduce_preprocessing's _make_nccl_premul_sum(1/dp)",
}


class _DeviceType(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, torch.device)

    def __call__(cls, *args, **kwargs):
        if args and isinstance(args[0], str) and args[0].startswith("cuda"):
            return torch.device("cpu")
        return torch.device(*args, **kwargs)


class _Device(metaclass=_DeviceType):
    """``torch.device`` where a CUDA device is the CPU (``isinstance`` still torch's)."""


def _cpu_mesh(mesh_cls):
    class _CpuDeviceMesh(mesh_cls):
        @staticmethod
        def from_group(group, device_type, *args, **kwargs):
            return mesh_cls.from_group(group, "cpu" if device_type == "cuda" else device_type,
                                       *args, **kwargs)
    _CpuDeviceMesh.__name__ = mesh_cls.__name__
    return _CpuDeviceMesh


_TORCH = torch_on_cpu()
_TORCH.__dict__["device"] = _Device


def patch_module(module, missed) -> None:
    """Patch one of :data:`FSDP_MODULES` right after it ran (``missed(patch, target)`` says
    that a target moved)."""
    if getattr(module, "torch", None) is torch:
        module.torch = _TORCH
    else:
        missed("Megatron-FSDP on CPU", f"{module.__name__}.torch")
    mesh = getattr(module, "DeviceMesh", None)
    if mesh is not None:
        module.DeviceMesh = _cpu_mesh(mesh)
    if module.__name__.endswith(".param_and_grad_buffer"):
        preprocess = getattr(module, "gradient_reduce_preprocessing", None)
        if preprocess is None:
            missed("PREMUL_SUM on gloo", f"{module.__name__}.gradient_reduce_preprocessing")
            return
        module.gradient_reduce_preprocessing = _scaled_on_gloo(preprocess)


def _scaled_on_gloo(preprocess):
    """``gradient_reduce_preprocessing`` that, where it would pick NCCL's ``PREMUL_SUM``,
    scales the gradients and sums (its own path without ``gradient_reduce_div_fusion``)."""
    def gradient_reduce_preprocessing(grad_data, scaling_factor, ddp_config):
        op = preprocess(grad_data, scaling_factor, ddp_config)
        if scaling_factor is not None and type(op) is torch.distributed.ReduceOp:  # PREMUL_SUM
            grad_data.mul_(scaling_factor)  # (SUM, AVG are ReduceOp.RedOpType members)
            return torch.distributed.ReduceOp.SUM
        return op
    return gradient_reduce_preprocessing
