"""``paraloom report RUN``: one self-contained HTML page per run, to open from disk.

The page holds, inline (no network: the script, the styles, the pictures and the data are in
the file): the run's configuration and the ``paraloom check`` verdict; loss, gradient norm,
learning rate and throughput per step (SVG); the communication order table of the first rank's
first recorded step with an English / Chinese switch, layers folded as in the terminal table
(a folded row expands to its layers) and each row's source site (``file:line``, with the
``explain`` facts of that place when the file is readable); a per-rank timeline of compute and
communication (zoom with the wheel or the buttons, drag to pan; an asynchronous operation is a
translucent span over the compute it overlaps); the pipeline schedule (SVG); and, when the run
folder has one, ``expert_load.png``. ``train`` and ``record`` write it as ``report.html``.

The command is ``paraloom report RUN [--out FILE.html] [--lang zh]``
(:mod:`paraloom.commands.report`).
"""

from __future__ import annotations

import base64
import json
from html import escape
from importlib.resources import files
from pathlib import Path

from ..run_folder import CONFIG, LEDGER, METRICS, read_json, read_ledger, read_metrics
from .plots import bubble_of, ledger_blocks
from .sections import check_verdict, config_rows, metric_charts, table_html, timeline_data
from .svg import schedule_svg
from .table import numbered_steps

__all__ = ["render_report", "write_report", "TITLES"]

TITLES = {  # section headings: (en, zh)
    "config": ("Configuration", "配置"), "check": ("Check against the formulas", "与公式核对"),
    "curves": ("Training curves", "训练曲线"), "table": ("Communication order", "通信顺序"),
    "timeline": ("Timeline of compute and communication", "计算与通信时间线"),
    "schedule": ("Pipeline schedule", "流水线调度"), "experts": ("Expert load", "专家负载"),
}


def _asset(name: str) -> str:
    return files("paraloom.report").joinpath("assets", name).read_text(encoding="utf-8")


def _h2(key: str) -> str:
    en, zh = TITLES[key]
    return f'<h2 data-en="{escape(en)}" data-zh="{escape(zh)}">{escape(en)}</h2>'


def _schedule(events: list[dict]) -> str:
    try:
        blocks, rows = ledger_blocks(events)
    except ValueError as err:
        return f"<p class='note'>{escape(str(err))}</p>"
    bubble = bubble_of(blocks, len(rows))
    step = max(e["step"] for e in events if e.get("site") == "pipeline.forward")  # drawn one
    return schedule_svg(blocks, rows, title=f"recorded schedule, step {step}: bubble "
                                            f"{bubble:.3f}")


def _tokens_per_step(cfg: dict | None) -> int | None:
    try:
        return int(cfg["global_batch_size"] * cfg["model"]["seq_length"])
    except (TypeError, KeyError):
        return None


def render_report(run: str | Path, lang: str = "en") -> str:
    """The report page of the run folder ``run`` (``ValueError`` when it has no ledger)."""
    run = Path(run)
    ledger = run / LEDGER
    if not ledger.is_file():
        raise ValueError(f"no ledger at {ledger} (RUN {str(run)!r} must be a run folder written "
                         f"by paraloom train or paraloom record)")
    events = read_ledger(ledger)
    comms = [e for e in events if e["op"] != "compute"]
    cfg = read_json(run / CONFIG, "a run configuration")
    metrics = read_metrics(run / METRICS)
    ranks = sorted({e["rank"] for e in events})
    parts = [f"<h1>paraloom run report: {escape(str(run.resolve()))}</h1>",
             '<div class="langs"><button id="lang-en">English</button>'
             '<button id="lang-zh">中文 (zh)</button></div>', _h2("config")]
    if cfg is not None:
        parts.append('<div class="kv">' + "".join(
            f"<span>{escape(k)}</span><b>{escape(v)}</b>" for k, v in config_rows(cfg))
            + "</div>")
    else:
        parts.append("<p class='note'>no config.json: a program recorded with "
                     "<code>paraloom record</code></p>")
    steps = numbered_steps(comms)
    parts.append(f"<p>{len(ranks)} ranks, {len(events)} ledger events ({len(comms)} "
                 f"communications) in recorded steps {steps}</p>")
    parts.append(_h2("check"))
    if cfg is not None and "parallel" in cfg:
        ok, text = check_verdict(cfg, events, {m["step"]: m for m in metrics})
        state = {True: "ok", False: "bad", None: "note"}[ok]
        parts.append(f'<p class="verdict {state}" id="verdict">{escape(text)}</p>')
    else:
        parts.append('<p class="verdict note" id="verdict">no formula check: the run was not '
                     'made by paraloom train (the formulas describe its layouts)</p>')
    parts.append(_h2("curves"))
    charts = metric_charts(metrics, _tokens_per_step(cfg))
    parts.append('<div class="charts">' + "".join(charts) + "</div>" if charts else
                 "<p class='note'>no metrics.jsonl</p>")
    parts.append(_h2("table"))
    if comms:
        rank = 0 if 0 in {e["rank"] for e in comms} else min(e["rank"] for e in comms)
        mine = [e for e in comms if e["rank"] == rank]
        steps = [e["step"] for e in mine if e.get("phase") != "setup"]
        step = min(steps) if steps else "setup"  # a program that never ran a forward: its setup
        zh_step = f"第 {step} 步" if steps else "初始化"
        parts.append(f'<p data-en="rank {rank}, step {step} (layers folded: ▸ expands)" '
                     f'data-zh="rank {rank}，{zh_step}（层已折叠：▸ 展开）">rank {rank}, step '
                     f'{step} (layers folded: ▸ expands)</p>')
        parts += [table_html(events, rank=rank, step=step, lang=code) for code in ("en", "zh")]
    else:
        parts.append("<p class='note'>no communication recorded</p>")
    parts.append(_h2("timeline"))
    parts.append('<div class="tl-tools"><button id="zoom-in">+</button><button id="zoom-out">'
                 '−</button><button id="zoom-reset">reset</button> <span id="tl-info"></span>'
                 '</div><div id="timeline"></div>')
    if any(str(e.get("site", "")).startswith("pipeline.") for e in events) \
            or (cfg or {}).get("parallel", {}).get("pp", 1) > 1:
        parts += [_h2("schedule"), _schedule(events)]  # one stage has no schedule to draw
    experts = run / "expert_load.png"
    if experts.is_file():
        data = base64.b64encode(experts.read_bytes()).decode()
        parts += [_h2("experts"), f'<img class="experts" alt="expert load" '
                                  f'src="data:image/png;base64,{data}">']
    data = json.dumps(timeline_data(events), separators=(",", ":")).replace("</", "<\\/")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>paraloom report {escape(run.name)}</title>"
            f"<script>{_asset('errors.js')}</script><style>{_asset('report.css')}</style>"
            f'</head><body data-lang="{lang}">' + "\n".join(parts)
            + f'<script type="application/json" id="tl-data">{data}</script>'
            + f"<script>{_asset('report.js')}</script></body></html>\n")


def write_report(run: str | Path, out: str | Path | None = None, lang: str = "en") -> Path:
    """Write :func:`render_report` of ``run`` to ``out`` (default ``RUN/report.html``)."""
    path = Path(out) if out is not None else Path(run) / "report.html"
    path.write_text(render_report(run, lang), encoding="utf-8")
    return path
