"""``paraloom train`` and ``paraloom eval``: flags -> :class:`TrainConfig` -> ranks.

Every flag has its Megatron-LM long name as an alias (``--tensor-model-parallel-size`` for
``--tp``, ``--train-iters`` for ``--steps``, ...). The configuration is validated before any rank
starts; a bad value is reported with what is valid and exit code 2. Without ``torchrun`` the
command forks ``tp * pp * dp`` local gloo ranks; under ``torchrun`` it joins the given world::

    paraloom train                                   # tp=2, pp=2, dp=2 on 8 local ranks
    torchrun --nproc-per-node 4 -m paraloom train --tp 2 --pp 2 --dp 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time

__all__ = ["add_train_parser", "train_main", "config_from_args"]

_DEFAULTS = dict(tp=2, pp=2, dp=2, layers=4, hidden=64, heads=4, seq_len=64, vocab=256,
                 global_batch_size=16, micro_batch_size=2, steps=150, lr=3e-3)
_MIN_LR = 3e-4


def add_train_parser(sub) -> argparse.ArgumentParser:
    cmd = sub.add_parser("train", help="train a GPT (default: the bundled corpus, tp=pp=dp=2)",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = cmd.add_argument
    a("--tp", "--tensor-model-parallel-size", type=int, default=_DEFAULTS["tp"])
    a("--pp", "--pipeline-model-parallel-size", type=int, default=_DEFAULTS["pp"])
    a("--dp", "--data-parallel-size", type=int, default=_DEFAULTS["dp"])
    a("--vpp", "--virtual-pipeline-model-parallel-size", "--num-layers-per-virtual-stage",
      dest="vpp", type=int, default=None, help="virtual stages per pipeline rank (interleaved)")
    a("--sequence-parallel", action="store_true")
    a("--global-batch-size", type=int, default=_DEFAULTS["global_batch_size"])
    a("--micro-batch-size", type=int, default=_DEFAULTS["micro_batch_size"])
    a("--seq-len", "--seq-length", dest="seq_len", type=int, default=None)
    a("--layers", "--num-layers", dest="layers", type=int, default=None)
    a("--hidden", "--hidden-size", dest="hidden", type=int, default=None)
    a("--heads", "--num-attention-heads", dest="heads", type=int, default=None)
    a("--ffn", "--ffn-hidden-size", dest="ffn", type=int, default=None)
    a("--vocab", "--vocab-size", dest="vocab", type=int, default=None)
    a("--init-from-hf", metavar="DIR", default=None,
      help="start from a local Hugging Face GPT-2 or Llama checkpoint folder (config.json + "
           "model.safetensors or pytorch_model.bin); the model shape comes from its config, "
           "--seq-len may shorten it")
    a("--steps", "--train-iters", dest="steps", type=int, default=_DEFAULTS["steps"])
    a("--lr", type=float, default=_DEFAULTS["lr"])
    a("--min-lr", type=float, default=None,
      help=f"the cosine schedule's final learning rate (default: {_MIN_LR:g}, or --lr if lower)")
    a("--warmup-steps", "--lr-warmup-iters", dest="warmup_steps", type=int, default=5)
    a("--weight-decay", type=float, default=0.1,
      help="AdamW weight decay of matrices and embeddings; biases and norm weights get none "
           "(Megatron-Core's rule)")
    a("--clip-grad", type=float, default=1.0)
    a("--seed", type=int, default=1234)
    a("--dropout", "--hidden-dropout", dest="dropout", type=float, default=0.0)
    a("--dtype", choices=["fp32", "bf16"], default="fp32")
    a("--recompute", "--recompute-granularity", dest="recompute",
      choices=["none", "selective", "full"], default="none")
    a("--schedule", choices=["1f1b", "interleaved", "none", "zb-h1"], default=None,
      help="default: none with pp 1, interleaved with vpp > 1, else 1f1b; zb-h1: zero-bubble "
           "1F1B (weight gradients deferred into the bubble; pp >= 2, no vpp)")
    a("--overlap-grad-reduce", action=argparse.BooleanOptionalAction, default=True,
      help="reduce each gradient bucket as soon as it is complete in backward (default: on)")
    a("--overlap-p2p-communication", dest="overlap_p2p_comm",
      action=argparse.BooleanOptionalAction, default=None,
      help="post pipeline sends/receives ahead so they overlap compute (default: on for gloo; "
           "--no-overlap-p2p-communication runs Megatron-Core's blocking batches)")
    a("--distributed-optimizer", "--use-distributed-optimizer", dest="distributed_optimizer",
      action="store_true")
    a("--async-grad-allreduce", "--async-tensor-model-parallel-allreduce",
      dest="async_grad_allreduce", action=argparse.BooleanOptionalAction, default=None,
      help="overlap the column layers' input-gradient all-reduce with their weight-gradient "
           "GEMM (default: on when tp > 1 without --sequence-parallel, as Megatron-Core)")
    a("--grad-accum-fusion", "--gradient-accumulation-fusion", dest="grad_accum_fusion",
      action=argparse.BooleanOptionalAction, default=False,
      help="accumulate weight grads straight into fp32 main_grad (default: off, as "
           "Megatron-Core's config; see README, Defaults)")
    a("--bucket-size", type=int, default=None, help="gradient bucket size in elements")
    a("--data", dest="data", default=None, help="text file (default: bundled)")
    a("--data-path", dest="data_path", metavar="PREFIX", default=None,
      help="a Megatron indexed dataset PREFIX.bin + PREFIX.idx (paraloom preprocess or "
           "Megatron's preprocess_data.py); needs --tokenizer")
    a("--tokenizer", "--tokenizer-model", dest="tokenizer", metavar="DIR", default=None,
      help="a local Hugging Face tokenizer folder (tokenizer.json); the vocabulary size comes "
           "from it (default: bytes, vocabulary 256)")
    a("--out", "--save", dest="out", default="runs/latest", help="run folder")
    a("--save-every", "--save-interval", dest="save_every", type=int, default=50,
      help="checkpoint every N steps and at the end (0: never)")
    a("--resume", "--load", dest="resume", default=None, help="run or checkpoint folder")
    a("--ledger-steps", type=int, default=2, help="steps recorded in the ledger (-1: all)")
    a("--timeout", dest="timeout_s", type=float, default=120.0,
      help="seconds any collective may wait before the run is ended")
    a("--max-bad-steps", type=int, default=3,
      help="stop after this many consecutive NaN/Inf steps (each is skipped)")
    a("--nprocs", "--nproc-per-node", dest="nprocs", type=int, default=None,
      help="local ranks to start (must equal tp*cp*pp*dp; default: tp*cp*pp*dp)")
    # TensorBoard (optional extra: paraloom[tensorboard])
    a("--tensorboard-dir", default=None, metavar="DIR",
      help="write loss, lr, grad norm, tokens/s and per-kind comm bytes as TensorBoard scalars")
    a("--log-interval", type=int, default=1, help="TensorBoard scalars every N steps")
    from ..commands.arch_flags import add_architecture_flags
    add_architecture_flags(cmd)
    add_cp_flags(cmd)
    add_moe_flags(cmd)
    return cmd


def add_cp_flags(cmd) -> None:
    """Context parallelism (``--cp``, ``--cp-comm-type``), shared by train and eval."""
    a = cmd.add_argument
    a("--cp", "--context-parallel-size", dest="cp", type=int, default=1,
      help="ranks sharing each sequence (load-balanced 2*cp chunks; default 1)")
    a("--cp-comm-type", dest="cp_comm_type", choices=["p2p", "all_gather"], default="p2p",
      help="context-parallel attention: p2p (K/V ring, default) or all_gather (one all-gather "
           "of K,V per layer)")


def check_cp_world(cp: int, world: int, where: str) -> None:
    """``ValueError`` when ``cp`` does not divide the ``world`` the launcher gives."""
    if world % cp:
        raise ValueError(f"--cp {cp} does not divide the world of {world} ranks ({where}); "
                         f"choose a --cp that divides {world}")


def add_moe_flags(cmd) -> None:
    """Mixture-of-experts flags (Megatron's names; see paraloom/moe)."""
    a = cmd.add_argument
    a("--num-experts", type=int, default=None, help="experts per MoE layer (default: dense)")
    a("--moe-router-topk", type=int, default=2, help="experts per token (default 2)")
    a("--moe-aux-loss-coeff", type=float, default=1e-2, help="load-balancing loss coefficient")
    a("--moe-z-loss-coeff", type=float, default=None, help="router z-loss coefficient")
    a("--moe-expert-capacity-factor", type=float, default=None,
      help="tokens per expert at most ceil(factor * N * k / E); the rest dropped (default: "
           "dropless)")
    a("--moe-token-drop-policy", choices=["probs", "position"], default="probs")
    a("--moe-pad-expert-input-to-capacity", action="store_true",
      help="with a capacity factor, pad each expert's tokens to the capacity (fixed all-to-all "
           "splits, no count exchange)")
    a("--moe-layer-freq", type=int, default=1, help="every N-th layer is MoE (default 1: all)")
    a("--ep", "--expert-model-parallel-size", dest="ep", type=int, default=1,
      help="expert-parallel size, carved out of --dp (must divide it)")


def moe_fields(args) -> dict:
    """The ModelConfig fields the MoE flags set."""
    return dict(num_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                moe_aux_loss_coeff=args.moe_aux_loss_coeff,
                moe_z_loss_coeff=args.moe_z_loss_coeff,
                moe_expert_capacity_factor=args.moe_expert_capacity_factor,
                moe_token_drop_policy=args.moe_token_drop_policy,
                moe_layer_freq=args.moe_layer_freq,
                moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity)


def config_from_args(args):
    """The validated :class:`TrainConfig` for parsed flags (``ValueError`` names bad values)."""
    from ..config import ModelConfig, ParallelConfig, TrainConfig
    vpp = args.vpp if args.vpp and args.vpp > 1 else None
    schedule = args.schedule or ("none" if args.pp == 1 else "interleaved" if vpp else "1f1b")
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, dp=args.dp, vpp=vpp,
                              sequence_parallel=args.sequence_parallel,
                              async_grad_allreduce=args.async_grad_allreduce,
                              gradient_accumulation_fusion=args.grad_accum_fusion,
                              cp=args.cp, cp_comm_type=args.cp_comm_type, ep=args.ep)
    from ..commands.arch_flags import architecture_from_args
    given = lambda name: _DEFAULTS[name] if getattr(args, name) is None else getattr(args, name)
    vocab = _tokenizer_vocab(args)
    model = _model_config(args) if args.init_from_hf else ModelConfig(
        vocab_size=vocab if args.vocab is None and vocab else given("vocab"),
        hidden_size=given("hidden"), num_layers=given("layers"),
        num_attention_heads=given("heads"), ffn_hidden_size=args.ffn,
        seq_length=given("seq_len"), dropout=args.dropout, **architecture_from_args(args),
        **moe_fields(args))
    from ..commands.layout_flags import check_layout_flags
    check_layout_flags(model, parallel, shape_from="--init-from-hf" if args.init_from_hf else None)
    if vocab is None and model.vocab_size < 256:
        raise ValueError(f"--vocab {model.vocab_size}: byte-level data needs a vocabulary of at "
                         f"least 256")
    if vocab is not None and model.vocab_size < vocab and args.resume is not None:
        raise ValueError(f"--resume {args.resume!r} holds a model with a vocabulary of "
                         f"{model.vocab_size}, but --tokenizer {args.tokenizer!r} has {vocab} "
                         f"tokens: a checkpoint keeps its vocabulary; resume with the tokenizer "
                         f"the run was trained with (or none, for a byte-level run)")
    if vocab is not None and model.vocab_size < vocab:
        src = f"--init-from-hf {args.init_from_hf!r} has" if args.init_from_hf else "--vocab"
        raise ValueError(f"{src} {model.vocab_size}: --tokenizer {args.tokenizer!r} has a "
                         f"vocabulary of {vocab}; leave --vocab out to take the tokenizer's")
    return TrainConfig(model=model, parallel=parallel, global_batch_size=args.global_batch_size,
                       micro_batch_size=args.micro_batch_size, steps=args.steps, lr=args.lr,
                       min_lr=min(_MIN_LR, args.lr) if args.min_lr is None else args.min_lr,
                       warmup_steps=args.warmup_steps,
                       weight_decay=args.weight_decay, clip_grad=args.clip_grad, seed=args.seed,
                       dtype=args.dtype, recompute=args.recompute, schedule=schedule,
                       overlap_grad_reduce=args.overlap_grad_reduce,
                       overlap_p2p_comm=args.overlap_p2p_comm,
                       distributed_optimizer=args.distributed_optimizer,
                       bucket_size=args.bucket_size, data=absolute(args.data), out=args.out,
                       save_every=args.save_every, resume=args.resume,
                       ledger_steps=args.ledger_steps, timeout_s=args.timeout_s,
                       max_bad_steps=args.max_bad_steps,
                       init_from_hf=absolute(args.init_from_hf),
                       tokenizer=absolute(args.tokenizer), data_path=absolute(args.data_path),
                       tensorboard_dir=args.tensorboard_dir, log_interval=args.log_interval)


def absolute(path: str | None) -> str | None:
    """``path`` made absolute: the run's config and checkpoints name its inputs so that
    ``--resume``, ``eval --resume`` and ``export-hf`` find them from any working folder."""
    return None if path is None else os.path.abspath(os.path.expanduser(path))


def _tokenizer_vocab(args) -> int | None:
    """The vocabulary size of ``--tokenizer`` (``None`` for bytes); ``ValueError`` for a bad
    folder, and for ``--data-path`` without a tokenizer."""
    if args.data is not None and args.data_path is not None:
        raise ValueError(f"--data {args.data!r} (a text file) and --data-path "
                         f"{args.data_path!r} (an indexed dataset) both given: give one")
    if args.tokenizer is None:
        if args.data_path is not None:
            raise ValueError(f"--data-path {args.data_path!r} needs --tokenizer DIR (the "
                             f"tokenizer that made it: the vocabulary size and end-of-document "
                             f"token come from it)")
        return None
    from ..data.tokenizer import load_tokenizer
    return load_tokenizer(args.tokenizer).vocab_size


def _model_config(args):
    """The shape of ``--init-from-hf DIR``; an explicit shape flag must agree with it."""
    from ..models.hf import model_config_from_hf, read_hf_config
    if args.resume is not None:
        raise ValueError("--init-from-hf starts a new run from Hugging Face weights and --resume "
                         "continues a paraloom checkpoint: give one of them")
    try:
        model = model_config_from_hf(read_hf_config(args.init_from_hf), seq_length=args.seq_len,
                                     dropout=args.dropout)
    except ValueError as err:
        raise ValueError(f"--init-from-hf: {err}") from None
    flags = (("--vocab", args.vocab, model.vocab_size), ("--hidden", args.hidden,
             model.hidden_size), ("--layers", args.layers, model.num_layers),
             ("--heads", args.heads, model.num_attention_heads), ("--ffn", args.ffn, model.ffn))
    clash = [f"{flag} {mine} (the checkpoint has {theirs})" for flag, mine, theirs in flags
             if mine is not None and mine != theirs]
    if clash:
        raise ValueError(f"--init-from-hf {args.init_from_hf!r} fixes the model shape; drop or "
                         f"correct: " + ", ".join(clash))
    try:
        from ..models.hf import check_hf_checkpoint
        check_hf_checkpoint(args.init_from_hf, model)
        from ..commands.arch_flags import apply_architecture
        model = apply_architecture(model, args, f"--init-from-hf {args.init_from_hf!r}")
    except ImportError as err:
        raise ValueError(f"--init-from-hf needs safetensors ({err}): pip install "
                         f"'paraloom[hf]'") from None
    return model


def _check_out(out: str) -> None:
    """The run folder must be a folder this process can create (nothing is created here: a
    refused run leaves no folder) and write."""
    from pathlib import Path
    path = Path(out).absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out!r} exists and is not a folder; give a run folder")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"--out {out!r} cannot be created: {str(existing)!r} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out!r} cannot be written: {str(existing)!r} is not writable")


def _check_inputs(cfg) -> None:
    from .checkpoint import find_checkpoint
    from .data import check_data
    _check_out(cfg.out)
    for note in check_data(cfg.data, cfg.model.seq_length, "train", data_path=cfg.data_path,
                           tokenizer=cfg.tokenizer):  # not in 8 ranks later
        print(f"paraloom train: note: {note}", file=sys.stderr)
    if cfg.resume is not None:
        ckpt, meta = find_checkpoint(cfg.resume)
        import dataclasses
        saved, now = meta["config"]["model"], dataclasses.asdict(cfg.model)
        diff = {k: (saved.get(k), v) for k, v in now.items()
                if k != "dropout" and saved.get(k) != v}
        if diff:
            raise ValueError(f"--resume {str(ckpt)!r} holds a different model: " + ", ".join(
                f"{k} = {a} in the checkpoint, {b} here" for k, (a, b) in diff.items()))
        if meta["config"].get("dtype", "fp32") != cfg.dtype:
            raise ValueError(
                f"--resume {str(ckpt)!r} was trained with --dtype {meta['config'].get('dtype')} "
                f"and --dtype {cfg.dtype} is given here: its optimizer state does not convert "
                f"(bf16 keeps fp32 master weights, fp32 has none); resume with --dtype "
                f"{meta['config'].get('dtype')}")
        if int(meta["step"]) >= cfg.steps:
            raise ValueError(f"--resume {str(ckpt)!r} is at step {meta['step']} and the run has "
                             f"--steps {cfg.steps}: nothing left to train; give --steps larger "
                             f"than {meta['step']} to extend it")
    if cfg.log_interval < 1:
        raise ValueError(f"--log-interval must be a positive integer, got {cfg.log_interval}")
    if cfg.tensorboard_dir is not None:
        from .tensorboard import check_tensorboard
        check_tensorboard()
    if cfg.parallel.sequence_parallel and cfg.parallel.tp == 1:
        print("paraloom train: note: --sequence-parallel has no effect with tp = 1 (nothing is "
              "split); running without it", file=sys.stderr)
    if cfg.dtype == "bf16":
        import torch
        if not torch.ones(1, dtype=torch.bfloat16).matmul(torch.ones(1, 1, dtype=torch.bfloat16)
                                                          ).isfinite().all():
            raise ValueError("--dtype bf16 is not supported by this PyTorch build")


def _rank(rank: int, world: int, cfg, t0: float, init_from_hf: str | None = None) -> None:
    from .loop import run_rank
    summary = run_rank(cfg, t0, init_from_hf)
    if summary is not None:
        _report(cfg, summary)


def _report(cfg, summary: dict) -> None:
    from pathlib import Path
    out = Path(cfg.out)
    ledger = out / "ledger.jsonl"
    if ledger.is_file():
        from ..ledger import load
        from ..report.table import render_table
        print("\nCommunication order, rank 0, first recorded step (layers folded; the full "
              "table is comm_table.md):\n" + render_table(load(ledger), rank=0, group=True))
    print(f"held-out loss: {summary['held_out_loss_before']:.4f} before -> "
          f"{summary['held_out_loss_after']:.4f} after {summary['steps']} steps")
    print(f"run folder: {out.resolve()}  (report.html, metrics.jsonl, ledger.jsonl, "
          f"trace.json, comm_table.md, loss.png, config.json, checkpoints/)")


def train_main(args, argv: list[str] | None = None) -> int:
    """Validate, then train on local ranks or in the torchrun world; returns the exit code.
    ``argv``: the ``train`` arguments as typed, which tell an explicit flag from a default
    (``--resume RUN`` takes every other setting from the run's checkpoint)."""
    from .. import launch
    try:
        if args.resume is not None and args.init_from_hf is None:
            from .resume import explicit_dests, resume_args
            for note in resume_args(args, explicit_dests(argv, args)):
                if os.environ.get("RANK", "0") == "0":  # once under torchrun
                    print(f"paraloom train: note: {note}", file=sys.stderr)
        if args.num_experts is None and os.environ.get("RANK", "0") == "0":
            from .resume import explicit_dests
            moe = sorted(d for d in explicit_dests(argv, args) if d.startswith("moe_"))
            if moe:
                print(f"paraloom train: note: {', '.join('--' + d.replace('_', '-') for d in moe)}"
                      f" ha{'s' if len(moe) == 1 else 've'} no effect without --num-experts (the "
                      f"model is dense)", file=sys.stderr)
        cfg = config_from_args(args)
        if not launch.under_torchrun():  # under torchrun every rank checks what it can read
            _check_inputs(cfg)
        world = cfg.parallel.world_size
        c = cfg.parallel
        layout = f"tp*cp*pp*dp = {c.tp}*{c.cp}*{c.pp}*{c.dp} = {world}"
        if launch.under_torchrun():
            if cfg.overlap_p2p_comm and c.pp > 1 and launch.default_backend() == "nccl":
                raise ValueError(
                    "--overlap-p2p-communication is for gloo (CPU); under torchrun with CUDA the "
                    "ranks use NCCL, which runs a pair of stages' sends and receives in the order "
                    "they were posted, so a receive posted ahead would wait for a peer that waits "
                    "on its send. Leave the flag out (off on CUDA) or pass "
                    "--no-overlap-p2p-communication")
            check_cp_world(c.cp, int(os.environ["WORLD_SIZE"]), "torchrun's WORLD_SIZE")
            if int(os.environ["WORLD_SIZE"]) != world:
                raise ValueError(f"torchrun started WORLD_SIZE = {os.environ['WORLD_SIZE']} "
                                 f"ranks but {layout}")
        elif args.nprocs is not None:
            check_cp_world(c.cp, args.nprocs, "--nprocs")
            if args.nprocs != world:
                raise ValueError(f"--nprocs {args.nprocs} does not match {layout}")
    except ValueError as err:
        if launch.under_torchrun():  # the other ranks may see no problem: tell them, not hang
            from .nodes import refuse_under_torchrun
            return refuse_under_torchrun("paraloom train", str(err), args.timeout_s)
        print(f"paraloom train: error: {err}", file=sys.stderr)
        return 2
    if launch.under_torchrun():
        from .nodes import run_under_torchrun
        return run_under_torchrun(
            "paraloom train", cfg.timeout_s, lambda: _check_inputs(cfg),
            lambda: _rank(int(os.environ["RANK"]), world, cfg, _shared_t0(), args.init_from_hf),
            resume=cfg.resume)
    threads = max(1, (os.cpu_count() or 1) // world)
    try:
        launch.spawn(_rank, world, cfg, time.time(), args.init_from_hf, timeout_s=cfg.timeout_s,
                     threads=threads)
    except RuntimeError as err:
        print(f"paraloom train: {err}", file=sys.stderr)
        return 1
    return 0


def _shared_t0() -> float:
    """Rank 0's clock, broadcast, so every rank's ledger times share one origin."""
    import torch
    import torch.distributed as dist

    from .. import comm
    from ..mesh import Axis
    world = Axis("world", tuple(range(dist.get_world_size())), dist.get_rank(), dist.group.WORLD)
    from ..launch import get_device
    t = torch.tensor([time.time()], dtype=torch.float64, device=get_device())  # NCCL: on GPU
    comm.broadcast(t, world, src=0, phase="setup", kind="world", site="train:clock")
    return float(t.item())
