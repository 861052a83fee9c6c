"""Where an imported module's source is, without importing it: for following calls across files.

A dotted module name is looked for, in order, next to the file being read (a relative import,
or an absolute one under any folder above the file: the file's package root or the project),
under the current directory, and among installed packages (``importlib.util.find_spec`` of the
top-level package only, which imports nothing but a parent package's ``__init__`` when the name
is dotted, so only the top level is asked and the rest is walked on disk). Parsed files are
cached per :class:`Project`; what a parsed file becomes (a :class:`~.module.Module`) is given
to the project by its maker, so this module needs nothing of the reader above it.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["Project", "SKIPPED", "is_skipped"]

SKIPPED = frozenset(sys.stdlib_module_names) | {"torch", "numpy", "typing_extensions"}
"""Top-level packages whose calls are not followed: the standard library, numpy, and torch
(whose communication the reader knows by name: torch.distributed, functional collectives,
DTensor, symmetric memory)."""

_MAX_BYTES = 400_000  # a larger file is not parsed to follow one call


def is_skipped(dotted: str) -> bool:
    return dotted.lstrip(".").split(".")[0] in SKIPPED and not dotted.startswith(".")


def _as_file(base: Path, parts: list[str]) -> Path | None:
    if not parts:
        init = base / "__init__.py"
        return init if init.is_file() else None
    stem = base.joinpath(*parts)
    for cand in (stem.with_suffix(".py"), stem / "__init__.py"):
        if cand.is_file():
            return cand
    return None


class Project:
    """Finds and parses the source files that calls lead to (one parse per file).

    ``build(tree, path, project)`` makes what :meth:`load` returns for a parsed file."""

    def __init__(self, build: Callable[[ast.Module, Path, Project], object]) -> None:
        self.build = build
        self.modules: dict[Path, object] = {}  # path -> built module (or None if unparsable)
        self._roots: dict[str, Path | None] = {}

    def find(self, dotted: str, importer: Path | None) -> Path | None:
        """The source file of module ``dotted`` imported from ``importer`` (None: not found)."""
        level = len(dotted) - len(dotted.lstrip("."))
        parts = [p for p in dotted.lstrip(".").split(".") if p]
        if level:
            if importer is None:
                return None
            base = importer.parent
            for _ in range(level - 1):
                base = base.parent
            return _as_file(base, parts)
        if not parts:
            return None
        bases = list(importer.parents) if importer is not None else []
        bases.append(Path.cwd())
        for base in bases:
            found = _as_file(base, parts)
            if found is not None:
                return found
        root = self._installed(parts[0])
        if root is None or root.is_file():
            return root if root is not None and len(parts) == 1 else None
        return _as_file(root, parts[1:])

    def _installed(self, top: str) -> Path | None:
        if top not in self._roots:
            try:
                spec = importlib.util.find_spec(top)
            except (ImportError, ValueError):
                spec = None
            path = None
            if spec is not None and spec.submodule_search_locations:
                path = Path(list(spec.submodule_search_locations)[0])
            elif spec is not None and spec.origin and spec.origin.endswith(".py"):
                path = Path(spec.origin)  # a single-file module
            self._roots[top] = path
        return self._roots[top]

    def load(self, path: Path):
        """The built module of ``path`` (None if it does not parse)."""
        path = path.resolve()
        if path not in self.modules:
            self.modules[path] = None  # guards import cycles while parsing
            try:
                text = path.read_text(encoding="utf-8")
                tree = ast.parse(text) if len(text) <= _MAX_BYTES else None
            except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
                tree = None
            if tree is not None:
                self.modules[path] = self.build(tree, path, self)
        return self.modules[path]
