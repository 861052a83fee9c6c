"""Run megatron-core 0.19.2's tensor-parallel layers on CPU/gloo: a test-side shim, never shipped.

megatron-core targets CUDA. What it takes to run its ``ColumnParallelLinear -> GeLU ->
RowParallelLinear`` block on gloo ranks (facts found by doing it, issue 12):

* ``import megatron.core`` imports ``megatron.core.transformer.moe.ops.paged_stash``, which
  imports triton: a stand-in module with the names the importer takes is registered first;
* the layers allocate with ``device=torch.cuda.current_device()`` (e.g. the sequence-parallel
  reduce-scatter output in the backward): ``torch.cuda.current_device`` returns the CPU device;
* ``torch.cuda.synchronize`` and ``torch.cuda.current_stream`` get no-op stand-ins;
* ``parallel_state.initialize_model_parallel`` works on an already initialised gloo world;
* the weights are created with ``use_cpu_initialization=True`` and
  ``gradient_accumulation_fusion=False`` (no apex / CUDA extension).

:func:`install` patches ``torch.cuda`` in the current process: call it inside a rank (a forked
test world or a ``paraloom record`` script), never in the pytest parent, so no other test sees
the patch. :func:`preload` only imports megatron-core (safe in the parent, before forking).

Run as a program it is an ordinary torchrun-style job (it initialises its own process group):
``paraloom record --nproc 2 --out DIR -- tests/_megatron_shim.py [SEQ BATCH HIDDEN]``.
"""

from __future__ import annotations

import sys
import types
import warnings

PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


class _NoStream:
    """``torch.cuda.current_stream()`` on CPU: every method a no-op."""

    def wait_stream(self, *_args) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *_args):
        return None


def preload() -> None:
    """``import megatron.core`` (with the triton stand-in) without touching ``torch.cuda``.

    The import costs ~9 s of CPU; a test that forks its ranks calls this in the parent first,
    so the ranks inherit the modules instead of importing them each."""
    import torch

    if PAGED_STASH not in sys.modules:  # also when megatron.core came in without it (a
        # part of it imported by another module): its other submodules import this one
        stub = types.ModuleType(PAGED_STASH)
        stub.__doc__ = "CPU stand-in for megatron-core's triton kernels (tests/_megatron_shim)"
        stub.GLOBAL_BLOCK_SIZE = 1024
        stub.paged_stash_copy_kernel = stub.paged_stash_pop_kernel = None
        sys.modules[PAGED_STASH] = stub
    if "megatron.core.tensor_parallel" in sys.modules:
        return
    compile_ = torch.compile
    torch.compile = _no_compile  # see _no_compile: halves the import time
    try:
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed", absl
            warnings.simplefilter("ignore")
            import megatron.core  # noqa: F401
            import megatron.core.tensor_parallel  # noqa: F401
    finally:
        torch.compile = compile_


def _no_compile(model=None, **_options):
    """``torch.compile`` while megatron-core is imported: megatron.core.jit decorates its fused
    kernels (bias-GeLU, GeGLU, ...) with ``torch.compile``, which imports TorchInductor (~9 s of
    CPU, half the import). The block under test uses none of them; they stay plain Python, as
    megatron's own ``disable_jit_fuser`` would leave them."""
    return model if model is not None else (lambda fn: fn)


def install() -> None:
    """Make megatron-core's tensor-parallel layers work on this CPU process (a rank)."""
    import torch

    preload()
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *_a, **_k: None
    torch.cuda.current_stream = lambda *_a, **_k: _NoStream()


def init_tp(tp: int) -> None:
    """Megatron's parallel_state groups with tensor-parallel size ``tp`` on the gloo world
    (idempotent, so one world can build several blocks)."""
    install()
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    elif ps.get_tensor_model_parallel_world_size() != tp:
        raise ValueError(f"megatron parallel_state already has tp="
                         f"{ps.get_tensor_model_parallel_world_size()}, asked for {tp}")


def mlp_block(hidden: int, *, sequence_parallel: bool, tp: int = 2):
    """Megatron-Core's own ``ColumnParallelLinear(h -> 4h, gather_output=False)`` and
    ``RowParallelLinear(4h -> h, input_is_parallel=True)``, both with bias."""
    import torch

    install()
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    init_tp(tp)
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                              gradient_accumulation_fusion=False, use_cpu_initialization=True)
    init = torch.nn.init.xavier_normal_
    fc1 = ColumnParallelLinear(hidden, 4 * hidden, config=cfg, init_method=init, bias=True,
                               gather_output=False)
    fc2 = RowParallelLinear(4 * hidden, hidden, config=cfg, init_method=init, bias=True,
                            input_is_parallel=True, skip_bias_add=False)
    return fc1, fc2


def forward_backward(fc1, fc2, x, dy):
    """One forward + backward of the block: ``fc2(gelu(fc1(x)))``, backward from ``dy``."""
    import torch.nn.functional as F

    h, _ = fc1(x)
    y, _ = fc2(F.gelu(h))
    y.backward(dy)
    return y


def block_inputs(seq: int, batch: int, hidden: int, *, sequence_parallel: bool, rank: int,
                 tp: int = 2):
    """This rank's input ``x`` (requires grad) and output grad ``dy``: the same seeded full
    tensors on every rank, sharded along the sequence (dim 0) with sequence parallelism."""
    import torch

    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(seq, batch, hidden, generator=g), torch.randn(seq, batch, hidden,
                                                                       generator=g)
    if sequence_parallel:
        x, dy = x.chunk(tp, 0)[rank], dy.chunk(tp, 0)[rank]
    return x.clone().requires_grad_(), dy


def checked_step(seq: int, batch: int, hidden: int, *, sequence_parallel: bool, rank: int,
                 tp: int = 2):
    """Megatron's block with seeded full weights (this rank's shards copied in), one forward +
    backward; its output must equal plain PyTorch with the full weights, computed locally (no
    communication, so a recorder sees only the block's)."""
    import torch
    import torch.nn.functional as F

    fc1, fc2 = mlp_block(hidden, sequence_parallel=sequence_parallel, tp=tp)
    g = torch.Generator().manual_seed(0)
    w1, b1 = torch.randn(4 * hidden, hidden, generator=g), torch.randn(4 * hidden, generator=g)
    w2, b2 = torch.randn(hidden, 4 * hidden, generator=g), torch.randn(hidden, generator=g)
    with torch.no_grad():
        fc1.weight.copy_(w1.chunk(tp, 0)[rank])
        fc1.bias.copy_(b1.chunk(tp, 0)[rank])
        fc2.weight.copy_(w2.chunk(tp, 1)[rank])
        fc2.bias.copy_(b2)
    x, dy = block_inputs(seq, batch, hidden, sequence_parallel=sequence_parallel, rank=rank,
                         tp=tp)
    y = forward_backward(fc1, fc2, x, dy)
    x_full, _ = block_inputs(seq, batch, hidden, sequence_parallel=False, rank=rank, tp=tp)
    want = F.linear(F.gelu(F.linear(x_full, w1, b1)), w2, b2).detach()
    torch.testing.assert_close(y, want.chunk(tp, 0)[rank] if sequence_parallel else want,
                               rtol=1e-4, atol=1e-4)
    return y


def main(argv: list[str]) -> None:
    """``paraloom record --nproc 2 --out DIR -- tests/_megatron_shim.py [SEQ BATCH HIDDEN]``:
    an ordinary torchrun-style program (it initialises its own process group) that runs the
    block with sequence parallelism off, then on."""
    import torch.distributed as dist

    seq, batch, hidden = (int(a) for a in (argv or ["8", "2", "16"]))
    dist.init_process_group("gloo")
    install()
    for sp in (False, True):
        checked_step(seq, batch, hidden, sequence_parallel=sp, rank=dist.get_rank(),
                     tp=dist.get_world_size())
    print(f"rank {dist.get_rank()}: megatron-core block ok (sp off, on)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
