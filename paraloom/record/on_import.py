"""Run a function on a module right after it is imported, without importing it up front.

The recorder adapts a few third-party modules (pipelining's stage, Megatron-Core's schedules and
optimizers, and, with ``--megatron-on-cpu``, Megatron's CUDA-minded modules). Importing them
eagerly would cost every record seconds and would change what the program imports; instead one
``sys.meta_path`` finder, which finds nothing itself, lets the other finders find the module and
runs the registered functions right after the module's code has run, before the importer sees
it. Modules imported already get the function at once.

    after_import("torch.distributed.pipelining.stage", tag_stage)
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable

__all__ = ["after_import", "forget", "around_import"]

_AFTER: dict[str, list[Callable]] = {}  # module name (or "prefix.") -> functions to run
_AROUND: list[Callable] = []  # context-manager factories entered while a megatron module runs


def _wanted(name: str) -> list[Callable]:
    found = list(_AFTER.get(name, ()))
    for key, fns in _AFTER.items():
        if key.endswith(".") and name.startswith(key):
            found += fns
    return found


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        fns = _wanted(name)
        if not fns:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module, run=run, name=name):
                    around = [make() for make in _AROUND if name.startswith("megatron.")]
                    for ctx in around:
                        ctx.__enter__()
                    try:
                        run(module)
                    finally:
                        for ctx in reversed(around):
                            ctx.__exit__(None, None, None)
                    for fn in _wanted(name):
                        fn(module)
                spec.loader.exec_module = exec_module
                return spec
        return None


_FINDER = _Finder()


def after_import(name: str, fn: Callable) -> None:
    """Call ``fn(module)`` once ``name`` is imported (now, if it is); a name ending in ``.``
    means every module below that package."""
    _AFTER.setdefault(name, [])
    if fn not in _AFTER[name]:
        _AFTER[name].append(fn)
    for loaded, module in list(sys.modules.items()):
        if module is not None and (loaded == name or (name.endswith(".")
                                                      and loaded.startswith(name))):
            fn(module)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def around_import(make: Callable) -> None:
    """``make()`` returns a context manager entered while each ``megatron.`` module that a
    registered function waits for is executed (``--megatron-on-cpu``: torch.compile off)."""
    if make not in _AROUND:
        _AROUND.append(make)


def forget(name: str, fn: Callable) -> None:
    """Stop calling ``fn`` for modules imported from now on."""
    fns = _AFTER.get(name, [])
    if fn in fns:
        fns.remove(fn)
    if not fns:
        _AFTER.pop(name, None)
    if not _AFTER and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
