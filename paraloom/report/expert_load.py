"""``expert_load.png``: how the tokens of each MoE layer spread over its experts, step by step.

One panel per MoE layer (at most 8, evenly chosen), a stacked area of each expert's share of the
layer's routed tokens (after any capacity drops) per step, read from ``metrics.jsonl``'s
``tokens_per_expert``; a dashed line marks the balanced share ``1/E``. Balanced routing is a flat
stack of equal bands; collapse onto a few experts shows as one band swallowing the others.
"""

from __future__ import annotations

from pathlib import Path

from ..run_folder import read_metrics

__all__ = ["plot_expert_load"]


def plot_expert_load(metrics_path: str | Path, out: str | Path) -> Path | None:
    """Write the picture; ``None`` (nothing written) when the run has no MoE metrics."""
    rows = read_metrics(metrics_path)
    rows = [r for r in rows if r.get("tokens_per_expert")]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    layers = sorted(rows[0]["tokens_per_expert"], key=int)
    if len(layers) > 8:
        layers = [layers[round(i * (len(layers) - 1) / 7)] for i in range(8)]
    steps = [r["step"] for r in rows]
    cols = min(4, len(layers))
    nrows = -(-len(layers) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.6 * nrows), squeeze=False,
                             sharey=True)
    for ax, layer in zip(axes.flat, layers, strict=False):
        counts = [r["tokens_per_expert"][layer] for r in rows]
        experts = len(counts[0])
        shares = [[c[e] / max(sum(c), 1) for c in counts] for e in range(experts)]
        ax.stackplot(steps, shares, labels=[f"expert {e}" for e in range(experts)])
        ax.axhline(1 / experts, color="black", ls="--", lw=0.8)
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_ylim(0, 1)
    for ax in list(axes.flat)[len(layers):]:
        ax.axis("off")
    axes[0][0].set_ylabel("share of routed tokens", fontsize=8)
    if len(rows[0]["tokens_per_expert"][layers[0]]) <= 16:
        axes[0][0].legend(fontsize=6, loc="upper left", ncol=2)
    fig.suptitle("expert load per MoE layer (dashed: balanced 1/E)", fontsize=10)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
