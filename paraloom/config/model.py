"""The shape of a GPT-style transformer: :class:`ModelConfig` (GPT-2 by default; Llama, MoE by
field), and :func:`check_layout`: can a model be split as a :class:`ParallelConfig` says."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import option
from .moe_checks import check_moe, moe_stage_problems
from .parallel import ParallelConfig, positive_int

__all__ = ["ModelConfig", "check_layout", "LLAMA", "mlp_width", "padded_vocab_rows"]

LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
             untie_embeddings_and_output_weights=True, add_bias_linear=False)
"""The Llama family's architecture fields (``--arch llama``); grouped-query attention is a
separate choice (``num_query_groups``)."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of a GPT-style transformer."""

    vocab_size: int = option(256, "--vocab", "--vocab-size",
                             help="vocabulary size (default: 256 bytes, or the tokenizer's)")
    """Vocabulary size before padding (byte-level tokens: 256)."""
    hidden_size: int = option(64, "--hidden", "--hidden-size", help="model width h")
    """Model width ``h``."""
    num_layers: int = option(4, "--layers", "--num-layers", help="transformer layers L")
    """Number of transformer layers ``L``."""
    num_attention_heads: int = option(4, "--heads", "--num-attention-heads",
                                      help="attention heads a")
    """Attention heads ``a``; ``hidden_size`` must be divisible by it."""
    ffn_hidden_size: int | None = option(None, "--ffn", "--ffn-hidden-size",
                                         help="MLP width (default: 4h; SwiGLU: Megatron's 8h/3 "
                                              "rule)")
    """MLP width; ``None`` means ``4 * hidden_size``."""
    seq_length: int = option(64, "--seq-len", "--seq-length", help="tokens per sample s")
    """Tokens per sample ``s``."""
    dropout: float = option(0.0, "--dropout", "--hidden-dropout",
                            help="attention and residual dropout probability")
    """Dropout probability for attention and residual dropout."""
    init_std: float = option(0.02, "--init-std", "--init-method-std",
                             help="standard deviation of the weights' normal initialisation "
                                  "(output layers of each block: / sqrt(2 x layers))")
    """Standard deviation of the normal initialisation (Megatron's ``--init-method-std``, default
    0.02); the blocks' output projections get ``init_std / sqrt(2 num_layers)``, as Megatron's
    ``scaled_init_method_normal``."""
    make_vocab_size_divisible_by: int = option(
        128, "--make-vocab-size-divisible-by",
        help="the embedding rows are the vocabulary rounded up to a multiple of this times tp "
             "(Megatron-LM's rule)")
    """The embedding and output-layer tables have ``vocab_size`` rounded up to a multiple of
    ``make_vocab_size_divisible_by * tp`` rows (Megatron-LM's rule, :meth:`padded_vocab`), so
    the vocabulary split divides by tp and the shapes are Megatron's. The padding rows are never a
    token and their logits are excluded from the loss, so every tp trains the same model; a
    checkpoint keeps the real rows when a layout with another padding loads it."""
    normalization: str = option("LayerNorm", "--normalization", choices=("LayerNorm", "RMSNorm"),
                                help="LayerNorm (GPT-2) or RMSNorm (Llama)")
    """``LayerNorm`` (GPT-2) or ``RMSNorm`` (Llama), Megatron's ``--normalization``."""
    norm_epsilon: float = option(1e-5, "--norm-epsilon", help="epsilon of every norm")
    """Epsilon of every norm (Megatron's ``--norm-epsilon``)."""
    swiglu: bool = option(False, "--swiglu", help="SwiGLU MLP (fc1 holds gate and up)")
    """MLP ``fc2(silu(gate) * up)`` with fc1 holding ``[gate; up]`` (Megatron's ``--swiglu``);
    off: the tanh-GeLU MLP."""
    position_embedding_type: str = option("learned_absolute", "--position-embedding-type",
                                          choices=("learned_absolute", "rope"),
                                          help="learned positions (GPT-2) or rotary (Llama)")
    """``learned_absolute`` (a learned table) or ``rope`` (rotary, applied to q and k)."""
    rotary_base: int = option(10000, "--rotary-base", help="rotary theta")
    """Rotary base ``theta`` (Megatron's ``--rotary-base``)."""
    num_query_groups: int | None = option(
        None, "--num-query-groups",
        help="key/value heads G with --group-query-attention (divisible by --tp: each rank "
             "holds G/tp groups)")
    """Key/value heads (grouped-query attention); ``None``: one per attention head."""
    untie_embeddings_and_output_weights: bool = option(
        False, "--untie-embeddings-and-output-weights",
        help="an output layer of its own instead of the word embeddings")
    """Give the output layer its own weight instead of reusing the word embeddings."""
    add_bias_linear: bool = option(True, "--disable-bias-linear", inverse=True,
                                   help="no biases in the linear layers")
    """Biases in the linear layers (``False``: Megatron's ``--disable-bias-linear``)."""
    attention: str = option("core", "--attention", choices=("core", "sdpa"),
                            help="core: written-out attention (saves the s x s scores); sdpa: "
                                 "torch's scaled_dot_product_attention (flash on GPUs)")
    """``core`` (written-out attention, saves the ``s x s`` scores) or ``sdpa``
    (``scaled_dot_product_attention``). Same function, different kernel and memory."""
    num_experts: int | None = option(None, "--num-experts",
                                     help="experts per MoE layer (default: dense)")
    """Experts per MoE layer (Megatron ``num_experts``); ``None``: a dense model."""
    moe_router_topk: int = option(2, "--moe-router-topk", help="experts per token")
    """Experts each token is routed to (``k``)."""
    moe_aux_loss_coeff: float = option(1e-2, "--moe-aux-loss-coeff",
                                       help="load-balancing loss coefficient")
    """Coefficient of the Switch load-balancing loss (0 turns it off)."""
    moe_z_loss_coeff: float | None = option(None, "--moe-z-loss-coeff",
                                            help="router z-loss coefficient")
    """Coefficient of the router z-loss (ST-MoE); ``None``: none."""
    moe_expert_capacity_factor: float | None = option(
        None, "--moe-expert-capacity-factor",
        help="tokens per expert at most ceil(factor * N * k / E), the rest dropped (default: "
             "dropless)")
    """Each expert takes at most ``ceil(factor * N * k / E)`` of a microbatch's ``N`` tokens,
    the others are dropped; ``None``: dropless."""
    moe_layer_freq: int = option(1, "--moe-layer-freq",
                                 help="every N-th layer is MoE (default 1: all)")
    """Every N-th layer (counting from layer 0) is an MoE layer, the others dense."""
    moe_token_drop_policy: str = option("probs", "--moe-token-drop-policy",
                                        choices=("probs", "position"),
                                        help="with a capacity factor, keep the highest-weight "
                                             "or the earliest tokens")
    """With a capacity factor, keep each expert's highest-weight tokens (``probs``) or its
    earliest ones (``position``)."""
    moe_pad_expert_input_to_capacity: bool = option(
        False, "--moe-pad-expert-input-to-capacity",
        help="with a capacity factor, pad each expert's tokens to the capacity (fixed "
             "all-to-all splits, no count exchange)")
    """With a capacity factor, pad every expert's input to exactly its capacity (Megatron's
    ``--moe-pad-expert-input-to-capacity``): the all-to-all splits are then fixed, so the token
    counts are not exchanged; padded rows carry weight 0 and change no result."""
    moe_token_dispatcher_type: str = option(
        "allgather", "--moe-token-dispatcher-type", choices=("allgather", "alltoall"),
        help="allgather (Megatron's default): every rank gathers all tokens of its tp x ep "
             "group and reduce-scatters the outputs; alltoall: tokens travel to their experts")
    """Megatron's token dispatcher: ``allgather`` (its default: the routing map, probabilities
    and tokens all-gathered over tp x ep, each rank's experts run on the rows routed to them,
    the outputs reduce-scattered back) or ``alltoall`` (tokens and probabilities all-to-all'd
    to their experts' ranks over ep, gathered over tp, and back)."""
    moe_shared_expert_intermediate_size: int | None = option(
        None, "--moe-shared-expert-intermediate-size",
        help="a shared expert of this MLP width in every MoE layer, run on every token beside "
             "the routed ones (needs --disable-bias-linear)")
    """Width of the shared expert (Megatron's ``moe_shared_expert_intermediate_size``): a dense
    MLP, split over tp like the model's, that every token runs before routing; its output is
    added to the routed experts'. No biases (as Megatron's). ``None``: no shared expert."""
    moe_shared_expert_gate: bool = option(
        False, "--moe-shared-expert-gate",
        help="scale the shared expert's output per token by sigmoid(x w), w [h] learned")
    """Multiply the shared expert's output by ``sigmoid(x @ gate_weight)`` per token (Megatron's
    ``moe_shared_expert_gate``; ``gate_weight [1, h]``, replicated over tp)."""
    moe_shared_expert_overlap: bool = option(
        False, "--moe-shared-expert-overlap",
        help="run the shared expert inside the alltoall dispatcher, its pieces between the "
             "token all-to-alls (Megatron's overlap; needs --moe-token-dispatcher-type alltoall)")
    """Megatron's ``moe_shared_expert_overlap``: the shared expert runs after the router, in
    pieces inside the alltoall dispatcher (its input gathered after the token counts, fc1 after
    the tokens' all-to-all, fc2 and its output's reduction after the combine all-to-all;
    :mod:`paraloom.moe.shared_overlap`) instead of before the router."""

    moe_grouped_gemm: bool = option(
        False, "--moe-grouped-gemm",
        help="the local experts as Megatron's grouped GEMM (TEGroupedMLP): the same arithmetic "
             "and communication, their parameters ordered fc1 of every local expert, then fc2")
    """Megatron's ``moe_grouped_gemm``: the local experts as one grouped GEMM per linear
    (``TEGroupedMLP``: ``linear_fc1.weight0..`` then ``linear_fc2.weight0..``). The arithmetic
    and the communication are the experts' own; what changes is the parameters' order, hence
    the gradient buffer's and its buckets' contents: fc1 (weight, bias) of every local expert,
    then fc2. Checkpoints keep the names ``experts.<g>.fc1.weight``: they load either way."""
    cross_entropy_loss_fusion: bool = option(
        False, "--cross-entropy-loss-fusion",
        help="Megatron's fused cross entropy: the target logits and the sums of exponentials "
             "in one tp all-reduce, the logits' gradient rounded to bf16")
    """Megatron's ``cross_entropy_loss_fusion`` (its native implementation,
    :mod:`paraloom.tensor_parallel.cross_entropy`)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                     "seq_length"):
            positive_int(name, getattr(self, name))
        if self.ffn_hidden_size is not None:
            positive_int("ffn_hidden_size", self.ffn_hidden_size)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size = {self.hidden_size} is not divisible by "
                             f"num_attention_heads = {self.num_attention_heads}")
        if not (isinstance(self.init_std, (int, float)) and 0 < self.init_std < float("inf")):
            raise ValueError(f"init_std (--init-method-std) must be a positive number, got "
                             f"{self.init_std}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        self._check_architecture()
        check_moe(self)

    def _check_architecture(self) -> None:
        for name, valid in (("normalization", ("LayerNorm", "RMSNorm")),
                            ("position_embedding_type", ("learned_absolute", "rope")),
                            ("attention", ("core", "sdpa"))):
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} must be {' or '.join(valid)}, got "
                                 f"{getattr(self, name)!r}")
        if not self.norm_epsilon > 0:
            raise ValueError(f"norm_epsilon must be positive, got {self.norm_epsilon}")
        positive_int("rotary_base", self.rotary_base)
        if self.num_query_groups is not None:
            positive_int("num_query_groups", self.num_query_groups)
            if self.num_attention_heads % self.num_query_groups:
                raise ValueError(f"num_attention_heads = {self.num_attention_heads} is not "
                                 f"divisible by num_query_groups = {self.num_query_groups}")
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ValueError(f"rope needs an even head dimension, got hidden_size / "
                             f"num_attention_heads = {self.head_dim}")
        if self.ffn < 1:
            raise ValueError(f"with swiglu and hidden_size = {self.hidden_size} Megatron's "
                             f"default MLP width is 0: give ffn_hidden_size")

    def padded_vocab(self, tp: int) -> int:
        """The embedding and output-layer rows under tensor parallelism ``tp``: Megatron-LM's
        rule (:func:`padded_vocab_rows`)."""
        return padded_vocab_rows(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    @property
    def ffn(self) -> int:
        """The MLP width actually used (with ``swiglu`` Megatron's default is
        ``int(4h * 2/3 / 64) * 64``, keeping the parameter count of a ``4h`` GeLU MLP)."""
        return mlp_width(self.hidden_size, self.swiglu, self.ffn_hidden_size)

    @property
    def head_dim(self) -> int:
        """Dimension of one attention head ``d = h / a``."""
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads ``g`` (``num_attention_heads`` without grouped-query attention)."""
        return self.num_query_groups or self.num_attention_heads


def mlp_width(hidden: int, swiglu: bool, ffn_hidden_size: int | None = None) -> int:
    """The MLP width a model uses: ``ffn_hidden_size`` when given, else Megatron's default,
    ``4h`` (GeLU) or ``int(4h * 2/3 / 64) * 64`` (SwiGLU: the parameters of a ``4h`` GeLU MLP)."""
    if ffn_hidden_size:
        return ffn_hidden_size
    return int(4 * hidden * 2 / 3 / 64) * 64 if swiglu else 4 * hidden


def padded_vocab_rows(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's embedding rows: ``vocab`` rounded up to a multiple of ``divisible_by * tp``
    (50257 -> 50304 at tp = 1, 51200 at tp = 8; 256 -> 512 at tp = 4 with the default 128), so
    every tp rank holds the same number of rows. The rows past ``vocab`` are never a class: the
    loss leaves them out, so every tp gives the same model."""
    m = divisible_by * tp
    return -(-vocab // m) * m


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
    if model.num_layers % chunks:
        problems.append(f"num_layers = {model.num_layers} is not divisible by pp * vpp = {chunks}")
    problems += moe_stage_problems(model, parallel)
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
    if cp > 1 and parallel.cp_comm_type in ("a2a", "a2a+p2p"):
        named = [("num_attention_heads", model.num_attention_heads)]
        if model.num_query_groups:
            named.append(("key/value heads (num_query_groups)", model.num_query_groups))
        # a2a+p2p: Ulysses inside the inner level only
        a2a, what = (cp, "cp") if parallel.cp_comm_type == "a2a" else \
            (parallel.cp_sizes[0], "the inner hierarchical cp size")
        for name, heads in named:
            if heads % tp == 0 and (heads // tp) % a2a:
                problems.append(f"cp_comm_type {parallel.cp_comm_type}: {name} / tp = {heads} / "
                                f"{tp} = {heads // tp} is not divisible by {what} = {a2a} "
                                f"(Ulysses gives each of its ranks a share of a tp rank's "
                                f"heads)")
    if cp > 1 and model.dropout > 0:
        problems.append(f"dropout = {model.dropout} with cp = {cp}: attention dropout is not "
                        f"implemented for context parallelism; use dropout 0")
    if problems:
        raise ValueError("invalid layout: " + "; ".join(problems))
