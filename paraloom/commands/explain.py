"""``paraloom explain`` and ``paraloom doctor``.

    paraloom explain PATH[:START-END] [--json] [--lang en|zh]       # or - for stdin
    paraloom explain PATH --set self.sequence_parallel=True ...     # decide conditions
    paraloom explain PATH --preset megatron:tp=2,sp=on              # Megatron-Core's settings
    paraloom explain --ask "QUESTION" PATH[:START-END]              # via an OpenAI-compatible model
    paraloom explain PATH --run DIR [--rank R|all]                  # next to a recorded run
    paraloom doctor [--config ~/.codex/config.toml]                 # diagnose the provider setup

Exit codes: 0 ok, 1 the provider failed or its answer contradicts the facts (``--ask``) or
doctor found problems, 2 bad input (the message names the value; also a provider setup that
is wrong before any request: no config, a missing table or key).

Wiring: the facts are :func:`paraloom.explain.explain`'s, the question and the check of the
answer :mod:`paraloom.explain.grounding`'s, the answer :func:`paraloom.llm.ask`'s, the text
:mod:`paraloom.report.explain_text`'s. ``paraloom doctor`` is :mod:`.doctor`.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

from .. import llm
from ..explain import (
    SYSTEM,
    SourceError,
    annotate,
    contradictions,
    explain,
    load_snippet,
    presets,
    question,
    to_json,
)
from ..explain.conditions import parse_settings
from ..report.explain_text import render, render_run

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="paraloom explain", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="--ask reads a Codex-style config.toml (--config, default "
               "~/.codex/config.toml); `paraloom doctor` checks it:\n\n"
               + textwrap.indent(llm.EXAMPLE_CONFIG, "  "))
    ap.add_argument("target", metavar="PATH[:START-END]", help="a Python file, or - for stdin")
    ap.add_argument("--json", action="store_true", help="print the facts as JSON")
    ap.add_argument("--lang", choices=("en", "zh"), default="en")
    ap.add_argument("--ask", metavar="QUESTION", help="ask an OpenAI-compatible model")
    ap.add_argument("--config", help="Codex-style config.toml (default ~/.codex/config.toml; "
                    "its form below)")
    ap.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                    help="--ask: deadline of the model's whole answer (default 60)")
    ap.add_argument("--run", metavar="DIR", help="a recorded run (paraloom record/train folder "
                    "or ledger.jsonl): mark each site with what the run did there")
    ap.add_argument("--rank", default="0", help="rank of the run to show, or 'all' (default 0)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="decide the conditions that read NAME (as written in the code: "
                    "self.sequence_parallel, config.sequence_parallel, ctx.allreduce_dgrad, "
                    "weight.requires_grad; or a bare name) with VALUE, a Python literal; the "
                    "report keeps the sites that run or may run (repeatable)")
    ap.add_argument("--preset", action="append", default=[], metavar="FRAMEWORK:K=V,...",
                    help="settings of a framework's configuration, expanded to --set values "
                    "(--set wins): " + "; ".join(presets.describe()))
    return ap


def _rank(text: str) -> int | None:
    if text == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise SourceError(f"--rank {text!r}: expected a rank number or 'all'") from None


def _settings(args) -> dict:
    """``--preset`` expanded, then ``--set`` over it (bad input: SourceError, exit 2)."""
    try:
        out = {}
        for spec in args.preset:
            out.update(presets.expand(spec))
        out.update(parse_settings(args.set))
    except ValueError as err:
        raise SourceError(str(err)) from None
    return out


def _ask(args, snippet, facts: dict) -> dict:
    """``{"answer", "flags", "provider"}``: the model's answer, checked against the facts."""
    got = llm.ask(SYSTEM, question(args.ask, snippet, facts, args.lang), args.config,
                  timeout=args.timeout)
    return {"answer": got["answer"], "flags": contradictions(got["answer"], facts),
            "provider": got["provider"]}


_STDIN_RANGE = "\x00stdin"
"""Stands in for ``-`` in ``-:START-END`` while argparse reads the line (which would take it for
a flag)."""


def main(argv: list[str] | None = None) -> int:
    typed = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args([_STDIN_RANGE + t[1:] if t.startswith("-:") else t
                                 for t in typed])
    if args.target.startswith(_STDIN_RANGE):
        args.target = "-" + args.target[len(_STDIN_RANGE):]
    if not 0 < args.timeout < 3600:
        print(f"paraloom explain: error: --timeout {args.timeout:g}: expected seconds in "
              f"(0, 3600)", file=sys.stderr)
        return 2
    try:
        settings = _settings(args)
        snippet = load_snippet(args.target)  # once: stdin can be read only once
        facts = explain(snippet, args.lang, settings=settings)
        if args.run:
            facts["run"] = annotate(facts, args.run, _rank(args.rank))
    except SourceError as err:
        print(f"paraloom explain: error: {err}", file=sys.stderr)
        return 2
    if args.ask:
        try:
            reply = _ask(args, snippet, facts)
        except llm.ConfigError as err:  # the setup, before any request: bad input
            print(f"paraloom explain: error: {err}\n(run `paraloom doctor`; the config's "
                  f"form: paraloom explain --help)", file=sys.stderr)
            return 2
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
            sys.stdout.write(render_run(facts, facts["run"], args.lang))
    return 1 if args.ask and reply["flags"] else 0
