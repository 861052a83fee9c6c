"""The one writer of a run's reports: what ``paraloom train`` and ``paraloom record`` leave in a run
folder next to its data (:mod:`paraloom.run_folder`).

From ``ledger.jsonl`` (and ``metrics.jsonl`` where training wrote one): ``trace.json`` (Perfetto),
``comm_table.md`` (the communication order table of the first rank, in each language asked for),
``loss.png`` and, for MoE runs, ``expert_load.png`` (matplotlib; skipped with a note without it),
and ``report.html`` (all of it on one page). A report that cannot be written is named in the
returned problems; the run itself is done and keeps its data.
"""

from __future__ import annotations

from pathlib import Path

from ..run_folder import METRICS, RunFolderError, load_events
from .expert_load import plot_expert_load
from .html import write_report
from .plots import plot_loss
from .table import render_table, steps_of
from .trace import write_trace

__all__ = ["write_reports"]

_SETUP = {"en": "## setup (before the first iteration)", "zh": "## 初始化（第一个迭代之前）"}
_FIRST = {"en": "## the first step", "zh": "## 第一个迭代"}


def write_reports(out: str | Path, events: list[dict] | None = None, *,
                  langs: tuple[str, ...] = ("en",), empty: bool = True) -> list[str]:
    """Write the reports of the run in ``out`` (``events``: its merged ledger, read from
    ``out/ledger.jsonl`` when not given); returns what could not be written, and why.
    ``empty=False``: a run without communication gets no trace and no page (a recorded program
    that never communicated); a training run's page is written anyway (its curves)."""
    out = Path(out)
    events = load_events(out) if events is None else events
    problems = []
    if events or empty:
        write_trace(events, out / "trace.json")
    if events:
        rank = min(e["rank"] for e in events)
        mine = [e for e in events if e["rank"] == rank]
        setup = "setup" in steps_of(mine) and len(steps_of(mine)) > 1
        parts = []
        for lang in langs:
            if setup:  # a recorded program's setup: its own section before the first step
                parts.append(f"{_SETUP[lang]}\n\n" + render_table(events, rank=rank,
                                                                  step="setup", lang=lang))
                parts.append(f"{_FIRST[lang]}\n")
            parts.append(render_table(events, rank=rank, lang=lang))
        (out / "comm_table.md").write_text("\n".join(parts) + ("\n" if len(langs) == 1 else ""))
    if (out / METRICS).is_file():
        try:
            plot_loss(out / METRICS, out / "loss.png")
            plot_expert_load(out / METRICS, out / "expert_load.png")  # MoE runs only
        except ImportError as err:  # matplotlib missing: everything else is written
            problems.append(f"loss.png not written: {err}")
    if events or empty:
        try:
            write_report(out)
        except (RunFolderError, ValueError, KeyError, TypeError, OSError) as err:
            problems.append(f"report.html not written: {err}")
    return problems
