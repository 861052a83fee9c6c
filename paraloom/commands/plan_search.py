"""``paraloom plan --search --gpus N ...``: the ranked table of the layouts that fit
(:mod:`paraloom.analysis.search`; ``--json`` for machines).

The model, dtype and global batch are read from ``paraloom train``'s flags (their Megatron-LM
aliases and arguments, train's defaults), as ``plan`` reads them; the layout flags are what the
search tries, so they are refused."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import asdict

from ..analysis.hardware import Hardware
from ..analysis.plan import human_bytes
from ..analysis.search import Candidate, cp_sizes, explain, no_valid_layout, search
from ..analysis.spec import Architecture
from ..config import TrainConfig
from .flags import TRAIN_FLAGS
from .hardware_flags import add_hardware_args, hardware_from_args
from .megatron_lm_flags import megatron_lm_spellings
from .train_flags import add_train_flags, config_from_args

__all__ = ["main"]


_SEARCHED = tuple(f for path in ("parallel.tp", "parallel.pp", "parallel.dp", "parallel.cp",
                                  "parallel.ep", "parallel.vpp", "parallel.sequence_parallel",
                                  "micro_batch_size", "recompute", "distributed_optimizer",
                                  "num_distributed_optimizer_instances", "use_megatron_fsdp",
                                  "data_parallel_sharding_strategy")
                  for f in TRAIN_FLAGS[path].flags) + (
    "--num-layers-per-virtual-stage", "--num-layers-per-virtual-pipeline-stage", "--nprocs",
    "--nproc", "--nproc-per-node")
"""Layout flags of ``train`` (and their Megatron-LM aliases): the search enumerates them."""


_CP_SHORT = {"p2p": "ring", "all_gather": "ag", "a2a": "a2a", "a2a+p2p": "h"}
"""How the cp column names the comm type: the ring, the all-gather, Ulysses' all-to-all, and
hierarchical ``h`` with its all-to-all level (``8 h4``: a2a in groups of 4, the ring across)."""
_EP_SHORT = {"allgather": "ag", "alltoall": "a2a"}
"""How the ep column names the MoE token dispatcher."""


def _zero(x: Candidate) -> str:
    """The zero column: off, on, on/N with N distributed-optimizer instances, or Megatron-FSDP's
    ZeRO stage (``fsdp1``: ``optim``, ``fsdp2``: ``optim_grads``, ``fsdp3``:
    ``optim_grads_params``)."""
    if x.fsdp:
        return f"fsdp{('optim', 'optim_grads', 'optim_grads_params').index(x.fsdp) + 1}"
    if not x.distributed_optimizer:
        return "off"
    return "on" if x.instances == 1 else f"on/{x.instances}"


def _row(i: int, x: Candidate, best: Candidate, hw: Hardware) -> str:
    r = x.prediction
    cp = f"{x.cp}" if x.cp == 1 else f"{x.cp} {_CP_SHORT[x.cp_comm_type]}" \
        + (f"{x.cp_a2a}" if x.cp_comm_type == "a2a+p2p" else "")
    ep = f"{x.ep} {_EP_SHORT[x.dispatcher]}" if x.dispatcher else f"{x.ep}"
    return (f"{i:>3} {x.tp:>3} {cp:>6} {ep:>6} {x.pp:>3} {x.dp:>5} {x.vpp:>3} "
            f"{x.micro_batch:>3} "
            f"{'on' if x.sequence_parallel else 'off':>3} {x.recompute:>9} "
            f"{_zero(x):>5} {x.step_time_s:>9.3f} "
            f"{r['mfu']:>5.1%} {human_bytes(x.memory_bytes):>10}  {explain(x, best, hw)}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="paraloom plan --search",
                                 description="rank the layouts of a job that fit memory: the "
                                             "model is paraloom train's flags (or Megatron-LM's "
                                             "arguments), the layout is searched")
    add_train_flags(ap)
    g = ap.add_argument_group("search")
    g.add_argument("--search", action="store_true")
    g.add_argument("--gpus", type=int, required=True, metavar="N", help="the world to fill")
    g.add_argument("--top", type=int, default=10, help="layouts to print (default 10)")
    g.add_argument("--max-cp", type=int, default=32,
                   help="largest context-parallel size tried (powers of two; default 32)")
    g.add_argument("--json", action="store_true")
    add_hardware_args(ap)
    return ap


def _searched(typed: list[str]) -> str | None:
    """The error for layout flags given to the search (it tries every value itself)."""
    searched = [f for f in _SEARCHED if any(t == f or t.startswith(f + "=") for t in typed)]
    if not searched:
        return None
    one = len(searched) == 1
    return (f"{', '.join(searched)}: the search tries every value of {'this' if one else 'these'} "
            f"itself; leave {'it' if one else 'them'} out (or drop --search to plan one layout)")


def _cp_comm_types(typed: list[str], cfg: TrainConfig) -> tuple[str, ...]:
    """The cp comm types to try: the one ``--cp-comm-type`` names, else all four."""
    if any(t == "--cp-comm-type" or t.startswith("--cp-comm-type=") for t in typed):
        return (cfg.parallel.cp_comm_type,)
    return ("p2p", "all_gather", "a2a", "a2a+p2p")


def _dispatchers(typed: list[str], cfg: TrainConfig) -> tuple[str, ...]:
    """The MoE token dispatchers to try: the one ``--moe-token-dispatcher-type`` names, else
    both."""
    if any(t.split("=", 1)[0] == "--moe-token-dispatcher-type" for t in typed):
        return (cfg.model.moe_token_dispatcher_type,)
    return ("allgather", "alltoall")


def _model(a: argparse.Namespace, typed: list[str]) -> TrainConfig:
    """The model, dtype and batch of the flags as ``paraloom train`` reads them (presets,
    tokenizer, Hugging Face shape, Megatron-LM's spellings), on one GPU: the layout is the
    search's. ``ValueError`` naming a bad value."""
    for name in ("gpus", "top", "max_cp"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    for path in ("parallel.tp", "parallel.pp", "parallel.dp", "parallel.cp", "parallel.ep"):
        setattr(a, path, 1)
    a.nprocs, a.megatron_lm_spelt = None, megatron_lm_spellings(_parser(), typed)
    try:
        cfg, _ = config_from_args(a)
    except ValueError as err:
        raise ValueError(f"paraloom train would refuse this model: {err}") from None
    m = cfg.model
    if m.num_query_groups and m.num_attention_heads % m.num_query_groups:
        raise ValueError(f"--num-query-groups {m.num_query_groups} must divide --heads "
                         f"{m.num_attention_heads}")
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    typed = sys.argv[1:] if argv is None else argv
    refused = _searched(typed)
    if refused:
        print(f"paraloom plan --search: error: {refused}", file=sys.stderr)
        return 2
    a = ap.parse_args(typed)
    try:
        hw, cfg = hardware_from_args(a), _model(a, typed)
    except ValueError as err:
        print(f"paraloom plan: error: {err}", file=sys.stderr)
        return 2
    m = cfg.model
    arch = Architecture.from_model(dataclasses.asdict(m))
    tic = time.perf_counter()
    fits, too_big = search(a.gpus, hw, layers=m.num_layers, hidden=m.hidden_size,
                           heads=m.num_attention_heads, seq_len=m.seq_length,
                           global_batch=cfg.global_batch_size, vocab=m.vocab_size,
                           vocab_multiple=m.make_vocab_size_divisible_by, ffn=m.ffn,
                           dtype_bytes=2 if cfg.dtype == "bf16" else 4, arch=arch,
                           cps=cp_sizes(a.gpus, m.seq_length, a.max_cp),
                           cp_comm_types=_cp_comm_types(typed, cfg),
                           num_experts=m.num_experts,
                           moe_topk=m.moe_router_topk, moe_layer_freq=m.moe_layer_freq,
                           moe_shared_ffn=m.moe_shared_expert_intermediate_size or 0,
                           moe_shared_gate=m.moe_shared_expert_gate,
                           dispatchers=_dispatchers(typed, cfg))
    took = time.perf_counter() - tic
    if a.json:
        print(json.dumps({"hardware": hw.to_dict(), "layouts_fitting": len(fits),
                          "layouts_too_big": too_big, "seconds": took,
                          "ranked": [asdict(x) for x in fits[:a.top]]}, indent=2))
        return 0
    return _print_ranked(a, cfg, hw, arch, fits, too_big, took)


def _print_ranked(a: argparse.Namespace, cfg: TrainConfig, hw: Hardware, arch: Architecture,
                  fits: list[Candidate], too_big: int, took: float) -> int:
    """The ranked table; 1 when nothing fits or no layout is valid."""
    print(f"{len(fits)} layouts fit {human_bytes(0.9 * hw.hbm_bytes)} of {hw.name} "
          f"({too_big} valid ones do not); searched in {took:.2f} s")
    if not fits and too_big:
        print("nothing fits: more GPUs, a shorter sequence or a smaller model")
        return 1
    if not fits:
        m = cfg.model
        print(no_valid_layout(a.gpus, layers=m.num_layers, hidden=m.hidden_size,
                              heads=m.num_attention_heads, seq_len=m.seq_length,
                              global_batch=cfg.global_batch_size,
                              query_groups=arch.num_query_groups))
        return 1
    print("  # " + " ".join(f"{h:>{w}}" for h, w in (
        ("tp", 3), ("cp", 6), ("ep", 6), ("pp", 3), ("dp", 5), ("vpp", 3), ("mb", 3), ("sp", 3),
        ("recompute", 9), ("zero", 5), ("step s", 9), ("MFU", 5), ("memory", 10))) + "  why")
    for i, x in enumerate(fits[:a.top], 1):
        print(_row(i, x, fits[0], hw))
    return 0
