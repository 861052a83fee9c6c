"""What a run reads, checked before it trains: the run folder, the data, the checkpoint it
resumes, the optional packages it needs.

Without torchrun this runs once, before any rank starts; under torchrun every rank runs it (each
rank reads its own files) and the ranks agree on the outcome (:mod:`.multinode`). Problems are
``ValueError`` naming the value and what would be valid; what is worth telling but not wrong
comes back as notes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..config import ModelConfig, TrainConfig
from ..data import check_data
from ..run_folder import check_out
from .checkpoint import find_checkpoint
from .tensorboard import check_tensorboard

__all__ = ["check_inputs", "check_resumable"]


HOW_NOT_WHAT = ("dropout", "init_std", "moe_grouped_gemm", "moe_token_dispatcher_type",
                "moe_shared_expert_overlap", "moe_pad_expert_input_to_capacity",
                "cross_entropy_loss_fusion")
"""Model fields that change how the same model is computed or communicated, not the model
(or only how it started: ``init_std``): a checkpoint resumes under other values (each trains
what one process trains either way)."""


def check_resumable(cfg: TrainConfig) -> None:
    """``cfg.run.resume`` holds the same model and dtype as ``cfg``, before its last step."""
    ckpt, meta = find_checkpoint(cfg.run.resume)
    saved_model = ModelConfig(**meta["config"]["model"])
    saved, now = dataclasses.asdict(saved_model), dataclasses.asdict(cfg.model)
    diff = {k: (saved[k], v) for k, v in now.items()
            if k not in HOW_NOT_WHAT and saved[k] != v}
    if diff:
        raise ValueError(f"--resume {str(ckpt)!r} holds a different model: " + ", ".join(
            f"{k} = {a} in the checkpoint, {b} here" for k, (a, b) in diff.items()))
    dtype = meta["config"].get("dtype", "fp32")
    if dtype != cfg.dtype:
        raise ValueError(
            f"--resume {str(ckpt)!r} was trained with --dtype {dtype} and --dtype {cfg.dtype} is "
            f"given here: its optimizer state does not convert (bf16 keeps fp32 master weights, "
            f"fp32 has none); resume with --dtype {dtype}")
    if int(meta["step"]) >= cfg.steps:
        raise ValueError(f"--resume {str(ckpt)!r} is after step {meta['step']} and the run has "
                         f"--steps {cfg.steps}: nothing left to train; give --steps larger "
                         f"than {meta['step']} to extend it")


def check_inputs(cfg: TrainConfig) -> list[str]:
    """Everything ``cfg`` reads or writes that can be checked without ranks; returns notes."""
    check_out(cfg.run.out)
    notes = check_data(cfg.data.file, cfg.model.seq_length, "train", data_path=cfg.data.data_path,
                       tokenizer=cfg.data.tokenizer, split=cfg.data.split)
    if cfg.run.resume is not None:
        check_resumable(cfg)
    if cfg.run.tensorboard_dir is not None:
        board = Path(cfg.run.tensorboard_dir).expanduser()
        if board.exists() and not board.is_dir():
            raise ValueError(f"--tensorboard-dir {cfg.run.tensorboard_dir!r} is a file: give a "
                             f"folder (created if it does not exist)")
        check_tensorboard()
    if cfg.parallel.sequence_parallel and not cfg.parallel.uses_sequence_parallel:
        notes.append("--sequence-parallel has no effect with tp = 1 (nothing is split); running "
                     "without it")
    if cfg.parallel.cp == 1 and cfg.parallel.cp_comm_type != "p2p":
        notes.append(f"--cp-comm-type {cfg.parallel.cp_comm_type} has no effect with cp = 1 "
                     f"(attention is not split over context ranks)")
    if cfg.model.moe_shared_expert_overlap and not cfg.model.moe_shared_expert_intermediate_size:
        notes.append("--moe-shared-expert-overlap has no effect without a shared expert "
                     "(--moe-shared-expert-intermediate-size)")
    if cfg.parallel.cp_sizes and cfg.parallel.cp_comm_type != "a2a+p2p":
        notes.append(f"--hierarchical-context-parallel-sizes has no effect with --cp-comm-type "
                     f"{cfg.parallel.cp_comm_type} (only a2a+p2p uses the levels)")
    if cfg.parallel.cp > 1 and cfg.model.attention == "sdpa" \
            and cfg.parallel.cp_comm_type != "a2a":  # Ulysses runs the model's own kernel
        notes.append(f"--attention sdpa has no effect with cp = {cfg.parallel.cp}: context-"
                     f"parallel attention ({cfg.parallel.cp_comm_type}) computes each block with "
                     f"its own kernel")
    if cfg.dtype == "bf16":
        one = torch.ones(1, dtype=torch.bfloat16)
        if not one.matmul(torch.ones(1, 1, dtype=torch.bfloat16)).isfinite().all():
            raise ValueError("--dtype bf16 is not supported by this PyTorch build")
    return notes
