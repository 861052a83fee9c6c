"""What ``paraloom explain`` reports on a snippet: :func:`explain` (every fact, the order table
and the checklist answers) and :func:`to_json` (the ``--json`` document).

The facts come from :func:`~.facts.extract` (static reading with ``ast``; nothing is imported
or run), the table and the answers from :mod:`.answers`, which use the facts only. The text
form is presentation: :func:`paraloom.report.explain_text.render`.
"""

from __future__ import annotations

from .answers import answer_all, order_rows
from .facts import extract
from .source import Snippet, load_snippet

__all__ = ["explain", "to_json"]

_SITE_KEYS = ("line", "class", "function", "phase", "op", "kind", "async", "condition",
              "active", "open", "via", "helper", "phase_basis", "through", "assumed")


def explain(spec: str | Snippet, lang: str = "en", stdin=None,
            settings: dict | None = None) -> dict:
    """Facts, order table and checklist answers of ``PATH[:START-END]`` (or ``-``: ``stdin``,
    default ``sys.stdin``), or of an already loaded :class:`~.source.Snippet`.

    ``settings`` (``{name as written in the code: value}``, ``--set``) decide the conditions
    they name: ``sites`` keeps the sites that run or may run (``active`` True or None), and
    ``inactive`` the ones the settings rule out (listed only in ``--json``)."""
    snippet = spec if isinstance(spec, Snippet) else load_snippet(spec, stdin)
    facts = extract(snippet, settings)
    facts["settings"] = dict(settings or {})
    facts["inactive"] = [s for s in facts["sites"] if s["active"] is False]
    facts["sites"] = [s for s in facts["sites"] if s["active"] is not False]
    facts["table"] = order_rows(facts)
    facts["answers"] = answer_all(facts, facts["guards"], lang)
    return facts


def to_json(facts: dict) -> dict:
    """The ``--json`` document: file and lines, the settings, every site (``active`` true,
    false, or null with its ``open`` conditions), unresolved calls, partitions, world sizes,
    local weights, the order table and the answers."""
    every = sorted(facts["sites"] + facts.get("inactive", []),
                   key=lambda s: (s["line"], s["op"]))
    return {"file": facts["file"], "lines": facts["lines"],
            "settings": {k: repr(v) if not isinstance(v, (bool, int, float, str, type(None)))
                         else v for k, v in facts.get("settings", {}).items()},
            "sites": [{k: s[k] for k in _SITE_KEYS} for s in every],
            "unresolved": facts["unresolved"],
            "partitions": facts["partitions"], "world_sizes": facts["world_sizes"],
            "weights": facts["weights"], "table": facts["table"], "answers": facts["answers"]}
