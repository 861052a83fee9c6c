"""``paraloom plan --search --gpus N ...``: the ranked table of the layouts that fit
(:mod:`paraloom.analysis.search`; ``--json`` for machines)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from ..analysis.hardware import Hardware
from ..analysis.plan import GPT2_VOCAB, human_bytes
from ..analysis.search import Candidate, cp_sizes, explain, no_valid_layout, search
from ..analysis.spec import Architecture
from ..config.model import mlp_width
from .arch_flags import add_architecture_flags, architecture_from_args
from .hardware_flags import add_hardware_args, hardware_from_args

__all__ = ["main"]


_SEARCHED = ("--tp", "--pp", "--dp", "--cp", "--ep", "--vpp", "--micro-batch-size",
             "--sequence-parallel", "--recompute", "--distributed-optimizer",
             "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
             "--context-parallel-size", "--expert-model-parallel-size")
"""Layout flags of ``plan``: the search enumerates them."""


def _row(i: int, x: Candidate, best: Candidate, hw: Hardware) -> str:
    r = x.prediction
    return (f"{i:>3} {x.tp:>3} {x.cp:>3} {x.ep:>3} {x.pp:>3} {x.dp:>5} {x.vpp:>3} "
            f"{x.micro_batch:>3} "
            f"{'on' if x.sequence_parallel else 'off':>3} {x.recompute:>9} "
            f"{'on' if x.distributed_optimizer else 'off':>4} {x.step_time_s:>9.3f} "
            f"{r['mfu']:>5.1%} {human_bytes(x.memory_bytes):>10}  {explain(x, best, hw)}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="paraloom plan --search",
                                 description="rank the layouts of a job that fit memory")
    ap.add_argument("--search", action="store_true")
    ap.add_argument("--gpus", type=int, required=True)
    for name in ("layers", "hidden", "heads", "seq-len", "global-batch-size"):
        ap.add_argument(f"--{name}", type=int, required=True)
    ap.add_argument("--vocab", type=int, default=GPT2_VOCAB)
    ap.add_argument("--ffn", type=int, default=None)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--top", type=int, default=10, help="layouts to print (default 10)")
    ap.add_argument("--max-cp", type=int, default=32,
                    help="largest context-parallel size tried (powers of two; default 32)")
    ap.add_argument("--cp-comm-type", choices=("p2p", "all_gather"), default="p2p")
    ap.add_argument("--num-experts", type=int, default=None,
                    help="MoE: experts per MoE layer (then every ep dividing dp is tried)")
    ap.add_argument("--moe-router-topk", type=int, default=2)
    ap.add_argument("--moe-layer-freq", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    add_hardware_args(ap)
    add_architecture_flags(ap)
    return ap


def _searched(typed: list[str]) -> str | None:
    """The error for layout flags given to the search (it tries every value itself)."""
    searched = [f for f in _SEARCHED if any(t == f or t.startswith(f + "=") for t in typed)]
    if not searched:
        return None
    one = len(searched) == 1
    return (f"{', '.join(searched)}: the search tries every value of {'this' if one else 'these'} "
            f"itself; leave {'it' if one else 'them'} out (or drop --search to plan one layout)")


def _checked(a: argparse.Namespace) -> tuple[Hardware, Architecture]:
    """The hardware and the architecture of the flags; ``ValueError`` naming a bad value."""
    hw = hardware_from_args(a)
    for name in ("gpus", "layers", "hidden", "heads", "seq_len", "global_batch_size",
                 "vocab", "top", "max_cp", "moe_router_topk", "moe_layer_freq"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                             f"{getattr(a, name)}")
    if a.hidden % a.heads:
        raise ValueError(f"--hidden {a.hidden} is not divisible by --heads {a.heads}")
    arch = Architecture(**{k: v for k, v in architecture_from_args(a).items()
                           if k in Architecture.__dataclass_fields__})
    if arch.num_query_groups and a.heads % arch.num_query_groups:
        raise ValueError(f"--num-query-groups {arch.num_query_groups} must divide --heads "
                         f"{a.heads}")
    if a.num_experts is not None and not arch.is_gpt2:
        raise ValueError("--num-experts: experts are GeLU MLPs with biases for now; "
                         "use the GPT-2 MLP flags with MoE")
    if a.num_experts is not None and a.num_experts < 1:
        raise ValueError(f"--num-experts must be >= 1, got {a.num_experts}")
    if a.num_experts is not None and not a.moe_router_topk <= a.num_experts:
        raise ValueError(f"--num-experts must be >= --moe-router-topk "
                         f"({a.moe_router_topk}), got {a.num_experts}")
    return hw, arch


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    typed = sys.argv[1:] if argv is None else argv
    refused = _searched(typed)
    if refused:
        print(f"paraloom plan --search: error: {refused}", file=sys.stderr)
        return 2
    a = ap.parse_args(argv)
    try:
        hw, arch = _checked(a)
    except ValueError as err:
        print(f"paraloom plan: error: {err}", file=sys.stderr)
        return 2
    tic = time.perf_counter()
    fits, too_big = search(a.gpus, hw, layers=a.layers, hidden=a.hidden, heads=a.heads,
                           seq_len=a.seq_len, global_batch=a.global_batch_size, vocab=a.vocab,
                           ffn=mlp_width(a.hidden, arch.swiglu, a.ffn),
                           dtype_bytes=2 if a.dtype == "bf16" else 4, arch=arch,
                           cps=cp_sizes(a.gpus, a.seq_len, a.max_cp),
                           cp_comm_type=a.cp_comm_type, num_experts=a.num_experts,
                           moe_topk=a.moe_router_topk, moe_layer_freq=a.moe_layer_freq)
    took = time.perf_counter() - tic
    if a.json:
        print(json.dumps({"hardware": hw.to_dict(), "layouts_fitting": len(fits),
                          "layouts_too_big": too_big, "seconds": took,
                          "ranked": [asdict(x) for x in fits[:a.top]]}, indent=2))
        return 0
    return _print_ranked(a, hw, arch, fits, too_big, took)


def _print_ranked(a: argparse.Namespace, hw: Hardware, arch: Architecture,
                  fits: list[Candidate], too_big: int, took: float) -> int:
    """The ranked table; 1 when nothing fits or no layout is valid."""
    print(f"{len(fits)} layouts fit {human_bytes(0.9 * hw.hbm_bytes)} of {hw.name} "
          f"({too_big} valid ones do not); searched in {took:.2f} s")
    if not fits and too_big:
        print("nothing fits: more GPUs, a shorter sequence or a smaller model")
        return 1
    if not fits:
        print(no_valid_layout(a.gpus, layers=a.layers, hidden=a.hidden, heads=a.heads,
                              seq_len=a.seq_len, global_batch=a.global_batch_size,
                              query_groups=arch.num_query_groups))
        return 1
    print("  # " + " ".join(f"{h:>{w}}" for h, w in (
        ("tp", 3), ("cp", 3), ("ep", 3), ("pp", 3), ("dp", 5), ("vpp", 3), ("mb", 3), ("sp", 3),
        ("recompute", 9), ("zero", 4), ("step s", 9), ("MFU", 5), ("memory", 10))) + "  why")
    for i, x in enumerate(fits[:a.top], 1):
        print(_row(i, x, fits[0], hw))
    return 0
