"""One ``paraloom train`` run: :class:`TrainConfig`, with its parts :class:`~.optim.OptimConfig`,
:class:`~.data.DataConfig` and :class:`~.run.RunConfig`.

``TrainConfig()`` is exactly the run ``paraloom train`` makes without flags (tp = pp = dp = 2 on
the bundled corpus): the command's defaults are these fields' defaults. A run folder's
``config.json`` is :meth:`TrainConfig.to_dict`; :meth:`TrainConfig.from_dict` reads it back, also
in the flat layout of earlier paraloom versions (every setting at the top level).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .data import DataConfig
from .earlier import earlier_meanings
from .fields import nested_configs, option
from .megatron_fsdp_checks import STRATEGIES
from .model import ModelConfig, check_layout
from .optim import OptimConfig
from .parallel import SCHEDULES, ParallelConfig, default_schedule, positive_int
from .run import RunConfig
from .sharding_checks import check_sharding

__all__ = ["TrainConfig", "migrate"]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One ``paraloom train`` run: model, layout, batch, optimiser, data and output settings."""

    model: ModelConfig = ModelConfig()
    """Shape of the GPT."""
    parallel: ParallelConfig = ParallelConfig(tp=2, pp=2, dp=2)
    """The layout; the default tp = pp = dp = 2 shows all three kinds in its table."""
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
    """Optimizer steps in total (counting those before a resume); the LR schedule's length."""
    seed: int = option(1234, "--seed", help="seeds the initializer, the data order and dropout")
    """Seeds the initializer, the data order and dropout."""
    dtype: str = option("fp32", "--dtype", choices=("fp32", "bf16"),
                        help="bf16: bf16 compute, fp32 master weights and main grads")
    """``fp32`` or ``bf16`` (bf16 compute, fp32 master weights and main grads)."""
    recompute: str = option("none", "--recompute", "--recompute-granularity",
                            choices=("none", "selective", "full"),
                            help="activation recomputation: selective (core attention) or "
                                 "full (per layer)")
    """Activation recomputation: ``none``, ``selective`` (core attention), ``full`` (layer)."""
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
    num_distributed_optimizer_instances: int = option(
        1, "--num-distributed-optimizer-instances", metavar="N",
        help="with --distributed-optimizer: shard the optimizer within each of N blocks of the "
             "dp group (reduce-scatter inside a block, all-reduce of the shard across blocks; "
             "Megatron's partial distributed optimizer, default 1)")
    """Megatron's ``--num-distributed-optimizer-instances`` (:mod:`paraloom.data_parallel.ddp`;
    groups: :func:`paraloom.mesh.instance_rank_groups`)."""
    overlap_param_gather: bool = option(False, "--overlap-param-gather", negatable=True,
                                        help="with --distributed-optimizer: all-gather each "
                                             "parameter bucket in the next forward, ahead of "
                                             "its first use, instead of in the optimizer step")
    """Megatron's ``--overlap-param-gather``: the distributed optimizer's parameter all-gather
    leaves the optimizer step; from the second step of a process on, forward pre-hooks gather
    each bucket before its parameters' first use and start the next bucket's gather
    asynchronously; with interleaving the schedule launches them (Megatron-LM's
    ``--align-param-gather``) (:mod:`paraloom.data_parallel.param_gather`)."""
    align_param_gather: bool = option(True, "--align-param-gather", negatable=True,
                                      help="with --overlap-param-gather and interleaving, the "
                                           "schedule launches each chunk's parameter "
                                           "all-gathers at the same step on every stage "
                                           "(default: on, as Megatron-LM; off: each chunk's "
                                           "forward pre-hooks launch them)")
    """Megatron-LM's ``--align-param-gather`` (on by default; it only acts with interleaving)."""
    overlap_param_gather_with_optimizer_step: bool = option(
        False, "--overlap-param-gather-with-optimizer-step",
        help="with --overlap-param-gather and interleaving: the first model chunk's parameters "
             "all-gathered right after its own optimizer step, behind the other chunks' steps")
    """Megatron's flag (:mod:`paraloom.data_parallel.param_gather`; bucketing off everywhere)."""
    align_grad_reduce: bool = option(True, "--align-grad-reduce", negatable=True,
                                     help="with --overlap-grad-reduce, pipeline stages after "
                                          "the first launch their gradient reduction once "
                                          "their backward is over, as Megatron-LM (default: "
                                          "on)")
    """Megatron-LM's ``--align-grad-reduce`` (its default): with ``overlap_grad_reduce``, the
    schedule launches each chunk's data-parallel reduction itself (``grad_sync_func``) — on
    pipeline stages after the first after the last ``send_backward``, interleaved at the same
    virtual microbatch on every stage — instead of from the gradient hooks."""
    calculate_per_token_loss: bool = option(
        False, "--calculate-per-token-loss",
        help="Megatron's per-token loss: each microbatch's loss summed over its tokens, the "
             "gradients summed over dp and divided by the step's token count (broadcast over "
             "pp, all-reduced over dp x cp in finalize_model_grads)")
    """Megatron's ``calculate_per_token_loss`` (:func:`paraloom.data_parallel.finalize.
    finalize_model_grads`); equal-length windows make it the same average as without it."""
    bucket_size: int | None = option(None, "--bucket-size",
                                     help="gradient bucket size in elements")
    """Gradient bucket size in elements; ``None`` for Megatron's default."""
    bucket_tail_splits: int = option(0, "--bucket-tail-splits",
                                     help="paraloom: halve the last gradient buckets of "
                                          "backward this many times, so less reduction is "
                                          "left when backward ends (default 0: Megatron's "
                                          "equal buckets)")
    """paraloom's tail-halving buckets (:func:`~paraloom.data_parallel.grad_buffer.
    bucket_layout`); 0, Megatron's equal buckets, by default."""
    use_megatron_fsdp: bool = option(False, "--use-megatron-fsdp", negatable=True,
                                     help="Megatron-FSDP instead of DistributedDataParallel")
    """Megatron-LM's ``--use-megatron-fsdp`` (:mod:`paraloom.data_parallel.megatron_fsdp`)."""
    data_parallel_sharding_strategy: str = option(
        "optim_grads_params", "--data-parallel-sharding-strategy", choices=STRATEGIES,
        help="Megatron-FSDP's: no_shard, optim (ZeRO-1), optim_grads (ZeRO-2); "
             "optim_grads_params (ZeRO-3, Megatron-LM's default) is not built")
    """Megatron-FSDP's sharding strategy; Megatron-LM's default, ZeRO-3, is refused."""
    megatron_fsdp_main_grads_dtype: str = option(
        "auto", "--megatron-fsdp-main-grads-dtype", choices=("auto", "fp32"),
        help="Megatron-FSDP's gradient reductions: auto (the parameters' dtype, Megatron-LM's "
             "default: bf16 under --dtype bf16) or fp32")
    megatron_lm_loop: bool = option(True, "--megatron-lm-loop", negatable=True,
                                    help="communicate what Megatron-LM's training loop adds to "
                                         "the step: the batch broadcast over tp, the rerun "
                                         "vote, the log's learning-rate maximum and timer "
                                         "barriers (default on; off: Megatron-Core's step "
                                         "alone, every rank reading its own microbatch)")
    """Megatron-LM's loop collectives around the step
    (:mod:`paraloom.training.megatron_lm_loop`)."""
    rerun_mode: str = option("validate_results", "--rerun-mode",
                             choices=("disabled", "validate_results", "report_stats"),
                             help="Megatron-LM's rerun state machine: with --megatron-lm-loop, "
                                  "'disabled' leaves out its vote after each step")
    """Megatron-LM's ``--rerun-mode``; only ``disabled`` changes communication (no vote)."""

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
        check_sharding(self)
        if self.use_megatron_fsdp:  # Megatron-LM: the optimizer sharded unless no_shard
            object.__setattr__(self, "distributed_optimizer",
                               self.data_parallel_sharding_strategy != "no_shard")

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
    def padded_vocab_size(self) -> int:
        """The embedding and output-layer rows of this run (Megatron-LM's padding under its tp:
        :meth:`ModelConfig.padded_vocab`)."""
        return self.model.padded_vocab(self.parallel.tp)

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
    return earlier_meanings(out)


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

