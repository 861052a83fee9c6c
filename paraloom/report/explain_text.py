"""``paraloom explain``'s text report: the static reading (:func:`render`) and, with ``--run``,
the recorded run next to it (:func:`render_run`), headings in English or Chinese.

Presentation only: the facts are :func:`paraloom.explain.explain`'s, the run marks
:func:`paraloom.explain.run.annotate`'s; the order table has the columns of :mod:`.table`.
Every fact is written with its line number.
"""

from __future__ import annotations

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


def render(facts: dict, lang: str = "en") -> str:
    """Plain-text report: every fact with its line number."""
    h = _STATIC_HEAD[lang]
    out = [f"{facts['file']} lines {facts['lines'][0]}-{facts['lines'][1]}", "", f"## {h[0]}"]
    out += [f"- line {w['line']}: {w['name']} = {w['source']} (group: {w['group']})"
            for w in facts["world_sizes"]] or [f"- {h[6]}"]
    out += ["", f"## {h[1]}"]
    out += [f"- line {p['line']}: {p['into'] or '?'} = {p['what']} / {p['parts']}"
            + (f"   [{p['parts_from']['name']} = {p['parts_from']['source']}, line "
               f"{p['parts_from']['line']}]" if p["parts_from"] else "")
            for p in facts["partitions"]] or [f"- {h[6]}"]
    out += ["", f"## {h[2]}"]
    out += [f"- line {w['line']}: {w['name']} [{', '.join(w['shape'] or ['?'])}] -> {w['layout']}"
            f" ({w['basis']})" for w in facts["weights"]] or [f"- {h[6]}"]
    out += ["", f"## {h[3]}"]
    for s in facts["sites"]:
        where = ".".join(x for x in (s["class"], s["function"]) if x) or "module"
        out.append(f"- line {s['line']} {where}: {s['op']} | phase {s['phase']} "
                   f"({s['phase_basis']}) | kind {s['kind']} | async {s['async']}"
                   + (f" | if {s['condition']}" if s["condition"] else "")
                   + (f" | via {' -> '.join(s['via'])}" if s["via"] else "")
                   + (f" | through {', '.join(s['through'])}" if s.get("through") else "")
                   + (f" | assumed: {s['assumed']}" if s.get("assumed") else "")
                   + (" | helper" if s["helper"] else ""))
    grouped: dict[str, dict] = {}  # one line per callee, with every line that calls it
    for u in facts.get("unresolved", []):
        grouped.setdefault(u["call"], dict(u, lines=[]))["lines"].append(str(u["line"]))
    for call, u in grouped.items():
        out.append(f"- line {', '.join(u['lines'])}: {call}(...) | "
                   + (u["why"] if lang == "en" else u["why"].replace(UNKNOWN, _NMC_ZH)))
    if not facts["sites"] and not facts.get("unresolved"):
        out.append(f"- {h[6]}")
    heads = HEADINGS[lang]
    out += ["", f"## {h[4]}", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in facts["table"]:
        cells = [r["index"], r["parallel_type"], r["split_object"], r["primitive"],
                 r["trigger_location"] + (f" [if {r['condition']}]" if r["condition"] else ""),
                 r["async"]]
        out.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    out += ["", f"## {h[5]}"]
    for i, a in enumerate(facts["answers"].values(), 1):
        cite = f" [lines {', '.join(map(str, a['lines']))}]" if a["lines"] else ""
        out += [f"{i}. {a['question']}", f"   {a['text']}{cite}"]
    return "\n".join(out) + "\n"


def _summary(events: list[dict]) -> str:
    """``rank 0: 2x all_gather backward async 512 B at #3, #8 in layers.0.mlp.fc1``."""
    groups: dict[tuple, list[dict]] = {}
    for e in events:
        key = (e["rank"], e["phase"], e["op"], e["async"], e["bytes"], e.get("module"))
        groups.setdefault(key, []).append(e)
    parts = []
    for (rank, phase, op, asy, nbytes, module), evs in groups.items():
        idx = ", ".join(f"#{e['index']}" for e in evs)
        parts.append(f"rank {rank}: {len(evs)}x {op} {phase} {'async' if asy else 'sync'} "
                     f"{nbytes} B at {idx}" + (f" in {module}" if module else ""))
    return "; ".join(parts)


_RUN_HEAD = {
    "en": ("Recorded run", "every rank", "order #k = position in the rank's communication "
           "sequence", "Recorded in this file but missed by the static reading"),
    "zh": ("实际运行记录", "所有 rank", "#k = 该 rank 通信序列中的位置",
           "运行中在本文件记录到、但静态阅读未找到的通信"),
}


def render_run(facts: dict, run: dict, lang: str = "en") -> str:
    """The text section appended to ``paraloom explain``'s report (headings en/zh)."""
    h = _RUN_HEAD[lang]
    who = h[1] if run["rank"] is None else f"rank {run['rank']}"
    out = ["", f"## {h[0]}: {run['dir']} ({who}; {h[2]})"]
    by_site = {m["site"]: m for m in run["sites"]}
    via = {v["site"]: v for v in run.get("via", [])}
    for i, s in enumerate(facts["sites"]):
        where = ".".join(x for x in (s["class"], s["function"]) if x) or "module"
        head = f"- line {s['line']} {where}: {s['op']} (static: {s['phase']}, async {s['async']})"
        if i in by_site:
            evs = by_site[i]["events"]
            out.append(f"{head} -> recorded: {_summary(evs)}" if evs
                       else f"{head} -> not run in the recorded run")
            continue
        chain, v = " -> ".join(s["via"]), via.get(i, {})
        if v.get("to") is not None:
            evs = by_site[v["to"]]["events"]
            out.append(f"{head} -> via {chain}: at line {by_site[v['to']]['line']} (all its "
                       f"callers): "
                       + (_summary(evs) if evs else "not run in the recorded run"))
        elif v.get("elsewhere") and v.get("events"):
            lines = ", ".join(str(n) for n in sorted({e["line"] for e in v["events"]}))
            out.append(f"{head} -> via {chain}: defined outside this file; recorded where this "
                       f"file runs it, line {lines}: {_summary(v['events'])}")
        elif v.get("elsewhere"):
            out.append(f"{head} -> via {chain}: {v['elsewhere']} is not defined in this file; "
                       f"its calls carry its own file's site")
        else:
            out.append(f"{head} -> via {chain}: several paths through helpers; see their "
                       f"direct sites above and below")
    if not facts["sites"]:
        out.append("- no communication site in the static reading")
    if not run.get("matched") and run.get("files"):
        top = sorted(run["files"].items(), key=lambda kv: -kv[1])[:5]
        out.append("- no recorded event names this file (or line range); the run's calls come "
                   "from: " + ", ".join(f"{f} ({n})" for f, n in top))
    out += ["", f"## {h[3]}"]
    out += [f"- line {e['line']} {e['function'] or ''}: {_summary([e])}"
            for e in run["missed"]] or ["- none"]
    return "\n".join(out) + "\n"
