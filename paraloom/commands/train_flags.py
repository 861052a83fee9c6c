"""``paraloom train``'s flags and the :class:`~paraloom.config.TrainConfig` they give.

Every flag comes from a configuration field (:mod:`.flags`) and has its Megatron-LM long name as
an alias (``--tensor-model-parallel-size`` for ``--tp``, ``--train-iters`` for ``--steps``, ...).
A new run starts from ``TrainConfig()`` (the defaults shown in ``--help``); ``--resume RUN``
starts from the checkpoint's own configuration (:mod:`.resume`); ``--init-from-hf DIR`` takes the
model's shape from a Hugging Face folder; ``--tokenizer DIR`` the vocabulary size from the
tokenizer. Then the typed flags are applied, and the result is validated before any rank starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from ..config import ModelConfig, ParallelConfig, TrainConfig
from ..config.train import migrate
from ..data.tokenizer import load_tokenizer
from ..device import default_backend
from ..launch import under_torchrun
from ..models.hf import check_hf_checkpoint, model_config_from_hf, read_hf_config
from .arch_flags import add_architecture_flags, apply_architecture, preset
from .flags import add_flags, apply, flag_name, fresh, given
from .layout_flags import check_layout_flags
from .megatron_lm_flags import (
    add_megatron_lm_flags,
    check_megatron_lm,
    layout_from_world,
    megatron_lm_defaults,
    megatron_lm_dtype,
    megatron_lm_timeout,
)
from .resume import Resumed, resume_base

__all__ = ["add_train_flags", "config_from_args", "absolute", "hf_tokenizer", "GROUPS"]

GROUPS = {
    "layout": ("parallel.tp", "parallel.pp", "parallel.dp", "parallel.vpp", "parallel.cp",
               "parallel.cp_comm_type", "parallel.cp_sizes", "parallel.ep",
               "parallel.sequence_parallel",
               "parallel.async_grad_allreduce", "parallel.gradient_accumulation_fusion",
               "schedule", "overlap_grad_reduce", "align_grad_reduce", "overlap_p2p_comm",
               "distributed_optimizer", "num_distributed_optimizer_instances",
               "overlap_param_gather", "align_param_gather",
               "overlap_param_gather_with_optimizer_step",
               "use_megatron_fsdp", "data_parallel_sharding_strategy",
               "megatron_fsdp_main_grads_dtype", "bucket_size",
               "bucket_tail_splits", "megatron_lm_loop", "rerun_mode"),
    "batch and steps": ("global_batch_size", "micro_batch_size", "steps", "seed", "dtype",
                        "recompute", "calculate_per_token_loss"),
    "model shape": ("model.seq_length", "model.num_layers", "model.hidden_size",
                    "model.num_attention_heads", "model.ffn_hidden_size", "model.vocab_size",
                    "model.make_vocab_size_divisible_by", "model.dropout", "model.init_std",
                    "model.cross_entropy_loss_fusion"),
    "optimizer": ("optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.warmup_fraction",
                  "optim.warmup_init", "optim.decay_steps", "optim.lr_decay_style",
                  "optim.megatron_lr_schedule", "optim.weight_decay", "optim.clip_grad",
                  "optim.adam_beta1", "optim.adam_beta2", "optim.adam_eps"),
    "data": ("data.file", "data.data_path", "data.tokenizer", "data.split"),
    "run": ("run.out", "run.save_every", "run.resume", "run.init_from_hf", "run.ledger_steps",
            "run.timeout_s", "run.hang_after", "run.max_bad_steps", "run.tensorboard_dir",
            "run.log_interval", "run.tensorboard_log_interval", "run.exit_duration_mins",
            "run.log_params_norm", "run.log_num_zeros_in_grad"),
    "mixture of experts (Megatron's flags)": (
        "model.num_experts", "model.moe_router_topk", "model.moe_aux_loss_coeff",
        "model.moe_z_loss_coeff", "model.moe_expert_capacity_factor",
        "model.moe_token_drop_policy", "model.moe_pad_expert_input_to_capacity",
        "model.moe_layer_freq", "model.moe_shared_expert_intermediate_size",
        "model.moe_shared_expert_gate", "model.moe_shared_expert_overlap",
        "model.moe_token_dispatcher_type", "model.moe_grouped_gemm"),
}
"""The flag groups of ``paraloom train --help`` (architecture flags: :mod:`.arch_flags`)."""

_SHOWN = {"schedule": "none with pp 1, interleaved with vpp > 1, else 1f1b"}
_PATHS = ("data.file", "data.data_path", "data.tokenizer", "run.init_from_hf")
"""Input paths, stored absolute: ``--resume``, ``eval`` and ``export-hf`` find them from any
working folder."""


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """Every ``paraloom train`` flag, in groups."""
    base = TrainConfig()
    for title, paths in GROUPS.items():
        add_flags(parser.add_argument_group(title), paths, base, defaults=_SHOWN)
    parser.add_argument("--num-layers-per-virtual-stage",
                        "--num-layers-per-virtual-pipeline-stage",
                        dest="layers_per_virtual_stage", type=int, default=None, metavar="N",
                        help="Megatron-LM's way to ask for interleaving: N layers per virtual "
                             "stage, so vpp = layers / (pp * N)")
    parser.add_argument("--nprocs", "--nproc", "--nproc-per-node", dest="nprocs", type=int,
                        default=None,
                        help="local ranks to start (default: tp*cp*pp*dp); given, it is the "
                             "world, and the layout is Megatron-LM's: tp and pp default to 1, "
                             "dp to the world over tp*pp*cp")
    add_architecture_flags(parser)
    add_megatron_lm_flags(parser)


def hf_tokenizer(folder: str) -> bool:
    """Whether a Hugging Face folder holds its tokenizer (``tokenizer.json``, as ``export-hf``
    writes it): then the model reads that tokenizer's tokens, not bytes."""
    return Path(folder, "tokenizer.json").is_file()


def absolute(path: str | None) -> str | None:
    """``path`` made absolute (``~`` expanded)."""
    return None if path is None else os.path.abspath(os.path.expanduser(path))


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, Resumed | None]:
    """The validated configuration of parsed ``train`` flags, and the checkpoint it resumes;
    ``ValueError`` names every bad value in the user's words."""
    values = {k: (absolute(v) if k in _PATHS else v) for k, v in given(args).items()}
    megatron_lm_dtype(args, values)
    megatron_lm_timeout(args, values)
    resumed = None
    if "run.resume" in values and "run.init_from_hf" not in values:
        base, resumed = resume_base(values)
    else:
        base = fresh()
    settings = apply(base, values)
    if resumed is not None and values.get("use_megatron_fsdp") is False:  # back to Megatron's
        for key in ("data_parallel_sharding_strategy", "megatron_fsdp_main_grads_dtype"):
            if key not in values:  # DDP: Megatron-FSDP's own settings at their defaults
                settings[key] = fresh()[key]
    data = settings["data"]
    if data.get("data_path") is not None and data.get("tokenizer") is None:
        raise ValueError(f"--data-path {data['data_path']!r} needs --tokenizer DIR (the "
                         f"tokenizer that made it: the vocabulary size and end-of-document "
                         f"token come from it)")
    hf = values.get("run.init_from_hf")
    if hf and "data.tokenizer" not in values and hf_tokenizer(hf):
        data["tokenizer"] = hf  # the model's own tokenizer, not the bundled corpus's bytes
    typed = getattr(args, "data.tokenizer", None)  # as typed: what an error names
    tokenizer = typed if typed is not None else data.get("tokenizer")
    vocab = load_tokenizer(tokenizer).vocab_size if tokenizer else None
    if "run.init_from_hf" in values:
        settings["model"] = _hf_model(args, values)
    elif resumed is None:
        settings["model"].update({k: v for k, v in preset(args.arch).items()
                                  if f"model.{k}" not in values})
        if vocab is not None and "model.vocab_size" not in values:
            settings["model"]["vocab_size"] = vocab
    elif args.arch is not None:
        _check_resumed_arch(args.arch, settings["model"], values, resumed)
    _check_arch_pairing(args, settings["model"])
    if resumed is None:  # a resumed run keeps its layout unless flags change it
        layout_from_world(settings["parallel"], values, _world(args))
    check_megatron_lm(args, settings["model"], default_backend())
    _virtual_stages(args, settings, values)
    if resumed is None and getattr(args, "megatron_lm_spelt", None):
        args.megatron_lm_defaults = megatron_lm_defaults(settings, values, default_backend())
    model = ModelConfig(**settings["model"])
    parallel = ParallelConfig(**settings["parallel"])
    check_layout_flags(model, parallel,
                       shape_from="--init-from-hf" if "run.init_from_hf" in values else None)
    _check_vocab(model, vocab, tokenizer, values, resumed)
    return TrainConfig.from_dict(migrate(settings)), resumed


def _check_resumed_arch(arch: str, model: dict, values: dict, resumed) -> None:
    """``--arch`` on a resumed run must name the checkpoint's architecture (the fields typed
    explicitly are compared by the model check); ``ValueError`` naming what differs."""
    clash = [f"{k} = {model.get(k)!r}" for k, v in preset(arch).items()
             if f"model.{k}" not in values and model.get(k) != v]
    if clash:
        raise ValueError(f"--arch {arch} contradicts --resume {str(resumed.ckpt)!r}, which was "
                         f"trained with {', '.join(clash)}; drop --arch (the checkpoint fixes "
                         f"the architecture)")


def _world(args: argparse.Namespace) -> int | None:
    """The world the run is given: torchrun's ``WORLD_SIZE``, else ``--nprocs``, else none."""
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    return getattr(args, "nprocs", None)


def _virtual_stages(args, settings: dict, values: dict) -> None:
    """``--num-layers-per-virtual-pipeline-stage N`` (layers per virtual stage, Megatron-LM's
    meaning) as ``vpp = layers / (pp * N)``; refused when it does not divide or contradicts
    ``--vpp``."""
    per = getattr(args, "layers_per_virtual_stage", None)
    if per is None:
        return
    layers = settings["model"].get("num_layers", ModelConfig().num_layers)
    pp = settings["parallel"].get("pp", 1)
    if per < 1 or layers % (pp * per):
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per}: the {layers} layers "
                         f"over pp = {pp} stages must split into virtual stages of {per} "
                         f"layers (layers must be a multiple of pp * {per} = {pp * per})")
    vpp = layers // (pp * per)
    given_vpp = values.get("parallel.vpp")
    if given_vpp is not None and given_vpp != vpp:
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per} means vpp = {vpp} "
                         f"({layers} layers, pp = {pp}), but --vpp {given_vpp} was given")
    settings["parallel"]["vpp"] = vpp if vpp > 1 else None


def _check_arch_pairing(args, model: dict) -> None:
    if args.group_query_attention and model.get("num_query_groups") is None:
        raise ValueError("--group-query-attention needs --num-query-groups G")
    if "model.num_query_groups" in given(args) and not args.group_query_attention:
        raise ValueError(f"--num-query-groups {model['num_query_groups']} needs "
                         f"--group-query-attention (Megatron's pairing)")


def _check_vocab(model: ModelConfig, vocab: int | None, tokenizer: str | None, values: dict,
                 resumed: Resumed | None) -> None:
    if vocab is None and model.vocab_size < 256:
        raise ValueError(f"--vocab {model.vocab_size}: byte-level data needs a vocabulary of at "
                         f"least 256")
    if vocab is not None and model.vocab_size < vocab and resumed is not None:
        raise ValueError(f"--resume {values['run.resume']!r} holds a model with a vocabulary of "
                         f"{model.vocab_size}, but --tokenizer {tokenizer!r} has {vocab} tokens: "
                         f"a checkpoint keeps its vocabulary; resume with the tokenizer the run "
                         f"was trained with (or none, for a byte-level run)")
    if vocab is not None and model.vocab_size < vocab:
        hf = values.get("run.init_from_hf")
        src = f"--init-from-hf {hf!r} has" if hf else "--vocab"
        raise ValueError(f"{src} {model.vocab_size}: --tokenizer {tokenizer!r} has a "
                         f"vocabulary of {vocab}; leave --vocab out to take the tokenizer's")


_SHAPE = (("model.vocab_size", "vocab_size"), ("model.hidden_size", "hidden_size"),
          ("model.num_layers", "num_layers"), ("model.num_attention_heads",
                                               "num_attention_heads"),
          ("model.ffn_hidden_size", "ffn"))


def _hf_model(args, values: dict) -> dict:
    """The model of ``--init-from-hf DIR``; an explicit shape flag must agree with it."""
    hf = values["run.init_from_hf"]
    if "run.resume" in values:
        raise ValueError("--init-from-hf starts a new run from Hugging Face weights and --resume "
                         "continues a paraloom checkpoint: give one of them")
    try:
        model = model_config_from_hf(read_hf_config(hf), seq_length=values.get(
            "model.seq_length"), dropout=values.get("model.dropout", 0.0))
    except ValueError as err:
        raise ValueError(f"--init-from-hf: {err}") from None
    clash = [f"{flag_name(path)} {values[path]} (the checkpoint has {getattr(model, field)})"
             for path, field in _SHAPE if path in values and values[path] != getattr(model, field)]
    if clash:
        raise ValueError(f"--init-from-hf {hf!r} fixes the model shape; drop or correct: "
                         + ", ".join(clash))
    try:
        check_hf_checkpoint(hf, model)
    except ImportError as err:
        raise ValueError(f"--init-from-hf needs safetensors ({err}): pip install "
                         f"'paraloom[hf]'") from None
    return dataclasses.asdict(apply_architecture(model, args, f"--init-from-hf {hf!r}"))
