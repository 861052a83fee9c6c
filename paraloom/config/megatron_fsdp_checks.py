"""Megatron-FSDP's settings of a :class:`~paraloom.config.train.TrainConfig`
(``--use-megatron-fsdp``, ``--data-parallel-sharding-strategy``), checked when the config is
made: what paraloom builds of it (:mod:`paraloom.data_parallel.megatron_fsdp`) and what does not
combine with it."""

from __future__ import annotations

__all__ = ["STRATEGIES", "BUILT", "check_megatron_fsdp", "fsdp_reduces_in_bf16",
           "ddp_overlaps_param_gather"]

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""Megatron-LM's ``--data-parallel-sharding-strategy`` choices (its default: the last)."""
BUILT = STRATEGIES
"""The strategies ``paraloom train`` builds (all of them)."""


def fsdp_reduces_in_bf16(cfg) -> bool:
    """Whether Megatron-FSDP reduces (and Megatron accumulates) the gradients in bf16: its
    main gradients take the parameters' dtype unless ``--megatron-fsdp-main-grads-dtype fp32``
    (paraloom keeps fp32 sums and reduces a bf16 copy, as for ``grad_reduce_in_fp32=False``)."""
    return cfg.use_megatron_fsdp and cfg.dtype == "bf16" and \
        cfg.megatron_fsdp_main_grads_dtype == "auto"


def ddp_overlaps_param_gather(cfg) -> bool:
    """Whether Megatron's DDP gathers the distributed optimizer's parameters in the next
    forward (``--overlap-param-gather``, its pre-hooks). Under Megatron-FSDP the flag is its
    own and changes no communication: megatron-core 0.19.2 turns it on itself for ZeRO-3, and
    under ``optim``/``optim_grads`` issues the optimizer step's gathers through its prefetch
    call instead, the same operations in the same order (recorded on CPU, with and without)."""
    return cfg.overlap_param_gather and not cfg.use_megatron_fsdp


def check_megatron_fsdp(cfg) -> None:
    """The strategy is one paraloom builds, and no flag is given that Megatron-FSDP replaces."""
    strategy = cfg.data_parallel_sharding_strategy
    if strategy not in STRATEGIES:
        raise ValueError(f"data_parallel_sharding_strategy (--data-parallel-sharding-strategy) "
                         f"must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if cfg.megatron_fsdp_main_grads_dtype not in ("auto", "fp32"):
        raise ValueError(f"megatron_fsdp_main_grads_dtype (--megatron-fsdp-main-grads-dtype) "
                         f"must be auto or fp32, got {cfg.megatron_fsdp_main_grads_dtype!r}")
    if not cfg.use_megatron_fsdp:
        if cfg.megatron_fsdp_main_grads_dtype != "auto":
            raise ValueError("--megatron-fsdp-main-grads-dtype needs --use-megatron-fsdp")
        if strategy != STRATEGIES[-1]:
            raise ValueError(f"--data-parallel-sharding-strategy {strategy} needs "
                             f"--use-megatron-fsdp (it is Megatron-FSDP's setting; without it "
                             f"--distributed-optimizer is ZeRO-1)")
        return
    taken = {
        "--num-distributed-optimizer-instances": (
            cfg.num_distributed_optimizer_instances > 1 and strategy == "no_shard",
            "Megatron-FSDP's hybrid sharding needs a sharding strategy (no_shard shards "
            "nothing)"),
        "--bucket-tail-splits": (cfg.bucket_tail_splits > 0, "paraloom's halving is for "
                                 "Megatron's DDP buckets"),
        f"--pp {cfg.parallel.pp}": (cfg.parallel.pp > 1, "megatron-core 0.19.2's Megatron-FSDP "
                                    "lays its device mesh over every rank as dp x cp x tp, so "
                                    "it cannot wrap a pipeline stage (pp must be 1)"),
        f"--ep {cfg.parallel.ep}": (strategy == "no_shard" and cfg.parallel.ep > 1,
                                    "megatron-core 0.19.2 reduces no_shard's gradient norm over "
                                    "the model-parallel group (tp x pp), which leaves out the "
                                    "other ep ranks' experts (ep 1, or a sharding strategy)")}
    for flag, (given, why) in taken.items():
        if given:
            raise ValueError(f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy} "
                             f"with {flag}: {why}")
