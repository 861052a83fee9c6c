"""One parsed source file: its imports, aliases, functions and classes, and what a name in it
refers to — in the same file, or (through :class:`~paraloom.explain.resolve.Project`) in another
module whose source can be found.

A ``Module`` read from a line range gets the whole file as ``context``: names defined or
imported outside the range resolve as they would in the file.
"""

from __future__ import annotations

import ast
from pathlib import Path

from .names import FORWARD_HOOKS, HOOK_REGISTRARS
from .resolve import Project, is_skipped

__all__ = ["Module", "src"]

_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


def src(node) -> str:
    """The source text of ``node`` ("" for None)."""
    return ast.unparse(node) if node is not None else ""


def _hook_names(call: ast.Call) -> list[str]:
    """Function names passed to a hook registrar (``f``, ``self.f``, ``partial(self.f, ...)``);
    ``@NAME`` for a factory whose call is passed (``register_hook(self._make_hook(p))``)."""
    out = []
    for a in [*call.args, *(k.value for k in call.keywords)]:
        if isinstance(a, ast.Call) and src(a.func).rpartition(".")[2] == "partial" and a.args:
            a = a.args[0]
        elif isinstance(a, ast.Call) and isinstance(a.func, (ast.Name, ast.Attribute)):
            out.append("@" + src(a.func).rpartition(".")[2])
        if isinstance(a, ast.Name):
            out.append(a.id)
        elif isinstance(a, ast.Attribute) and src(a.value) in ("self", "cls"):
            out.append(a.attr)
    return out


class Module:
    """Imports, aliases, functions and classes of a parsed file or snippet."""

    def __init__(self, tree: ast.Module, path: Path | None = None,
                 project: Project | None = None, context: Module | None = None) -> None:
        self.tree, self.path, self.project = tree, path, project or Project(Module)
        self.imports: dict[str, str] = {}  # local name -> dotted origin
        self.aliases: dict[str, set[str]] = {}  # name -> dotted targets it was assigned
        self.parent: dict[ast.AST, ast.AST] = {}
        self.funcs: dict[str, list[ast.FunctionDef]] = {}  # simple name -> defs
        self.classes: dict[str, ast.ClassDef] = {}
        self.hooks: set[str] = set()  # functions registered as gradient hooks (backward)
        self.fwd_hooks: set[str] = set()  # functions run as forward hooks / DTensor io fns
        self.bound: set[str] = set()  # every name assigned or taken as a parameter
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.imports[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                base = "." * node.level + (node.module or "")
                for a in node.names:
                    self.imports[a.asname or a.name] = f"{base}.{a.name}".lstrip(".") \
                        if node.level == 0 else f"{base.rstrip('.')}.{a.name}" \
                        if node.module else f"{base}{a.name}"
            elif isinstance(node, _FUNCS):
                self.funcs.setdefault(node.name, []).append(node)
                node.pl_module = self
                self.bound.update(a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg))
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                self.bound.add(node.id)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name) \
                    and isinstance(node.value, (ast.Name, ast.Attribute)):
                self.aliases.setdefault(node.targets[0].id, set()).add(self.dotted(node.value))
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
                name = src(node.func).rpartition(".")[2]
                if FORWARD_HOOKS.search(name):
                    self.fwd_hooks.update(_hook_names(node))
                elif HOOK_REGISTRARS.search(name):
                    self.hooks.update(_hook_names(node))
        for name in [h for h in self.hooks if h.startswith("@")]:  # what factories return
            for d in self.funcs.get(name[1:], []):
                self.hooks.update(r.value.id for r in ast.walk(d) if isinstance(r, ast.Return)
                                  and isinstance(r.value, ast.Name))
        if context is not None:  # names from the rest of the file, where the range lacks them
            for mine, theirs in ((self.imports, context.imports), (self.aliases, context.aliases),
                                 (self.funcs, context.funcs), (self.classes, context.classes)):
                for k, v in theirs.items():
                    mine.setdefault(k, v)
            self.hooks |= context.hooks
            self.fwd_hooks |= context.fwd_hooks
            self.bound |= context.bound

    def dotted(self, node) -> str:
        """``dist.all_reduce`` -> ``torch.distributed.all_reduce`` (through imports)."""
        if isinstance(node, ast.Name):
            return self.imports.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            return f"{self.dotted(node.value)}.{node.attr}"
        return src(node)

    def enclosing(self, node) -> tuple[ast.ClassDef | None, ast.FunctionDef | None]:
        cls = fn = None
        while node in self.parent:
            node = self.parent[node]
            if fn is None and isinstance(node, _FUNCS):
                fn = node
            if isinstance(node, ast.ClassDef):
                cls = node
                break
        return cls, fn

    def qualname(self, fn) -> str:
        cls, _ = self.enclosing(fn)
        return f"{cls.name}.{fn.name}" if cls is not None else fn.name

    # ------------------------------------------------------------ names in other modules
    def lookup(self, dotted: str, depth: int = 0):
        """What an imported dotted name is: ``("func", Module, FunctionDef)``,
        ``("class", Module, ClassDef, rest)``, ``("skip",)`` for code not followed (standard
        library, torch), or ``("missing", module name)`` when no source is found."""
        if is_skipped(dotted):
            return ("skip",)
        parts = dotted.split(".")
        lead = len(dotted) - len(dotted.lstrip("."))
        for k in range(len(parts), lead, -1):
            modname = ".".join(parts[:k])
            if not modname.strip("."):
                continue
            path = self.project.find(modname, self.path)
            if path is None:
                continue
            other = self.project.load(path)
            rest = parts[k:]
            if other is None or not rest:
                return ("missing", modname) if other is None else ("skip",)
            return other.local(rest, depth)
        return ("missing", dotted)

    def local(self, rest: list[str], depth: int = 0):
        """``rest`` (``["f"]``, ``["Cls", "apply"]``) looked up in this module's top level."""
        head = rest[0]
        defs = [d for d in self.funcs.get(head, []) if self.enclosing(d)[0] is None]
        if defs and len(rest) == 1:
            return ("func", self, defs[0])
        if head in self.classes:
            return ("class", self, self.classes[head], rest[1:])
        if head in self.imports and depth < 4:  # re-exported from another module
            return self.lookup(".".join([self.imports[head], *rest[1:]]), depth + 1)
        return ("missing", ".".join(rest))

    def instance_class(self, node, fn) -> str | None:
        """The dotted class of ``v`` / ``self.attr`` when the code shows it: ``v = C(...)`` in
        the function, a parameter annotated ``v: C``, or ``self.attr = C(...)`` in the class."""
        scopes = []
        if isinstance(node, ast.Subscript):
            return self._element_class(src(node.value), fn)
        if isinstance(node, ast.Attribute) and src(node.value) == "self" and fn is not None:
            scopes = [self.enclosing(fn)[0]]
        elif isinstance(node, ast.Name) and fn is not None:
            up = fn  # the function and the ones it is nested in (closures)
            while up is not None:
                if isinstance(up, _FUNCS):
                    scopes.append(up)
                up = self.parent.get(up)
        name = src(node)
        for sub in (n for scope in scopes if scope is not None for n in ast.walk(scope)):
            if isinstance(sub, ast.arg) and sub.arg == name and isinstance(
                    sub.annotation, (ast.Name, ast.Attribute)):
                cls = self.dotted(sub.annotation)
                if cls.rpartition(".")[2][:1].isupper():
                    return cls
            if isinstance(sub, ast.Assign) and any(src(t) == name for t in sub.targets) \
                    and isinstance(sub.value, ast.Call):
                cls = self.dotted(sub.value.func)
                if cls.rpartition(".")[2][:1].isupper():
                    return cls
        return None

    def _element_class(self, container: str, fn) -> str | None:
        """The class of ``self.xs[i]`` when the class fills ``self.xs`` with ``C(...)``
        (``self.xs.append(C(...))`` or ``self.xs = [C(...) for ...]``)."""
        cls = self.enclosing(fn)[0] if fn is not None else None
        if cls is None or not container.startswith("self."):
            return None
        for sub in ast.walk(cls):
            made = None
            if isinstance(sub, ast.Call) and src(sub.func) == container + ".append" \
                    and sub.args:
                made = sub.args[0]
            elif isinstance(sub, ast.Assign) and any(src(t) == container for t in sub.targets) \
                    and isinstance(sub.value, (ast.ListComp, ast.List)):
                made = sub.value.elt if isinstance(sub.value, ast.ListComp) else (
                    sub.value.elts[0] if sub.value.elts else None)
            if isinstance(made, ast.Call):
                name = self.dotted(made.func)
                if name.rpartition(".")[2][:1].isupper():
                    return name
        return None
