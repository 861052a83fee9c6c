"""Loading the snippet to read: ``PATH``, ``PATH:START-END`` or ``-`` (stdin).

A range may start inside a class or a function, so the lines are dedented and, if they still do
not parse (a block cut in the middle), trailing lines are dropped until they do; line numbers
always refer to the original file.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Snippet", "SourceError", "load_snippet", "parse_snippet"]

_RANGE = re.compile(r"^(?P<path>.+):(?P<start>[^:-]*)(?:-(?P<end>[^:]*))?$")


class SourceError(ValueError):
    """A bad path, range or unparsable snippet; the message names the value."""


@dataclass(frozen=True)
class Snippet:
    """The lines being read: ``text`` holds file lines ``first..last`` (1-based, inclusive)."""

    name: str
    text: str
    first: int
    last: int
    full: str | None = None
    """The whole file when ``text`` is a range of it: names resolve from all of it."""

    def numbered(self) -> str:
        """The snippet with its original line numbers, as sent to a language model."""
        return "\n".join(f"{self.first + i:5d}  {line}"
                         for i, line in enumerate(self.text.splitlines()))


def _read(path: str, stdin) -> str:
    """The text of ``path`` (``-``: standard input), UTF-8, a byte-order mark dropped."""
    if path == "-":
        stream = stdin or sys.stdin
        if stream is None or getattr(stream, "closed", False):
            raise SourceError("- reads standard input, which is closed: pipe the code in "
                              "(cat f.py | paraloom explain -) or give a file")
        raw = getattr(stream, "buffer", None)
        try:
            data = raw.read() if raw is not None else stream.read()
        except OSError as err:
            raise SourceError(f"- cannot read standard input: {err}") from None
        if isinstance(data, bytes):
            try:
                data = data.decode("utf-8")
            except UnicodeDecodeError as err:
                raise SourceError(f"- : standard input is not UTF-8 text (byte {err.start} is "
                                  f"{data[err.start]:#04x}); explain reads Python source") from None
        return data.removeprefix("\ufeff")
    p = Path(path)
    if p.is_dir():
        raise SourceError(f"{path!r} is a folder: give a Python file in it (PATH or "
                          f"PATH:START-END)")
    if not p.is_file():
        raise SourceError(f"no such file: {path!r}")
    try:
        return p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise SourceError(f"cannot read {path!r}: not UTF-8 text (byte {err.start}); explain "
                          f"reads Python source") from None
    except OSError as err:
        raise SourceError(f"cannot read {path!r}: {err}") from None


def load_snippet(spec: str, stdin=None) -> Snippet:
    """Read ``PATH``, ``PATH:START-END`` (1-based, inclusive) or ``-`` / ``-:START-END``."""
    path, first, last = spec, None, None
    m = _RANGE.match(spec)
    if m and not (spec != "-" and Path(spec).is_file()):
        path = m["path"]
        end = m["start"] if m["end"] is None else m["end"]  # PATH:N is the one line N
        try:
            first, last = int(m["start"]), int(end)
        except ValueError:
            given = m["start"] if m["end"] is None else f"{m['start']}-{m['end']}"
            raise SourceError(f"bad line range {given!r} in {spec!r}: expected START-END (two "
                              f"line numbers) or N (one line)") from None
    text = _read(path, stdin)
    lines = text.splitlines()
    if first is None:
        return Snippet(path, text, 1, max(len(lines), 1))
    if first > last:
        raise SourceError(f"line range {first}-{last} is reversed: START must not be after END "
                          f"(did you mean {last}-{first}?)")
    if not 1 <= first <= last <= len(lines):
        raise SourceError(f"line range {first}-{last} is outside {path!r}, which has "
                          f"{len(lines)} lines (need 1 <= START <= END <= {len(lines)})")
    return Snippet(path, "\n".join(lines[first - 1:last]) + "\n", first, last, full=text)


def _try_parse(lines: list[str]) -> tuple[ast.Module | None, SyntaxError | None]:
    """Parse ``lines`` (dedented), dropping up to 20 trailing lines of a block cut short."""
    text = textwrap.dedent("\n".join(lines)).splitlines()
    error = None
    for keep in range(len(text), max(len(text) - 21, 0), -1):
        try:
            tree = ast.parse("\n".join(text[:keep]) + "\n")
        except SyntaxError as err:
            error = error or err
            continue
        if tree.body or not any(line.strip() and not line.strip().startswith("#")
                                for line in text[keep:]):
            return tree, None  # not a comment line left alone after dropping the code
    return None, error


def parse_snippet(snippet: Snippet) -> ast.Module:
    """Parse the snippet; every node's ``lineno`` is shifted to the original file's numbering.

    A range that starts inside a deeper block than it ends in (the tail of one function, then
    a class) loses its leading lines up to the first one that lets the rest parse."""
    lines = snippet.text.splitlines()
    if not any(line.strip() for line in lines):
        return ast.Module(body=[], type_ignores=[])
    first_error = None
    for lead in range(0, min(len(lines), 40)):
        tree, error = _try_parse(lines[lead:])
        first_error = first_error or error
        if tree is None and not isinstance(first_error, IndentationError):
            break  # a real syntax error, not a block cut at the start
        if tree is not None:
            ast.increment_lineno(tree, snippet.first - 1 + lead)
            return tree
    line = (first_error.lineno or 1) + snippet.first - 1
    raise SourceError(f"{snippet.name!r} does not parse as Python near line {line}: "
                      f"{first_error.msg}")
