"""What Megatron-LM's ``train_step`` and its loop agree on after the optimizer step.

* :func:`agree` — ``logical_and_across_model_parallel_group`` (the update flag, int32 MIN) and
  ``reduce_max_stat_across_model_parallel_group`` (the gradient norm, and with
  ``--log-num-zeros-in-grad`` the zero count, fp32 MAX) over the model-parallel group;
* :func:`reduce_loss` — on the last stage the loss ``[sum, tokens]`` summed over dp x cp;
* :func:`params_norm` — ``--log-params-norm``: Megatron-LM's ``calc_params_l2_norm`` after the
  step. Each parameter counts once (not the tensor-parallel duplicates, not the last stage's tied
  embedding); in bf16 its fp32 main copy, which the distributed optimizer holds as this rank's
  shard. Megatron sums four squared norms over the data-parallel groups whatever the model
  (the dense shards' and its generalized-tensor-parallel shards' over dp x cp, the experts' two
  over the expert-data-parallel group: zero where nothing is sharded), then the dense and expert
  parts over the model-parallel group — one all-reduce when the expert model-parallel group is
  the same ranks (ep = 1), else one each. All fp32 ``[1]``.
"""

from __future__ import annotations

import math

import torch

from .. import comm
from ..data_parallel.clip_grads import counts_once

__all__ = ["agree", "reduce_loss", "params_norm"]


def agree(run, ok: bool, grad_norm: float, zeros: int | None = None) -> tuple:
    """``(ok, grad_norm, zeros)`` agreed over the model-parallel group (``zeros``: None
    without ``--log-num-zeros-in-grad``)."""
    device, mp = run.device, run.mesh.mp
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    comm.all_reduce(flag, mp, op="min", phase="optimizer", kind="mp",
                    site="train_step:update_successful", split="whether this rank updated")
    stats = [("grad_norm", "the gradient norm", grad_norm)]
    if zeros is not None:
        stats.append(("num_zeros", "the count of zero gradients", float(zeros)))
    out = []
    for tag, split, value in stats:
        t = torch.tensor([value], dtype=torch.float32, device=device)
        comm.all_reduce(t, mp, op="max", phase="optimizer", kind="mp", site=f"train_step:{tag}",
                        split=split)
        out.append(t.item())
    return bool(flag.item()), out[0], (int(out[1]) if zeros is not None else None)


def reduce_loss(run, losses: list) -> float | None:
    """The step's loss per token on the last stage (``None`` elsewhere): the microbatches'
    ``[sum, count]`` summed, then over dp x cp (kind ``dp``)."""
    if not run.mesh.is_last_stage:
        return None
    total = torch.stack(losses).sum(0)                   # fp32 [2]
    comm.all_reduce(total, run.mesh.dp_cp, phase="optimizer", kind="dp",
                    site="train_step:loss", split="loss sum and token count")
    return (total[0] / total[1]).item()


def _pieces(run) -> dict[str, list[torch.Tensor]]:
    """The parameter values each part of the norm takes on this rank."""
    mesh, bf16 = run.mesh, run.cfg.dtype == "bf16"
    parts: dict[str, list] = {"dense": [], "dense_sharded": [], "moe": [], "moe_sharded": []}
    if bf16 and run.cfg.distributed_optimizer:  # the fp32 main shards: the stretches the
        # gradient norm counts (GradNorm's, sharded), read in the masters
        masters = {id(b): (lo, master) for opt in run.optimizers for b, lo, _, master, *_ in
                   opt.shards}
        for key, pieces in (("dense_sharded", run.grad_norm.pieces),
                            ("moe_sharded", run.grad_norm.expert_pieces)):
            for bucket, a, b in pieces:
                lo, master = masters[id(bucket)]
                parts[key].append(master[a - lo:b - lo])
        return parts
    for ddp, opt in zip(run.ddps, run.optimizers, strict=True):
        masters = {id(g[0]): g[1] for g in getattr(opt, "groups", ())} if bf16 else {}
        for bucket in ddp.buckets:
            for param in bucket.params:
                if counts_once(param, mesh):
                    parts["moe" if bucket.expert else "dense"].append(
                        masters.get(id(param), param.data))
    return parts


def _sq(values: list[torch.Tensor], device) -> torch.Tensor:
    if not values:
        return torch.zeros(1, dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(v.float()) for v in values])
    return norms.double().square().sum().float().view(1)


@torch.no_grad()
def params_norm(run) -> float:
    """The L2 norm of the whole model's parameters, reduced as Megatron-LM reduces it."""
    mesh, device = run.mesh, run.device
    parts = {k: _sq(v, device) for k, v in _pieces(run).items()}
    gtp, moe_gtp = (torch.zeros(1, dtype=torch.float32, device=device) for _ in range(2))
    for value, axis, kind in ((parts["dense_sharded"], mesh.dp_cp, "dp"), (gtp, mesh.dp_cp, "dp"),
                              (parts["moe_sharded"], mesh.edp, "edp"), (moe_gtp, mesh.edp, "edp")):
        comm.all_reduce(value, axis, phase="optimizer", kind=kind,
                        site="calc_params_l2_norm:sharded_norm",
                        split="squared norm of this rank's parameter shards")
    dense = parts["dense"] + parts["dense_sharded"] + gtp
    moe = parts["moe"] + parts["moe_sharded"] + moe_gtp
    norm = dict(phase="optimizer", site="calc_params_l2_norm:model_parallel",
                split="squared parameter norm of this rank's model part")
    if list(mesh.mp.ranks) == list(mesh.tp_ep_pp.ranks):
        dense += moe
        comm.all_reduce(dense, mesh.mp, kind="mp", **norm)
    else:
        comm.all_reduce(dense, mesh.mp, kind="mp", **norm)
        comm.all_reduce(moe, mesh.tp_ep_pp, kind="tp_ep_pp", **norm)
        dense += moe
    return math.sqrt(dense.item())
