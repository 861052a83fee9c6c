"""PNG pictures: the pipeline schedule, drawn like the figures of the Megatron papers.

Stages are rows, time runs left to right, each forward (``F``) and backward (``B``) step is a
block coloured by its microbatch (backward blocks hatched, zero-bubble weight-gradient ``W``
blocks dotted and pale, the chunk shown as ``3.1`` = microbatch
3, chunk 1 when interleaved); the idle gaps are the bubble. Two sources:

* :func:`timetable_blocks` — a pure timetable (:func:`paraloom.pipeline_parallel.timetable.
  timetable`), one unit of time per step;
* :func:`ledger_blocks` — a recorded run: the compute spans with site ``pipeline.forward`` /
  ``pipeline.backward`` of one step, at their real times.

matplotlib is imported lazily with the Agg backend (no display needed), so importing this module
costs nothing for code that does not draw.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..pipeline_parallel.timetable import idle_share
from ..run_folder import read_metrics

__all__ = ["Block", "timetable_blocks", "ledger_blocks", "bubble_of", "draw_schedule", "plot_loss"]

_SITES = {"pipeline.forward": "F", "pipeline.backward": "B", "pipeline.weight_grad": "W"}
_HATCH = {"F": None, "B": "///", "W": "..."}
_ALPHA = {"F": 1.0, "B": 0.75, "W": 0.4}


@dataclass(frozen=True)
class Block:
    """One compute step on one row of the picture."""

    row: int
    start: float
    duration: float
    kind: str
    """``"F"``, ``"B"`` or ``"W"`` (a deferred weight gradient, zero-bubble schedules)."""
    microbatch: int
    chunk: int = 0


def timetable_blocks(slots) -> tuple[list[Block], list[str]]:
    """Blocks and row labels of a unit-time timetable (a list of slots of (stage, kind, mb, c))."""
    blocks = [Block(stage, t, 1.0, kind, mb, c) for t, slot in enumerate(slots)
              for stage, kind, mb, c in slot]
    rows = 1 + max((b.row for b in blocks), default=0)
    return blocks, [f"stage {r}" for r in range(rows)]


def ledger_blocks(events, step: int | None = None) -> tuple[list[Block], list[str]]:
    """Blocks (seconds from the step's first span) and row labels from ledger events.

    One row per rank, ordered by pipeline stage then rank; ``step`` defaults to the last step
    that has pipeline spans. ``ValueError`` if there are none.
    """
    spans = [e for e in events if e.get("op") == "compute" and e.get("site") in _SITES]
    if not spans:
        raise ValueError("the ledger has no pipeline compute spans (site pipeline.forward / "
                         "pipeline.backward); was it recorded with a pipeline schedule?")
    steps = sorted({e["step"] for e in spans})
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ValueError(f"step {step} has no pipeline spans; recorded steps: {steps}")
    spans = [e for e in spans if e["step"] == step]
    ranks = sorted({e["rank"] for e in spans},
                   key=lambda r: (next(e.get("stage", 0) for e in spans if e["rank"] == r), r))
    row = {r: i for i, r in enumerate(ranks)}
    t0 = min(e["t_start"] for e in spans)
    blocks = [Block(row[e["rank"]], e["t_start"] - t0, max(e["t_end"] - e["t_start"], 0.0),
                    _SITES[e["site"]], e["microbatch"], e.get("chunk", 0)) for e in spans]
    stage = {e["rank"]: e.get("stage", 0) for e in spans}
    return blocks, [f"stage {stage[r]} (rank {r})" for r in ranks]


def bubble_of(blocks: list[Block], rows: int) -> float:
    """Idle share of ``rows`` x (first start .. last end): the pipeline bubble fraction."""
    if not blocks:
        return 0.0
    span = max(b.start + b.duration for b in blocks) - min(b.start for b in blocks)
    return idle_share(sum(b.duration for b in blocks), rows, span)


def draw_schedule(blocks: list[Block], rows: list[str], out: str | Path, *, title: str = "",
                  time_unit: str = "time slot") -> Path:
    """Draw ``blocks`` to the PNG ``out`` and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    microbatches = sorted({b.microbatch for b in blocks})
    chunks = max((b.chunk for b in blocks), default=0) + 1
    cmap = plt.get_cmap("tab10" if len(microbatches) <= 10 else "tab20")
    colour = {mb: cmap(i % cmap.N) for i, mb in enumerate(microbatches)}
    end = max((b.start + b.duration for b in blocks), default=1.0)
    fig, ax = plt.subplots(figsize=(min(4 + 0.45 * len({b.start for b in blocks}), 22),
                                    0.8 + 0.55 * len(rows)))
    for b in blocks:
        y = len(rows) - 1 - b.row
        ax.barh(y, b.duration, left=b.start, height=0.8, color=colour[b.microbatch],
                alpha=_ALPHA[b.kind], hatch=_HATCH[b.kind],
                edgecolor="black", linewidth=0.6)
        if b.duration >= 0.35 * end / max(len(blocks) / max(len(rows), 1), 1):
            label = f"{b.microbatch}" + (f".{b.chunk}" if chunks > 1 else "")
            ax.text(b.start + b.duration / 2, y, label, ha="center", va="center", fontsize=7,
                    color="white" if b.kind == "F" else "black", fontweight="bold")
    ax.set_yticks(range(len(rows)), list(reversed(rows)))
    ax.set_xlim(0, end)
    ax.set_xlabel(time_unit)
    ax.set_title(title, fontsize=10)
    handles = [Patch(facecolor="lightgrey", edgecolor="black", label="forward"),
               Patch(facecolor="lightgrey", edgecolor="black", hatch="///", label="backward")]
    if any(b.kind == "W" for b in blocks):
        handles[1] = Patch(facecolor="lightgrey", edgecolor="black", hatch="///",
                           label="backward: input grad (B)")
        handles.append(Patch(facecolor="lightgrey", edgecolor="black", hatch="...", alpha=0.4,
                             label="weight grad (W)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              title="colour = microbatch" + (", n.c = chunk c" if chunks > 1 else ""),
              title_fontsize=7)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def plot_loss(metrics_path: str | Path, out: str | Path) -> Path:
    """Training loss (and gradient norm, right axis) per step from a run's ``metrics.jsonl``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = read_metrics(metrics_path)
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(steps, [r["loss"] for r in rows], color="tab:blue", marker=".", label="loss")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no 0.25 on a short run
    ax.set_ylabel("training loss (nats / byte)", color="tab:blue")
    norm = ax.twinx()
    norm.plot(steps, [r["grad_norm"] for r in rows], color="tab:grey", alpha=0.5, lw=1)
    norm.set_ylabel("gradient norm", color="tab:grey")
    ax.set_title("paraloom train", fontsize=10)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
