"""Megatron-LM's training arguments that ``paraloom train`` takes beside its own flags.

A Megatron-LM command line (``pretrain_gpt.py``'s arguments) is read as it is: the model, layout,
batch and optimizer arguments are paraloom's flags' Megatron aliases (``--num-layers``,
``--tensor-model-parallel-size``, ``--train-iters``, ...); the ones here have no paraloom field:

* :data:`KERNEL_FLAGS` select a CUDA kernel, a fusion, where weights are initialised, how data
  are loaded or memory handled; they do not change what is communicated (nor, here, what is
  computed), so they are accepted and named in one note.
* ``--mock-data``: Megatron-LM's synthetic tokens; paraloom trains on its bundled corpus (also
  deterministic, also no download). ``--tokenizer-type NullTokenizer`` with ``--vocab-size N``:
  token ids without a tokenizer, paraloom's byte-level data with vocabulary N; another
  tokenizer type is refused (``--tokenizer DIR`` takes a Hugging Face folder).
* ``--max-position-embeddings`` must equal ``--seq-length`` (paraloom's learned position table
  has one row per position of a sample), ``--attention-dropout`` the hidden dropout (one
  dropout), ``--distributed-backend`` the backend of the device (gloo on CPU, NCCL on CUDA).
* ``--bf16`` is ``--dtype bf16``; ``--fp16`` is refused (no loss scaling here).
  ``--distributed-timeout-minutes N`` is ``--timeout`` of ``60 N`` seconds; ``--kv-channels``
  must be the head size paraloom has (hidden / heads), ``--rotary-percent`` 1.0.
* Features paraloom does not have are refused by name (:mod:`.megatron_lm_refused`).
* ``--eval-iters`` / ``--eval-interval``: paraloom evaluates the held-out loss before and after
  training (no periodic evaluation); accepted and noted.

:func:`layout_from_world`: given a world (torchrun's ``WORLD_SIZE`` or ``--nprocs``), the layout
is Megatron-LM's: tensor, pipeline and context sizes default to 1 and the data-parallel size is
the world divided by ``tp * pp * cp``. Without a world, paraloom's own default layout stands.

:func:`megatron_lm_spellings`: a command line that spells a flag as Megatron-LM does (an alias
such as ``--train-iters`` or ``--tensor-model-parallel-size``, or an argument of this module)
is Megatron-LM's, and :data:`MEGATRON_LM_DEFAULTS` replace paraloom's own defaults where these
differ in what is communicated (README, "Defaults"), so the run communicates as Megatron-LM's
does with the same command line; a flag given says otherwise.
"""

from __future__ import annotations

import argparse

__all__ = ["KERNEL_FLAGS", "add_megatron_lm_flags", "check_megatron_lm", "megatron_lm_notes",
           "megatron_lm_dtype", "megatron_lm_timeout",
           "layout_from_world", "megatron_lm_spellings", "MEGATRON_LM_DEFAULTS",
           "megatron_lm_defaults"]

KERNEL_FLAGS = {
    "--transformer-impl": "the layer implementation (Transformer Engine or local)",
    "--attention-backend": "the attention kernel",
    "--no-bias-gelu-fusion": "a fused kernel", "--bias-gelu-fusion": "a fused kernel",
    "--no-bias-dropout-fusion": "a fused kernel", "--bias-dropout-fusion": "a fused kernel",
    "--no-masked-softmax-fusion": "a fused kernel", "--masked-softmax-fusion": "a fused kernel",
    "--no-bias-swiglu-fusion": "a fused kernel", "--no-persist-layer-norm": "a fused kernel",
    "--no-rope-fusion": "a fused kernel", "--apply-rope-fusion": "a fused kernel",
    "--use-flash-attn": "the attention kernel", "--use-cpu-initialization": "initialisation",
    "--no-async-tensor-model-parallel-allreduce": None,
    "--attention-softmax-in-fp32": "the softmax's precision (torch's bf16 softmax computes in "
                                   "fp32 already: the same probabilities, bit for bit)",
    "--use-mcore-models": "Megatron-Core's model classes (paraloom's are built as those)",
    "--manual-gc": "when Python collects garbage",
    "--empty-unused-memory-level": "when CUDA's cached memory is released",
    "--data-cache-path": "where dataset indices are cached",
    "--no-mmap-bin-files": "how dataset files are read",
    "--num-workers": "data-loader worker processes",
    "--no-create-attention-mask-in-dataloader": "the data loader's attention masks",
    "--tiktoken-pattern": "the tiktoken tokenizer's pattern",
    "--log-throughput": "a line of the log",
    "--ckpt-format": "Megatron's checkpoint format (paraloom writes its own checkpoints)",
}
"""Accepted Megatron-LM switches that change no communication (value: what they select)."""
_VALUED = ("--transformer-impl", "--attention-backend", "--empty-unused-memory-level",
           "--data-cache-path", "--num-workers", "--tiktoken-pattern", "--ckpt-format")
_DEST = "megatron_lm__"


def add_megatron_lm_flags(parser: argparse.ArgumentParser) -> None:
    """The Megatron-LM arguments of this module, in their own help group."""
    group = parser.add_argument_group(
        "Megatron-LM arguments (accepted so its command line runs as it is)")
    for flag, what in KERNEL_FLAGS.items():
        if what is None:
            continue
        dest = f"{_DEST}{flag[2:]}"
        if flag in _VALUED:
            group.add_argument(flag, dest=dest, metavar="X", default=argparse.SUPPRESS,
                               help=f"selects {what}: no change to communication")
        else:
            group.add_argument(flag, dest=dest, action="store_true", default=argparse.SUPPRESS,
                               help=f"selects {what}: no change to communication")
    value = dict(default=argparse.SUPPRESS)
    group.add_argument("--mock-data", dest=f"{_DEST}mock-data", action="store_true",
                       help="Megatron-LM's synthetic data: paraloom trains on its bundled corpus",
                       **value)
    group.add_argument("--tokenizer-type", dest=f"{_DEST}tokenizer-type", metavar="TYPE",
                       help="NullTokenizer (token ids, vocabulary --vocab-size) only", **value)
    group.add_argument("--max-position-embeddings", dest=f"{_DEST}max-position-embeddings",
                       type=int, metavar="N", help="must equal --seq-length", **value)
    group.add_argument("--attention-dropout", dest=f"{_DEST}attention-dropout", type=float,
                       metavar="P", help="must equal --hidden-dropout (one dropout)", **value)
    group.add_argument("--distributed-backend", dest=f"{_DEST}distributed-backend",
                       choices=("gloo", "nccl"), help="must be the device's (gloo on CPU, "
                       "nccl on CUDA)", **value)
    group.add_argument("--bf16", dest=f"{_DEST}bf16", action="store_true",
                       help="bf16 parameters and activations: --dtype bf16", **value)
    group.add_argument("--fp16", dest=f"{_DEST}fp16", action="store_true",
                       help="refused: fp16 with loss scaling is not implemented (use --bf16)",
                       **value)
    group.add_argument("--kv-channels", dest=f"{_DEST}kv-channels", type=int, metavar="N",
                       help="must equal --hidden-size / --num-attention-heads", **value)
    group.add_argument("--rotary-percent", dest=f"{_DEST}rotary-percent", type=float,
                       metavar="P", help="must be 1.0 (every channel rotated)", **value)
    group.add_argument("--cross-entropy-fusion-impl", dest=f"{_DEST}ce-impl",
                       choices=("native", "te"), help="native (--cross-entropy-loss-fusion's)",
                       **value)
    group.add_argument("--distributed-timeout-minutes", dest=f"{_DEST}distributed-timeout",
                       type=float, metavar="N", help="--timeout in minutes", **value)
    for flag in ("--eval-iters", "--eval-interval"):
        group.add_argument(flag, dest=f"{_DEST}{flag[2:]}", type=int, metavar="N",
                           help="accepted: paraloom evaluates before and after training",
                           **value)


def _given(args: argparse.Namespace) -> dict:
    return {k[len(_DEST):]: v for k, v in vars(args).items() if k.startswith(_DEST)}


def megatron_lm_dtype(args: argparse.Namespace, values: dict) -> None:
    """``--bf16`` as ``--dtype bf16`` in ``values`` (the flags typed, by dotted path);
    ``ValueError`` for ``--fp16`` or a ``--dtype`` that says otherwise."""
    got = _given(args)
    if got.get("fp16"):
        raise ValueError("--fp16: fp16 training (with its loss scaling) is not implemented; "
                         "give --bf16 (or --dtype bf16)")
    if not got.get("bf16"):
        return
    if values.get("dtype", "bf16") != "bf16":
        raise ValueError(f"--bf16 contradicts --dtype {values['dtype']}: give one of them")
    values["dtype"] = "bf16"


def megatron_lm_timeout(args: argparse.Namespace, values: dict) -> None:
    """``--distributed-timeout-minutes N`` as ``--timeout`` of ``60 N`` seconds in ``values``;
    ``ValueError`` when ``--timeout`` says otherwise."""
    minutes = _given(args).get("distributed-timeout")
    if minutes is None:
        return
    if "run.timeout_s" in values and values["run.timeout_s"] != 60 * minutes:
        raise ValueError(f"--distributed-timeout-minutes {minutes:g} contradicts --timeout "
                         f"{values['run.timeout_s']:g} (seconds): give one of them")
    values["run.timeout_s"] = 60.0 * minutes


def check_megatron_lm(args: argparse.Namespace, model: dict, backend: str) -> None:
    """``ValueError`` naming the value when a Megatron-LM argument asks for what paraloom does
    not do (``model``: the model settings as they will be built)."""
    got = _given(args)
    kind = got.get("tokenizer-type")
    if kind is not None and kind != "NullTokenizer":
        raise ValueError(f"--tokenizer-type {kind}: paraloom takes NullTokenizer (token ids, "
                         f"--vocab-size N) or a Hugging Face tokenizer folder (--tokenizer DIR)")
    positions = got.get("max-position-embeddings")
    if positions is not None and model.get("position_embedding_type") == "learned_absolute" \
            and positions != model["seq_length"]:
        raise ValueError(f"--max-position-embeddings {positions} must equal --seq-length "
                         f"{model['seq_length']}: paraloom's learned position table has one "
                         f"row per position of a sample")
    channels, heads = got.get("kv-channels"), model.get("num_attention_heads")
    if channels is not None and heads and channels * heads != model.get("hidden_size"):
        raise ValueError(f"--kv-channels {channels}: paraloom's attention heads have "
                         f"--hidden-size / --num-attention-heads = {model.get('hidden_size')} "
                         f"/ {heads} channels; give that or leave it out")
    if got.get("ce-impl") == "te":
        raise ValueError("--cross-entropy-fusion-impl te: Megatron-LM refuses it (Transformer "
                         "Engine's fused cross entropy is disabled there); give native")
    rotary = got.get("rotary-percent")
    if rotary is not None and rotary != 1.0:
        raise ValueError(f"--rotary-percent {rotary:g}: partial rotary embeddings are not "
                         f"built (every channel of a head is rotated): give 1.0")
    dropout = got.get("attention-dropout")
    if dropout is not None and dropout != model.get("dropout", 0.0):
        raise ValueError(f"--attention-dropout {dropout:g} differs from --hidden-dropout "
                         f"{model.get('dropout', 0.0):g}: paraloom has one dropout; give both "
                         f"the same value")
    wanted = got.get("distributed-backend")
    if wanted is not None and wanted != backend:
        raise ValueError(f"--distributed-backend {wanted}: this machine's ranks use {backend} "
                         f"(gloo on CPU, nccl on CUDA)")


def megatron_lm_notes(args: argparse.Namespace) -> list[str]:
    """One line per kind of accepted Megatron-LM argument that paraloom does not act on."""
    got, notes = _given(args), []
    kernels = [f"--{k}" + (f" {v}" if not isinstance(v, bool) else "") for k, v in got.items()
               if f"--{k}" in KERNEL_FLAGS]
    if kernels:
        notes.append(f"{', '.join(kernels)}: select{'s' if len(kernels) == 1 else ''} "
                     f"kernels, initialisation, data loading, logging or memory handling, not "
                     f"communication: accepted, no effect here")
    if got.get("mock-data"):
        notes.append("--mock-data: training on the bundled corpus (deterministic, no download) "
                     "instead of Megatron-LM's synthetic tokens")
    evals = [f"--{k} {got[k]}" for k in ("eval-iters", "eval-interval") if k in got]
    if evals:
        notes.append(f"{', '.join(evals)}: paraloom evaluates the held-out loss before and "
                     f"after training, not periodically")
    return notes


def layout_from_world(parallel: dict, values: dict, world: int | None) -> None:
    """Megatron-LM's layout for a world of ``world`` ranks: ``tp``, ``pp``, ``cp`` default to 1
    and ``dp`` is ``world / (tp * pp * cp)`` when not given (``parallel``: the settings, changed
    in place; ``values``: the flags typed)."""
    if world is None:
        return
    for size in ("tp", "pp", "cp"):
        if f"parallel.{size}" not in values:
            parallel[size] = 1
    if "parallel.dp" not in values:
        model_parallel = parallel["tp"] * parallel["pp"] * parallel.get("cp", 1)
        if model_parallel > 0 and world % model_parallel == 0:
            parallel["dp"] = world // model_parallel


def _megatron_lm_overlap(settings: dict, backend: str) -> bool:
    """Megatron-LM's ``overlap_p2p_comm``: on, and used by the interleaved schedule only (1F1B
    has blocking batches); on CUDA paraloom runs interleaving with blocking batches (its
    overlapped p2p is for gloo)."""
    vpp = settings.get("parallel", {}).get("vpp")
    return vpp is not None and vpp > 1 and backend == "gloo"


MEGATRON_LM_DEFAULTS = {
    "overlap_grad_reduce": (lambda settings, backend: False,
                            "gradients reduced after backward (--overlap-grad-reduce: during it)"),
    "overlap_p2p_comm": (_megatron_lm_overlap,
                         "pipeline p2p as Megatron-LM: blocking batches, and with interleaving "
                         "overlapped (--no-overlap-p2p-communication: blocking)"),
    "run.ledger_steps": (lambda settings, backend: -1,
                         "every step in the ledger, as paraloom record (--ledger-steps N)"),
    "model.moe_aux_loss_coeff": (
        lambda settings, backend: 0.0 if settings.get("model", {}).get("num_experts") else None,
        "no MoE load-balancing loss (--moe-aux-loss-coeff)"),
    "optim.megatron_lr_schedule": (lambda settings, backend: True,
                                   "steps counted as Megatron-LM's scheduler"),
    "optim.weight_decay": (lambda settings, backend: 0.01, "weight decay 0.01 (--weight-decay)"),
    "optim.adam_beta2": (lambda settings, backend: 0.999, "Adam beta2 0.999 (--adam-beta2)"),
    "optim.lr_decay_style": (lambda settings, backend: "linear",
                             "linear learning-rate decay (--lr-decay-style)"),
    "optim.min_lr": (lambda settings, backend: 0.0, "decay to 0 (--min-lr)"),
    "optim.warmup_steps": (lambda settings, backend: None if settings.get("optim", {}).get(
        "warmup_fraction") is not None else 0, "no warm-up (--lr-warmup-iters)"),
}
"""Megatron-LM's defaults where paraloom's own differ: setting -> (its value for the settings
and backend of the run, or ``None`` where it does not apply; what it means, said only when it
applied: a value the command line gave is not listed)."""
_NOT_MEGATRON = {"nprocs"}  # torchrun's spellings


def megatron_lm_spellings(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The flags of ``argv`` spelt Megatron-LM's way, in order: a flag's Megatron-LM alias (its
    option strings after the first, paraloom's own), or an argument of this module."""
    spelt = set()
    for action in parser._actions:
        longs = [o for o in action.option_strings
                 if o.startswith("--") and not o.startswith("--no-")]
        if action.dest.startswith(_DEST):
            spelt.update(longs)
        elif action.dest not in _NOT_MEGATRON:
            spelt.update(longs[1:])
    found = []
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag in spelt and flag not in found:
            found.append(flag)
    return found


def megatron_lm_defaults(settings: dict, values: dict, backend: str) -> list[str]:
    """Apply :data:`MEGATRON_LM_DEFAULTS` to ``settings`` (in place) where the flag was not
    given (``values``); returns what each applied one means."""
    applied = []
    for path, (value, what) in MEGATRON_LM_DEFAULTS.items():
        if path in values:
            continue
        chosen = value(settings, backend)
        if chosen is None:  # does not apply to this run
            continue
        *parents, name = path.split(".")
        target = settings
        for part in parents:
            target = target.setdefault(part, {})
        target[name] = chosen
        applied.append(what)
    return applied
