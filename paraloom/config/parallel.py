"""How the world is split: :class:`ParallelConfig` (tp, cp, ep, dp, pp, vpp and the tensor-parallel
switches), with Megatron's names and flags."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .fields import option

__all__ = ["ParallelConfig", "positive_int", "default_schedule", "SCHEDULES", "CP_COMM_TYPES"]

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
"""Context-parallel attention (Megatron's ``--cp-comm-type``): the K/V ring, one all-gather,
Ulysses' all-to-all, and Ulysses inside groups with the ring across them."""

SCHEDULES = ("1f1b", "interleaved", "none", "zb-h1")
"""Pipeline schedules: 1F1B, interleaved 1F1B (virtual stages), none (gradient accumulation,
pp = 1) and ZB-H1 (zero bubble)."""


def positive_int(name: str, value: object) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is an int >= 1 (``True`` is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def default_schedule(pp: int, vpp: int | None) -> str:
    """Megatron's choice when none is given: no pipelining at pp = 1, interleaved 1F1B with
    virtual stages, else 1F1B."""
    return "none" if pp == 1 else "interleaved" if (vpp or 1) > 1 else "1f1b"


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the world is split: ``world_size = tp * cp * dp * pp`` (tensor fastest, then context,
    data, pipeline slowest); ``ep`` is carved out of ``dp * cp``."""

    tp: int = option(1, "--tp", "--tensor-model-parallel-size",
                     help="tensor-parallel size: ranks sharing each layer")
    """Tensor-model-parallel size (Megatron ``tensor_model_parallel_size``): ranks sharing each
    layer."""
    pp: int = option(1, "--pp", "--pipeline-model-parallel-size",
                     help="pipeline-parallel size: pipeline stages")
    """Pipeline-model-parallel size (``pipeline_model_parallel_size``): number of pipeline
    stages."""
    dp: int = option(1, "--dp", "--data-parallel-size",
                     help="data-parallel size: model replicas")
    """Data-parallel size: model replicas, each on a different slice of the global batch."""
    vpp: int | None = option(None, "--vpp", "--virtual-pipeline-model-parallel-size",
                             help="virtual stages per pipeline rank (interleaved; or give "
                                  "--num-layers-per-virtual-pipeline-stage N, Megatron-LM's "
                                  "layers per virtual stage)")
    """Virtual pipeline stages per rank (``virtual_pipeline_model_parallel_size``), for interleaved
    1F1B; ``None`` (or 1, which means the same) is one chunk per stage."""
    sequence_parallel: bool = option(False, "--sequence-parallel",
                                     help="split norms and dropout along the sequence over tp")
    """Split LayerNorm/dropout activations along the sequence over the tp group; tp all-reduces
    become all-gather + reduce-scatter pairs (Korthikanti et al. 2022)."""
    async_grad_allreduce: bool | None = option(
        None, "--async-grad-allreduce", "--async-tensor-model-parallel-allreduce", negatable=True,
        help="overlap the column layers' input-gradient all-reduce with their weight-gradient "
             "GEMM (default: on when tp > 1 without --sequence-parallel, as Megatron-Core)")
    """Overlap the column layer's input-gradient all-reduce with its weight-gradient GEMM.
    ``None`` (default) follows Megatron-Core, which always does it when ``tp > 1`` and sequence
    parallelism is off (``allreduce_dgrad`` in its ``ColumnParallelLinear``); ``False`` turns it
    off; ``True`` asks for it explicitly. Not with ``sequence_parallel``, which has no such
    all-reduce (its reduce-scatter always overlaps): the default then simply does not use it,
    an explicit ``True`` is an error. :attr:`uses_async_grad_allreduce` is the effective value."""
    gradient_accumulation_fusion: bool = option(
        False, "--grad-accum-fusion", "--gradient-accumulation-fusion", negatable=True,
        help="accumulate weight grads straight into fp32 main_grad (default: off, as "
             "Megatron-Core's config; see README, Defaults)")
    """Accumulate weight gradients straight into fp32 ``param.main_grad``; ``param.grad`` stays
    None. Off by default, as in Megatron-Core's ``ModelParallelConfig`` (Megatron-LM's training
    script turns it on, but there it needs a fused CUDA kernel; see README, "Defaults")."""
    cp: int = option(1, "--cp", "--context-parallel-size",
                     help="ranks sharing each sequence (load-balanced 2*cp chunks)")
    """Context-parallel size (``context_parallel_size``): ranks sharing each sequence, split
    load-balanced into ``2 * cp`` chunks (rank r holds chunks r and 2cp-1-r)."""
    cp_comm_type: str = option("p2p", "--cp-comm-type", choices=CP_COMM_TYPES,
                               help="context-parallel attention: p2p (K/V ring), all_gather "
                                    "(one all-gather of K,V per layer), a2a (Ulysses: Q,K,V "
                                    "all-to-all from sequence to heads) or a2a+p2p (a2a inside "
                                    "groups of A cp ranks, the ring across them; needs "
                                    "--hierarchical-context-parallel-sizes A B)")
    """How attention sees the other chunks: ``p2p`` (a K/V ring of cp steps, Megatron/TE's
    default), ``all_gather`` (one all-gather of K,V per layer, as in Llama 3), ``a2a``
    (DeepSpeed-Ulysses: Q, K, V all-to-all'd to head shards; needs cp to divide the key/value
    heads of a tp rank) or ``a2a+p2p`` (hierarchical: Ulysses inside each group of ``A``
    consecutive cp ranks, then the ring across the ``B`` groups; ``cp_sizes = (A, B)``)."""
    cp_sizes: tuple[int, ...] | None = option(
        None, "--hierarchical-context-parallel-sizes", nargs="+", metavar="SIZE",
        help="cp split into levels, innermost first (A B: groups of A consecutive cp ranks, "
             "B of them); their product is cp; a2a+p2p needs exactly two, each > 1")
    """Megatron's ``hierarchical_context_parallel_sizes``: the cp group split into levels, the
    innermost first (level 0: ``A`` consecutive cp ranks; level 1: the ranks ``A`` apart).
    ``--cp-comm-type a2a+p2p`` all-to-alls in level 0 and runs the ring over level 1."""
    ep: int = option(1, "--ep", "--expert-model-parallel-size",
                     help="expert-parallel size, carved out of --dp (must divide it)")
    """Expert-model-parallel size (``expert_model_parallel_size``): ranks the experts of each MoE
    layer are divided over; carved out of the ``dp`` (x cp) ranks, so it must divide them."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep"):
            positive_int(name, getattr(self, name))
        dp_cp = self.dp * self.cp
        if dp_cp % self.ep:
            raise ValueError(f"ep = {self.ep} does not divide dp * cp = {dp_cp}: expert "
                             f"parallelism is carved out of the data-parallel ranks; choose an "
                             f"ep among the divisors of {dp_cp}")
        if self.vpp is not None:
            positive_int("vpp", self.vpp)
            if self.vpp > 1 and self.pp == 1:
                raise ValueError(
                    f"vpp = {self.vpp} needs pipeline parallelism (pp > 1), got pp = 1")
            if self.vpp == 1:  # one chunk per stage: Megatron's None
                object.__setattr__(self, "vpp", None)
        if not (self.async_grad_allreduce is None or isinstance(self.async_grad_allreduce, bool)):
            raise ValueError(f"async_grad_allreduce must be None (Megatron-Core's rule), True or "
                             f"False, got {self.async_grad_allreduce!r}")
        if self.sequence_parallel and self.async_grad_allreduce:
            raise ValueError(
                "sequence_parallel=True cannot be combined with async_grad_allreduce=True: with "
                "sequence parallelism there is no input-gradient all-reduce to overlap (it is a "
                "reduce-scatter, which already overlaps the weight-gradient GEMM); leave "
                "async_grad_allreduce at its default (None: not used with sequence_parallel)")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type must be one of {', '.join(CP_COMM_TYPES)}, got "
                             f"{self.cp_comm_type!r}")
        self._check_cp_sizes()

    def _check_cp_sizes(self) -> None:
        sizes = self.cp_sizes
        if sizes is not None:
            sizes = tuple(sizes)  # a list from the command line or a saved config.json
            object.__setattr__(self, "cp_sizes", sizes)
            if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes) \
                    or math.prod(sizes) != self.cp:
                raise ValueError(f"--hierarchical-context-parallel-sizes "
                                 f"{' '.join(map(str, sizes))}: the sizes must be positive "
                                 f"integers whose product is cp = {self.cp}")
        if self.cp_comm_type != "a2a+p2p" or self.cp == 1:
            return
        if sizes is None or len(sizes) != 2 or min(sizes) < 2:
            got = "not given" if sizes is None else " ".join(map(str, sizes))
            raise ValueError(
                f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A B (two "
                f"levels, A * B = cp = {self.cp}, each at least 2), got {got}; with one level "
                f"use --cp-comm-type a2a or p2p")

    @property
    def uses_sequence_parallel(self) -> bool:
        """Whether sequence parallelism is in effect: asked for, and tp > 1 (with one tensor
        rank nothing is split; Megatron-LM turns the flag off there)."""
        return self.sequence_parallel and self.tp > 1

    @property
    def uses_async_grad_allreduce(self) -> bool:
        """Whether the column layers overlap their input-gradient all-reduce: the explicit
        setting, or Megatron-Core's rule ``tp > 1 and not sequence_parallel``."""
        if self.async_grad_allreduce is None:
            return self.tp > 1 and not self.sequence_parallel
        return self.async_grad_allreduce and self.tp > 1

    @property
    def world_size(self) -> int:
        """Number of ranks this layout needs: ``tp * cp * pp * dp``."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def layout(self) -> tuple[int, int, int, int, int, int]:
        """``(tp, cp, ep, dp, pp, vpp)``: what decides which part of the model and which RNG
        streams a rank holds (two runs with the same layout put rank r in the same place)."""
        return self.tp, self.cp, self.ep, self.dp, self.pp, self.vpp or 1
