"""Where a ledger event's communication is written in source, and what ``explain`` reads there.

Two kinds of ``site``:

* a recorded program's (``paraloom record``): ``path/to/file.py:LINE function`` — the file and
  line are in the site;
* paraloom's own labels (``ColumnParallelLinear.backward:input_grad``, ``p2p.send_forward``,
  ``finalize_model_grads:embedding_grads``): the label is looked up in paraloom's source — first
  as a quoted literal, then its head (before ``:``) as a literal, then the class it names
  (``class ColumnParallelLinear``), then a module named by its first part (``p2p.py``) —
  giving the file and line of the label, the class or the module.

The explain facts for the place are the static sites of :func:`paraloom.explain.facts.extract`
in that file: at the line's statement (a few lines above it for a call spread over lines), or,
when the place is a class, that class's and its helpers' sites with the event's op and phase.
A file that cannot be read or parsed gives the place without facts.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from ..explain.facts import extract
from ..explain.run import parse_site
from ..explain.source import SourceError, load_snippet

__all__ = ["resolve_site", "site_facts"]

_PKG = Path(__file__).resolve().parents[1]
_NOT_SITES = ("report", "explain", "record", "llm", "commands", "analysis", "verify", "measure")
"""Packages that name labels (the table, the formulas, plan --table's order) but never
communicate: a label is looked up where it is issued."""
_FACT_KEYS = ("line", "class", "function", "op", "kind", "phase", "async", "condition", "call")


@lru_cache(maxsize=1)
def _paraloom_sources() -> tuple[tuple[Path, tuple[str, ...]], ...]:
    return tuple((p, tuple(p.read_text(encoding="utf-8").splitlines()))
                 for p in sorted(_PKG.rglob("*.py"))
                 if p.relative_to(_PKG).parts[0] not in _NOT_SITES)


def _find(pattern: re.Pattern) -> tuple[Path, int] | None:
    for path, lines in _paraloom_sources():
        for i, line in enumerate(lines):
            if pattern.search(line):
                return path, i + 1
    return None


@lru_cache(maxsize=512)
def resolve_site(site: str) -> dict | None:
    """``{"file", "path", "line", "how"}`` for ``site`` (``how``: ``recorded``, ``label``,
    ``class`` or ``module``), or ``None`` when no place is known. ``file`` is shown (relative
    to paraloom's package for its own sources); ``path`` is the file to read."""
    where = parse_site(site)
    if where and where[0].endswith(".py"):
        return {"file": where[0], "path": where[0], "line": where[1], "how": "recorded"}
    head = site.partition(":")[0]
    found, how = None, "label"
    for text in dict.fromkeys((site, head)):
        found = _find(re.compile(r"[\"']" + re.escape(text) + r"[\"'.:{]"))
        if found:
            break
    if not found:
        name = head.split(".")[0]
        found, how = _find(re.compile(r"^\s*class " + re.escape(name) + r"\b")), "class"
    if not found:  # ``p2p.send_forward``: a label built in module p2p.py
        module = next((p for p, _ in _paraloom_sources() if p.stem == head.split(".")[0]), None)
        found, how = ((module, 1), "module") if module else (None, how)
    if not found:
        return None
    path, line = found
    return {"file": "paraloom/" + path.relative_to(_PKG).as_posix(), "path": str(path),
            "line": line, "how": how}


@lru_cache(maxsize=64)
def _facts_of(path: str) -> tuple[dict, ...] | None:
    try:
        return tuple(extract(load_snippet(path))["sites"])
    except (SourceError, OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None


def site_facts(place: dict, op: str, phase: str) -> list[dict] | None:
    """The explain facts for ``place`` (from :func:`resolve_site`) of an ``op`` in ``phase``;
    ``None`` when the file cannot be read or parsed."""
    sites = _facts_of(place["path"])
    if sites is None:
        return None
    line = place["line"]
    if place["how"] in ("class", "module"):
        chosen = [s for s in sites if s["op"] == op and s["phase"] in (phase, "unknown")]
        if not chosen and op in ("send", "recv"):  # a p2p helper batches its sends/receives
            chosen = [s for s in sites if s["op"] in ("batch_p2p", "isend", "irecv", op)]
    else:
        near = [s for s in sites if line - 4 <= s["line"] <= line]
        best = max((s["line"] for s in near), default=None)
        chosen = [s for s in near if s["line"] == best]
        if place["how"] == "label" and not chosen:
            chosen = [s for s in sites if s["op"] == op and s["phase"] == phase][:3]
    return [{k: s.get(k) for k in _FACT_KEYS} for s in chosen[:4]]
