"""The condition a communication site sits under, read from its source file.

A rank that runs an extra collective or skips one usually does so under a rank-local
condition (``if loss > 2.5:``, ``if rank == 3:``). Given an event's ``site``
(``path:LINE function``), :func:`condition_of` finds the innermost ``if`` / ``while`` of the
file whose body holds that line and quotes its test, so the explanation can say where to look.
Nothing is said when the file cannot be read (another machine, a frozen module).
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

__all__ = ["condition_of", "split_site"]


def split_site(site: str | None) -> tuple[str, int] | None:
    """``("prog.py", 88)`` from ``"prog.py:88 main"``, or ``None``."""
    if not site or ":" not in site:
        return None
    place = site.split(" ")[0]
    path, _, line = place.rpartition(":")
    return (path, int(line)) if line.isdigit() and path else None


@lru_cache(maxsize=64)
def _tree(path: str) -> tuple[ast.AST, str] | None:
    try:
        text = Path(path).read_text()
        return ast.parse(text), text
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None


def _innermost(tree: ast.AST, line: int, kinds: tuple) -> tuple | None:
    best = None
    for node in ast.walk(tree):
        if not isinstance(node, kinds):
            continue
        for body in (node.body, node.orelse):
            if body and body[0].lineno <= line <= (body[-1].end_lineno or body[-1].lineno):
                inside = body is node.body
                if best is None or node.lineno > best[0].lineno:
                    best = (node, inside)
    return best


def condition_of(event: dict, loops: bool = False) -> str:
    """``", under `if loss > 2.5:` (prog.py:87)"`` for the event's site, or ``""``; with
    ``loops``, the innermost ``for`` / ``while`` loop instead (a stage running another number of
    microbatches)."""
    place = split_site(event.get("site"))
    if place is None:
        return ""
    parsed = _tree(place[0])
    if parsed is None:
        return ""
    tree, text = parsed
    kinds = (ast.While, ast.For) if loops else (ast.If, ast.While)
    found = _innermost(tree, place[1], kinds)
    if found is None:
        return ""
    node, inside = found
    if isinstance(node, ast.For):
        head = f"{ast.unparse(node.target)} in {ast.unparse(node.iter)}"
        return f", in the loop `for {head}:` ({place[0]}:{node.lineno})"
    test = ast.get_source_segment(text, node.test) or ast.unparse(node.test)
    keyword = "while" if isinstance(node, ast.While) else "if"
    where = "under" if inside else "in the else branch of"
    return f", {where} `{keyword} {test}:` ({place[0]}:{node.lineno})"
