"""What one call is, for the source reader: a collective (``torch.distributed``, functional
collectives, symmetric memory, DTensor redistribution, a ``parallelize_module`` plan, paraloom's
``comm``), a region helper, or a call into code the reader can follow (a function of the file,
an autograd Function's ``apply``, a method of an object whose class the code shows, a function or
Function in another module) — or a call into code that cannot be found ("needs more context").
"""

from __future__ import annotations

import ast

from .module import Module, src
from .names import (
    COLLECTIVES,
    DISTRIBUTE,
    DTENSOR_METHODS,
    FSDP_METHODS,
    FUNCOL,
    FUNCOL_MODULES,
    PARALOOM_COMM,
    SYMM_MEM,
    SYMM_MEM_MODULES,
    region_semantics,
)

__all__ = ["classify", "label"]

_DIST = "torch.distributed"
_DIST_NAMES = ("dist", "torch_dist", "tdist")
_QUIET = ("logger", "logging", "log", "warnings", "print")  # never communicate


def label(mod: Module, target: Module, fn) -> str:
    """``Class.f`` in the same file; ``module_stem.Class.f`` in another."""
    name = target.qualname(fn)
    if target is mod or target.path is None or target.path == mod.path:
        return name
    return f"{target.path.stem}.{name}"


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _plain(node) -> bool:
    """A dotted name (``a.b.c``), nothing computed on the way."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _local(mod: Module, name: str, head: str, fn) -> list[ast.FunctionDef]:
    defs = mod.funcs[name]
    if head in ("self", "cls") and fn is not None:
        cls, _ = mod.enclosing(fn)
        return [d for d in defs if mod.enclosing(d)[0] is cls] or defs
    if head in mod.classes:
        return [d for d in defs if mod.enclosing(d)[0] is mod.classes[head]]
    return [d for d in defs if mod.enclosing(d)[0] is None] or defs


def _of_class(owner: Module, cls: ast.ClassDef, rest: list[str]) -> list[tuple]:
    """Targets of ``Cls.apply`` / ``Cls.method`` / ``obj.method`` in ``owner``."""
    if not rest:
        return []  # a constructor
    methods = {f.name: f for f in cls.body if isinstance(f, (ast.FunctionDef,
                                                               ast.AsyncFunctionDef))}
    if rest == ["apply"]:
        return [(f"apply_{n}", methods[n], methods[n].pl_module) for n in ("forward", "backward")
                if n in methods]
    if len(rest) == 1 and rest[0] in methods:
        return [("helper", methods[rest[0]], methods[rest[0]].pl_module)]
    return [("unresolved", f"{cls.name}.{'.'.join(rest)} is not defined in the class", None)]


def _followed(mod: Module, name: str, call: ast.Call, fn) -> list[tuple]:
    """Calls into another module, or methods of an object whose class the code shows."""
    root = _root(call.func)
    text = src(call.func)
    element = isinstance(call.func, ast.Attribute) and isinstance(
        call.func.value, ast.Subscript) and _plain(call.func.value.value)
    if not (_plain(call.func) or element):
        return []  # f().g(): the object's class is not in the code
    if isinstance(root, ast.Name) and root.id in mod.imports:
        found = mod.lookup(name)
    elif isinstance(call.func, ast.Attribute) and isinstance(
            call.func.value, (ast.Name, ast.Attribute, ast.Subscript)):
        cls = mod.instance_class(call.func.value, fn)
        if cls is None:
            return []
        if cls in mod.classes:
            found = ("class", mod, mod.classes[cls], [])
        elif cls.split(".")[0] in mod.imports.values() or "." in cls:
            found = mod.lookup(cls)
        else:
            return []
        if found[0] == "class":
            found = found[:3] + (found[3] + [call.func.attr],)
        elif found[0] == "func":
            return []
    else:
        return []
    if found[0] == "func":
        return [("helper", found[2], found[1])]
    if found[0] == "class":
        return _of_class(found[1], found[2], found[3])
    if found[0] == "missing" and text.split(".")[0] not in _QUIET:
        return [("unresolved", f"source of {found[1]!r} not found", None)]
    return []


def classify(mod: Module, call: ast.Call, fn) -> tuple[list[tuple], str | None]:
    """``([(what, target, owner module)...], assumption)`` for one call; ``what`` is one of
    dist, comm, funcol, symm, dtensor, plan, region, helper, apply_forward, apply_backward,
    unresolved."""
    names = {mod.dotted(call.func)}
    if isinstance(call.func, ast.Name):
        names |= mod.aliases.get(call.func.id, set())
    root, assumed = _root(call.func), None
    if isinstance(root, ast.Name) and root.id in _DIST_NAMES and root.id not in mod.imports \
            and root.id not in mod.aliases and root.id not in mod.bound:
        names = {_DIST + src(call.func)[len(root.id):]}
        assumed = f"`{root.id}` is not imported in the file: read as torch.distributed"
    out: list[tuple] = []
    for name in sorted(names):  # a set: sorted, so a merged site's `via` is the same every run
        name = name.removesuffix(".default")
        head, _, last = name.rpartition(".")
        if (head == _DIST or head.endswith(".distributed")) and last in COLLECTIVES:
            out.append(("dist", last, mod))
        elif head in FUNCOL_MODULES and last in FUNCOL:
            out.append(("funcol", last, mod))
        elif head in SYMM_MEM_MODULES and last in SYMM_MEM:
            out.append(("symm", last, mod))
        elif (head.split(".")[-1] == "comm" or head.endswith("paraloom.comm")) \
                and last in PARALOOM_COMM:
            out.append(("comm", last, mod))
        elif last == "parallelize_module":
            out.append(("plan", last, mod))
        elif last in DISTRIBUTE and "tensor" in head.split("."):
            out.append(("distribute", last, mod))
        elif last in mod.funcs and (head in ("", "self", "cls") or head in mod.classes):
            out += [("helper", f, f.pl_module) for f in _local(mod, last, head, fn)]
        elif last == "apply" and head in mod.classes:
            out += _of_class(mod, mod.classes[head], ["apply"])
        elif region_semantics(last) and last not in mod.funcs:
            out.append(("region", last, mod))
        elif isinstance(call.func, ast.Attribute) and last in FSDP_METHODS:
            out.append(("fsdp", last, mod))
        elif isinstance(call.func, ast.Attribute) and last in DTENSOR_METHODS:
            out.append(("dtensor", last, mod))
        else:
            out += _followed(mod, name, call, fn)
    return out, assumed
