"""Activation memory, measured: the bytes autograd keeps for backward, per transformer layer.

:class:`SavedTensors` is a ``torch.autograd.graph.saved_tensors_hooks`` account. Every tensor an
operation saves for backward passes through its pack hook, which records the tensor's *storage*
once — views of one allocation (q, k and v of one QKV output) and a tensor saved by two operations
(the softmax output when there is no dropout) are one allocation — and skips the storages of
parameters (weights are model state, not activations). Inside a checkpointed region
``torch.utils.checkpoint`` installs its own hooks, which keep nothing; what it does keep, the
region's inputs, passes through ours. So the account is what backward will find in memory.

:func:`saved_bytes_per_layer` runs one training forward of a
:class:`~paraloom.models.gpt.TransformerLayer` on this rank and returns the bytes it saved;
:func:`layer_saved_tensors` gives them per tensor; :func:`expected_saved_bytes` is the exact
accounting below, to compare with, and with Korthikanti et al. 2022, Table 2
(:func:`paraloom.analysis.memory_formulas.activation_bytes_per_layer`).

What a pre-LayerNorm GPT layer written with autograd ops saves, per rank. ``s`` sequence, ``b``
micro-batch, ``h`` hidden, ``a`` heads, ``f`` MLP width (4h), ``t`` tensor-parallel size, ``e``
bytes per activation element (2 in bf16); masks are bool (1 byte). ``s'`` is ``s/t`` with sequence
parallelism (the tensors outside the tensor-parallel regions are split along the sequence), else
``s``. The linears save their input, never their output::

    saved by               tensor                                  shape               bytes
    LayerNorm 1            its input (the layer input)             [s', b, h]          e s'bh
                           mean and 1/std                          2 x [s', b, 1]      2 e s'b
    QKV linear             its input (sp: the shard, re-gathered   [s', b, h]          e s'bh
                           in backward)
    QK^T and attn @ V      q, k, v: views of one QKV output        [s, b, 3h/t]        3e sbh/t
    masked_fill            the causal mask                         [s, s]              s^2
    softmax                its output                              [b, a/t, s, s]      e as^2b/t
    attention dropout      its mask                                [b, a/t, s, s]      as^2b/t
    attn @ V               the dropped-out probabilities           [b, a/t, s, s]      e as^2b/t
    proj linear            its input (the attention context)       [s, b, h/t]         e sbh/t
    residual dropout 1     its mask                                [s', b, h]          s'bh
    LayerNorm 2            its input                               [s', b, h]          e s'bh
                           mean and 1/std                          2 x [s', b, 1]      2 e s'b
    fc1                    its input                               [s', b, h]          e s'bh
    GeLU                   its input (the fc1 output)              [s, b, f/t]         e sbf/t
    fc2                    its input (the GeLU output)             [s, b, f/t]         e sbf/t
    residual dropout 2     its mask                                [s', b, h]          s'bh

Residual and bias additions, the 1/sqrt(d) scaling, views, permutes and the tensor-parallel
communications save nothing. With ``e = 2``, ``f = 4h``: ``10 s'bh + 24 sbh/t + 5 as^2b/t`` —
Korthikanti's Table 2 (``sbh(10 + 24/t + 5as/ht)``, and ``34/t`` with sequence parallelism) — plus
the two extra terms below. Selective recomputation checkpoints the core attention (QK^T to
attn @ V): it keeps only its inputs q, k, v (counted already) and drops the mask, the softmax
output, the dropout mask and the probabilities: ``10 s'bh + 24 sbh/t`` (+ statistics). Full
recomputation keeps the layer input only: ``e s'bh``. Without dropout the masks are gone and the
probabilities are the softmax output (one storage).

Where this differs from Table 2, exactly:

1. LayerNorm statistics: mean and 1/std per token, two LayerNorms: ``4 s'b`` elements (in the
   activation dtype on CPU, fp32 on CUDA). O(sb), below the paper's O(sbh) resolution.
2. The causal mask ``[s, s]`` (bool) that ``masked_fill`` saves, ``s^2`` bytes per layer (not in
   selective or full recomputation: it is inside the checkpointed region). Megatron's fused
   upper-triangular masked softmax saves only its output.
3. Full recomputation with sequence parallelism: the layer input is the ``[s/t, b, h]`` shard, so
   ``2sbh/t``; Table 2's ``2sbh`` is the replicated input of tensor parallelism alone.

``attention="sdpa"`` (``F.scaled_dot_product_attention``, the fused kernel) keeps no ``s x s``
tensor: instead of the causal mask, softmax output and probabilities it saves q, k, v (counted
already), its output (which the proj input reshapes; on CPU one storage) and the per-row softmax
log-sum-exp, ``[b, a/t, s]`` in fp32. (With attention dropout, CPU runs PyTorch's unfused math
fallback, which saves far more; the accounting is for the fused path, no attention dropout.)

Not counted by either: the RNG states a checkpointed region keeps to replay dropout (a few KB per
region on CPU), which are not saved tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..mesh import ParallelMesh
from ..models.gpt import TransformerLayer
from ..models.layers import RotaryEmbedding
from ..tensor_parallel.random import MODEL_PARALLEL_RNG, get_rng_tracker, tensor_parallel_seed
from ..utils import divide

__all__ = ["SavedTensor", "SavedTensors", "layer_saved_tensors", "saved_bytes_per_layer",
           "expected_saved_bytes"]


@dataclass(frozen=True)
class SavedTensor:
    """One storage saved for backward: the first view saved of it, and the storage's bytes."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def _key(t: torch.Tensor) -> tuple:
    return t.device, t.untyped_storage().data_ptr()


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class SavedTensors:
    """Context manager: records every storage saved for backward inside it, each once.

    ``exclude``: tensors (the parameters) whose storages are not counted. The storages recorded
    stay alive as long as the graph that saved them, so their addresses identify them.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {_key(t) for t in exclude}
        self.tensors: dict[tuple, SavedTensor] = {}
        self._hooks = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key not in self._excluded and key not in self.tensors:
            self.tensors[key] = SavedTensor(tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
        return t

    def __enter__(self) -> SavedTensors:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        """Bytes of all distinct storages saved."""
        return sum(t.nbytes for t in self.tensors.values())

    def table(self) -> str:
        """One line per storage: shape, dtype, bytes (for reports and failing tests)."""
        rows = [f"{list(t.shape)!s:>20} {str(t.dtype):>15} {t.nbytes:>9}"
                for t in self.tensors.values()]
        return "\n".join(rows + [f"{'total':>36} {self.nbytes:>9}"])


@contextmanager
def _measurement_rng(seed: int, tp_rank: int, device: torch.device) -> Iterator[None]:
    """Seed as ``model_parallel_seed`` does, and restore the caller's generators afterwards."""
    tracker = get_rng_tracker()
    states, seeds = tracker.states, tracker.seeds
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        tracker.states, tracker.seeds = {}, {}
        try:
            tracker.add(MODEL_PARALLEL_RNG, tensor_parallel_seed(seed, tp_rank))
            yield
        finally:
            tracker.states, tracker.seeds = states, seeds


def layer_saved_tensors(cfg: ModelConfig, mesh: ParallelMesh, options, s: int, b: int, *,
                        device: torch.device | str = "cpu") -> SavedTensors:
    """The storages one training forward of ``TransformerLayer(cfg, mesh, 0, options)`` saves on
    this rank, for an input ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism) in
    ``options.params_dtype``. Collective with the tensor-parallel group when ``tp > 1``."""

    device = torch.device(device)
    sp = options.uses_sequence_parallel(mesh)
    with _measurement_rng(options.seed, mesh.tp.rank, device):
        layer = TransformerLayer(cfg, mesh, 0, options).to(device).train()
        x = torch.randn(divide(s, mesh.tp.size, "s") if sp else s, b, cfg.hidden_size,
                        dtype=options.params_dtype, device=device, requires_grad=True)
        rope = None
        if cfg.position_embedding_type == "rope":  # the angles are shared by every layer
            rope = tuple(t.to(options.params_dtype) for t in RotaryEmbedding(
                cfg.head_dim, cfg.rotary_base)(torch.arange(s, device=device)))
        with SavedTensors(exclude=layer.parameters()) as saved:
            out = layer(x, rope)
        del out  # the graph (and what it saved) is freed here
    return saved


def saved_bytes_per_layer(cfg: ModelConfig, mesh: ParallelMesh, options, s: int, b: int, *,
                          device: torch.device | str = "cpu") -> int:
    """Bytes one transformer layer keeps for backward on this rank (storage-deduplicated,
    parameters excluded); see :func:`layer_saved_tensors`."""
    return layer_saved_tensors(cfg, mesh, options, s, b, device=device).nbytes


def expected_saved_bytes(s: int, b: int, h: int, a: int, t: int = 1, *,
                         sequence_parallel: bool = False, recompute: str = "none",
                         ffn: int | None = None, dropout: bool = True, act_bytes: int = 2,
                         stat_bytes: int | None = None,
                         attention: str = "core") -> dict[str, int]:
    """The exact accounting of the module docstring: ``{tensor: bytes}`` one layer saves per
    rank. ``stat_bytes``: bytes per LayerNorm mean / 1/std element (default ``act_bytes``, as on
    CPU; 4 on CUDA). Masks are bool, 1 byte."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    e, st, f = act_bytes, stat_bytes or act_bytes, ffn or 4 * h
    s1 = s // t if sequence_parallel and t > 1 else s          # s': outside the tp regions
    if recompute == "full":
        return {"layer input": e * s1 * b * h}
    out = {"ln1 input": e * s1 * b * h, "ln1 mean, 1/std": 2 * st * s1 * b,
           "qkv input": e * s1 * b * h, "q, k, v": 3 * e * s * b * h // t,
           "proj input": e * s * b * h // t,
           "ln2 input": e * s1 * b * h, "ln2 mean, 1/std": 2 * st * s1 * b,
           "fc1 input": e * s1 * b * h, "gelu input": e * s * b * f // t,
           "fc2 input": e * s * b * f // t}
    if dropout:
        out["residual dropout masks"] = 2 * s1 * b * h
    if recompute == "none" and attention == "sdpa":
        out["sdpa log-sum-exp"] = 4 * b * (a // t) * s
    elif recompute == "none":
        probs = b * (a // t) * s * s
        out["causal mask"] = s * s
        out["softmax output"] = e * probs
        if dropout:
            out["attention dropout mask"] = probs
            out["dropped-out probabilities"] = e * probs
    return out
