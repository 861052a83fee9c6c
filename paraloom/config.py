"""Configuration dataclasses: frozen, keyword-only, one docstring per field, validated on creation.

Every error names the offending value and what would be valid, so a bad layout is rejected before
any process group or rank is started.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ParallelConfig", "ModelConfig", "TrainConfig", "check_layout"]


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the world is split: ``world_size = tp * cp * dp * pp`` (tensor fastest, then context,
    data, pipeline slowest)."""

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
    async_grad_allreduce: bool | None = None
    """Overlap the column layer's input-gradient all-reduce with its weight-gradient GEMM.
    ``None`` (default) follows Megatron-Core, which always does it when ``tp > 1`` and sequence
    parallelism is off (``allreduce_dgrad`` in its ``ColumnParallelLinear``); ``False`` turns it
    off; ``True`` asks for it explicitly. Not with ``sequence_parallel``, which has no such
    all-reduce (its reduce-scatter always overlaps): the default then simply does not use it,
    an explicit ``True`` is an error. :attr:`uses_async_grad_allreduce` is the effective value."""
    gradient_accumulation_fusion: bool = False
    """Accumulate weight gradients straight into fp32 ``param.main_grad``; ``param.grad`` stays
    None. Off by default, as in Megatron-Core's ``ModelParallelConfig`` (Megatron-LM's training
    script turns it on, but there it needs a fused CUDA kernel; see README, "Defaults")."""
    cp: int = 1
    """Context-parallel size (``context_parallel_size``): ranks sharing each sequence, split
    load-balanced into ``2 * cp`` chunks (rank r holds chunks r and 2cp-1-r)."""
    cp_comm_type: str = "p2p"
    """How attention sees the other chunks' K/V: ``p2p`` (a ring of cp steps, Megatron/TE's
    default) or ``all_gather`` (one all-gather of K,V per layer, as in Llama 3)."""
    ep: int = 1
    """Expert-model-parallel size (``expert_model_parallel_size``): ranks the experts of each MoE
    layer are divided over; carved out of the ``dp`` (x cp) ranks, so it must divide them."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep"):
            _positive_int(name, getattr(self, name))
        dp_cp = self.dp * getattr(self, "cp", 1)
        if dp_cp % self.ep:
            raise ValueError(f"ep = {self.ep} does not divide dp * cp = {dp_cp}: expert "
                             f"parallelism is carved out of the data-parallel ranks; choose an "
                             f"ep among the divisors of {dp_cp}")
        if self.vpp is not None:
            _positive_int("vpp", self.vpp)
            if self.vpp > 1 and self.pp == 1:
                raise ValueError(
                    f"vpp = {self.vpp} needs pipeline parallelism (pp > 1), got pp = 1")
        if not (self.async_grad_allreduce is None or isinstance(self.async_grad_allreduce, bool)):
            raise ValueError(f"async_grad_allreduce must be None (Megatron-Core's rule), True or "
                             f"False, got {self.async_grad_allreduce!r}")
        if self.sequence_parallel and self.async_grad_allreduce:
            raise ValueError(
                "sequence_parallel=True cannot be combined with async_grad_allreduce=True: with "
                "sequence parallelism there is no input-gradient all-reduce to overlap (it is a "
                "reduce-scatter, which already overlaps the weight-gradient GEMM); leave "
                "async_grad_allreduce at its default (None: not used with sequence_parallel)")
        if self.cp_comm_type not in ("p2p", "all_gather"):
            raise ValueError(f"cp_comm_type must be p2p or all_gather, got {self.cp_comm_type!r}")

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
    make_vocab_size_divisible_by: int = 128
    """The embedding table has ``vocab_size`` rounded up to a multiple of this many rows, so its
    vocabulary split divides by tp. A fixed multiple (not Megatron's ``128 * tp``) keeps the
    table's shape, and so checkpoints, the same under every layout; padding rows are never a
    token and their logits are excluded from the loss."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` (GPT-2) or ``RMSNorm`` (Llama), Megatron's ``--normalization``."""
    norm_epsilon: float = 1e-5
    """Epsilon of every norm (Megatron's ``--norm-epsilon``)."""
    swiglu: bool = False
    """MLP ``fc2(silu(gate) * up)`` with fc1 holding ``[gate; up]`` (Megatron's ``--swiglu``);
    off: the tanh-GeLU MLP."""
    position_embedding_type: str = "learned_absolute"
    """``learned_absolute`` (a learned table) or ``rope`` (rotary, applied to q and k)."""
    rotary_base: int = 10000
    """Rotary base ``theta`` (Megatron's ``--rotary-base``)."""
    num_query_groups: int | None = None
    """Key/value heads (grouped-query attention); ``None``: one per attention head."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weight instead of reusing the word embeddings."""
    add_bias_linear: bool = True
    """Biases in the linear layers (``False``: Megatron's ``--disable-bias-linear``)."""
    attention: str = "core"
    """``core`` (written-out attention, saves the ``s x s`` scores) or ``sdpa``
    (``scaled_dot_product_attention``). Same function, different kernel and memory."""
    num_experts: int | None = None
    """Experts per MoE layer (Megatron ``num_experts``); ``None``: a dense model."""
    moe_router_topk: int = 2
    """Experts each token is routed to (``k``)."""
    moe_aux_loss_coeff: float = 1e-2
    """Coefficient of the Switch load-balancing loss (0 turns it off)."""
    moe_z_loss_coeff: float | None = None
    """Coefficient of the router z-loss (ST-MoE); ``None``: none."""
    moe_expert_capacity_factor: float | None = None
    """Each expert takes at most ``ceil(factor * N * k / E)`` of a microbatch's ``N`` tokens,
    the others are dropped; ``None``: dropless."""
    moe_layer_freq: int = 1
    """Every N-th layer (counting from layer 0) is an MoE layer, the others dense."""
    moe_token_drop_policy: str = "probs"
    """With a capacity factor, keep each expert's highest-weight tokens (``probs``) or its
    earliest ones (``position``)."""
    moe_pad_expert_input_to_capacity: bool = False
    """With a capacity factor, pad every expert's input to exactly its capacity (Megatron's
    ``--moe-pad-expert-input-to-capacity``): the all-to-all splits are then fixed, so the token
    counts are not exchanged; padded rows carry weight 0 and change no result."""

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
        self._check_architecture()
        if self.num_experts is not None:
            _check_moe(self)

    def _check_architecture(self) -> None:
        for name, valid in (("normalization", ("LayerNorm", "RMSNorm")),
                            ("position_embedding_type", ("learned_absolute", "rope")),
                            ("attention", ("core", "sdpa"))):
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} must be {' or '.join(valid)}, got "
                                 f"{getattr(self, name)!r}")
        if not self.norm_epsilon > 0:
            raise ValueError(f"norm_epsilon must be positive, got {self.norm_epsilon}")
        _positive_int("rotary_base", self.rotary_base)
        if self.num_query_groups is not None:
            _positive_int("num_query_groups", self.num_query_groups)
            if self.num_attention_heads % self.num_query_groups:
                raise ValueError(f"num_attention_heads = {self.num_attention_heads} is not "
                                 f"divisible by num_query_groups = {self.num_query_groups}")
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ValueError(f"rope needs an even head dimension, got hidden_size / "
                             f"num_attention_heads = {self.head_dim}")
        if self.ffn < 1:
            raise ValueError(f"with swiglu and hidden_size = {self.hidden_size} Megatron's "
                             f"default MLP width is 0: give ffn_hidden_size")

    @property
    def padded_vocab_size(self) -> int:
        """``vocab_size`` rounded up to a multiple of ``make_vocab_size_divisible_by``."""
        m = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // m) * m

    @property
    def ffn(self) -> int:
        """The MLP width actually used (with ``swiglu`` Megatron's default is
        ``int(4h * 2/3 / 64) * 64``, keeping the parameter count of a ``4h`` GeLU MLP)."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu else 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        """Dimension of one attention head ``d = h / a``."""
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads ``g`` (``num_attention_heads`` without grouped-query attention)."""
        return self.num_query_groups or self.num_attention_heads


def _check_moe(m: ModelConfig) -> None:
    _positive_int("num_experts", m.num_experts)
    _positive_int("moe_router_topk", m.moe_router_topk)
    _positive_int("moe_layer_freq", m.moe_layer_freq)
    if m.moe_router_topk > m.num_experts:
        raise ValueError(f"moe_router_topk = {m.moe_router_topk} is larger than num_experts = "
                         f"{m.num_experts}: a token cannot go to more experts than there are")
    if m.moe_aux_loss_coeff < 0 or (m.moe_z_loss_coeff or 0) < 0:
        raise ValueError(f"moe_aux_loss_coeff ({m.moe_aux_loss_coeff}) and moe_z_loss_coeff "
                         f"({m.moe_z_loss_coeff}) must be >= 0")
    cf = m.moe_expert_capacity_factor
    if cf is not None and not cf > 0:
        raise ValueError(f"moe_expert_capacity_factor must be positive (or None: dropless), "
                         f"got {cf}")
    if m.swiglu or not m.add_bias_linear:
        raise ValueError(f"num_experts = {m.num_experts} with swiglu = {m.swiglu} and "
                         f"add_bias_linear = {m.add_bias_linear}: experts are GeLU MLPs with "
                         f"biases (as GPT-2's MLP) for now; use the GPT-2 MLP flags with MoE")
    if m.moe_pad_expert_input_to_capacity and cf is None:
        raise ValueError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor "
                         "(padding is to the capacity); give --moe-expert-capacity-factor")
    if m.moe_token_drop_policy not in ("probs", "position"):
        raise ValueError(f"moe_token_drop_policy must be probs or position, got "
                         f"{m.moe_token_drop_policy!r}")


def check_layout(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Raise ``ValueError`` (every number named) if ``model`` cannot be split as ``parallel``
    says."""
    tp, chunks = parallel.tp, parallel.pp * (parallel.vpp or 1)
    problems = []
    sizes = [("hidden_size", model.hidden_size), ("ffn_hidden_size", model.ffn),
             ("num_attention_heads", model.num_attention_heads)]
    if model.num_query_groups:
        sizes.append(("num_query_groups", model.num_query_groups))
    for name, value in sizes:
        if value % tp:
            problems.append(f"{name} = {value} is not divisible by tp = {tp}")
    if model.padded_vocab_size % tp:
        problems.append(f"the padded vocabulary ({model.vocab_size} rounded up to a multiple of "
                        f"make_vocab_size_divisible_by = {model.make_vocab_size_divisible_by}: "
                        f"{model.padded_vocab_size}) is not divisible by tp = {tp}")
    if model.num_layers % chunks:
        problems.append(f"num_layers = {model.num_layers} is not divisible by pp * vpp = {chunks}")
    if model.num_experts is not None and model.num_experts % parallel.ep:
        problems.append(f"num_experts = {model.num_experts} is not divisible by ep = "
                        f"{parallel.ep} (each ep rank holds num_experts / ep experts)")
    if model.num_experts is None and parallel.ep > 1:
        problems.append(f"ep = {parallel.ep} needs an MoE model (give num_experts)")
    if parallel.sequence_parallel and model.seq_length % tp:
        problems.append(f"seq_length = {model.seq_length} is not divisible by tp = {tp} "
                        f"(needed by sequence_parallel)")
    cp = parallel.cp
    if cp > 1 and model.seq_length % (2 * cp):
        problems.append(f"seq_length = {model.seq_length} is not divisible by 2 * cp = {2 * cp} "
                        f"(context parallelism cuts each sequence into 2 * cp chunks)")
    elif cp > 1 and parallel.sequence_parallel and (model.seq_length // cp) % tp:
        problems.append(f"seq_length / cp = {model.seq_length // cp} is not divisible by tp = "
                        f"{tp} (needed by sequence_parallel with context parallelism)")
    if cp > 1 and model.dropout > 0:
        problems.append(f"dropout = {model.dropout} with cp = {cp}: attention dropout is not "
                        f"implemented for context parallelism; use dropout 0")
    if problems:
        raise ValueError("invalid layout: " + "; ".join(problems))


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One ``paraloom train`` run: model shape, layout, optimisation and output settings."""

    model: ModelConfig = ModelConfig()
    """Shape of the GPT."""
    parallel: ParallelConfig = ParallelConfig()
    """The (tp, pp, dp, vpp) layout and its switches."""
    global_batch_size: int = 8
    """Samples per optimizer step, over all data-parallel ranks and microbatches."""
    micro_batch_size: int = 2
    """Samples per microbatch on one data-parallel rank."""
    steps: int = 20
    """Optimizer steps to run (in total, counting steps done before a resume)."""
    lr: float = 3e-3
    """Peak learning rate (AdamW), reached after ``warmup_steps``, then cosine decay."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 2
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to biases and LayerNorm parameters)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm (over tp, pp and dp) to this value; 0 disables."""
    seed: int = 1234
    """Seeds the initializer, the data order and dropout."""
    dtype: str = "fp32"
    """``fp32`` or ``bf16`` (bf16 compute, fp32 master weights and main grads)."""
    recompute: str = "none"
    """Activation recomputation: ``none``, ``selective`` (core attention) or ``full``
    (per layer)."""
    schedule: str = "1f1b"
    """Pipeline schedule: ``1f1b``, ``interleaved`` (needs vpp), ``none`` (no pipelining) or
    ``zb-h1`` (zero bubble: weight gradients deferred into 1F1B's bubble; no vpp)."""
    overlap_grad_reduce: bool = True
    """Launch each gradient bucket's reduction as soon as it is complete in backward (Megatron's
    default is off; see README, "Defaults")."""
    overlap_p2p_comm: bool | None = None
    """Pipeline p2p posted ahead and waited late so transfers overlap compute (Megatron's
    ``overlap_p2p_comm``); ``None``: on for gloo (CPU), off on CUDA; ``False``: Megatron-Core's
    blocking batches. The messages are the same either way."""
    distributed_optimizer: bool = False
    """ZeRO-1: shard optimizer states over dp (reduce-scatter grads, all-gather params)."""
    bucket_size: int | None = None
    """Gradient bucket size in elements; ``None`` for Megatron's default."""
    data: str | None = None
    """Training text file; ``None`` for the bundled corpus."""
    out: str = "runs/latest"
    """Run folder (config.json, metrics.jsonl, ledger.jsonl, trace.json, ...)."""
    save_every: int = 0
    """Save a checkpoint every N steps (and at the end when N > 0)."""
    resume: str | None = None
    """Run folder or checkpoint folder to resume from."""
    ledger_steps: int = 1
    """Steps recorded in the ledger (from the first); -1 records every step."""
    timeout_s: float = 120.0
    """Timeout for every collective wait; a dead or stuck rank ends the run after this long."""
    max_bad_steps: int = 3
    """Stop after this many consecutive steps with a NaN/Inf loss or gradient (each skipped)."""
    init_from_hf: str | None = None
    """A Hugging Face GPT-2 folder whose weights replace the initial ones (recorded here so the
    run folder's config.json says where the model came from)."""
    tokenizer: str | None = None
    """A local Hugging Face tokenizer folder (``--tokenizer``); ``None``: tokens are bytes. The
    vocabulary size comes from it."""
    data_path: str | None = None
    """Prefix of a Megatron indexed dataset ``P.bin``/``P.idx`` (``--data-path``), read instead
    of ``data``; its documents are joined with the tokenizer's end-of-document token between."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here (rank 0; Megatron's ``--tensorboard-dir``)."""
    log_interval: int = 1
    """TensorBoard scalars every N steps (and at the last; Megatron's ``--log-interval``)."""

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "micro_batch_size", "steps", "seed"):
            value = getattr(self, name)
            if name == "seed":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"seed must be a non-negative integer, got {value!r}")
            else:
                _positive_int(name, value)
        p, m = self.parallel, self.model
        check_layout(m, p)
        per_step = self.micro_batch_size * p.dp
        if self.global_batch_size % per_step:
            raise ValueError(f"global_batch_size = {self.global_batch_size} is not divisible by "
                             f"micro_batch_size * dp = {self.micro_batch_size} * {p.dp} = "
                             f"{per_step}")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype must be fp32 or bf16, got {self.dtype!r}")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be none, selective or full, got {self.recompute!r}")
        if self.schedule not in ("1f1b", "interleaved", "none", "zb-h1"):
            raise ValueError(f"schedule must be 1f1b, interleaved, none or zb-h1, got "
                             f"{self.schedule!r}")
        if self.schedule == "zb-h1" and p.pp < 2:
            raise ValueError(f"schedule zb-h1 (zero bubble) needs pp >= 2, got pp = {p.pp}")
        if self.schedule == "interleaved":
            if (p.vpp or 1) < 2:
                raise ValueError("schedule interleaved needs vpp >= 2 (--vpp, virtual stages per "
                                 "pipeline rank), got " + (f"vpp = {p.vpp}" if p.vpp else
                                                            "no vpp"))
            if self.num_microbatches % p.pp:
                raise ValueError(f"the interleaved schedule needs the number of microbatches "
                                 f"({self.num_microbatches}) to be a multiple of pp = {p.pp}")
        elif (p.vpp or 1) > 1:
            raise ValueError(f"vpp = {p.vpp} needs schedule interleaved, got {self.schedule!r}")
        if self.schedule == "none" and p.pp > 1:
            raise ValueError(f"schedule none (no pipelining) needs pp = 1, got pp = {p.pp}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr (--lr) must be a positive number, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr (--min-lr) must be between 0 and lr = {self.lr} (the "
                             f"schedule decays from lr down to it), got {self.min_lr}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"weight_decay (--weight-decay) must be >= 0, got "
                             f"{self.weight_decay}")
        if self.bucket_size is not None:
            _positive_int("bucket_size (--bucket-size, elements)", self.bucket_size)
        if isinstance(self.ledger_steps, bool) or not isinstance(self.ledger_steps, int) or (
                self.ledger_steps < 1 and self.ledger_steps != -1):
            raise ValueError(f"ledger_steps (--ledger-steps) must be a positive number of steps "
                             f"or -1 (every step), got {self.ledger_steps!r}")
        if self.warmup_steps < 0 or self.save_every < 0 or not self.clip_grad >= 0:
            raise ValueError(f"warmup_steps ({self.warmup_steps}), save_every ({self.save_every}) "
                             f"and clip_grad ({self.clip_grad}) must be >= 0")
        _positive_int("max_bad_steps", self.max_bad_steps)
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ValueError(f"timeout_s (--timeout) must be a positive number of seconds, got "
                             f"{self.timeout_s}")

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step on each data-parallel rank."""
        return self.global_batch_size // (self.micro_batch_size * self.parallel.dp)
