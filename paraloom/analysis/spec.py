"""The data types of the analytical model: a layout as the formulas see it (:class:`CommConfig`,
with its :class:`Architecture` and :class:`MoECommConfig` parts) and a rank's parameters and
gradient buckets (:class:`Param`, :class:`Bucket`).

They are plain frozen dataclasses with no behaviour beyond their derived sizes, so every formula
module (``layout``, ``formulas``, ``cp_formulas``, ``moe_formulas``, ``steptime``, ...) imports
them from here and none of those modules needs another in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

__all__ = ["Architecture", "CommConfig", "MoECommConfig", "Param", "Bucket", "F32"]

F32 = 4
"""Bytes of a float32 (what the loss and cross-entropy reductions move per element)."""


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """ModelConfig's architecture fields (same names and defaults: GPT-2)."""

    normalization: str = "LayerNorm"
    swiglu: bool = False
    position_embedding_type: str = "learned_absolute"
    num_query_groups: int | None = None
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    attention: str = "core"

    @classmethod
    def from_model(cls, model: dict) -> Architecture:
        """From a ``config.json``'s ``model`` dict (absent keys: GPT-2's values)."""
        return cls(**{f.name: model[f.name] for f in fields(cls) if f.name in model})

    @cached_property  # asked for every layout the search tries; the instance is frozen
    def is_gpt2(self) -> bool:
        """Every parameter as in GPT-2 (``attention`` changes no parameter)."""
        return self == Architecture(attention=self.attention)

    @property
    def tied(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def fc1(self, ffn: int) -> int:
        """Rows of an MLP's fc1 of width ``ffn``: ``2 ffn`` with SwiGLU (gate and up)."""
        return 2 * ffn if self.swiglu else ffn

    def mlp_flops(self, tokens: int, hidden: int, ffn: int) -> int:
        """Forward FLOPs of one MLP of width ``ffn`` on ``tokens`` tokens: fc1 and fc2."""
        return 2 * tokens * hidden * (self.fc1(ffn) + ffn)


@dataclass(frozen=True)
class MoECommConfig:
    """The MoE part of a layout."""

    num_experts: int
    topk: int = 2
    ep: int = 1
    layer_freq: int = 1
    capacity: bool = False
    """A capacity factor is set: tokens may be dropped, dispatch rows are data-dependent."""
    padded_rows: int = 0
    """With ``moe_pad_expert_input_to_capacity``: rows every dispatch sends (``E x capacity``,
    fixed); the token counts are then not exchanged. 0: not padded."""
    shared_ffn: int = 0
    """Width of the shared expert (``moe_shared_expert_intermediate_size``; 0: none): a dense
    tp-split MLP in every MoE layer."""
    shared_gate: bool = False
    """The shared expert's sigmoid gate (``gate_weight [1, h]``, replicated)."""
    shared_overlap: bool = False
    """``moe_shared_expert_overlap``: its input gathered once by the dispatcher (no re-gather
    in backward)."""
    dispatcher: str = "allgather"
    """Megatron's token dispatcher: ``allgather`` (its default) or ``alltoall``."""
    grouped_gemm: bool = False
    """``moe_grouped_gemm``: the local experts' parameters fc1 of each, then fc2 (their order in
    the gradient buffer, :class:`paraloom.moe.experts.GroupedExperts`)."""
    aux_loss: bool = True
    """A load-balancing loss (``moe_aux_loss_coeff > 0``): its counts are summed over tp x cp."""

    def is_moe_layer(self, index: int) -> bool:
        return index % self.layer_freq == 0


@dataclass(frozen=True, kw_only=True)
class CommConfig:
    """One layout of the GPT of :mod:`paraloom.models.gpt`, as the formulas need it."""

    layers: int
    """Transformer layers ``L`` (all stages)."""
    hidden: int
    """Model width ``h``."""
    heads: int
    """Attention heads ``a``."""
    seq_len: int
    """Tokens per sample ``s``."""
    vocab: int
    """Vocabulary ``V`` (already padded to a multiple of ``t``)."""
    ffn: int | None = None
    """MLP width; ``None`` means ``4h``."""
    micro_batch: int = 1
    """Samples per microbatch ``b``."""
    num_microbatches: int = 1
    """Microbatches per step ``m`` (per data-parallel rank)."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B); ``None`` or 1: one chunk."""
    sequence_parallel: bool = False
    recompute: str = "none"
    """``none``, ``selective`` (attention core only: no communication) or ``full`` (each layer's
    forward communication runs again in backward, all of it, as Megatron's re-run)."""
    distributed_optimizer: bool = False
    """ZeRO-1: gradient buckets reduce-scattered, parameter shards all-gathered."""
    megatron_fsdp: str | None = None
    """``--use-megatron-fsdp``: its sharding strategy (``no_shard``, ``optim``, ``optim_grads``;
    :mod:`paraloom.data_parallel.megatron_fsdp`), ``None`` for Megatron's DDP."""
    instances: int = 1
    """``--num-distributed-optimizer-instances``: buckets sharded and reduce-scattered within
    blocks of ``dp / instances`` ranks, the shard then all-reduced across the blocks (kind
    ``dp_inter``, synchronous); the grad norm over one instance (``1/instances`` of the world)."""
    overlap_param_gather: bool = False
    """``--overlap-param-gather``: the parameter shards are all-gathered in the next forward
    (phase ``forward``, :mod:`paraloom.data_parallel.param_gather`), not after the update."""
    align_param_gather: bool = True
    """Megatron-LM's ``--align-param-gather``: with interleaving the schedule launches every
    chunk's gathers, also in the step after a checkpoint gathered them (as Megatron's)."""
    param_gather_with_optimizer_step: bool = False
    """``--overlap-param-gather-with-optimizer-step``: chunk 0's buckets (one: bucketing is off
    on every chunk) are all-gathered in the optimizer step, right after chunk 0's update, in
    every step (its other chunks as ``overlap_param_gather`` says)."""
    param_gather_forward: bool = False
    """With ``overlap_param_gather``: this step's forward gathers every bucket (the hooks are
    on: an earlier step of the process succeeded; and no checkpoint gathered them since the last
    step). A run's view has it on; :func:`paraloom.verify.check.step_config` decides per step."""
    grad_sync: bool = True
    """The step is a train step: it reduces gradients (data-parallel buckets,
    ``finalize_model_grads``), the gradient norm and the step's agreements and loss; ``False``
    for a bare forward + backward of the model."""
    optimizer_step: bool = True
    """The optimizer step ran; a train step whose gradient norm is not finite skips it
    (``"skipped"`` in metrics.jsonl), and with it the distributed optimizer's all-gathers."""
    overlap_grad_reduce: bool = True
    """Bucket reductions launched from backward hooks (phase ``backward``), else ``optimizer``."""
    buckets: tuple[int, ...] | None = None
    """Elements per gradient bucket of this rank (padded as the buffer pads them), an override
    for one stage; ``None``: the exact layout (:func:`paraloom.analysis.layout.rank_buckets`)."""
    bucket_size: int | None = None
    """Elements at which a bucket closes (``None``: Megatron's ``max(40M, 1M * dp)``)."""
    bucket_tail_splits: int = 0
    """paraloom's halving of the last buckets (0: Megatron's equal buckets)."""
    align_grad_reduce: bool = True
    """Megatron-LM's ``--align-grad-reduce``: the schedule launches the reduction of 1F1B stages
    after the first and of every interleaved chunk (phase ``backward`` even in the first step)."""
    first_step: bool = False
    """The run's first step: Megatron launches no bucket from the gradient hooks yet, and agrees
    once on separate grad-norm groups (one more int32 all-reduce per grad-stats group)."""
    megatron_lm_loop: bool = False
    """``--megatron-lm-loop``: Megatron-LM's loop collectives around the step (the batch
    broadcast over tp, the rerun vote, the log's learning rate, timer barriers)."""
    rerun_vote: bool = True
    """With the loop: the rerun state machine votes after each step (``--rerun-mode`` not
    ``disabled``)."""
    timer_barriers: bool = False
    """With the loop: this is a logged iteration (two barriers over the world)."""
    last_step: bool = False
    """With the loop: the run's last step ("after training is done": one more barrier)."""
    total_steps: int | None = None
    """The run's steps (which step is the last)."""
    log_interval: int = 100
    """Megatron-LM's ``--log-interval`` (which iterations are logged)."""
    schedule: str | None = None
    """``1f1b``, ``interleaved``, ``none``, ``zb-h1``; ``None``: the default for pp and vpp."""
    dtype_bytes: int = 4
    """Bytes per activation / parameter element (fp32 4, bf16 2)."""
    grad_bytes: int = 4
    dp_grad_bytes: int | None = None
    """Bytes per element of the data-parallel gradient reductions where they differ from
    ``grad_bytes`` (Megatron-FSDP in bf16 reduces bf16: 2)."""
    """Bytes per element of reduced gradients (fp32 ``main_grad``: 4; bf16 reduction: 2)."""
    label_smoothing: bool = False
    """Cross-entropy reduces a third per-token number (the sum of logits)."""
    params_norm: bool = False
    """``--log-params-norm``: Megatron-LM's parameter norm after each step (four fp32 ``[1]``
    over the dp x cp and expert-dp groups, then over mp, and over tp x ep x pp when ep > 1)."""
    num_zeros: bool = False
    """``--log-num-zeros-in-grad``: an int64 ``[1]`` per grad-stats group in the optimizer step
    and an fp32 ``[1]`` MAX over mp after it."""
    per_token_loss: bool = False
    """``--calculate-per-token-loss``: the step's token count broadcast over pp and all-reduced
    over dp x cp (int32, 4 bytes each) in ``finalize_model_grads``."""
    exit_vote: bool = False
    """``--exit-duration-in-mins``: after each step an int32 MAX all-reduce over the world."""
    cross_entropy_fusion: bool = False
    """Megatron's fused cross entropy: the target logits and exponential sums in one
    all-reduce (two numbers per token) after the max."""
    arch: Architecture = Architecture()
    """Llama-family switches (:mod:`paraloom.analysis.arch`); the default is GPT-2."""
    cp: int = 1
    """Context-parallel size: each rank holds ``s/cp`` tokens of every sequence
    (:mod:`paraloom.analysis.cp_formulas`)."""
    cp_comm_type: str = "p2p"
    """``p2p`` (K/V ring), ``all_gather``, ``a2a`` (Ulysses) or ``a2a+p2p`` (hierarchical)."""
    cp_a2a: int = 1
    """``a2a+p2p``: the all-to-all level's size (``A`` of ``--hierarchical-context-parallel-sizes
    A B``); the ring runs over the other ``cp / cp_a2a`` ranks."""
    moe: MoECommConfig | None = None
    """Mixture of experts (:class:`MoECommConfig`); ``None``:
    dense. Its all-to-alls are checked by :mod:`paraloom.analysis.moe_formulas`."""

    def __post_init__(self) -> None:
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be none, selective or full, got {self.recompute!r}")
        for name in ("layers", "hidden", "heads", "seq_len", "vocab", "micro_batch",
                     "num_microbatches", "tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.layers % (self.pp * self.v):
            raise ValueError(f"layers = {self.layers} is not divisible by pp * vpp = "
                             f"{self.pp} * {self.v}")

    @property
    def v(self) -> int:
        return self.vpp or 1

    @property
    def f(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (it needs tp > 1)."""
        return self.sequence_parallel and self.tp > 1


@dataclass(frozen=True)
class Param:
    """One parameter of a chunk as the gradient buffer sees it."""

    name: str
    numel: int
    shared: bool = False
    """``shared_embedding``: the tied word embedding when ``pp > 1`` (its own bucket)."""
    sp: bool = False
    """``sequence_parallel``: its gradient is all-reduced over tp by ``finalize_model_grads``."""
    expert: bool = False
    """An expert's parameter (``allreduce=False``): its own buffer, reduced over edp."""
    row: int = 1
    """Elements of one row (all dimensions but the first; 1 for a vector): Megatron-FSDP's
    layout orders and pads by it (:mod:`paraloom.data_parallel.fsdp_layout`)."""


@dataclass(frozen=True)
class Bucket:
    """One gradient bucket: padded elements and whether it is reduce-scattered."""

    numel: int
    reduce_scatter: bool
    names: tuple[str, ...]
    expert: bool = False
    """Expert parameters' bucket: reduced (and ZeRO-sharded) over edp, not dp."""
