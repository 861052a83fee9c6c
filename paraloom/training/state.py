"""What a checkpoint holds for a run: parameters and optimizer state under global names.

Parameters are saved as ``model.<global name>`` (the tied output copy on the last pipeline stage
has the same name as the input embedding, so it is stored once). Adam moments (and fp32 master
copies of bf16 parameters) are saved per parameter as ``optim.<global name>.exp_avg`` etc., split
over tp like their parameter. The distributed optimizer keeps only a ``1/dp`` shard of each
bucket, so its moments are all-gathered over dp before saving and re-sliced after loading: the
file is the same whichever optimizer or layout wrote it.

The vocabulary tables (word embeddings, an untied output layer) carry ``vocab_rows``: their
padding follows tp, and a load under another tp keeps the real rows (:class:`Entry`).

A parameter split with ``partition_stride = k > 1`` (SwiGLU's fc1: ``[gate_r; up_r]`` on rank
``r``) is saved as ``[k, n/k, ...]`` split on dim 1, so the file holds ``[gate; up]`` whatever tp
wrote it.
"""

from __future__ import annotations

import torch

from .. import comm
from ..data_parallel import DistributedOptimizer
from .checkpoint import Entry

__all__ = ["state_entries"]


def _pdim(param) -> int | None:
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None


def _entry(tensor: torch.Tensor, param) -> Entry:
    """``tensor`` (shaped like ``param``) as a checkpoint entry, strided splits unfolded."""
    stride, dim = getattr(param, "partition_stride", 1), _pdim(param)
    if dim is None or stride == 1:
        return Entry(tensor, dim, getattr(param, "vocab_rows", None))
    shape = tensor.shape
    return Entry(tensor.view(*shape[:dim], stride, shape[dim] // stride, *shape[dim + 1:]),
                 dim + 1)


def state_entries(run, *, for_save: bool):
    """``(entries, finish)``: the tensors to save or fill, and a function to call after a load."""
    entries: dict[str, Entry] = {}
    for chunk in run.chunks:
        for name, p in chunk.named_parameters():
            entries[f"model.{name}"] = _entry(p.data, p)
    finishers = []
    for ddp, opt in zip(run.ddps, run.optimizers, strict=True):
        names = dict(ddp.named_main_params())
        if isinstance(opt, DistributedOptimizer):
            finishers.append(_zero_entries(ddp, opt, entries, for_save))
            continue
        for (param, master, exp_avg, exp_avg_sq, fp32), name in zip(opt.groups, names, strict=True):
            states = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
            if not fp32:
                states["master"] = master
            for key, tensor in states.items():
                entries[f"optim.{name}.{key}"] = _entry(tensor, param)

    def finish(meta: dict) -> None:
        for fn in finishers:
            fn()
        for ddp in run.ddps:  # Megatron-FSDP's ZeRO-3 keeps its pieces apart
            getattr(ddp, "after_load", lambda: None)()
        for opt in run.optimizers:
            opt.step_count = int(meta["optimizer_steps"])
    return entries, finish


def _zero_entries(ddp, opt, entries: dict, for_save: bool):
    """Per-parameter views of whole-bucket moment tensors (gathered over dp for a save)."""
    fulls = []
    for bucket, lo, hi, master, exp_avg, exp_avg_sq, copy in opt.shards:
        dp = bucket.axis  # mesh.dp, or mesh.edp for experts
        states = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        if copy:
            states["master"] = master
        for key, shard in states.items():
            if for_save:
                full = comm.all_gather(shard, dp, phase="setup", kind="dp",
                                       site="checkpoint:gather_optimizer_shards")
            else:
                full = torch.zeros(bucket.numel, dtype=shard.dtype, device=shard.device)
            fulls.append((full, shard, lo, hi))
            for name, param in zip(bucket.names, bucket.params, strict=True):
                _, a, b = ddp.param_range(param)
                entries[f"optim.{name}.{key}"] = _entry(full[a:b].view(param.shape), param)

    def finish() -> None:
        for full, shard, lo, hi in fulls:
            shard.copy_(full[lo:hi])
    return finish
