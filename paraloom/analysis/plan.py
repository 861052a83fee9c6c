"""The validated model extrapolated to a layout far beyond this machine (``paraloom plan``).

Nothing is started: every number comes from :mod:`paraloom.analysis.formulas` (the same
per-``(kind, op, phase)`` communication that ``paraloom check`` verifies on recorded runs), and
the predicted step time on ``--gpu`` hardware from :mod:`paraloom.analysis.steptime`
(``--search``: :mod:`~paraloom.analysis.search`; ``--calibrate``:
:mod:`~paraloom.measure.calibrate`).
FLOPs are reported twice: model FLOPs (no recomputation, what MFU divides) and hardware FLOPs
(with ``--recompute``, what HFU divides).

Memory per GPU (the busiest pipeline stage) is :mod:`.memory_formulas`'.

    paraloom plan --layers 96 --hidden 12288 --heads 96 --seq-len 2048 --vocab 51200 \\
        --global-batch-size 1536 --micro-batch-size 1 --tp 8 --pp 16 --dp 8 \\
        --sequence-parallel --recompute selective --distributed-optimizer
"""

from __future__ import annotations

from ..pipeline_parallel.timetable import pipeline_bubble
from .flops import hardware_flops, model_flops
from .formulas import expected_comm
from .layout import arch_param_count, param_count, params_per_rank
from .memory_formulas import memory_per_gpu, moe_extra
from .spec import CommConfig

__all__ = ["plan", "memory_per_gpu", "render_plan", "human_bytes", "human_count",
           "GPT2_VOCAB"]

GPT2_VOCAB = 50257
"""``--vocab`` when not given: the GPT-2 BPE vocabulary of Megatron-LM's GPT examples."""


def human_count(n: float) -> str:
    """``6.7e9`` -> ``6.7B``, ``446.1e6`` -> ``446.1M``, ``1.2e4`` -> ``12.0K``."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:,.1f}{unit}"
    return f"{n:.0f}"


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.50 KiB`` (binary units up to PiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} PiB"


def plan(c: CommConfig) -> dict:
    """Parameters, memory per GPU, communication per step and kind, bubble and FLOPs."""
    stages = range(c.pp)
    extra = {r: moe_extra(c, r) for r in stages}  # MoE: experts, their activations, all-to-all
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
            "bubble_fraction": pipeline_bubble(c.pp, c.num_microbatches, c.vpp),
            "flops_per_step": flops, "flops_per_gpu_per_step": flops / gpus,
            "hardware_flops_per_step": hw_flops}




def render_plan(c: CommConfig, p: dict) -> str:
    """The plan as a few aligned lines for people."""
    mem = p["memory_per_gpu_bytes"]
    moe = (f", {c.moe.num_experts} experts top-{c.moe.topk} ep={c.moe.ep}" if c.moe else "")
    lines = [f"{human_count(p['parameters']['total'])} parameters on {p['gpus']} GPUs "
             f"(tp={c.tp} pp={c.pp} dp={c.dp} vpp={c.v}"
             + (f" cp={c.cp} ({c.cp_comm_type}{_levels(c)})" if c.cp > 1 else "") + moe
             + f", sp={'on' if c.sp else 'off'}, "
             f"recompute={c.recompute}, distributed optimizer="
             f"{'on' if c.distributed_optimizer else 'off'}"
             + (f" x {c.instances} instances" if c.instances > 1 else "")
             + (f", Megatron-FSDP {c.megatron_fsdp}" if c.megatron_fsdp else "") + ", "
             f"{'bf16' if c.dtype_bytes == 2 else 'fp32'})",
             f"global batch {p['global_batch_size']} = micro {c.micro_batch} x "
             f"{c.num_microbatches} microbatches x dp {c.dp}",
             f"parameters per GPU   {human_count(p['parameters']['per_gpu'])}"
             + (" (the stage holding most)" if c.pp > 1 else ""),
             "memory per GPU" + (" (each part at the stage needing most: an upper bound):"
                                 if c.pp > 1 else ":")]
    lines += [f"  {k:<12} {human_bytes(v)}" for k, v in mem.items()]
    lines.append("communication per GPU per step"
                 + (" (each kind at its busiest stage):" if c.pp > 1 else ":"))
    width = max(map(len, p["comm_bytes_per_step"]), default=4)
    lines += [f"  {k:<{width}} {p['comm_ops_per_step'][k]:>8} ops  {human_bytes(b)}"
              for k, b in sorted(p["comm_bytes_per_step"].items())]
    lines.append(f"pipeline bubble      {p['bubble_fraction']:.1%}")
    lines.append(f"model FLOPs per step {p['flops_per_step']:.3e} "
                 f"({p['flops_per_gpu_per_step'] / 1e12:,.1f} TFLOP per GPU; no recomputation)")
    lines.append(f"hardware FLOPs       {p['hardware_flops_per_step']:.3e} "
                 f"(with recompute={c.recompute})")
    return "\n".join(lines)


def _levels(c) -> str:
    """`` A x B`` of hierarchical cp (``a2a+p2p``), else nothing."""
    return f" {c.cp_a2a}x{c.cp // c.cp_a2a}" if c.cp_comm_type == "a2a+p2p" else ""
