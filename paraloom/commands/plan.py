"""``paraloom plan``: memory, communication, bubble and FLOPs per GPU for any model and cluster,
and the predicted step time on ``--gpu`` hardware (:mod:`paraloom.analysis.plan`).

``plan`` reads the very flags of ``paraloom train`` (their Megatron-LM aliases and the
Megatron-LM arguments ``train`` accepts, with its defaults): the run is the
:class:`~paraloom.config.TrainConfig` ``train`` would run, and the formulas see it through the
one view (:func:`~paraloom.analysis.view.comm_view`). ``--gpus N`` is the world, as torchrun's or
``--nprocs`` is for ``train``: the layout is then Megatron-LM's (tp, pp, cp default to 1, dp is
the rest). ``--table`` prints one rank's step-1 communication order instead
(:mod:`paraloom.analysis.order`). ``--search`` ranks the layouts that fit (:mod:`.plan_search`),
``--calibrate`` measures this machine (:mod:`.plan_calibrate`), ``--explain-error ROW`` sets a
published run against the prediction (:mod:`.plan_explain_error`)::

    paraloom plan --gpus 1024 --num-layers 96 --hidden-size 12288 --num-attention-heads 96 \\
        --seq-length 2048 --max-position-embeddings 2048 --vocab-size 51200 \\
        --global-batch-size 1536 --micro-batch-size 1 --tensor-model-parallel-size 8 \\
        --pipeline-model-parallel-size 16 --bf16 --sequence-parallel \\
        --recompute-granularity selective --use-distributed-optimizer --gpu h100-sxm
    paraloom plan RUN_FOLDER --gpu h100-sxm     # the run a folder holds (:mod:`.plan_run`)
"""

from __future__ import annotations

import argparse
import json
import sys

from ..analysis.order import step_one_events
from ..analysis.plan import human_bytes, plan, render_plan
from ..analysis.search import memory_fit
from ..analysis.steptime import Options, render_step_time, step_time
from ..analysis.view import comm_view
from ..config import TrainConfig
from ..device import default_backend
from ..report.table import render_table
from . import plan_calibrate, plan_explain_error, plan_run, plan_search
from .hardware_flags import add_hardware_args, hardware_from_args
from .megatron_lm_flags import megatron_lm_spellings
from .megatron_lm_refused import not_built
from .train_flags import add_train_flags, config_from_args

__all__ = ["main", "parser", "config_of"]


def parser() -> argparse.ArgumentParser:
    """``paraloom train``'s flags, the world (``--gpus``), the hardware and the outputs."""
    ap = argparse.ArgumentParser(prog="paraloom plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_flags(ap)
    g = ap.add_argument_group("plan")
    g.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="the world (as --nprocs or torchrun's for train): the layout is then "
                        "Megatron-LM's, tp, pp and cp 1 unless given and dp = N / (tp*pp*cp); "
                        "without it, train's default layout")
    g.add_argument("--json", action="store_true", help="print the plan as JSON")
    g.add_argument("--table", action="store_true",
                   help="print rank --rank's communication order in step 1 instead: the rows "
                        "`paraloom table RUN --step 1` shows for this run, derived from the "
                        "layout alone, at any size")
    g.add_argument("--rank", type=int, default=0, help="the rank of --table (default 0)")
    g.add_argument("--format", choices=("md", "csv", "json"), default="md",
                   help="--table as Markdown (default), CSV or JSON rows")
    g.add_argument("--lang", choices=("en", "zh"), default="en", help="--table's language")
    g.add_argument("--require-fit", action="store_true",
                   help="exit 1 when the layout does not fit the GPU's memory (for scripts; "
                        "the verdict line is printed either way)")
    g.add_argument("--search", action="store_true",
                   help="rank every layout of --gpus N that fits memory (see --search --help)")
    g.add_argument("--calibrate", action="store_true",
                   help="measure this machine's GEMM rate and gloo alpha/beta (--calibrate "
                        "--help)")
    g.add_argument("--explain-error", metavar="ROW", default=None,
                   help="a published Megatron run (or `all`) next to the model's prediction, "
                        "part by part (--explain-error all --help)")
    add_hardware_args(ap)
    return ap


def config_of(args: argparse.Namespace, typed: list[str]) -> TrainConfig:
    """The run ``paraloom train`` would make of the same flags, in a world of ``--gpus``
    (``ValueError`` naming what train would refuse, or a world the layout does not fill)."""
    gpus = args.gpus
    if gpus is not None:
        if gpus < 1:
            raise ValueError(f"--gpus must be >= 1, got {gpus}")
        if args.nprocs is not None and args.nprocs != gpus:
            raise ValueError(f"--gpus {gpus} and --nprocs {args.nprocs} both give the world: "
                             f"give one")
        args.nprocs = gpus
    args.megatron_lm_spelt = megatron_lm_spellings(parser(), typed)
    try:
        cfg, _ = config_from_args(args)
    except ValueError as err:
        raise ValueError(f"paraloom train would refuse this run: {err}") from None
    world, p = args.nprocs, cfg.parallel
    if world is not None and world != p.world_size:
        raise ValueError(f"--gpus {world} does not match tp*cp*pp*dp = {p.tp}*{p.cp}*{p.pp}*"
                         f"{p.dp} = {p.world_size}")
    return cfg


def _defaults_note(cfg: TrainConfig, args: argparse.Namespace) -> str:
    """What the plan took from train's defaults that matters at scale, and the padding."""
    m, typed = cfg.model, vars(args)
    vocab = "given" if "model.vocab_size" in typed or cfg.data.tokenizer else \
        "paraloom train's default, bytes; --vocab-size 50257 is GPT-2's BPE"
    parts = [f"vocabulary {m.vocab_size} ({vocab})"
             + (f", padded to {cfg.padded_vocab_size} rows (a multiple of "
                f"{m.make_vocab_size_divisible_by} x tp {cfg.parallel.tp}, as Megatron-LM pads it)"
                if cfg.padded_vocab_size != m.vocab_size else "")]
    if "dtype" not in typed and cfg.dtype == "fp32":
        parts.append("fp32 (train's default; --dtype bf16, or Megatron-LM's --bf16, for bf16)")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: print the plan and the predicted step time (``--json`` for machines); exit 2
    naming a bad value. ``--search`` and ``--calibrate`` are their own commands."""
    typed = sys.argv[1:] if argv is None else argv
    if not_built(typed):  # a Megatron-LM feature paraloom does not have
        print(f"paraloom plan: error: {not_built(typed)}", file=sys.stderr)
        return 2
    if "--search" in typed:
        return plan_search.main(typed)
    if "--calibrate" in typed:
        return plan_calibrate.main(typed)
    if any(t == "--explain-error" or t.startswith("--explain-error=") for t in typed):
        return plan_explain_error.main(typed)
    try:
        if plan_run.is_run_folder(typed):
            cfg, hw, args, note = plan_run.from_run_folder(typed)
        else:
            args = parser().parse_args(typed)
            cfg = config_of(args, typed)
            hw, note = hardware_from_args(args), _defaults_note(cfg, args)
    except ValueError as err:
        print(f"paraloom plan: error: {err}", file=sys.stderr)
        return 2
    config = comm_view(cfg)
    if args.table:
        return _table(cfg, config, args)
    result = plan(config)
    result["step_time"] = step_time(config, hw, Options(
        overlap_param_gather=config.overlap_param_gather))
    result["hardware"] = hw.to_dict()
    fit = result["memory_fit"] = memory_fit(config, hw)
    result["config"] = cfg.to_dict()
    code = 1 if args.require_fit and not fit["fits"] else 0
    if args.json:
        print(json.dumps(result, indent=2))
        return code
    print(render_plan(config, result) + "\n" + _verdict(fit, hw) + "\n" + note + "\n"
          + render_step_time(result["step_time"]))
    return code


def _table(cfg: TrainConfig, config, args: argparse.Namespace) -> int:
    """``--table``: the rank's step-1 order (:mod:`paraloom.analysis.order`); p2p as this
    machine's backend runs it (gloo: the overlapped plan unless switched off)."""
    world = cfg.parallel.world_size
    try:
        if not 0 <= args.rank < world:
            raise ValueError(f"--rank {args.rank}: the layout has ranks 0-{world - 1}")
        overlap = cfg.overlap_p2p_comm if cfg.overlap_p2p_comm is not None else \
            default_backend() == "gloo"
        events = step_one_events(cfg, config, args.rank, overlap_p2p=overlap)
    except ValueError as err:
        print(f"paraloom plan: error: {err}", file=sys.stderr)
        return 2
    text = render_table(events, rank=args.rank, step=1, lang=args.lang, fmt=args.format)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def _verdict(fit: dict, hw) -> str:
    """One line: fits or not, by how much, and what to change."""
    need, budget = fit["need_bytes"], fit["budget_bytes"]
    where = f"{human_bytes(budget)} usable of the {hw.name}'s {human_bytes(hw.hbm_bytes)}"
    if fit["fits"]:
        return f"verdict: fits ({human_bytes(need)} of {where}; {need / budget:.0%})"
    return (f"verdict: does NOT fit: {human_bytes(need)} needed, {where} ({need / budget:.1f}x "
            f"too much); try " + "; ".join(fit["advice"]))
