"""``paraloom eval``: the loss of a checkpoint (paraloom or Hugging Face GPT-2) on held-out text,
under any layout.

The model's shape comes from the checkpoint; the layout (``--tp --pp --dp ...``) is free, since
checkpoints are stored under global names. Prints one JSON line on rank 0::

    paraloom eval --resume runs/latest --tp 2  # {"loss": 2.71, "tokens": 16384, "windows": 512}
    paraloom eval --hf gpt2-folder --tp 2 --pp 2       # a Hugging Face GPT-2 checkpoint ("step": 0)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

__all__ = ["eval_main"]


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
                   help="heldout: the last 5%% of the tokens (never trained on); all: the file")
    p.add_argument("--batches", type=int, default=8, help="global batches to evaluate")
    p.add_argument("--tp", "--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pp", "--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--dp", "--data-parallel-size", type=int, default=1)
    p.add_argument("--vpp", "--virtual-pipeline-model-parallel-size", type=int, default=None)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=int, default=1,
                   help="expert-parallel size for an MoE checkpoint (must divide --dp)")
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--timeout", dest="timeout_s", type=float, default=120.0)
    from ..commands.arch_flags import add_architecture_flags
    add_architecture_flags(p)  # only --attention may differ from the checkpoint's model
    from .command import add_cp_flags
    add_cp_flags(p)
    return p


def _config(args):
    from ..commands.arch_flags import apply_architecture
    from ..config import ModelConfig
    from .checkpoint import find_checkpoint
    if args.batches < 1:
        raise ValueError(f"--batches must be a positive integer, got {args.batches}")
    if args.hf is not None:
        from ..models.hf import check_hf_checkpoint, model_config_from_hf, read_hf_config
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
    flag = "--tokenizer"
    if args.tokenizer is None and meta["config"].get("tokenizer"):  # the run's own tokenizer
        args.tokenizer = meta["config"]["tokenizer"]
        flag = "the checkpoint's --tokenizer"
    saved = meta["config"]
    if args.data is None and args.data_path is None and (saved.get("data")
                                                          or saved.get("data_path")):
        # the run's own text: its held-out 5 % is what training never saw
        args.data, args.data_path = saved.get("data"), saved.get("data_path")
        print(f"paraloom eval: note: scoring the run's own data, "
              f"{'--data' if args.data else '--data-path'} "
              f"{args.data or args.data_path!r} (from the checkpoint); give --data or "
              f"--data-path for another", file=sys.stderr)
    _check_vocab(args, model.vocab_size, f"--resume {str(ckpt)!r} has a vocabulary of", flag)
    return _train_config(args, model, ckpt), ckpt


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
    from ..data.tokenizer import load_tokenizer
    tokens = load_tokenizer(args.tokenizer, flag).vocab_size
    if vocab_size < tokens:
        raise ValueError(f"{what} {vocab_size}, but --tokenizer {args.tokenizer!r} has "
                         f"{tokens} tokens")


def _train_config(args, model, ckpt):
    from ..commands.layout_flags import check_layout_flags
    from ..config import ParallelConfig, TrainConfig
    vpp = args.vpp if args.vpp and args.vpp > 1 else None
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, dp=args.dp, vpp=vpp,
                              sequence_parallel=args.sequence_parallel, cp=args.cp,
                              cp_comm_type=args.cp_comm_type, ep=args.ep)
    check_layout_flags(model, parallel, shape_from=f"--hf {args.hf!r}" if args.hf else
                       "the checkpoint")
    schedule = "none" if args.pp == 1 else "interleaved" if vpp else "1f1b"
    return TrainConfig(model=model, parallel=parallel, global_batch_size=args.global_batch_size,
                       micro_batch_size=args.micro_batch_size, schedule=schedule, data=args.data,
                       resume=None if ckpt is None else str(ckpt), timeout_s=args.timeout_s,
                       tokenizer=args.tokenizer, data_path=args.data_path)


def _rank(rank, world, cfg, ckpt, split, batches, hf=None) -> None:
    import torch.distributed as dist

    from ..launch import tune_allocator
    tune_allocator()

    from ..mesh import ParallelMesh
    from .checkpoint import load_checkpoint
    from .data import Corpus, eval_batches, load_tokens
    from .state import state_entries
    from .train import build, evaluate
    mesh = ParallelMesh(cfg.parallel)
    corpus = Corpus(load_tokens(cfg.data, cfg.data_path, cfg.tokenizer), cfg.model.seq_length,
                    cfg.seed)
    run = build(cfg, mesh, corpus, init_from_hf=hf)
    meta = {"step": 0}
    if hf is None:
        entries = {k: e for k, e in state_entries(run, for_save=False)[0].items()
                   if k.startswith("model.")}  # parameters only: no optimizer state needed
        meta = load_checkpoint(ckpt, entries, mesh)
    start = 0 if split == "all" else None
    chosen = eval_batches(corpus, cfg.global_batch_size, batches, start=start)
    loss = evaluate(run, chosen)
    if dist.get_rank() == 0:
        # a short evaluated part repeats windows: "tokens" counts scored positions, "windows"
        # the distinct ones, so a 65-byte file does not read as thousands of tokens of text
        distinct = len({tuple(row.tolist()) for tokens, _ in chosen for row in tokens})
        tokens = batches * cfg.global_batch_size * cfg.model.seq_length
        print(json.dumps({"loss": loss, "tokens": tokens, "windows": distinct,
                          "checkpoint": str(ckpt or hf), "step": meta["step"], "split": split}),
              flush=True)


def eval_main(argv) -> int:
    from .. import launch
    args = _parser().parse_args(argv)
    try:
        cfg, ckpt = _config(args)
        from .data import check_data
        for note in check_data(cfg.data, cfg.model.seq_length, args.split,
                               data_path=cfg.data_path, tokenizer=cfg.tokenizer):
            print(f"paraloom eval: note: {note}", file=sys.stderr)
    except ImportError as err:
        print(f"paraloom eval: error: --hf needs safetensors ({err}): pip install "
              f"'paraloom[hf]'", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as err:
        print(f"paraloom eval: error: {err}", file=sys.stderr)
        return 2
    world = cfg.parallel.world_size
    threads = max(1, (os.cpu_count() or 1) // world)
    try:
        launch.spawn(_rank, world, replace(cfg, steps=1), ckpt, args.split, args.batches,
                     args.hf, timeout_s=cfg.timeout_s, threads=threads)
    except RuntimeError as err:
        print(f"paraloom eval: {err}", file=sys.stderr)
        return 1
    return 0
