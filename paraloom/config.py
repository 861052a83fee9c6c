"""Configuration dataclasses: frozen, keyword-only, one docstring per field, validated on creation.

Every error names the offending value and what would be valid, so a bad layout is rejected before
any process group or rank is started.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ParallelConfig", "ModelConfig", "check_layout"]


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the world is split: ``world_size = tp * pp * dp`` (tensor fastest, pipeline
    slowest)."""

    tp: int = 1
    """Tensor-model-parallel size (Megatron ``tensor_model_parallel_size``): ranks sharing each
    layer."""
    pp: int = 1
    """Pipeline-model-parallel size (``pipeline_model_parallel_size``): number of pipeline
    stages."""
    dp: int = 1
    """Data-parallel size: model replicas, each on a different slice of the global batch."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (``virtual_pipeline_model_parallel_size``), for interleaved
    1F1B; ``None`` means one chunk per stage."""
    sequence_parallel: bool = False
    """Split LayerNorm/dropout activations along the sequence over the tp group; tp all-reduces
    become all-gather + reduce-scatter pairs (Korthikanti et al. 2022)."""
    async_grad_allreduce: bool = False
    """Overlap the column layer's input-gradient all-reduce with its weight-gradient GEMM. Not with
    ``sequence_parallel``, which has no such all-reduce (its reduce-scatter always overlaps)."""
    gradient_accumulation_fusion: bool = False
    """Accumulate weight gradients straight into fp32 ``param.main_grad``; ``param.grad`` stays
    None."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            _positive_int(name, getattr(self, name))
        if self.vpp is not None:
            _positive_int("vpp", self.vpp)
            if self.vpp > 1 and self.pp == 1:
                raise ValueError(
                    f"vpp = {self.vpp} needs pipeline parallelism (pp > 1), got pp = 1")
        if self.sequence_parallel and self.async_grad_allreduce:
            raise ValueError(
                "sequence_parallel=True cannot be combined with async_grad_allreduce=True: with "
                "sequence parallelism there is no input-gradient all-reduce to overlap (it is a "
                "reduce-scatter, which already overlaps the weight-gradient GEMM); turn one off")

    @property
    def world_size(self) -> int:
        """Number of ranks this layout needs: ``tp * pp * dp``."""
        return self.tp * self.pp * self.dp


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of a GPT-style transformer."""

    vocab_size: int = 256
    """Vocabulary size before padding (byte-level tokens: 256)."""
    hidden_size: int = 64
    """Model width ``h``."""
    num_layers: int = 4
    """Number of transformer layers ``L``."""
    num_attention_heads: int = 4
    """Attention heads ``a``; ``hidden_size`` must be divisible by it."""
    ffn_hidden_size: int | None = None
    """MLP width; ``None`` means ``4 * hidden_size``."""
    seq_length: int = 64
    """Tokens per sample ``s``."""
    dropout: float = 0.0
    """Dropout probability for attention and residual dropout."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                     "seq_length"):
            _positive_int(name, getattr(self, name))
        if self.ffn_hidden_size is not None:
            _positive_int("ffn_hidden_size", self.ffn_hidden_size)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size = {self.hidden_size} is not divisible by "
                             f"num_attention_heads = {self.num_attention_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def ffn(self) -> int:
        """The MLP width actually used."""
        return self.ffn_hidden_size or 4 * self.hidden_size


def check_layout(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Raise ``ValueError`` (every number named) if ``model`` cannot be split as ``parallel``
    says."""
    tp, chunks = parallel.tp, parallel.pp * (parallel.vpp or 1)
    problems = []
    for name, value in (("hidden_size", model.hidden_size), ("ffn_hidden_size", model.ffn),
                        ("num_attention_heads", model.num_attention_heads)):
        if value % tp:
            problems.append(f"{name} = {value} is not divisible by tp = {tp}")
    if model.num_layers % chunks:
        problems.append(f"num_layers = {model.num_layers} is not divisible by pp * vpp = {chunks}")
    if parallel.sequence_parallel and model.seq_length % tp:
        problems.append(f"seq_length = {model.seq_length} is not divisible by tp = {tp} "
                        f"(needed by sequence_parallel)")
    if problems:
        raise ValueError("invalid layout: " + "; ".join(problems))
