"""``paraloom explain`` and ``paraloom doctor``.

    paraloom explain PATH[:START-END] [--json] [--lang en|zh]       # or - for stdin
    paraloom explain --ask "QUESTION" PATH[:START-END]              # via an OpenAI-compatible model
    paraloom explain PATH --run DIR [--rank R|all]                  # next to a recorded run
    paraloom doctor [--config ~/.codex/config.toml]                 # diagnose the provider setup

Exit codes: 0 ok, 1 the provider failed or its answer contradicts the facts (``--ask``) or
doctor found problems, 2 bad input (the message names the value).
"""

from __future__ import annotations

import argparse
import json
import sys

from .answers import answer_all, order_rows
from .facts import extract
from .rules import UNKNOWN
from .source import SourceError, load_snippet

__all__ = ["explain", "render", "to_json", "explain_main", "doctor_main"]

_NMC_ZH = "需要更多上下文"
_HEAD = {
    "en": ("World sizes", "Partitions (divide)", "Local weights", "Communication sites",
           "Communication order (static: forward in source order, then backward)",
           "Checklist", "none in this snippet"),
    "zh": ("并行规模（world size）", "切分（divide）", "本地权重", "通信位置",
           "通信顺序（静态：先按源码顺序的前向，再反向）", "检查清单", "片段中没有"),
}


def explain(spec: str, lang: str = "en", stdin=None) -> dict:
    """Facts, order table and checklist answers of ``PATH[:START-END]`` (or ``-``)."""
    facts = extract(load_snippet(spec, stdin))
    facts["table"] = order_rows(facts)
    facts["answers"] = answer_all(facts, facts["guards"], lang)
    return facts


def to_json(facts: dict) -> dict:
    """The ``--json`` document (issue 8's shape plus weights, table and file)."""
    keys = ("line", "class", "function", "phase", "op", "kind", "async", "condition", "via",
            "helper", "phase_basis", "through", "assumed")
    return {"file": facts["file"], "lines": facts["lines"],
            "sites": [{k: s[k] for k in keys} for s in facts["sites"]],
            "unresolved": facts["unresolved"],
            "partitions": facts["partitions"], "world_sizes": facts["world_sizes"],
            "weights": facts["weights"], "table": facts["table"], "answers": facts["answers"]}


def render(facts: dict, lang: str = "en") -> str:
    """Plain-text report: every fact with its line number."""
    from ..report.table import HEADINGS

    h = _HEAD[lang]
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


def explain_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="paraloom explain", description=__doc__.splitlines()[0])
    ap.add_argument("target", metavar="PATH[:START-END]", help="a Python file, or - for stdin")
    ap.add_argument("--json", action="store_true", help="print the facts as JSON")
    ap.add_argument("--lang", choices=("en", "zh"), default="en")
    ap.add_argument("--ask", metavar="QUESTION", help="ask an OpenAI-compatible model")
    ap.add_argument("--config", help="Codex-style config.toml (default ~/.codex/config.toml)")
    ap.add_argument("--run", metavar="DIR", help="a recorded run (paraloom record/train folder "
                    "or ledger.jsonl): mark each site with what the run did there")
    ap.add_argument("--rank", default="0", help="rank of the run to show, or 'all' (default 0)")
    args = ap.parse_args(argv)
    try:
        facts = explain(args.target, args.lang)
        if args.run:
            from .run import annotate
            facts["run"] = annotate(facts, args.run, _rank(args.rank))
    except SourceError as err:
        print(f"paraloom explain: error: {err}", file=sys.stderr)
        return 2
    if args.ask:
        from . import llm
        try:
            reply = llm.ask(args.ask, load_snippet(args.target), facts, args.config, args.lang)
        except llm.ProviderError as err:
            print(f"paraloom explain: provider error: {err}\n(run `paraloom doctor`)",
                  file=sys.stderr)
            return 1
        if reply["flags"]:
            print(f"paraloom explain: the answer contradicts the extracted facts in "
                  f"{len(reply['flags'])} place(s) (marked !!); exit status 1", file=sys.stderr)
        if args.json:
            print(json.dumps(dict(to_json(facts), ask=reply), ensure_ascii=False, indent=1))
            return 1 if reply["flags"] else 0
        print(reply["answer"].rstrip() + "\n")
        for flag in reply["flags"]:
            print(f"!! {flag}")
        print("\n--- extracted facts, for comparison ---\n")
    if args.json and not args.ask:
        doc = dict(to_json(facts), **({"run": facts["run"]} if "run" in facts else {}))
        print(json.dumps(doc, ensure_ascii=False, indent=1))
    else:
        sys.stdout.write(render(facts, args.lang))
        if "run" in facts:
            from .run import render_run
            sys.stdout.write(render_run(facts, facts["run"], args.lang))
    return 1 if args.ask and reply["flags"] else 0


def _rank(text: str) -> int | None:
    if text == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise SourceError(f"--rank {text!r}: expected a rank number or 'all'") from None


def doctor_main(argv: list[str] | None = None) -> int:
    from .doctor import doctor_main as main
    return main(argv)

