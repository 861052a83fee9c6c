"""Memory per GPU in the analytical model: activation bytes per layer (Korthikanti et al. 2022,
Table 2) and the whole of a layout's busiest stage (weights, gradients, optimizer states,
activations).

Memory assumes Megatron's mixed precision when the dtype is 16-bit: weights in ``dtype``, fp32
``main_grad`` (4 B/param), Adam with fp32 master weights (12 B/param; 8 B/param in fp32), the
optimizer states divided by ``dp`` with the distributed optimizer (by ``dp / N`` with ``N``
instances). Activations: the per-layer
bytes (scaled from 16-bit figures to ``dtype``) times the layers of a stage times the
microbatches 1F1B keeps in flight on the first stage (``min(p, m)``), times
``1 + (p-1)/(p v)`` for the interleaved schedule. The per-tensor accounting of a real layer is
:mod:`paraloom.measure.memory`.
"""

from __future__ import annotations

from .cp_formulas import cp_activation_factor
from .layout import layers_per_stage, params_per_rank
from .moe_formulas import moe_plan
from .spec import CommConfig

__all__ = ["activation_bytes_per_layer", "memory_per_gpu", "moe_extra"]


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, *,
                               sequence_parallel: bool = False, recompute: str = "none",
                               attention: str = "core") -> float:
    """Activation bytes one layer keeps for backward (16-bit activations), Korthikanti et al.
    2022 Table 2: none ``sbh(34 + 5as/h)``; tp ``sbh(10 + 24/t + 5as/(ht))``; tp + sp
    ``sbh(34/t + 5as/(ht))``; selective + tp ``sbh(10 + 24/t)``; selective + tp + sp
    ``sbh(34/t)``; full recomputation ``2sbh`` (only the layer input). ``attention="sdpa"``
    (fused attention) keeps no ``s x s`` tensor: the ``5as/(ht)`` term drops, as with selective
    recomputation (its per-row softmax statistics are O(sb), below this resolution)."""
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh
    attn = 0.0 if recompute == "selective" or attention == "sdpa" else 5 * a * s / (h * t)
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    if sequence_parallel and t > 1:
        return sbh * (34 / t + attn)
    return sbh * (10 + 24 / t + attn)


def moe_extra(c: CommConfig, r: int) -> dict:
    """What MoE adds on pipeline rank ``r`` (:func:`~.moe_formulas.moe_plan`; zeros if dense)."""
    if c.moe is None:
        return {"params": 0, "activation_bytes": 0, "ep_bytes": 0, "ep_ops": 0,
                "expert_params": 0, "edp": c.dp, "total_params": 0}
    return moe_plan(c, r)


def memory_per_gpu(c: CommConfig) -> dict[str, float]:
    """Bytes per GPU of the busiest stage: weights, grads, optimizer, activations, total."""
    stages = {0, min(1, c.pp - 1), c.pp - 1}  # the middle stages are all alike
    extra = {r: moe_extra(c, r) for r in stages}  # MoE: experts, their activations, all-to-all
    per_rank = max(params_per_rank(c, r) + extra[r]["params"] for r in stages)
    opt_bytes = 12 if c.dtype_bytes < 4 else 8
    layer_act = activation_bytes_per_layer(c.seq_len, c.micro_batch, c.hidden, c.heads, c.tp,
                                           sequence_parallel=c.sp, recompute=c.recompute,
                                           attention=c.arch.attention)
    interleave = 1 + (c.pp - 1) / (c.pp * c.v) if c.v > 1 else 1.0
    activations = ((layer_act * c.dtype_bytes / 2 * layers_per_stage(c)
                    + max(e["activation_bytes"] for e in extra.values()))
                   * min(c.pp, c.num_microbatches) * interleave
                   * cp_activation_factor(c.cp))  # cp: each rank holds s/cp tokens
    experts = max(e["expert_params"] for e in extra.values())  # ZeRO shards them over edp
    shards = (c.dp * c.cp // c.instances, max(1, extra[0]["edp"] // c.instances)) \
        if c.distributed_optimizer else (1, 1)  # sharded within one optimizer instance
    # Megatron-FSDP's ZeRO-2 and 3 as paraloom builds them: the full fp32 buffer each backward
    # writes, plus the 1/dp pieces this rank sums over the microbatches
    sharded = (per_rank - experts) / shards[0] + experts / shards[1]
    owned = sharded if c.megatron_fsdp in ("optim_grads", "optim_grads_params") else 0
    # ZeRO-3 keeps its 1/dp pieces besides the gathered parameters, which are all held at
    # once after each optimizer step (Megatron-FSDP gathers every bucket then)
    kept = sharded if c.megatron_fsdp == "optim_grads_params" else 0
    memory = {"weights": (per_rank + kept) * c.dtype_bytes, "grads": (per_rank + owned) * 4,
              "optimizer": ((per_rank - experts) / shards[0] + experts / shards[1]) * opt_bytes,
              "activations": activations}
    memory["total"] = sum(memory.values())
    return memory
