"""``paraloom plan``: the validated model extrapolated to a layout far beyond this machine.

Nothing is started: every number comes from :mod:`paraloom.analysis.formulas` (the same
per-``(kind, op, phase)`` communication that ``paraloom check`` verifies on recorded runs), and
the predicted step time on ``--gpu`` hardware from :mod:`paraloom.analysis.steptime`
(``--search``: :mod:`~paraloom.analysis.search`; ``--calibrate``:
:mod:`~paraloom.analysis.calibrate`).
FLOPs are reported twice: model FLOPs (no recomputation, what MFU divides) and hardware FLOPs
(with ``--recompute``, what HFU divides).

Memory per GPU (the busiest pipeline stage) assumes Megatron's mixed precision when the dtype is
16-bit: weights in ``dtype``, fp32 ``main_grad`` (4 B/param), Adam with fp32 master weights
(12 B/param; 8 B/param in fp32), the optimizer states divided by ``dp`` with the distributed
optimizer. Activations: Korthikanti et al.'s per-layer bytes (scaled from their 16-bit figures to
``dtype``) times the layers of a stage times the microbatches 1F1B keeps in flight on the first
stage (``min(p, m)``), times ``1 + (p-1)/(p v)`` for the interleaved schedule.

    paraloom plan --layers 96 --hidden 12288 --heads 96 --seq-len 2048 --vocab 51200 \\
        --global-batch-size 1536 --micro-batch-size 1 --tp 8 --pp 16 --dp 8 \\
        --sequence-parallel --recompute selective --distributed-optimizer
"""

from __future__ import annotations

import argparse
import json
import sys

from .arch import Architecture, arch_param_count
from .cp_formulas import cp_activation_factor
from .flops import hardware_flops, model_flops
from .formulas import (
    CommConfig,
    activation_bytes_per_layer,
    bubble_fraction,
    expected_comm,
    param_count,
    params_per_rank,
    stage_layers,
)
from .hardware import add_hardware_args, hardware_from_args
from .steptime import render_step_time, step_time

__all__ = ["plan", "plan_main", "memory_per_gpu", "render_plan", "human_bytes", "padded_vocab",
           "GPT2_VOCAB"]

GPT2_VOCAB = 50257
"""``--vocab`` when not given: the GPT-2 BPE vocabulary of Megatron-LM's GPT examples."""


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.50 KiB`` (binary units up to PiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} PiB"


def memory_per_gpu(c: CommConfig) -> dict[str, float]:
    """Bytes per GPU of the busiest stage: weights, grads, optimizer, activations, total."""
    stages = {0, min(1, c.pp - 1), c.pp - 1}  # the middle stages are all alike
    extra = {r: _moe_plan(c, r) for r in stages}  # MoE: experts, their activations, all-to-all
    per_rank = max(params_per_rank(c, r) + extra[r]["params"] for r in stages)
    opt_bytes = 12 if c.dtype_bytes < 4 else 8
    layer_act = activation_bytes_per_layer(c.seq_len, c.micro_batch, c.hidden, c.heads, c.tp,
                                           sequence_parallel=c.sp, recompute=c.recompute,
                                           attention=c.arch.attention)
    interleave = 1 + (c.pp - 1) / (c.pp * c.v) if c.v > 1 else 1.0
    activations = ((layer_act * c.dtype_bytes / 2 * stage_layers(c)
                    + max(e["activation_bytes"] for e in extra.values()))
                   * min(c.pp, c.num_microbatches) * interleave
                   * cp_activation_factor(c.cp))  # cp: each rank holds s/cp tokens
    experts = max(e["expert_params"] for e in extra.values())  # ZeRO shards them over edp
    shards = (c.dp * c.cp, extra[0]["edp"]) if c.distributed_optimizer else (1, 1)
    memory = {"weights": per_rank * c.dtype_bytes, "grads": per_rank * 4,
              "optimizer": ((per_rank - experts) / shards[0] + experts / shards[1]) * opt_bytes,
              "activations": activations}
    memory["total"] = sum(memory.values())
    return memory


def plan(c: CommConfig) -> dict:
    """Parameters, memory per GPU, communication per step and kind, bubble and FLOPs."""
    stages = range(c.pp)
    extra = {r: _moe_plan(c, r) for r in stages}  # MoE: experts, their activations, all-to-all
    per_rank = max(params_per_rank(c, r) + extra[r]["params"] for r in stages)
    memory = memory_per_gpu(c)
    comm_bytes: dict[str, int] = {}
    comm_ops: dict[str, int] = {}
    for r in stages:  # per kind, the busiest stage
        kinds: dict[str, list[int]] = {}
        for (kind, _op, _phase), v in expected_comm(c, r).items():
            cell = kinds.setdefault(kind, [0, 0])
            cell[0] += v["count"]
            cell[1] += v["bytes"]
        if extra[r]["ep_ops"]:  # token all-to-alls: their bytes under balanced routing
            kinds["ep"] = [extra[r]["ep_ops"], extra[r]["ep_bytes"]]
        for kind, (n, b) in kinds.items():
            if b > comm_bytes.get(kind, -1):
                comm_bytes[kind], comm_ops[kind] = b, n
    gbs = c.micro_batch * c.num_microbatches * c.dp
    flops, hw_flops = model_flops(c), hardware_flops(c)  # GQA, SwiGLU, MoE experts
    gpus = c.tp * c.cp * c.pp * c.dp
    return {"gpus": gpus, "global_batch_size": gbs,
            "parameters": {"total": (arch_param_count(c) if not c.arch.is_gpt2 else
                                     param_count(c.layers, c.hidden, c.vocab, c.seq_len, c.ffn))
                           + extra[0]["total_params"], "per_gpu": per_rank},
            "memory_per_gpu_bytes": memory, "comm_bytes_per_step": comm_bytes,
            "comm_ops_per_step": comm_ops,
            "bubble_fraction": bubble_fraction(c.pp, c.num_microbatches, c.vpp),
            "flops_per_step": flops, "flops_per_gpu_per_step": flops / gpus,
            "hardware_flops_per_step": hw_flops}


def _moe_plan(c: CommConfig, r: int) -> dict:
    if c.moe is None:
        return {"params": 0, "activation_bytes": 0, "ep_bytes": 0, "ep_ops": 0,
                "expert_params": 0, "edp": c.dp, "total_params": 0}
    from .moe_formulas import moe_plan
    return moe_plan(c, r)


def render_plan(c: CommConfig, p: dict) -> str:
    """The plan as a few aligned lines for people."""
    mem = p["memory_per_gpu_bytes"]
    lines = [f"{p['parameters']['total'] / 1e9:.1f}B parameters on {p['gpus']} GPUs "
             f"(tp={c.tp} pp={c.pp} dp={c.dp} vpp={c.v}"
             + (f" cp={c.cp} ({c.cp_comm_type})" if c.cp > 1 else "")
             + f", sp={'on' if c.sp else 'off'}, "
             f"recompute={c.recompute}, distributed optimizer="
             f"{'on' if c.distributed_optimizer else 'off'})",
             f"global batch {p['global_batch_size']} = micro {c.micro_batch} x "
             f"{c.num_microbatches} microbatches x dp {c.dp}",
             f"parameters per GPU   {p['parameters']['per_gpu'] / 1e6:,.1f}M", "memory per GPU:"]
    lines += [f"  {k:<12} {human_bytes(v)}" for k, v in mem.items()]
    lines.append("communication per GPU per step (busiest stage):")
    lines += [f"  {k:<4} {p['comm_ops_per_step'][k]:>8} ops  {human_bytes(b)}"
              for k, b in sorted(p["comm_bytes_per_step"].items())]
    lines.append(f"pipeline bubble      {p['bubble_fraction']:.1%}")
    lines.append(f"model FLOPs per step {p['flops_per_step']:.3e} "
                 f"({p['flops_per_gpu_per_step'] / 1e12:,.1f} TFLOP per GPU; no recomputation)")
    lines.append(f"hardware FLOPs       {p['hardware_flops_per_step']:.3e} "
                 f"(with recompute={c.recompute})")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="paraloom plan", description=__doc__.splitlines()[0])
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
    from ..commands.arch_flags import add_architecture_flags
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


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's embedding rows: ``vocab`` rounded up to a multiple of ``divisible_by * tp``
    (50257 -> 50304 for tp = 1, 50688 for tp = 8), so the vocabulary split divides by tp."""
    m = divisible_by * tp
    return -(-vocab // m) * m


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
    moe = None
    if a.num_experts is not None:
        from ..config import ModelConfig, ParallelConfig, check_layout
        from .moe_formulas import MoECommConfig
        try:  # the training config's own checks: topk <= E, ep | dp, E % ep
            check_layout(ModelConfig(num_experts=a.num_experts, moe_router_topk=a.moe_router_topk,
                                     moe_layer_freq=a.moe_layer_freq),
                         ParallelConfig(dp=a.dp, ep=a.ep, cp=a.cp))
        except ValueError as err:
            problems.append(str(err))
        moe = MoECommConfig(num_experts=a.num_experts, topk=a.moe_router_topk, ep=a.ep,
                            layer_freq=a.moe_layer_freq)
    elif a.ep != 1:
        problems.append(f"--ep {a.ep} needs --num-experts")
    if problems:
        raise ValueError("; ".join(problems))
    ffn = a.ffn or (int(4 * a.hidden * 2 / 3 / 64) * 64 if arch.swiglu else None)
    return CommConfig(layers=a.layers, hidden=a.hidden, heads=a.heads, seq_len=a.seq_len,
                      vocab=padded_vocab(a.vocab, a.make_vocab_size_divisible_by, a.tp),
                      ffn=ffn, micro_batch=a.micro_batch_size,
                      num_microbatches=a.global_batch_size // (a.micro_batch_size * a.dp),
                      tp=a.tp, pp=a.pp, dp=a.dp, vpp=a.vpp,
                      sequence_parallel=a.sequence_parallel, recompute=a.recompute,
                      distributed_optimizer=a.distributed_optimizer,
                      dtype_bytes=2 if a.dtype == "bf16" else 4, arch=arch, cp=a.cp,
                      cp_comm_type=a.cp_comm_type, moe=moe)


def _architecture(a: argparse.Namespace, problems: list[str]) -> Architecture:
    """The Llama-family switches of the flags (``--arch llama`` ...); problems appended."""
    from ..commands.arch_flags import architecture_from_args
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


def plan_main(argv: list[str] | None = None) -> int:
    """CLI entry: print the plan and the predicted step time (``--json`` for machines); exit 2
    naming a bad value. ``--search`` and ``--calibrate`` are their own commands."""
    typed = sys.argv[1:] if argv is None else argv
    if "--search" in typed:
        from .search import search_main
        return search_main(typed)
    if "--calibrate" in typed:
        from .calibrate import calibrate_main
        return calibrate_main(typed)
    args = _parser().parse_args(argv)
    try:
        config = _config(args)
        hw = hardware_from_args(args)
    except ValueError as err:
        print(f"paraloom plan: error: {err}", file=sys.stderr)
        return 2
    result = plan(config)
    result["step_time"] = step_time(config, hw)
    result["hardware"] = hw.to_dict()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    given = "given" if any(a.startswith("--vocab") for a in typed) else "default, GPT-2 BPE"
    note = (f"vocabulary {args.vocab} ({given})"
            + (f", padded to {config.vocab} rows (multiple of {args.make_vocab_size_divisible_by}"
               f" x tp {args.tp})" if config.vocab != args.vocab else ""))
    print(render_plan(config, result) + "\n" + note + "\n"
          + render_step_time(result["step_time"]))
    return 0
