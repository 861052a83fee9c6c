"""The data-parallel sharding settings of a :class:`~paraloom.config.train.TrainConfig`:
Megatron-LM's rules for the distributed optimizer's flags, checked when the config is made (a
bad value names itself and what is valid)."""

from __future__ import annotations

from .megatron_fsdp_checks import check_megatron_fsdp
from .parallel import positive_int

__all__ = ["check_sharding"]


def check_sharding(cfg) -> None:
    """``--num-distributed-optimizer-instances`` and ``--overlap-param-gather`` (and its
    variant) under Megatron-LM's conditions."""
    if cfg.bucket_size is not None:
        positive_int("bucket_size (--bucket-size, elements)", cfg.bucket_size)
    if isinstance(cfg.bucket_tail_splits, bool) or not isinstance(
            cfg.bucket_tail_splits, int) or not 0 <= cfg.bucket_tail_splits <= 8:
        raise ValueError(f"bucket_tail_splits (--bucket-tail-splits) must be an integer "
                         f"from 0 to 8, got {cfg.bucket_tail_splits!r}")
    check_megatron_fsdp(cfg)  # first: under it the distributed optimizer's flags do not apply
    _check_instances(cfg)
    _check_param_gather(cfg)
    p = cfg.parallel
    if cfg.calculate_per_token_loss and cfg.model.num_experts and p.tp > 1 \
            and not p.sequence_parallel:
        raise ValueError(f"--calculate-per-token-loss with --num-experts and tp = {p.tp} needs "
                         f"--sequence-parallel: Megatron scales the MoE auxiliary losses by the "
                         f"router's tokens x tp x cp, which counts the tokens once only when "
                         f"the sequence is split over tp")


def _check_instances(cfg) -> None:
    n, p = cfg.num_distributed_optimizer_instances, cfg.parallel
    positive_int("num_distributed_optimizer_instances (--num-distributed-optimizer-instances)",
                 n)
    if n == 1:
        return
    if not (cfg.distributed_optimizer or cfg.use_megatron_fsdp):  # (FSDP: implied)
        raise ValueError(f"--num-distributed-optimizer-instances {n} needs "
                         f"--distributed-optimizer (the instances are copies of the distributed "
                         f"optimizer; Megatron-Core: 'Partial DistOpt cannot be used without "
                         f"DistOpt')")
    dp_cp, ep = p.dp * p.cp, p.ep
    if dp_cp % n:
        raise ValueError(f"--num-distributed-optimizer-instances {n} must divide dp * cp = "
                         f"{p.dp} * {p.cp} = {dp_cp} (each instance is a block of the "
                         f"data-parallel ranks); valid: a divisor of {dp_cp}")
    if (dp_cp // ep) % n:
        raise ValueError(f"--num-distributed-optimizer-instances {n} must divide the "
                         f"expert-data-parallel size dp * cp / ep = {dp_cp} / {ep} = "
                         f"{dp_cp // ep} (the expert optimizer has instances too)")


def _check_param_gather(cfg) -> None:
    """Megatron-LM's own conditions for ``--overlap-param-gather`` (and its variant)."""
    if cfg.overlap_param_gather_with_optimizer_step and not (
            cfg.overlap_param_gather and cfg.distributed_optimizer
            and cfg.parallel.vpp and cfg.parallel.vpp > 1):
        raise ValueError(f"--overlap-param-gather-with-optimizer-step needs --distributed-"
                         f"optimizer, --overlap-param-gather and --vpp > 1 (Megatron-LM's "
                         f"conditions), got distributed_optimizer = "
                         f"{cfg.distributed_optimizer}, overlap_param_gather = "
                         f"{cfg.overlap_param_gather}, vpp = {cfg.parallel.vpp}")
    if not cfg.overlap_param_gather:
        return
    if not (cfg.distributed_optimizer or cfg.use_megatron_fsdp):
        raise ValueError("--overlap-param-gather needs --distributed-optimizer (there is no "
                         "parameter all-gather to overlap without it; Megatron-LM refuses "
                         "it too)")
    if not cfg.overlap_grad_reduce:
        raise ValueError("--overlap-param-gather needs --overlap-grad-reduce, got "
                         "--no-overlap-grad-reduce (Megatron-LM: 'Must use "
                         "--overlap-param-gather with --overlap-grad-reduce')")
