"""``paraloom eval``: the loss of a checkpoint (paraloom or Hugging Face GPT-2 / Llama) on held-out
text, under any layout.

The model's shape comes from the checkpoint; the layout (``--tp --pp --dp ...``) is free, since
checkpoints are stored under global names. Prints one JSON line on rank 0::

    paraloom eval --resume runs/latest --tp 2  # {"loss": 2.71, "tokens": 16384, "windows": 512}
    paraloom eval --hf gpt2-folder --tp 2 --pp 2       # a Hugging Face GPT-2 checkpoint ("step": 0)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from .. import launch
from ..config import (
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
    default_schedule,
)
from ..data import check_data
from ..data.tokenizer import load_tokenizer
from ..models.hf import check_hf_checkpoint, model_config_from_hf, read_hf_config
from ..training.checkpoint import find_checkpoint
from ..training.evaluate import evaluate_rank
from ..training.loop import EVAL_BATCHES
from .arch_flags import add_architecture_flags, apply_architecture
from .flags import add_flags, given
from .layout_flags import check_layout_flags
from .train_flags import absolute, hf_tokenizer

__all__ = ["main"]

_BASE = TrainConfig(parallel=ParallelConfig(), global_batch_size=8, micro_batch_size=1)
"""What ``eval`` starts from: one rank, small batches."""
_LAYOUT = ("parallel.tp", "parallel.pp", "parallel.dp", "parallel.vpp",
           "parallel.sequence_parallel", "parallel.ep", "parallel.cp", "parallel.cp_comm_type",
           "parallel.cp_sizes")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paraloom eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--resume", "--load", dest="resume", help="run folder or checkpoint folder")
    which.add_argument("--hf", metavar="DIR",
                       help="a local Hugging Face GPT-2 or Llama checkpoint folder")
    p.add_argument("--seq-len", "--seq-length", dest="seq_len", type=int, default=None,
                   help="with --hf: tokens per sample (default: its n_positions)")
    p.add_argument("--data", dest="data", default=None,
                   help="text file (default: with --resume, the run's own --data or "
                        "--data-path; else the bundled corpus)")
    p.add_argument("--data-path", dest="data_path", metavar="PREFIX", default=None,
                   help="a Megatron indexed dataset PREFIX.bin + PREFIX.idx; needs a tokenizer")
    p.add_argument("--tokenizer", "--tokenizer-model", dest="tokenizer", metavar="DIR",
                   default=None, help="a local Hugging Face tokenizer folder (default: the "
                   "checkpoint's run's, else bytes)")
    p.add_argument("--split", choices=["heldout", "all"], default="heldout",
                   help="heldout: the part never trained on (the last 5%% of the tokens, or "
                        "the validation part of the run's --split A,B,C); all: the file")
    p.add_argument("--batches", type=int, default=None,
                   help="global batches to evaluate (default: with --resume, what train scored "
                        "as its held-out loss, 2 global batches of the run's size, so the loss "
                        "is the one train printed; with --hf, 8)")
    add_flags(p.add_argument_group("layout"), _LAYOUT, _BASE)
    add_flags(p, ("global_batch_size", "micro_batch_size", "run.timeout_s"), _BASE)
    add_architecture_flags(p)  # only --attention may differ from the checkpoint's model
    return p


def _check_vocab(args, vocab_size: int, what: str, flag: str = "--tokenizer") -> None:
    """The model's vocabulary must hold the tokenizer's (bytes: 256)."""
    if args.data_path is not None and args.tokenizer is None:
        raise ValueError(f"--data-path {args.data_path!r} needs --tokenizer DIR (the tokenizer "
                         f"that made it)")
    if args.tokenizer is None:
        if vocab_size < 256:
            raise ValueError(f"{what} {vocab_size}, but the data are bytes (a vocabulary of at "
                             f"least 256 is needed); give its --tokenizer")
        return
    tokens = load_tokenizer(args.tokenizer, flag).vocab_size
    if vocab_size < tokens:
        raise ValueError(f"{what} {vocab_size}, but --tokenizer {args.tokenizer!r} has "
                         f"{tokens} tokens")


def _config(args) -> tuple[TrainConfig, object]:
    """The configuration to evaluate with, and the checkpoint (``None`` for ``--hf``)."""
    if args.batches is not None and args.batches < 1:
        raise ValueError(f"--batches must be a positive integer, got {args.batches}")
    if args.hf is not None:
        args.batches = args.batches or 8
        if args.tokenizer is None and hf_tokenizer(args.hf):
            args.tokenizer = args.hf
            print(f"paraloom eval: note: --hf {args.hf!r} holds its tokenizer (tokenizer.json): "
                  f"the data are read as its tokens (give --tokenizer for another)",
                  file=sys.stderr)
        model = model_config_from_hf(read_hf_config(args.hf), seq_length=args.seq_len)
        _check_vocab(args, model.vocab_size, f"--hf {args.hf!r}: vocab_size =")
        check_hf_checkpoint(args.hf, model)
        return _train_config(args, apply_architecture(model, args, f"--hf {args.hf!r}"),
                             None), None
    if args.seq_len is not None:
        raise ValueError("--seq-len is only for --hf (a checkpoint has its own)")
    ckpt, meta = find_checkpoint(args.resume)
    model = ModelConfig(**{**meta["config"]["model"], "dropout": 0.0})
    model = apply_architecture(model, args, "the checkpoint")
    run = TrainConfig.from_dict(meta["config"])
    saved = run.data
    flag = "--tokenizer"
    if args.tokenizer is None and saved.tokenizer:  # the run's own tokenizer
        args.tokenizer, flag = saved.tokenizer, "the checkpoint's --tokenizer"
    if args.data is None and args.data_path is None:
        # the run's own data: its held-out part (its --split's, else the last 5 %) is what
        # training never saw
        args.run_split = saved.split
        if saved.file or saved.data_path:
            args.data, args.data_path = saved.file, saved.data_path
            print(f"paraloom eval: note: scoring the run's own data, "
                  f"{'--data' if args.data else '--data-path'} "
                  f"{args.data or args.data_path!r} (from the checkpoint); give --data or "
                  f"--data-path for another", file=sys.stderr)
    _check_vocab(args, model.vocab_size, f"--resume {str(ckpt)!r} has a vocabulary of", flag)
    batch = {} if "global_batch_size" in given(args) else {
        "global_batch_size": run.global_batch_size,
        **({} if "micro_batch_size" in given(args) else {
            "micro_batch_size": run.micro_batch_size})}
    if args.batches is None:
        args.batches = EVAL_BATCHES
        if batch:
            print(f"paraloom eval: note: {EVAL_BATCHES} global batches of "
                  f"{run.global_batch_size} windows, as train scored its held-out loss (give "
                  f"--batches, --global-batch-size for more)", file=sys.stderr)
    return _train_config(args, model, ckpt, batch), ckpt


def _train_config(args, model: ModelConfig, ckpt, batch: dict | None = None) -> TrainConfig:
    values = {**(batch or {}), **given(args)}
    parallel = dataclasses.replace(_BASE.parallel, **{
        k[len("parallel."):]: v for k, v in values.items() if k.startswith("parallel.")})
    check_layout_flags(model, parallel, shape_from=f"--hf {args.hf!r}" if args.hf else
                       "the checkpoint")
    return dataclasses.replace(
        _BASE, model=model, parallel=parallel,
        global_batch_size=values.get("global_batch_size", _BASE.global_batch_size),
        micro_batch_size=values.get("micro_batch_size", _BASE.micro_batch_size), steps=1,
        schedule=default_schedule(parallel.pp, parallel.vpp),
        data=DataConfig(file=absolute(args.data), data_path=absolute(args.data_path),
                        tokenizer=absolute(args.tokenizer),
                        split=getattr(args, "run_split", None)),
        run=RunConfig(resume=None if ckpt is None else str(ckpt), save_every=0,
                      timeout_s=values.get("run.timeout_s", _BASE.run.timeout_s)))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg, ckpt = _config(args)
        d = cfg.data
        for note in check_data(d.file, cfg.model.seq_length, args.split,
                               data_path=d.data_path, tokenizer=d.tokenizer, split=d.split):
            print(f"paraloom eval: note: {note}", file=sys.stderr)
    except ImportError as err:
        print(f"paraloom eval: error: --hf needs safetensors ({err}): pip install "
              f"'paraloom[hf]'", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as err:
        print(f"paraloom eval: error: {err}", file=sys.stderr)
        return 2
    world = cfg.parallel.world_size
    try:
        launch.spawn(evaluate_rank, world, cfg, ckpt, args.split, args.batches, args.hf,
                     timeout_s=cfg.run.timeout_s, threads=launch.local_threads(world))
    except RuntimeError as err:
        print(f"paraloom eval: {err}", file=sys.stderr)
        return 1
    return 0
