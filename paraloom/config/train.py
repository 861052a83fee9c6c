"""One ``paraloom train`` run: :class:`TrainConfig` and its parts (:class:`OptimConfig`,
:class:`DataConfig`, :class:`RunConfig`).

``TrainConfig()`` is exactly the run ``paraloom train`` makes without flags (tp = pp = dp = 2 on
the bundled corpus): the command's defaults are these fields' defaults. A run folder's
``config.json`` is :meth:`TrainConfig.to_dict`; :meth:`TrainConfig.from_dict` reads it back, also
in the flat layout of earlier paraloom versions (every setting at the top level).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .fields import nested_configs, option
from .model import ModelConfig, check_layout
from .parallel import SCHEDULES, ParallelConfig, default_schedule, positive_int

__all__ = ["TrainConfig", "OptimConfig", "DataConfig", "RunConfig", "DEFAULT_MIN_LR"]

DEFAULT_MIN_LR = 3e-4
"""The cosine schedule's final learning rate when none is given (or ``lr`` if that is lower)."""


def _finite(name: str, value, *, low: float = 0.0, strict: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (strict and value == low):
        need = f"> {low:g}" if strict else f">= {low:g}"
        raise ValueError(f"{name} must be a number {need}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with Megatron's defaults, under a linear warm-up and cosine decay."""

    lr: float = option(3e-3, "--lr", help="peak learning rate (AdamW)")
    """Peak learning rate, reached after ``warmup_steps``, then cosine decay to ``min_lr``."""
    min_lr: float | None = option(None, "--min-lr", help=f"the cosine schedule's final learning "
                                  f"rate (default: {DEFAULT_MIN_LR:g}, or --lr if lower)")
    """Learning rate at the end of the cosine decay; ``None``: ``DEFAULT_MIN_LR`` or ``lr`` if
    that is lower (resolved on creation, so a saved config holds the number)."""
    warmup_steps: int = option(5, "--warmup-steps", "--lr-warmup-iters",
                               help="linear warm-up steps")
    """Linear warm-up steps (Megatron's ``--lr-warmup-iters``)."""
    weight_decay: float = option(0.1, "--weight-decay",
                                 help="AdamW weight decay of matrices and embeddings; biases and "
                                      "norm weights get none (Megatron-Core's rule)")
    """AdamW weight decay (not applied to biases and norm weights, Megatron-Core's rule)."""
    clip_grad: float = option(1.0, "--clip-grad",
                              help="clip the global gradient norm to this (0: no clipping)")
    """Clip the global gradient norm (over tp, pp and dp) to this value; 0 disables."""
    adam_beta1: float = option(0.9, "--adam-beta1", help="Adam's first-moment decay")
    """Adam's ``beta1`` (Megatron's ``--adam-beta1``, default 0.9)."""
    adam_beta2: float = option(0.95, "--adam-beta2", help="Adam's second-moment decay")
    """Adam's ``beta2``: 0.95, GPT-3's and Megatron-LM's GPT examples' value (its flag's own
    default is 0.999)."""
    adam_eps: float = option(1e-8, "--adam-eps", help="Adam's epsilon")
    """Adam's ``eps`` (Megatron's ``--adam-eps``, default 1e-8)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr (--lr) must be a positive number, got {self.lr}")
        if self.min_lr is None:
            object.__setattr__(self, "min_lr", min(DEFAULT_MIN_LR, self.lr))
        if not (isinstance(self.min_lr, (int, float)) and 0 <= self.min_lr <= self.lr):
            raise ValueError(f"min_lr (--min-lr) must be between 0 and lr = {self.lr} (the "
                             f"schedule decays from lr down to it), got {self.min_lr}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"weight_decay (--weight-decay) must be >= 0, got "
                             f"{self.weight_decay}")
        if self.warmup_steps < 0 or not self.clip_grad >= 0:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) and clip_grad "
                             f"({self.clip_grad}) must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be in [0, 1), got "
                                 f"{value}")
        _finite("adam_eps (--adam-eps)", self.adam_eps, strict=True)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What the run reads: a text file (bytes are tokens), or a tokenizer and its data."""

    file: str | None = option(None, "--data", metavar="FILE",
                              help="text file, bytes are tokens, .gz decompressed (default: the "
                                   "bundled corpus)")
    """Training text file; ``None`` for the bundled corpus. Stored absolute."""
    data_path: str | None = option(None, "--data-path", metavar="PREFIX",
                                   help="a Megatron indexed dataset PREFIX.bin + PREFIX.idx "
                                        "(paraloom preprocess or Megatron's preprocess_data.py); "
                                        "needs --tokenizer")
    """Prefix of a Megatron indexed dataset ``P.bin``/``P.idx``, read instead of ``file``; its
    documents are joined with the tokenizer's end-of-document token between."""
    tokenizer: str | None = option(None, "--tokenizer", "--tokenizer-model", metavar="DIR",
                                   help="a local Hugging Face tokenizer folder (tokenizer.json); "
                                        "the vocabulary size comes from it (default: bytes, "
                                        "vocabulary 256)")
    """A local Hugging Face tokenizer folder; ``None``: tokens are bytes."""

    def __post_init__(self) -> None:
        if self.file is not None and self.data_path is not None:
            raise ValueError(f"--data {self.file!r} (a text file) and --data-path "
                             f"{self.data_path!r} (an indexed dataset) both given: give one")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Where the run writes, what it records, and when it gives up."""

    out: str = option("runs/latest", "--out", "--save", help="run folder")
    """Run folder (config.json, metrics.jsonl, ledger.jsonl, trace.json, ...)."""
    save_every: int = option(50, "--save-every", "--save-interval",
                             help="checkpoint every N steps and at the end (0: never)")
    """Save a checkpoint every N steps (and at the end when N > 0)."""
    resume: str | None = option(None, "--resume", "--load", help="run or checkpoint folder")
    """Run folder or checkpoint folder to continue from."""
    init_from_hf: str | None = option(
        None, "--init-from-hf", metavar="DIR",
        help="start from a local Hugging Face GPT-2 or Llama checkpoint folder (config.json + "
             "model.safetensors or pytorch_model.bin); the model shape comes from its config, "
             "--seq-len may shorten it")
    """A Hugging Face folder whose weights replace the initial ones (stored absolute, so the
    run folder says where the model came from)."""
    ledger_steps: int = option(2, "--ledger-steps", help="steps recorded in the ledger (-1: all)")
    """Steps recorded in the ledger (from the first); -1 records every step."""
    timeout_s: float = option(120.0, "--timeout",
                              help="seconds any collective may wait before the run is ended")
    """Timeout for every collective wait; a dead or stuck rank ends the run after this long."""
    max_bad_steps: int = option(3, "--max-bad-steps",
                                help="stop after this many consecutive NaN/Inf steps (each is "
                                     "skipped)")
    """Stop after this many consecutive steps with a NaN/Inf loss or gradient (each skipped)."""
    tensorboard_dir: str | None = option(
        None, "--tensorboard-dir", metavar="DIR",
        help="write loss, lr, grad norm, tokens/s and per-kind comm bytes as TensorBoard scalars")
    """Write TensorBoard scalars here (rank 0; Megatron's ``--tensorboard-dir``)."""
    log_interval: int = option(1, "--log-interval", help="TensorBoard scalars every N steps")
    """TensorBoard scalars every N steps (and at the last; Megatron's ``--log-interval``)."""

    def __post_init__(self) -> None:
        if isinstance(self.ledger_steps, bool) or not isinstance(self.ledger_steps, int) or (
                self.ledger_steps < 1 and self.ledger_steps != -1):
            raise ValueError(f"ledger_steps (--ledger-steps) must be a positive number of steps "
                             f"or -1 (every step), got {self.ledger_steps!r}")
        if self.save_every < 0:
            raise ValueError(f"save_every (--save-every) must be >= 0, got {self.save_every}")
        positive_int("max_bad_steps", self.max_bad_steps)
        if isinstance(self.log_interval, bool) or not isinstance(self.log_interval, int) \
                or self.log_interval < 1:
            raise ValueError(f"--log-interval must be a positive integer, got "
                             f"{self.log_interval}")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0
                and math.isfinite(self.timeout_s)):
            raise ValueError(f"timeout_s (--timeout) must be a positive number of seconds, got "
                             f"{self.timeout_s}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One ``paraloom train`` run: model, layout, batch, optimiser, data and output settings."""

    model: ModelConfig = ModelConfig()
    """Shape of the GPT."""
    parallel: ParallelConfig = ParallelConfig(tp=2, pp=2, dp=2)
    """The layout and its switches; the default run uses tp = pp = dp = 2 so that its table
    shows all three kinds of communication."""
    optim: OptimConfig = OptimConfig()
    """Optimiser and learning-rate schedule."""
    data: DataConfig = DataConfig()
    """What the run reads."""
    run: RunConfig = RunConfig()
    """Where it writes, what it records, when it gives up."""
    global_batch_size: int = option(16, "--global-batch-size",
                                    help="samples per optimizer step, over dp and microbatches")
    """Samples per optimizer step, over all data-parallel ranks and microbatches."""
    micro_batch_size: int = option(2, "--micro-batch-size",
                                   help="samples per microbatch on one data-parallel rank")
    """Samples per microbatch on one data-parallel rank."""
    steps: int = option(150, "--steps", "--train-iters",
                        help="optimizer steps in total (counting those before a resume)")
    """Optimizer steps to run (in total, counting steps done before a resume); also the length
    of the learning-rate schedule."""
    seed: int = option(1234, "--seed", help="seeds the initializer, the data order and dropout")
    """Seeds the initializer, the data order and dropout."""
    dtype: str = option("fp32", "--dtype", choices=("fp32", "bf16"),
                        help="bf16: bf16 compute, fp32 master weights and main grads")
    """``fp32`` or ``bf16`` (bf16 compute, fp32 master weights and main grads)."""
    recompute: str = option("none", "--recompute", "--recompute-granularity",
                            choices=("none", "selective", "full"),
                            help="activation recomputation: selective (core attention) or "
                                 "full (per layer)")
    """Activation recomputation: ``none``, ``selective`` (core attention) or ``full``
    (per layer)."""
    schedule: str | None = option(None, "--schedule", choices=SCHEDULES,
                                  help="default: none with pp 1, interleaved with vpp > 1, else "
                                       "1f1b; zb-h1: zero-bubble 1F1B (weight gradients "
                                       "deferred into the bubble; pp >= 2, no vpp)")
    """Pipeline schedule: ``1f1b``, ``interleaved`` (needs vpp), ``none`` (no pipelining) or
    ``zb-h1`` (zero bubble: weight gradients deferred into 1F1B's bubble; no vpp). ``None``:
    :func:`~paraloom.config.parallel.default_schedule` (resolved on creation)."""
    overlap_grad_reduce: bool = option(True, "--overlap-grad-reduce", negatable=True,
                                       help="reduce each gradient bucket as soon as it is "
                                            "complete in backward (default: on)")
    """Launch each gradient bucket's reduction as soon as it is complete in backward (Megatron's
    default is off; see README, "Defaults")."""
    overlap_p2p_comm: bool | None = option(
        None, "--overlap-p2p-communication", negatable=True,
        help="post pipeline sends/receives ahead so they overlap compute (default: on for gloo; "
             "--no-overlap-p2p-communication runs Megatron-Core's blocking batches)")
    """Pipeline p2p posted ahead and waited late so transfers overlap compute (Megatron's
    ``overlap_p2p_comm``); ``None``: on for gloo (CPU), off on CUDA; ``False``: Megatron-Core's
    blocking batches. The messages are the same either way."""
    distributed_optimizer: bool = option(False, "--distributed-optimizer",
                                         "--use-distributed-optimizer",
                                         help="ZeRO-1: optimizer states sharded over dp")
    """ZeRO-1: shard optimizer states over dp (reduce-scatter grads, all-gather params)."""
    bucket_size: int | None = option(None, "--bucket-size",
                                     help="gradient bucket size in elements")
    """Gradient bucket size in elements; ``None`` for Megatron's default."""

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "micro_batch_size", "steps"):
            positive_int(name, getattr(self, name))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
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
        if self.schedule is None:
            object.__setattr__(self, "schedule", default_schedule(p.pp, p.vpp))
        self._check_schedule()
        if self.bucket_size is not None:
            positive_int("bucket_size (--bucket-size, elements)", self.bucket_size)

    def _check_schedule(self) -> None:
        p = self.parallel
        if self.schedule not in SCHEDULES:
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

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step on each data-parallel rank."""
        return self.global_batch_size // (self.micro_batch_size * self.parallel.dp)

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step trains on (every data-parallel rank together)."""
        return self.global_batch_size * self.model.seq_length

    # -- saved configs and changes -------------------------------------------------------------
    def to_dict(self) -> dict:
        """The nested dict written as a run's ``config.json``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, saved: dict) -> TrainConfig:
        """The configuration a ``config.json`` holds (this version's nested layout, or the flat
        one of earlier versions); ``ValueError`` naming keys that are not settings."""
        return cls(**_parts(cls, migrate(saved)))

    def replace(self, **changes) -> TrainConfig:
        """A copy with ``changes``; a key is a field of this class (``model=...``) or of one of
        its parts (``lr=...`` for ``optim.lr``, ``out=...`` for ``run.out``)."""
        nested = nested_configs(type(self))
        top, parts = {}, {name: {} for name in nested}
        for key, value in changes.items():
            owner = _owner(key)
            if owner is None:
                top[key] = value
            else:
                parts[owner][key] = value
        for name, fields in parts.items():
            if fields and name not in top:
                top[name] = dataclasses.replace(getattr(self, name), **fields)
            elif fields:
                top[name] = dataclasses.replace(top[name], **fields)
        return dataclasses.replace(self, **top)


_PARTS = {"optim": OptimConfig, "data": DataConfig, "run": RunConfig}
_LEAVES = {f.name: part for part, cls in _PARTS.items() for f in dataclasses.fields(cls)}
"""Field name -> the part that holds it (names are unique across the parts and the top)."""


def _owner(key: str) -> str | None:
    if key in {f.name for f in dataclasses.fields(TrainConfig)}:
        return None
    if key not in _LEAVES:
        raise TypeError(f"TrainConfig has no setting {key!r}")
    return _LEAVES[key]


def migrate(saved: dict) -> dict:
    """A ``config.json`` dict in this version's nested layout: settings that earlier versions
    kept at the top level (``lr``, ``out``, ``data`` as a file name, ...) moved into their part.
    ``ValueError`` for a key that is no setting at all."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in saved.items()}
    if "data" in out and not isinstance(out["data"], dict):  # earlier: the text file's name
        out["data"] = {"file": out["data"]}
    top = {f.name for f in dataclasses.fields(TrainConfig)}
    for key in [k for k in out if k not in top]:
        if key not in _LEAVES:
            raise ValueError(f"the saved configuration has a setting {key!r} this paraloom does "
                             f"not know (written by a newer version?)")
        out.setdefault(_LEAVES[key], {})[key] = out.pop(key)
    return out


def _parts(cls, saved: dict) -> dict:
    """Constructor arguments of ``cls`` from a nested dict (nested parts built first)."""
    nested = nested_configs(cls)
    kwargs = {}
    for key, value in saved.items():
        if key in nested:
            sub = nested[key]
            known = {f.name for f in dataclasses.fields(sub)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"the saved configuration's {key} has settings this paraloom "
                                 f"does not know: {', '.join(unknown)}")
            kwargs[key] = sub(**_parts(sub, value))
        else:
            kwargs[key] = value
    return kwargs

