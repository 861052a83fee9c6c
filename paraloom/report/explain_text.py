"""``paraloom explain``'s text report: the static reading (:func:`render`) and, with ``--run``,
the recorded run next to it (:func:`render_run`), headings in English or Chinese.

Presentation only: the facts are :func:`paraloom.explain.explain`'s, the run marks
:func:`paraloom.explain.run.annotate`'s; the order table has the columns of :mod:`.table`.
Every fact is written with its line number.
"""

from __future__ import annotations

import re

from ..explain.conditions import phrases
from ..explain.rules import UNKNOWN
from .table import HEADINGS

__all__ = ["render", "render_run"]

_NMC_ZH = "需要更多上下文"
_STATIC_HEAD = {
    "en": ("World sizes", "Partitions (divide)", "Local weights", "Communication sites",
           "Communication order (static: forward in source order, then backward)",
           "Checklist", "none in this snippet"),
    "zh": ("并行规模（world size）", "切分（divide）", "本地权重", "通信位置",
           "通信顺序（静态：先按源码顺序的前向，再反向）", "检查清单", "片段中没有"),
}


_WORD = {  # the fixed words of a site line, the table and the run section
    "zh": {"line": "第 {} 行", "lines": "第 {}-{} 行", "phase": "阶段",
           "kind": "类型",
           "async": "异步", "if": "条件", "via": "经由", "through": "途经", "assumed": "假定",
           "helper": "辅助函数", "group": "组", "module": "模块顶层", True: "是", False: "否",
           "static": "静态", "recorded": "记录到", "not run": "在记录的运行中未执行",
           "callers": "（它的所有调用方）",
           "outside": "定义在本文件之外；在本文件调用它的位置记录到",
           "not here": "未在本文件中定义；它的调用带有它自己文件的位置",
           "several": "经由辅助函数有多条路径；见上下文中它们的直接位置",
           "no site": "静态阅读中没有通信位置",
           "no event": "没有记录到的事件指向本文件（或行范围）；运行中的调用来自：",
           "none": "无", "sync": "同步", "at": "位于", "in": "在",
           "by label": "按标签记录到（见下文）：",
           "one site": "本文件的静态位置：第 {} 行",
           "one of": "本文件的静态位置之一：第 {} 行",
           "no static": "静态阅读中没有该所有者、该操作和阶段的位置（静态阅读遗漏）",
           "elsewhere labels": "另有 {} 个事件的标签属于本文件之外的代码",
           "settings": "设定：{}；{} 个位置因此不会执行（--json 中列出），"
                       "其余条件只写仍未决定的部分"},
}
_PHRASES = {"zh": (
    ("needs more context", "需要更多上下文"), ("explicit phase argument", "显式 phase 参数"),
    ("module level", "模块顶层"), ("inside a forward method", "在 forward 方法内"),
    ("constructor", "构造函数"), ("ONNX export (not training)", "ONNX 导出（非训练）"),
    ("backward of ", "反向，来自 "), ("via ", "经由 "), ("forward", "前向"), ("backward", "反向"),
    ("optimizer", "优化器"), ("setup", "初始化"))}
"""Phrases of phases, their bases and trigger locations; a whole word only, so code names
(``Block.forward``, ``send_forward``) are kept."""


_EN = {"line": "line {}", "lines": "lines {}-{}", True: "True", False: "False",
       "callers": "(all its callers)", "recorded": "recorded", "not run":
       "not run in the recorded run", "outside": "defined outside this file; recorded where "
       "this file runs it,", "not here": "is not defined in this file; its calls carry its own "
       "file's site", "several": "several paths through helpers; see their direct sites above "
       "and below", "no site": "no communication site in the static reading", "no event":
       "no recorded event names this file (or line range); the run's calls come from:",
       "by label": "recorded by label (below):", "one site": "the static site at line {}",
       "one of": "one of the static sites at lines {}",
       "no static": "no static site of its owner with this op and phase (missed by the static "
                    "reading)",
       "elsewhere labels": "{} more events carry labels of code outside this file",
       "settings": "settings: {}; {} sites ruled out by them (listed in --json); conditions "
                   "show only what they leave open"}


def _w(lang: str, key, *args) -> str:
    """The word ``key`` in ``lang`` (English: the key itself, formatted)."""
    text = _WORD.get(lang, {}).get(key)
    if text is None:
        text = _EN.get(key, key)
    return text.format(*args) if args else text


def _tr(text: str, lang: str) -> str:
    """A phase, a phase's basis or a trigger location in ``lang`` (code names kept)."""
    for en, other in _PHRASES.get(lang, ()):
        text = re.sub(rf"(?<![\w.]){re.escape(en)}(?!\w)", other, text)
    return text


def _cond(site: dict, lang: str) -> str:
    """The site's condition (what the settings leave open, under ``--set``) in ``lang``."""
    return phrases(site["parts"], lang) if "parts" in site else site["condition"]


def render(facts: dict, lang: str = "en") -> str:
    """Plain-text report: every fact with its line number."""
    h = _STATIC_HEAD[lang]
    out = [f"{facts['file']} {_w(lang, 'lines', *facts['lines'])}"]
    if facts.get("settings"):
        given = ", ".join(f"{k}={v!r}" for k, v in facts["settings"].items())
        out.append(_w(lang, "settings", given, len(facts.get("inactive", []))))
    out += ["", f"## {h[0]}"]
    out += [f"- {_w(lang, 'line', w['line'])}: {w['name']} = {w['source']} "
            f"({_w(lang, 'group')}: {w['group']})"
            for w in facts["world_sizes"]] or [f"- {h[6]}"]
    out += ["", f"## {h[1]}"]
    out += [f"- {_w(lang, 'line', p['line'])}: {p['into'] or '?'} = {p['what']} / {p['parts']}"
            + (f"   [{p['parts_from']['name']} = {p['parts_from']['source']}, "
               f"{_w(lang, 'line', p['parts_from']['line'])}]" if p["parts_from"] else "")
            for p in facts["partitions"]] or [f"- {h[6]}"]
    out += ["", f"## {h[2]}"]
    out += [f"- {_w(lang, 'line', w['line'])}: {w['name']} [{', '.join(w['shape'] or ['?'])}] "
            f"-> {w['layout']} ({w['basis']})" for w in facts["weights"]] or [f"- {h[6]}"]
    out += ["", f"## {h[3]}"]
    for s in facts["sites"]:
        where = ".".join(x for x in (s["class"], s["function"]) if x) or _w(lang, "module")
        out.append(f"- {_w(lang, 'line', s['line'])} {where}: {s['op']} | {_w(lang, 'phase')} "
                   f"{_tr(s['phase'], lang)} ({_tr(s['phase_basis'], lang)}) | "
                   f"{_w(lang, 'kind')} {s['kind']} | {_w(lang, 'async')} {_w(lang, s['async'])}"
                   + (f" | {_w(lang, 'if')} {_cond(s, lang)}" if s["condition"] else "")
                   + (f" | {_w(lang, 'via')} {' -> '.join(s['via'])}" if s["via"] else "")
                   + (f" | {_w(lang, 'through')} {', '.join(s['through'])}"
                      if s.get("through") else "")
                   + (f" | {_w(lang, 'assumed')}: {s['assumed']}" if s.get("assumed") else "")
                   + (f" | {_w(lang, 'helper')}" if s["helper"] else ""))
    grouped: dict[str, dict] = {}  # one line per callee, with every line that calls it
    for u in facts.get("unresolved", []):
        grouped.setdefault(u["call"], dict(u, lines=[]))["lines"].append(str(u["line"]))
    for call, u in grouped.items():
        out.append(f"- {_w(lang, 'line', ', '.join(u['lines']))}: {call}(...) | "
                   + (u["why"] if lang == "en" else u["why"].replace(UNKNOWN, _NMC_ZH)))
    if not facts["sites"] and not facts.get("unresolved"):
        out.append(f"- {h[6]}")
    heads = HEADINGS[lang]
    out += ["", f"## {h[4]}", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in facts["table"]:
        location = r["trigger_location"]
        if lang != "en":  # the phase and the words; the code names stay
            phase, _, rest = location.partition(" · ")
            rest = re.sub(r"\(line (\d+)\)", lambda m: f"（{_w(lang, 'line', m[1])}）", rest)
            via = _w(lang, "via")
            location = f"{_tr(phase, lang)} · " + rest.replace(" via ", f" {via} ")
        cells = [r["index"], r["parallel_type"], r["split_object"], r["primitive"],
                 location + (f" [{_w(lang, 'if')} {_cond(r, lang)}]" if r["condition"] else ""),
                 _w(lang, r["async"]) if isinstance(r["async"], bool) else r["async"]]
        out.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    out += ["", f"## {h[5]}"]
    for i, a in enumerate(facts["answers"].values(), 1):
        cite = f" [{_w(lang, 'line', ', '.join(map(str, a['lines'])))}]" if a["lines"] else ""
        out += [f"{i}. {a['question']}", f"   {a['text']}{cite}"]
    return "\n".join(out) + "\n"


def _summary(events: list[dict], lang: str = "en") -> str:
    """``rank 0: 2x all_gather backward async 512 B at #3, #8 in layers.0.mlp.fc1``."""
    groups: dict[tuple, list[dict]] = {}
    for e in events:
        key = (e["rank"], e["phase"], e["op"], e["async"], e["bytes"], e.get("module"))
        groups.setdefault(key, []).append(e)
    parts = []
    for (rank, phase, op, asy, nbytes, module), evs in groups.items():
        idx = ", ".join(f"#{e['index']}" for e in evs)
        parts.append(f"rank {rank}: {len(evs)}x {op} {_tr(phase, lang)} "
                     f"{_w(lang, 'async' if asy else 'sync')} {nbytes} B {_w(lang, 'at')} {idx}"
                     + (f" {_w(lang, 'in')} {module}" if module else ""))
    return "; ".join(parts)


_RUN_HEAD = {
    "en": ("Recorded run", "every rank", "order #k = position in the rank's communication "
           "sequence", "Recorded in this file but missed by the static reading",
           "Recorded in this file, inside torch's wrappers (their collectives are torch's code, "
           "not this file's)",
           "Recorded by label (a paraloom train run's ledger names paraloom's labels, not source "
           "lines: each label is matched to this file's sites of its owner, op and phase)"),
    "zh": ("实际运行记录", "所有 rank", "#k = 该 rank 通信序列中的位置",
           "运行中在本文件记录到、但静态阅读未找到的通信",
           "运行中在本文件记录到、发生在 torch 封装内部的通信（其集合通信属于 torch 的代码）",
           "按标签记录到（paraloom train 运行的记录写的是 paraloom 的标签而非源码行："
           "每个标签按其所有者、操作和阶段对应到本文件的位置）"),
}


def render_run(facts: dict, run: dict, lang: str = "en") -> str:
    """The text section appended to ``paraloom explain``'s report (headings en/zh)."""
    h = _RUN_HEAD[lang]
    who = h[1] if run["rank"] is None else f"rank {run['rank']}"
    out = ["", f"## {h[0]}: {run['dir']} ({who}; {h[2]})"]
    by_site = {m["site"]: m for m in run["sites"]}
    via = {v["site"]: v for v in run.get("via", [])}
    labelled = {i: g for g in run.get("labels", []) for i in g["candidates"]}
    for i, s in enumerate(facts["sites"]):
        if i in labelled and not by_site.get(i, {}).get("events"):
            out.append(_site_head(s, lang) + f" -> {_w(lang, 'by label')} {labelled[i]['label']}")
            continue
        where = ".".join(x for x in (s["class"], s["function"]) if x) or _w(lang, "module")
        head = (f"- {_w(lang, 'line', s['line'])} {where}: {s['op']} ({_w(lang, 'static')}: "
                f"{_tr(s['phase'], lang)}, {_w(lang, 'async')} {_w(lang, s['async'])})")
        if i in by_site:
            evs = by_site[i]["events"]
            out.append(f"{head} -> {_w(lang, 'recorded')}: {_summary(evs, lang)}" if evs
                       else f"{head} -> {_w(lang, 'not run')}")
            continue
        chain, v = " -> ".join(s["via"]), via.get(i, {})
        head = f"{head} -> {_w(lang, 'via')} {chain}"
        if v.get("to") is not None:
            evs = by_site[v["to"]]["events"]
            out.append(f"{head}: {_w(lang, 'at')} {_w(lang, 'line', by_site[v['to']]['line'])} "
                       f"{_w(lang, 'callers')}: "
                       + (_summary(evs, lang) if evs else _w(lang, "not run")))
        elif v.get("elsewhere") and v.get("events"):
            lines = ", ".join(str(n) for n in sorted({e["line"] for e in v["events"]}))
            out.append(f"{head}: {_w(lang, 'outside')} {_w(lang, 'line', lines)}: "
                       f"{_summary(v['events'], lang)}")
        elif v.get("elsewhere"):
            out.append(f"{head}: {v['elsewhere']} {_w(lang, 'not here')}")
        else:
            out.append(f"{head}: {_w(lang, 'several')}")
    if not facts["sites"]:
        out.append(f"- {_w(lang, 'no site')}")
    if not run.get("matched") and run.get("files"):
        top = sorted(run["files"].items(), key=lambda kv: -kv[1])[:5]
        out.append(f"- {_w(lang, 'no event')} " + ", ".join(f"{f} ({n})" for f, n in top))
    out += ["", f"## {h[3]}"]
    out += [f"- {_w(lang, 'line', e['line'])} {e['function'] or ''}: {_summary([e], lang)}"
            for e in run["missed"]] or [f"- {_w(lang, 'none')}"]
    if run.get("labels") or run.get("labels_elsewhere"):
        out += ["", f"## {h[5]}"] + _label_lines(facts, run, lang)
    if run.get("inside"):
        out += ["", f"## {h[4]}"]
        out += [f"- {_w(lang, 'line', e['line'])} {e['function'] or ''}: {_summary([e], lang)}"
                f" <- {e['wrapper']}" for e in run["inside"]]
    return "\n".join(out) + "\n"


def _site_head(s: dict, lang: str) -> str:
    where = ".".join(x for x in (s["class"], s["function"]) if x) or _w(lang, "module")
    return (f"- {_w(lang, 'line', s['line'])} {where}: {s['op']} ({_w(lang, 'static')}: "
            f"{_tr(s['phase'], lang)}, {_w(lang, 'async')} {_w(lang, s['async'])})")


def _label_lines(facts: dict, run: dict, lang: str) -> list[str]:
    """One line per (label, op, phase) of a train run's ledger that this file owns."""
    out = []
    for g in run.get("labels", []):
        lines = sorted({facts["sites"][i]["line"] for i in g["candidates"]})
        where = (_w(lang, "no static") if not lines else
                 _w(lang, "one site", lines[0]) if len(lines) == 1 else
                 _w(lang, "one of", ", ".join(map(str, lines))))
        out.append(f"- {g['label']}: {_summary(g['events'], lang)}; {where}")
    if run.get("labels_elsewhere"):
        out.append(f"- {_w(lang, 'elsewhere labels', run['labels_elsewhere'])}")
    return out
