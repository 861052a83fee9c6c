"""The parts of the HTML run report, as HTML fragments or JSON-ready data (see ``html.py``).

* :func:`config_rows` — ``config.json`` flattened to ``(key, value)`` rows;
* :func:`check_verdict` — ``paraloom check`` on the run (every rank, every recorded step);
* :func:`metric_charts` — loss, grad norm, learning rate and tokens/s from ``metrics.jsonl``;
* :func:`table_html` — the communication order table of one rank and step in one language,
  layers folded (each folded row expands to its layers), each row with its source site;
* :func:`timeline_data` — every rank's compute and communication spans, compactly, for the
  page's script to draw.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

from ..verify.check import all_ok, check_run, config_from_run, step_config
from .sources import resolve_site, site_facts
from .svg import line_chart
from .table import HEADINGS, KEYS, group_rows, numbered_steps, table_rows
from .trace import KIND_ORDER

__all__ = ["config_rows", "check_verdict", "metric_charts", "table_html", "timeline_data",
           "SOURCE_HEADING"]

SOURCE_HEADING = {"en": "Source", "zh": "源码位置"}


def config_rows(cfg: dict, prefix: str = "") -> list[tuple[str, str]]:
    """``{"model": {"hidden_size": 64}}`` -> ``[("model.hidden_size", "64")]``."""
    out = []
    for key, value in cfg.items():
        if isinstance(value, dict):
            out += config_rows(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", json.dumps(value)))
    return out


def check_verdict(cfg: dict, events: list[dict],
                  metrics: dict[int, dict]) -> tuple[bool | None, str]:
    """``(ok, text)``: whether the ledger agrees with the formulas on every rank and recorded
    step (``None`` when the check cannot run, the text saying why)."""
    try:
        config = config_from_run(cfg)
        steps = numbered_steps(events)
        if not steps:
            return None, "the ledger holds no communication"
        rows = []
        for step in steps:
            rows += check_run(step_config(config, step, metrics), events, step=step)
    except (ValueError, KeyError, TypeError) as err:
        return None, f"paraloom check could not run on this run: {err}"
    bad = [r for r in rows if not r["ok"]]
    if all_ok(rows):
        return True, (f"paraloom check: all {len(rows)} rows agree (every rank, steps "
                      f"{steps[0]}..{steps[-1]}: count and bytes per kind, op and phase)")
    return False, f"paraloom check: {len(bad)} of {len(rows)} rows differ: " + "; ".join(
        f"rank {r['rank']} {r['kind']} {r['op']} {r['phase']}: expected {r['expected_count']} "
        f"ops / {r['expected_bytes']} B, recorded {r['recorded_count']} / "
        f"{r['recorded_bytes']} B" for r in bad[:8])


def metric_charts(metrics: list[dict], tokens_per_step: int | None) -> list[str]:
    """SVG charts of the per-step metrics; tokens/s from the tokens counted between lines."""
    if not metrics:
        return []
    steps = [m["step"] for m in metrics]
    tok_s, before = [], None
    for m in metrics:
        done = m.get("tokens")
        step_tokens = (done - before if done is not None and before is not None
                       else tokens_per_step)
        before = done
        tok_s.append(step_tokens / m["time_s"] if step_tokens and m.get("time_s") else None)
    charts = [("loss", "training loss", "训练损失"), ("grad_norm", "gradient norm", "梯度范数"),
              ("lr", "learning rate", "学习率")]
    out = [line_chart(steps, [m.get(key) for m in metrics], title=title, title_zh=zh)
           for key, title, zh in charts]
    out.append(line_chart(steps, tok_s, title="throughput (tokens/s)", title_zh="吞吐（词元/秒）"))
    return out


def _facts_html(place: dict | None, row: dict) -> str:
    if place is None:
        return '<span class="nosrc">—</span>'
    facts = site_facts(place, row["primitive"], row["phase"])
    # a label found as its class or module: the call site the facts name, not the class line
    line = facts[0]["line"] if facts and place["how"] in ("class", "module") else place["line"]
    where = f"{place['file']}:{line}"
    if facts is None:
        body = "<li>the file is not readable here: no explain facts</li>"
    elif not facts:
        body = "<li>explain: no static communication site with this op and phase there</li>"
    else:
        body = "".join(
            f"<li>line {f['line']} {escape('.'.join(x for x in (f['class'], f['function']) if x))}"
            f": {escape(str(f['op']))} ({escape(str(f['kind']))}, {escape(str(f['phase']))}, "
            f"async {f['async']})" + (f", when <code>{escape(str(f['condition']))}</code>"
                                      if f.get("condition") else "")
            + f"<br><code>{escape(str(f['call']))}</code></li>" for f in facts)
    link = Path(place["path"]).resolve().as_uri() if Path(place["path"]).is_file() else None
    opener = f' <a href="{escape(link)}">open</a>' if link else ""
    how = place["how"] if line == place["line"] else \
        f"{place['how']} at line {place['line']}, its call site"
    return (f'<details class="src"><summary>{escape(where)}</summary><div>{escape(how)}'
            f'{opener}<ul>{body}</ul></div></details>')


def _cells(row: dict, index: str) -> str:
    cells = [index] + [escape(str(row[k])) for k in KEYS[1:]]
    return "".join(f"<td>{c}</td>" for c in cells) + \
        f"<td>{_facts_html(resolve_site(row['site']), row)}</td>"


def table_html(events: list[dict], *, rank: int, step: int | None, lang: str) -> str:
    """The folded table (``<thead>`` + ``<tbody>``) of ``rank``'s ``step`` in ``lang``."""
    rows = group_rows(table_rows(events, rank=rank, step=step, lang=lang), lang, KEYS,
                      members=True)
    heads = "".join(f"<th>{escape(h)}</th>" for h in (*HEADINGS[lang], SOURCE_HEADING[lang]))
    body = []
    for row in rows:
        n = len(row["members"])
        index = str(row["index"])
        if n > 1:
            index += f' <button class="fold" data-row="{row["index"]}" title="x{n}">▸</button>'
        body.append(f'<tr class="row" data-row="{row["index"]}">{_cells(row, index)}</tr>')
        if n > 1:
            body += [f'<tr class="member" data-parent="{row["index"]}" hidden>'
                     f'{_cells(m, "↳")}</tr>' for m in row["members"]]
    return (f'<table class="comm" data-lang="{lang}"><thead><tr>{heads}</tr></thead><tbody>'
            + "".join(body) + "</tbody></table>")


TIMELINE_STEPS = 4
"""Recorded steps drawn on the timeline (the first ones): a ledger of every step of a long run
(``--ledger-steps -1``) would make a page too heavy to draw."""


def timeline_data(events: list[dict], max_steps: int = TIMELINE_STEPS) -> dict:
    """Spans per rank for the timeline: ``ev`` rows are ``[rank, lane, start_us, end_us, name,
    async, step]`` (``lane`` and ``name`` index ``lanes`` and ``names``); lane 0 is compute.
    Only the set-up and the first ``max_steps`` recorded steps; ``steps`` lists them, ``of``
    counts all."""
    recorded = sorted({e["step"] for e in events if e.get("phase") != "setup"})
    shown = set(recorded[:max_steps])
    events = [e for e in events if e.get("phase") == "setup" or e["step"] in shown]
    kinds = sorted({e["kind"] for e in events if e["op"] != "compute"},
                   key=lambda k: (KIND_ORDER.index(k) if k in KIND_ORDER else 99, k))
    lanes = ["compute", *kinds]
    names: dict[str, int] = {}
    rows = []
    for e in events:
        compute = e["op"] == "compute"
        name = (e["site"] + (f" ({e['module']})" if e.get("module") else "") if compute else
                f"{e['op']} {e['kind']} {e['site']}" + (f" ({e['module']})" if e.get("module")
                                                        else "") + f" {e['bytes']} B")
        rows.append([e["rank"], 0 if compute else lanes.index(e["kind"]),
                     round(e["t_start"] * 1e6, 1), round(max(e["t_end"], e["t_start"]) * 1e6, 1),
                     names.setdefault(name, len(names)), int(bool(e["async"]) and not compute),
                     e["step"]])
    return {"ranks": sorted({e["rank"] for e in events}), "lanes": lanes, "names": list(names),
            "ev": rows, "steps": sorted(shown), "of": len(recorded)}
