"""Inline SVG pictures for the HTML run report: line charts of a metric and the pipeline schedule.

Drawn as plain SVG text (no matplotlib, no script), so the page stays small, opens from disk and
scales with the browser window. Each picture is a ``<svg>`` element string with a ``<title>``
per point or block (the browser shows it as a tooltip).
"""

from __future__ import annotations

from html import escape

from .plots import Block

__all__ = ["line_chart", "schedule_svg"]

_W, _H, _PAD_L, _PAD_B, _PAD_T, _PAD_R = 420, 190, 58, 28, 22, 12
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-2:
        return f"{v:.2e}"
    return f"{v:.4g}"


def line_chart(xs: list[float], ys: list[float], *, title: str, x_label: str = "step",
               css_class: str = "chart", title_zh: str | None = None) -> str:
    """A line chart of ``ys`` over ``xs`` with min/max ticks; a point per value (tooltip).
    ``title_zh``: the title in Chinese (the page's language switch shows one or the other)."""
    pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and y == y
           and abs(y) != float("inf")]
    langs = f' data-en="{escape(title)}" data-zh="{escape(title_zh)}"' if title_zh else ""
    head = (f'<svg class="{css_class}" viewBox="0 0 {_W} {_H}" role="img" '
            f'aria-label="{escape(title)}"><text x="{_W / 2}" y="14" class="ct"{langs}>'
            f'{escape(title)}</text>')
    if not pts:
        return head + f'<text x="{_W / 2}" y="{_H / 2}" class="ct">no finite values</text></svg>'
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) or 1) * 0.05, y1 + (abs(y1) or 1) * 0.05
    if x1 == x0:
        x0, x1 = x0 - 0.5, x1 + 0.5
    pw, ph = _W - _PAD_L - _PAD_R, _H - _PAD_T - _PAD_B
    sx = lambda x: _PAD_L + (x - x0) / (x1 - x0) * pw
    sy = lambda y: _PAD_T + (1 - (y - y0) / (y1 - y0)) * ph
    path = " ".join(f"{'M' if i == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}"
                    for i, (x, y) in enumerate(pts))
    dots = "".join(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.2"><title>{x_label} '
                   f'{_fmt(x)}: {_fmt(y)}</title></circle>' for x, y in pts) \
        if len(pts) <= 400 else ""
    axes = (f'<line class="ax" x1="{_PAD_L}" y1="{_PAD_T + ph}" x2="{_PAD_L + pw}" '
            f'y2="{_PAD_T + ph}"/><line class="ax" x1="{_PAD_L}" y1="{_PAD_T}" x2="{_PAD_L}" '
            f'y2="{_PAD_T + ph}"/>'
            f'<text class="tk" x="{_PAD_L - 4}" y="{_PAD_T + 4}" text-anchor="end">'
            f'{_fmt(y1)}</text><text class="tk" x="{_PAD_L - 4}" y="{_PAD_T + ph}" '
            f'text-anchor="end">{_fmt(y0)}</text>'
            f'<text class="tk" x="{_PAD_L}" y="{_H - 10}">{_fmt(x0)}</text>'
            f'<text class="tk" x="{_PAD_L + pw}" y="{_H - 10}" text-anchor="end">{_fmt(x1)}'
            f'</text><text class="tk" x="{_PAD_L + pw / 2}" y="{_H - 4}" text-anchor="middle">'
            f'{escape(x_label)}</text>')
    return head + axes + f'<path class="line" d="{path}"/>' + dots + "</svg>"


def schedule_svg(blocks: list[Block], rows: list[str], *, title: str,
                 time_unit: str = "seconds") -> str:
    """The pipeline schedule as in :func:`paraloom.report.plots.draw_schedule`: one row per
    stage, forward blocks filled, backward blocks lighter and striped, colour = microbatch."""
    if not blocks:
        return ""
    t0 = min(b.start for b in blocks)
    end = max(b.start + b.duration for b in blocks) - t0 or 1.0
    label_w, row_h, width = 130, 26, 900
    height = _PAD_T + row_h * len(rows) + 30
    scale = (width - label_w - 10) / end
    chunks = max(b.chunk for b in blocks) + 1
    parts = [f'<svg class="schedule" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="{escape(title)}"><defs><pattern id="bw" width="6" height="6" '
             f'patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><line x1="0" y1="0" '
             f'x2="0" y2="6" stroke="#000" stroke-opacity=".35" stroke-width="2"/></pattern>'
             f'</defs><text x="{width / 2}" y="14" class="ct">{escape(title)}</text>']
    for i, name in enumerate(rows):
        y = _PAD_T + i * row_h
        parts.append(f'<text class="tk" x="4" y="{y + row_h / 2 + 4}">{escape(name)}</text>')
    for b in blocks:
        x = label_w + (b.start - t0) * scale
        w = max(b.duration * scale, 0.8)
        y = _PAD_T + b.row * row_h + 2
        colour = _COLOURS[b.microbatch % len(_COLOURS)]
        label = f"{b.microbatch}" + (f".{b.chunk}" if chunks > 1 else "")
        what = {"F": "forward", "B": "backward", "W": "weight grad (W)"}[b.kind]
        tip = (f"{what} microbatch {b.microbatch}"
               + (f" chunk {b.chunk}" if chunks > 1 else "")
               + f": {b.duration * 1e3:.2f} ms" * (time_unit == "seconds"))
        opacity = {"F": "1", "B": ".6", "W": ".3"}[b.kind]
        parts.append(f'<g class="blk {b.kind}"><title>{escape(tip)}</title><rect x="{x:.1f}" '
                     f'y="{y}" width="{w:.1f}" height="{row_h - 4}" fill="{colour}" '
                     f'fill-opacity="{opacity}" stroke="#222" stroke-width=".5"/>')
        if b.kind == "B":
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h - 4}" '
                         f'fill="url(#bw)"/>')
        if w > 14:
            parts.append(f'<text class="bl" x="{x + w / 2:.1f}" y="{y + row_h / 2 + 2}">'
                         f'{label}</text>')
        parts.append("</g>")
    axis_y = _PAD_T + row_h * len(rows) + 16
    unit = f"{end * 1e3:.1f} ms" if time_unit == "seconds" else f"{end:g} {time_unit}"
    parts.append(f'<text class="tk" x="{label_w}" y="{axis_y}">0</text><text class="tk" '
                 f'x="{width - 10}" y="{axis_y}" text-anchor="end">{unit}</text></svg>')
    return "".join(parts)
