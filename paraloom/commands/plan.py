"""``paraloom plan``: memory, communication, bubble and FLOPs per GPU for any model and cluster,
and the predicted step time on ``--gpu`` hardware (:mod:`paraloom.analysis.plan`); ``--search``
ranks the layouts that fit (:mod:`.plan_search`), ``--calibrate`` measures this machine
(:mod:`.plan_calibrate`)::

    paraloom plan --layers 96 --hidden 12288 --heads 96 --seq-len 2048 --vocab 51200 \\
        --global-batch-size 1536 --micro-batch-size 1 --tp 8 --pp 16 --dp 8 \\
        --sequence-parallel --recompute selective --distributed-optimizer
    paraloom plan RUN_FOLDER --gpu h100-sxm     # the run a folder holds (:mod:`.plan_run`)
"""

from __future__ import annotations

import argparse
import json
import sys

from ..analysis.plan import GPT2_VOCAB, human_bytes, plan, render_plan
from ..analysis.search import memory_fit
from ..analysis.spec import Architecture, CommConfig, MoECommConfig
from ..analysis.steptime import render_step_time, step_time
from ..config import ModelConfig, ParallelConfig, TrainConfig
from ..config.model import padded_vocab_rows
from . import plan_calibrate, plan_run, plan_search
from .arch_flags import add_architecture_flags, architecture_from_args
from .hardware_flags import add_hardware_args, hardware_from_args

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="paraloom plan", description="``paraloom plan``: the "
                                 "validated model extrapolated to a layout far beyond this "
                                 "machine.")
    for name in ("layers", "hidden", "heads", "seq-len", "global-batch-size",
                 "micro-batch-size", "tp", "pp", "dp"):
        ap.add_argument(f"--{name}", type=int, required=name not in ("tp", "pp", "dp"),
                        default=1)
    ap.add_argument("--vocab", type=int, default=GPT2_VOCAB,
                    help=f"vocabulary size (default {GPT2_VOCAB}, the GPT-2 BPE vocabulary that "
                         "Megatron-LM's GPT examples use); padded like Megatron, see below")
    ap.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                    help="the embedding rows are the vocabulary rounded up to a multiple of this "
                         "times --tp (Megatron-LM's rule; default 128)")
    ap.add_argument("--ffn", type=int, default=None, help="MLP width (default 4 * hidden)")
    ap.add_argument("--vpp", type=int, default=None)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    ap.add_argument("--distributed-optimizer", action="store_true")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("--require-fit", action="store_true",
                    help="exit 1 when the layout does not fit the GPU's memory (for scripts; "
                         "the verdict line is printed either way)")
    add_architecture_flags(ap)
    ap.add_argument("--cp", "--context-parallel-size", dest="cp", type=int, default=1,
                    help="context-parallel size (each rank holds seq-len / cp tokens)")
    ap.add_argument("--cp-comm-type", dest="cp_comm_type", choices=("p2p", "all_gather"),
                    default="p2p")
    ap.add_argument("--num-experts", type=int, default=None, help="MoE: experts per MoE layer")
    ap.add_argument("--moe-router-topk", type=int, default=2)
    ap.add_argument("--moe-layer-freq", type=int, default=1)
    ap.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=int, default=1)
    ap.add_argument("--search", action="store_true",
                    help="rank every layout of --gpus N that fits memory (see --search --help)")
    ap.add_argument("--calibrate", action="store_true",
                    help="measure this machine's GEMM rate and gloo alpha/beta (--calibrate "
                         "--help)")
    add_hardware_args(ap)
    return ap


def _config(a: argparse.Namespace) -> CommConfig:
    """Validate the arguments (every number named) and build the formulas' config."""
    problems = []
    for name in ("layers", "hidden", "heads", "seq_len", "vocab", "global_batch_size",
                 "micro_batch_size", "tp", "pp", "dp", "make_vocab_size_divisible_by", "cp"):
        if getattr(a, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if problems:
        raise ValueError("; ".join(problems))
    if a.hidden % a.heads:
        problems.append(f"--hidden {a.hidden} is not divisible by --heads {a.heads}")
    for name, value in (("hidden", a.hidden), ("heads", a.heads)):
        if value % a.tp:
            problems.append(f"--{name} {value} is not divisible by --tp {a.tp}")
    if a.layers % (a.pp * (a.vpp or 1)):
        problems.append(f"--layers {a.layers} is not divisible by --pp * --vpp = "
                        f"{a.pp} * {a.vpp or 1}")
    if a.global_batch_size % (a.micro_batch_size * a.dp):
        problems.append(f"--global-batch-size {a.global_batch_size} is not divisible by "
                        f"--micro-batch-size * --dp = {a.micro_batch_size} * {a.dp}")
    if a.sequence_parallel and a.seq_len % a.tp:
        problems.append(f"--seq-len {a.seq_len} is not divisible by --tp {a.tp}")
    arch = _architecture(a, problems)
    if a.cp > 1 and a.seq_len % (2 * a.cp):
        problems.append(f"--seq-len {a.seq_len} is not divisible by 2 * --cp = {2 * a.cp} "
                        f"(context parallelism cuts each sequence into 2 * cp chunks)")
    if a.num_experts is None and a.ep != 1:
        problems.append(f"--ep {a.ep} needs --num-experts")
    if problems:
        raise ValueError("; ".join(problems))
    train = _train_config(a, arch)
    moe = None if a.num_experts is None else MoECommConfig(
        num_experts=a.num_experts, topk=a.moe_router_topk, ep=a.ep, layer_freq=a.moe_layer_freq)
    ffn = train.model.ffn
    return CommConfig(layers=a.layers, hidden=a.hidden, heads=a.heads, seq_len=a.seq_len,
                      vocab=padded_vocab_rows(a.vocab, a.make_vocab_size_divisible_by, a.tp),
                      ffn=ffn, micro_batch=a.micro_batch_size,
                      num_microbatches=a.global_batch_size // (a.micro_batch_size * a.dp),
                      tp=a.tp, pp=a.pp, dp=a.dp, vpp=a.vpp,
                      sequence_parallel=a.sequence_parallel, recompute=a.recompute,
                      distributed_optimizer=a.distributed_optimizer,
                      dtype_bytes=2 if a.dtype == "bf16" else 4, arch=arch, cp=a.cp,
                      cp_comm_type=a.cp_comm_type, moe=moe)


def _train_config(a: argparse.Namespace, arch: Architecture) -> TrainConfig:
    """The run the flags describe, checked as ``paraloom train`` checks it (layout, schedule,
    microbatches, the MoE model): ``ValueError`` for what train would refuse."""
    fields = {k: getattr(arch, k) for k in Architecture.__dataclass_fields__
              if k in ModelConfig.__dataclass_fields__}
    moe = {} if a.num_experts is None else dict(
        num_experts=a.num_experts, moe_router_topk=a.moe_router_topk,
        moe_layer_freq=a.moe_layer_freq)
    try:
        return TrainConfig(
            model=ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers,
                              num_attention_heads=a.heads, ffn_hidden_size=a.ffn,
                              seq_length=a.seq_len,
                              make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
                              **fields, **moe),
            parallel=ParallelConfig(tp=a.tp, pp=a.pp, dp=a.dp, vpp=a.vpp, cp=a.cp, ep=a.ep,
                                    sequence_parallel=a.sequence_parallel,
                                    cp_comm_type=a.cp_comm_type),
            global_batch_size=a.global_batch_size, micro_batch_size=a.micro_batch_size,
            dtype=a.dtype, recompute=a.recompute, distributed_optimizer=a.distributed_optimizer)
    except ValueError as err:
        raise ValueError(f"paraloom train would refuse this run: {err}") from None


def _architecture(a: argparse.Namespace, problems: list[str]) -> Architecture:
    """The Llama-family switches of the flags (``--arch llama`` ...); problems appended."""
    try:
        fields = architecture_from_args(a)
    except ValueError as err:
        problems.append(str(err))
        return Architecture()
    groups = fields.get("num_query_groups")
    if groups is not None and (a.heads % groups or groups % a.tp):
        problems.append(f"--num-query-groups {groups} must divide --heads {a.heads} and be "
                        f"divisible by --tp {a.tp}")
    return Architecture(**{k: v for k, v in fields.items()
                           if k in Architecture.__dataclass_fields__})


def main(argv: list[str] | None = None) -> int:
    """CLI entry: print the plan and the predicted step time (``--json`` for machines); exit 2
    naming a bad value. ``--search`` and ``--calibrate`` are their own commands."""
    typed = sys.argv[1:] if argv is None else argv
    if "--search" in typed:
        return plan_search.main(typed)
    if "--calibrate" in typed:
        return plan_calibrate.main(typed)
    try:
        if plan_run.is_run_folder(typed):
            config, hw, args, note = plan_run.from_run_folder(typed)
        else:
            args = _parser().parse_args(argv)
            config, hw = _config(args), hardware_from_args(args)
            given = "given" if any(a.startswith("--vocab") for a in typed) else \
                "default, GPT-2 BPE"
            note = (f"vocabulary {args.vocab} ({given})"
                    + (f", padded to {config.vocab} rows (multiple of "
                       f"{args.make_vocab_size_divisible_by} x tp {args.tp})"
                       if config.vocab != args.vocab else ""))
    except ValueError as err:
        print(f"paraloom plan: error: {err}", file=sys.stderr)
        return 2
    result = plan(config)
    result["step_time"] = step_time(config, hw)
    result["hardware"] = hw.to_dict()
    fit = result["memory_fit"] = memory_fit(config, hw)
    code = 1 if args.require_fit and not fit["fits"] else 0
    if args.json:
        print(json.dumps(result, indent=2))
        return code
    print(render_plan(config, result) + "\n" + _verdict(fit, hw) + "\n" + note + "\n"
          + render_step_time(result["step_time"]))
    return code


def _verdict(fit: dict, hw) -> str:
    """One line: fits or not, by how much, and what to change."""
    need, budget = fit["need_bytes"], fit["budget_bytes"]
    where = f"{human_bytes(budget)} usable of the {hw.name}'s {human_bytes(hw.hbm_bytes)}"
    if fit["fits"]:
        return f"verdict: fits ({human_bytes(need)} of {where}; {need / budget:.0%})"
    return (f"verdict: does NOT fit: {human_bytes(need)} needed, {where} ({need / budget:.1f}x "
            f"too much); try " + "; ".join(fit["advice"]))
