"""Recorded ledger vs the analytical model: per ``(kind, op, phase)`` counts and bytes, exactly.

:func:`compare` tallies one rank's events the way :func:`~paraloom.analysis.formulas.expected_comm`
keys its numbers (compute spans and ``setup`` operations are not part of a step; an event with
``recompute: true`` is keyed with phase ``recompute``) and returns one diff row per key present
on either side. :func:`check_run` does it for every rank of a run, each against the expectation
of its own pipeline stage. :func:`render_diff` prints the rows as a Markdown table.

    paraloom check RUN_DIR [--step N] [--only-diff]

reads ``RUN_DIR/config.json`` (the run's ``TrainConfig``), derives the :class:`CommConfig`
(:func:`config_from_run`, through :mod:`.view`; the bucket layout is derived from the model's
parameters, see :mod:`paraloom.analysis.layout`; :func:`step_config` reads metrics.jsonl for
the steps that skipped their update or were their process's first), compares every rank of
every recorded step (or ``--step N``) and exits 0 only if every row agrees; 1 naming the
differences; 2 on an unreadable run folder.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from ..analysis.formulas import expected_comm
from ..analysis.moe_splits import check_all_to_all, split_bytes
from ..analysis.spec import CommConfig
from ..analysis.view import view_of_saved
from ..run_folder import CONFIG, LEDGER, METRICS, read_json, read_ledger, read_metrics
from ..training.megatron_lm_loop import logged_iteration

__all__ = ["tally", "compare", "check_run", "render_diff", "all_ok", "config_from_run",
           "load_run", "step_config"]


def _phase(event: dict) -> str:
    return "recompute" if event.get("recompute") else event["phase"]


def tally(events: Iterable[dict], *, rank: int | None = None,
          step: int | None = None) -> dict[tuple[str, str, str], dict]:
    """``{(kind, op, phase): {"count", "bytes"}}`` of the communications in ``events`` (of
    ``rank`` and ``step`` when given)."""
    out: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
    for e in events:
        if e["op"] == "compute" or e["phase"] == "setup":
            continue
        if (rank is not None and e["rank"] != rank) or (step is not None and e["step"] != step):
            continue
        cell = out[e["kind"], e["op"], _phase(e)]
        cell["count"] += 1
        cell["bytes"] += e["bytes"]
    return dict(out)


def compare(expected: dict, events: Iterable[dict], *, rank: int = 0,
            step: int | None = None) -> list[dict]:
    """One row per key in the expectation or the record: expected and recorded count and bytes,
    and ``ok`` when both agree exactly. Rows are sorted by kind, phase, op."""
    recorded = tally(events, rank=rank, step=step)
    rows = []
    zero = {"count": 0, "bytes": 0}
    for key in sorted(set(expected) | set(recorded), key=lambda k: (k[0], k[2], k[1])):
        exp, rec = expected.get(key, zero), recorded.get(key, zero)
        rows.append({"rank": rank, "kind": key[0], "op": key[1], "phase": key[2],
                     "expected_count": exp["count"], "recorded_count": rec["count"],
                     "expected_bytes": exp["bytes"], "recorded_bytes": rec["bytes"],
                     "ok": exp["count"] == rec["count"] and exp["bytes"] == rec["bytes"]})
    return rows


def check_run(config: CommConfig, events: list[dict], *, step: int | None = None) -> list[dict]:
    """:func:`compare` for every rank of the layout (and any other rank in ``events``), each
    against its own pipeline stage (rank order tp fastest, then cp, dp, pp: ``pp_rank = rank
    // (tp * cp * dp)``); a rank that recorded nothing shows all of its expectation as missing."""
    rows = []
    world = config.tp * config.cp * config.pp * config.dp
    for rank in sorted(set(range(world)) | {e["rank"] for e in events}):
        pp_rank = rank // (config.tp * config.cp * config.dp)
        expected = expected_comm(config, pp_rank) if rank < world else {}  # outside: all DIFF
        if config.moe is not None and rank < world:  # token all-to-alls: bytes from the splits
            for key, cell in split_bytes(config, events, rank, step).items():
                expected[key] = {"count": expected.get(key, {"count": 0})["count"],
                                 "bytes": expected.get(key, {"bytes": 0})["bytes"] + cell["bytes"]}
        rows += compare(expected, events, rank=rank, step=step)
    if config.moe is not None:
        rows += check_all_to_all(config, events, step=step)
    return rows


def all_ok(rows: list[dict]) -> bool:
    """True when every row agrees (an empty comparison agrees)."""
    return all(r["ok"] for r in rows)


def render_diff(rows: list[dict], *, only_diff: bool = False) -> str:
    """Markdown diff table (``only_diff`` keeps the disagreeing rows) and a verdict line."""
    head = ("| rank | kind | op | phase | expected count | recorded count | expected bytes "
            "| recorded bytes | |")
    lines = [head, "|" + "---|" * 9]
    bad = [r for r in rows if not r["ok"]]
    for r in (bad if only_diff else rows):
        mark = "ok" if r["ok"] else "DIFF"
        lines.append(f"| {r['rank']} | {r['kind']} | {r['op']} | {r['phase']} | "
                     f"{r['expected_count']} | {r['recorded_count']} | {r['expected_bytes']} | "
                     f"{r['recorded_bytes']} | {mark} |")
    verdict = (f"all {len(rows)} rows agree" if not bad else
               f"{len(bad)} of {len(rows)} rows differ: " + "; ".join(
                   f"rank {r['rank']} {r['kind']} {r['op']} {r['phase']}: expected "
                   f"{r['expected_count']} ops / {r['expected_bytes']} B, recorded "
                   f"{r['recorded_count']} / {r['recorded_bytes']} B" for r in bad[:5]))
    return "\n".join(lines) + "\n\n" + verdict + "\n"


def config_from_run(cfg: dict) -> CommConfig:
    """The :class:`CommConfig` of a run from its ``config.json`` (read as
    :meth:`TrainConfig.from_dict` reads it; :func:`~paraloom.analysis.view.comm_view`)."""
    return view_of_saved(cfg)


def step_config(config: CommConfig, step: int, metrics: dict[int, dict]) -> CommConfig:
    """``config`` for one recorded step: the optimizer step skipped or not (metrics.jsonl
    ``skipped``), and whether it was the first step its process ran (``first_of_process``; the
    first step communicates differently, as Megatron's: see :class:`CommConfig`). Without a
    metrics line, step 1 is a first step. The step before a process's first is the
    last of the one before (which ended with its own barrier)."""
    line = metrics.get(step, {})
    first = bool(line.get("first_of_process", step == 1))
    # the last step of a process (its run's end, or a resumed run's earlier part) ends with
    # Megatron-LM's "after training is done" barrier
    last = step == config.total_steps \
        or bool(metrics.get(step + 1, {}).get("first_of_process", False))
    return replace(config, optimizer_step=not line.get("skipped", False), first_step=first,
                   param_gather_forward=_param_gather_forward(config, step, metrics),
                   timer_barriers=logged_iteration(step, config.log_interval, first),
                   last_step=last)


def _param_gather_forward(config: CommConfig, step: int, metrics: dict[int, dict]) -> bool:
    """Under ``--overlap-param-gather``, whether ``step``'s forward gathers the parameters: the
    hooks are on once a step of the process succeeded (Megatron-LM's ``train()``), and a
    checkpoint's gather (``params_gathered_at_save`` on the step's line) leaves nothing to
    gather until the next step's gradients are reduced -- for the hooks: with interleaving and
    ``align_param_gather`` the schedule launches every chunk's gathers all the same."""
    scheduled = config.v > 1 and config.align_param_gather
    if not config.overlap_param_gather or (
            metrics.get(step, {}).get("params_gathered_at_save") and not scheduled):
        return False
    for earlier in range(step - 1, 0, -1):  # back to the first step of this process
        line = metrics.get(earlier, {})
        if not line.get("skipped", False):
            return True
        if line.get("first_of_process", earlier == 1):
            return False
    return False


def load_run(run_dir: str) -> tuple[dict, list[dict], dict[int, dict]]:
    """``config.json``, the ledger, and metrics.jsonl's lines by step; ``ValueError`` for a
    folder ``check`` cannot read (naming what is missing)."""
    root = Path(run_dir)
    if not (root / CONFIG).is_file() and any(root.glob("ledger/rank*.status.json")):
        raise ValueError(f"{run_dir!r} was recorded by paraloom record: a recorded program has "
                         f"no formulas to check its ledger against (no config.json); read it "
                         f"with paraloom table, trace or report")
    for name in (CONFIG, LEDGER):
        if not (root / name).is_file():
            raise ValueError(f"no {name} in {run_dir!r} (a run folder written by paraloom "
                             f"train holds config.json and ledger.jsonl)")
    metrics = {m["step"]: m for m in read_metrics(root / METRICS)} \
        if (root / METRICS).is_file() else {}
    return read_json(root / CONFIG, "a run configuration"), read_ledger(root / LEDGER), \
        metrics


