"""Megatron-Core on CPU ranks: the opt-in run-time patches of ``paraloom record --megatron-on-cpu``.

megatron-core targets CUDA; its training step (``GPTModel``, ``DistributedDataParallel``, the
optimizers, ``get_forward_backward_func()``, ``finalize_model_grads``) does nothing a CPU could
not, but it creates a few tensors on ``"cuda"``, asks CUDA for the current device and stream,
checks tensor types by their CUDA names, and imports triton. Each patch below serves one such
place, is applied only in the recorded ranks, and only where CUDA is absent; nothing of Megatron's
source is copied or changed on disk. Communication is untouched: the recorder sees exactly the
collectives Megatron issues (one runs in another form, recorded as issued: the uneven all-gather
gloo refuses, :mod:`.gloo_uneven`).

* ``triton``: :data:`PAGED_STASH`, megatron's triton kernels for MoE paged stashing, is imported
  by ``pipeline_parallel/schedules.py`` (via ``transformer/moe/paged_stash.py``) whatever the
  model; a stand-in module with the names the importer takes is registered when triton is missing.
* ``torch.compile`` while megatron-core is imported: ``megatron/core/jit.py`` decorates its fused
  kernels with it, which imports TorchInductor (~9 s of CPU per rank); they stay plain Python, as
  Megatron's ``disable_jit_fuser`` leaves them (the local layer spec does not call them).
* ``torch`` as seen by :data:`CUDA_MODULES`: a stand-in whose tensor factories put
  ``device="cuda"`` tensors on the CPU, whose ``torch.cuda.current_device()`` is the CPU,
  ``torch.cuda.synchronize`` a no-op and ``torch.cuda.current_stream()`` / ``Stream`` a stream
  that does nothing (the scalars of the optimizer and grad scaler, the grad-norm and token-count
  buffers, the p2p and tensor-parallel buffers, the bucket buffers); every other name is torch's.
* ``Tensor.type()`` answers ``torch.cuda.FloatTensor`` (etc.) for a CPU tensor when Megatron's
  own code asks (``optimizer/optimizer.py``, ``optimizer/distrib_optimizer.py`` and
  ``optimizer/clip_grads.py`` assert it), and ``Tensor.cuda()`` is the tensor itself when
  Megatron's code calls it (the tied-embedding copy of ``language_module.py``, state reloads).
* Megatron's RNG tracker (``tensor_parallel/random.py``) is its own inference tracker
  (``initialize_rng_tracker(inference_rng_tracker=True)``): the training one saves and restores
  CUDA generator states. Dropout inside tensor-parallel regions then draws from the default
  generator; with dropout 0 (what the example uses) nothing draws at all.
* Recomputation (``CheckpointFunction`` in ``tensor_parallel/random.py``) saves and restores the
  CUDA generator's state next to the CPU one's; on a CPU there is only the CPU generator, which
  it saves and restores already, so the CUDA half is the CPU state and a restore that does nothing.
* The MoE all-to-all dispatcher moves its split sizes to the host as numpy arrays
  (``moe_utils.maybe_move_tensor_to_cpu(as_numpy=True)``, which converts only CUDA tensors);
  on a CPU they are converted as they would be from the device, and the dispatcher's CUDA
  event for that copy is one already reached.
* The local spec's norm without apex (``transformer/torch_norm.py``'s ``WrappedTorchNorm``)
  refuses sequence parallelism; with it, the norm is built as usual and its parameters are
  tagged ``sequence_parallel``, as the fused norm it replaces tags them (so
  ``finalize_model_grads`` all-reduces their grads over the tensor-parallel group).

:func:`install` applies them, once per process; :data:`TESTED` is the version range they were
made on (others get a warning naming the patches that did not find their target).
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings

import torch

from . import gloo_uneven, megatron_fsdp_cpu, on_import
from .cuda_on_cpu import TORCH, torch_on_cpu

__all__ = ["install", "PATCHES", "CUDA_MODULES", "TESTED", "PAGED_STASH", "torch_on_cpu"]

TESTED = ("0.19.",)
"""megatron-core versions the patches were made and tested on."""
PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"
CUDA_MODULES = (
    "megatron.core.optimizer.optimizer", "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.clip_grads", "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel", "megatron.core.utils",
    "megatron.core.tensor_parallel.layers", "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.data", "megatron.core.transformer.utils",
    "megatron.core.transformer.moe.router", "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher", "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer", "megatron.core.transformer.moe.shared_experts",
)
"""Modules whose ``torch`` is the CPU stand-in (each creates or places tensors on CUDA)."""
PATCHES = {
    "triton stand-in": "megatron/core/transformer/moe/ops/paged_stash.py: import triton",
    "torch.compile during import": "megatron/core/jit.py: jit_fuser = torch.compile",
    "torch on CPU": ", ".join(m.removeprefix("megatron.core.") for m in CUDA_MODULES)
                    + ': device="cuda", torch.cuda.current_device/current_stream/synchronize',
    "Tensor.type() CUDA names": "optimizer/optimizer.py, distrib_optimizer.py, clip_grads.py: "
                                "assert ....type() == 'torch.cuda.FloatTensor'",
    "Tensor.cuda() identity": "models/common/language_module/language_module.py: "
                              "weight.data.cuda(); optimizer state reloads; a script's "
                              "batch.cuda()",
    "inference RNG tracker": "tensor_parallel/random.py: CudaRNGStatesTracker.add saves CUDA "
                             "generator states",
    "recomputation RNG state": "tensor_parallel/random.py: CheckpointFunction saves and restores "
                               "the CUDA generator (_get_cuda_rng_state / _set_cuda_rng_state)",
    "MoE split sizes on the host": "transformer/moe/moe_utils.py: maybe_move_tensor_to_cpu("
                                   "as_numpy=True) turns only CUDA tensors into the all-to-all's "
                                   "split-size arrays",
    "sequence-parallel torch norm": "transformer/torch_norm.py: WrappedTorchNorm asserts not "
                                    "config.sequence_parallel (the fused norm tags its "
                                    "parameters sequence_parallel instead)",
    "uneven all-gather on gloo": "tensor_parallel/mappings.py: _gather_along_first_dim's "
                                 "torch.distributed.all_gather into unequal tensors (the "
                                 "alltoall dispatcher with tp > 1); run padded, recorded as "
                                 "issued",
    **megatron_fsdp_cpu.PATCHES,
}
"""Every patch and the lines of megatron-core it serves (README, "Record Megatron-Core itself")."""

_INSTALLED = False


def _from_megatron(depth: int = 2) -> bool:
    return sys._getframe(depth).f_globals.get("__name__", "").startswith("megatron.")


def _patch_tensor_methods() -> None:
    type_ = torch.Tensor.type

    def tensor_type(self, *args, **kwargs):
        name = type_(self, *args, **kwargs)
        if not args and not kwargs and name.startswith("torch.") \
                and not name.startswith("torch.cuda.") and _from_megatron():
            return "torch.cuda." + name[len("torch."):]
        return name

    def tensor_cuda(self, *args, **kwargs):
        return self  # whoever calls: Megatron's code, or a training script moving its batch

    torch.Tensor.type = tensor_type
    torch.Tensor.cuda = tensor_cuda


def _missed(patch: str, target: str) -> None:
    warnings.warn(f"paraloom record --megatron-on-cpu: patch {patch!r} did not apply "
                  f"({target} not found in this megatron-core)", stacklevel=3)


def _norm_with_sequence_parallel(cls) -> None:
    """``WrappedTorchNorm`` (the local spec's norm without apex) refuses
    ``config.sequence_parallel``; the fused norm it stands for accepts it and tags its
    parameters ``sequence_parallel`` (so ``finalize_model_grads`` all-reduces their grads over
    tp). The same here: built with the flag lowered for the check, then tagged."""
    build = cls.__new__

    def __new__(klass, config, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return build(klass, config, *args, **kwargs)
        config.sequence_parallel = False
        try:
            norm = build(klass, config, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm
    cls.__new__ = __new__


def _patch_module(module) -> None:
    """What :data:`CUDA_MODULES`, the RNG module and the torch norm get, right after they
    are executed."""
    name = module.__name__
    if name in megatron_fsdp_cpu.FSDP_MODULES:
        megatron_fsdp_cpu.patch_module(module, _missed)
    if name in CUDA_MODULES:
        if getattr(module, "torch", None) is torch:
            module.torch = TORCH
        else:
            _missed("torch on CPU", f"{name}.torch")
    if name == "megatron.core.tensor_parallel.random":
        initialize = getattr(module, "initialize_rng_tracker", None)
        if initialize is None:
            _missed("inference RNG tracker", f"{name}.initialize_rng_tracker")
            return

        def initialize_rng_tracker(use_te_rng_tracker=False, inference_rng_tracker=False,
                                   *args, **kwargs):
            return initialize(use_te_rng_tracker, True, *args, **kwargs)
        module.initialize_rng_tracker = initialize_rng_tracker
        if hasattr(module, "_get_cuda_rng_state") and hasattr(module, "_set_cuda_rng_state"):
            # recomputation's CheckpointFunction saves the CUDA generator besides the CPU one;
            # on a CPU the CPU generator is all there is (and it saves and restores that itself)
            module._get_cuda_rng_state = lambda *_a, **_k: torch.get_rng_state()
            module._set_cuda_rng_state = lambda *_a, **_k: None
        else:
            _missed("recomputation RNG state", f"{name}._get_cuda_rng_state")
    if name == "megatron.core.transformer.moe.moe_utils":
        move = getattr(module, "maybe_move_tensor_to_cpu", None)
        if move is None:
            _missed("MoE split sizes on the host", f"{name}.maybe_move_tensor_to_cpu")
            return

        def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
            if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
                return tensor.numpy()  # what the device's split sizes become on the host
            return move(tensor, as_numpy, record_stream)
        module.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    if name == "megatron.core.transformer.torch_norm":
        cls = getattr(module, "WrappedTorchNorm", None)
        if cls is None:
            _missed("sequence-parallel torch norm", f"{name}.WrappedTorchNorm")
            return
        _norm_with_sequence_parallel(cls)


@contextlib.contextmanager
def _compile_off():
    compile_ = torch.compile
    torch.compile = _no_compile
    try:
        yield
    finally:
        torch.compile = compile_


def _no_compile(model=None, **_options):
    return model if model is not None else (lambda fn: fn)


def _stub_triton() -> None:
    try:
        import triton  # noqa: F401
    except ImportError:
        stub = types.ModuleType(PAGED_STASH)
        stub.__doc__ = "CPU stand-in for megatron-core's triton kernels (paraloom record)"
        stub.GLOBAL_BLOCK_SIZE = 1024
        stub.paged_stash_copy_kernel = stub.paged_stash_pop_kernel = None
        sys.modules.setdefault(PAGED_STASH, stub)


def _check_version() -> None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        found = version("megatron-core")
    except PackageNotFoundError:
        return
    if not found.startswith(TESTED):
        warnings.warn(f"paraloom record --megatron-on-cpu: made and tested on megatron-core "
                      f"{' / '.join(v + 'x' for v in TESTED)}, found {found}; a patch whose "
                      f"target moved is named when it does not apply", stacklevel=2)


def install() -> None:
    """Apply every patch in this process (a recorded rank), before the program imports
    megatron-core; modules already imported are patched at once."""
    global _INSTALLED
    if _INSTALLED or torch.cuda.is_available():
        return
    _check_version()
    _stub_triton()
    _patch_tensor_methods()
    gloo_uneven.install()
    on_import.around_import(_compile_off)
    on_import.after_import("megatron.", _patch_module)
    _INSTALLED = True
