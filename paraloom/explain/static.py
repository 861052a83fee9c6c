"""Every communication site in a Python snippet, read with ``ast`` (nothing is imported or run).

A site is a call of a ``torch.distributed`` collective or point-to-point function (also through
an alias such as ``dist_all_gather_func = torch.distributed.all_gather_into_tensor``), of
``paraloom.comm``, or of a known region helper ("forward: X / backward: Y"), or a call of a
function defined in the same snippet that leads to one (``_reduce`` calling ``all_reduce``;
``_Region.apply`` running the autograd function's forward, and its backward in backward).

For each site: line, enclosing class and function, phase, primitive, parallel type, async flag and
the guarding conditions (enclosing ``if``s, and ``if ...: return`` guards before it). Whatever the
snippet does not decide is reported as :data:`UNKNOWN`.
"""

from __future__ import annotations

import ast

from .names import COLLECTIVES, HOOK_REGISTRARS, KINDS, PARALOOM_COMM, PHASES, region_semantics
from .rules import UNKNOWN, async_flag, context_phase, kind_of, region_condition

__all__ = ["UNKNOWN", "Module", "find_sites", "src"]

_DIST = "torch.distributed"
_SAME = "same"  # a helper's site runs in the phase of its caller


def src(node) -> str:
    """The source text of ``node`` ("" for None)."""
    return ast.unparse(node) if node is not None else ""


class Module:
    """Imports, aliases, functions and classes of a parsed snippet."""

    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.imports: dict[str, str] = {}  # local name -> dotted origin
        self.aliases: dict[str, set[str]] = {}  # name -> dotted targets it was assigned
        self.parent: dict[ast.AST, ast.AST] = {}
        self.funcs: dict[str, list[ast.FunctionDef]] = {}  # simple name -> defs
        self.classes: dict[str, ast.ClassDef] = {}
        self.hooks: set[str] = set()  # names of functions registered as gradient hooks
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
                        if node.level == 0 else f"{base}.{a.name}"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.funcs.setdefault(node.name, []).append(node)
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name) \
                    and isinstance(node.value, (ast.Name, ast.Attribute)):
                self.aliases.setdefault(node.targets[0].id, set()).add(self.dotted(node.value))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and HOOK_REGISTRARS.search(node.func.attr):
                self.hooks.update(a.id for a in node.args if isinstance(a, ast.Name))

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
            if fn is None and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                fn = node
            if isinstance(node, ast.ClassDef):
                cls = node
                break
        return cls, fn

    def targets(self, call: ast.Call, fn) -> list[tuple[str, object]]:
        """What a call is: [("dist", name)], [("comm", name)], [("region", name)],
        [("helper", FunctionDef) ...] or []."""
        names = {self.dotted(call.func)}
        if isinstance(call.func, ast.Name):
            names |= self.aliases.get(call.func.id, set())
        out: list[tuple[str, object]] = []
        for name in names:
            head, _, last = name.rpartition(".")
            if (head == _DIST or head.endswith(".distributed")) and last in COLLECTIVES:
                out.append(("dist", last))
            elif (head.split(".")[-1] == "comm" or head.endswith("paraloom.comm")) \
                    and last in PARALOOM_COMM:
                out.append(("comm", last))
            elif last in self.funcs and (head in ("", "self", "cls") or head in self.classes):
                out += [("helper", f) for f in self._resolve(last, head, fn)]
            elif last == "apply" and head in self.classes:
                out += [("helper", f) for f in self.classes[head].body
                        if isinstance(f, ast.FunctionDef) and f.name in ("forward", "backward")]
            elif region_semantics(last) and last not in self.funcs:
                out.append(("region", last))
        return out

    def _resolve(self, name: str, head: str, fn) -> list[ast.FunctionDef]:
        defs = self.funcs[name]
        if head in ("self", "cls") and fn is not None:
            cls, _ = self.enclosing(fn)
            return [d for d in defs if self.enclosing(d)[0] is cls] or defs
        if head in self.classes:
            return [d for d in defs if self.enclosing(d)[0] is self.classes[head]]
        return [d for d in defs if self.enclosing(d)[0] is None] or defs


class _Walker:
    """Raw sites of one function body: dicts with line, op, kind, async, conds, via, rel."""

    def __init__(self, mod: Module, memo: dict) -> None:
        self.mod, self.memo = mod, memo

    def function(self, fn, stack: tuple = ()) -> list[dict]:
        if fn in self.memo:
            return self.memo[fn]
        if fn in stack:
            return []
        self.memo[fn] = []  # recursion guard while walking
        sites = self.stmts(fn.body, [], fn, stack + (fn,))
        phase, _ = context_phase(self.mod, fn)
        cls, _ = self.mod.enclosing(fn)
        for s in sites:
            if s["kind"] is None:
                s["kind"] = kind_of(" ".join([cls.name if cls else "", fn.name, *s["via"],
                                            *s["conds"], *s.get("inner_conds", []), s["call"]]))
        absolute = phase == "backward" or (phase == "forward" and fn.name != "forward")
        for s in sites:
            if s["rel"] == _SAME and absolute:
                s["rel"] = phase
        self.memo[fn] = sites
        return sites

    def stmts(self, body, conds, fn, stack) -> list[dict]:
        out, conds = [], list(conds)
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(stmt, ast.If):
                test = src(stmt.test)
                out += self.exprs(stmt.test, conds, fn, stack)
                out += self.stmts(stmt.body, conds + [test], fn, stack)
                out += self.stmts(stmt.orelse, conds + [f"not ({test})"], fn, stack)
                if not stmt.orelse and stmt.body and \
                        isinstance(stmt.body[-1], (ast.Return, ast.Raise)):
                    conds.append(f"not ({test})")  # an early-return guard covers what follows
                continue
            blocks = [getattr(stmt, k, None) for k in ("body", "orelse", "finalbody")]
            handlers = getattr(stmt, "handlers", [])
            if isinstance(stmt, (ast.For, ast.While, ast.With, ast.Try)):
                heads = [getattr(stmt, k, None) for k in ("iter", "test")]
                heads += [item.context_expr for item in getattr(stmt, "items", [])]
                for sub in heads:
                    if sub is not None:
                        out += self.exprs(sub, conds, fn, stack)
                for block in [b for b in blocks if b] + [h.body for h in handlers]:
                    out += self.stmts(block, conds, fn, stack)
                continue
            out += self.exprs(stmt, conds, fn, stack)
        return out

    def exprs(self, node, conds, fn, stack, hook=False) -> list[dict]:
        out = []
        if isinstance(node, ast.IfExp):
            test = src(node.test)
            return (self.exprs(node.test, conds, fn, stack, hook)
                    + self.exprs(node.body, conds + [test], fn, stack, hook)
                    + self.exprs(node.orelse, conds + [f"not ({test})"], fn, stack, hook))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return out
        if isinstance(node, ast.Call):
            out += self.call(node, conds, fn, stack, hook)
            hook = hook or (isinstance(node.func, ast.Attribute)
                            and bool(HOOK_REGISTRARS.search(node.func.attr)))
        for child in ast.iter_child_nodes(node):
            out += self.exprs(child, conds, fn, stack, hook)
        return out

    def call(self, call, conds, fn, stack, hook) -> list[dict]:
        mod = self.mod
        out = []
        base = {"line": call.lineno, "conds": list(conds), "via": [], "call": src(call)[:120],
                "arg": src(call.args[0]) if call.args else None,
                "rel": "backward" if hook else _SAME, "kind": None}
        strings = [n.value for n in ast.walk(call) if isinstance(n, ast.Constant)
                   and isinstance(n.value, str)]
        explicit_phase = next((s for s in strings if s in PHASES), None)
        explicit_kind = next((s for s in strings if s in KINDS), None)
        for what, target in mod.targets(call, fn):
            if what in ("dist", "comm"):
                op = (COLLECTIVES if what == "dist" else PARALOOM_COMM)[target]
                if target == "P2POp" and call.args:
                    op = COLLECTIVES.get(mod.dotted(call.args[0]).rpartition(".")[2], "p2p_op")
                out.append(dict(base, op=op, asynchronous=async_flag(call, target),
                                kind=explicit_kind or (
                                    "pp" if op in ("send", "recv", "batch_p2p", "send_recv")
                                    else None),
                                rel=explicit_phase or base["rel"], explicit=bool(explicit_phase)))
            elif what == "region":
                fwd, bwd, kind, moved = region_semantics(target)
                cond = region_condition(target, call)
                for op, rel in ((fwd, base["rel"]), (bwd, "backward")):
                    if op:
                        out.append(dict(base, op=op, asynchronous=False, kind=kind,
                                        rel=rel, via=[target], moved=moved, explicit=False,
                                        conds=base["conds"] + ([cond] if cond and
                                                               rel == "backward" else [])))
            else:
                name = target.name if mod.enclosing(target)[0] is None \
                    else f"{mod.enclosing(target)[0].name}.{target.name}"
                for inner in self.function(target, stack):
                    rel = inner["rel"] if inner["rel"] != _SAME else base["rel"]
                    out.append(dict(inner, line=call.lineno, conds=list(conds), rel=rel,
                                    via=[name] + inner["via"], call=base["call"],
                                    arg=base["arg"],
                                    inner_line=inner.get("inner_line", inner["line"]),
                                    inner_conds=[f"in {name}: {c}" for c in inner["conds"]]
                                    + inner.get("inner_conds", [])))
        unique: dict[tuple, dict] = {}
        for s in out:  # aliases bound to several equivalent functions give one site per op
            key = (s["op"], s["rel"], str(s["asynchronous"]), s["kind"])
            if key in unique and unique[key].get("inner_conds") != s.get("inner_conds"):
                unique[key].update(inner_conds=[], via=s["via"][:1])  # several paths: no guard
            unique.setdefault(key, s)
        return list(unique.values())


def _basis(site: dict, phase: str, context: str, why: str) -> str:
    if site.get("explicit"):
        return "explicit phase argument"
    if site["rel"] in (_SAME, context):
        return why
    if site["via"] and phase == "backward":
        return f"backward of {site['via'][-1]}"
    return "via " + " -> ".join(site["via"]) if site["via"] else why


def find_sites(mod: Module) -> list[dict]:
    """Every communication site of the snippet, in source order (see the module docstring)."""
    walker = _Walker(mod, {})
    called = set()
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Call):
            _, fn = mod.enclosing(node)
            called.update(id(t) for w, t in mod.targets(node, fn) if w == "helper")
    sites = []
    bodies = [(None, mod.tree.body)] + [
        (fn, None) for defs in mod.funcs.values() for fn in defs]
    for fn, body in bodies:
        raw = walker.stmts(body, [], None, ()) if fn is None else walker.function(fn)
        cls, _ = mod.enclosing(fn) if fn is not None else (None, None)
        phase, why = context_phase(mod, fn)
        helper = fn is not None and id(fn) in called
        if helper and phase == UNKNOWN:
            why = "helper: its call sites in the snippet carry the phase"
        for s in raw:
            p = s["rel"] if s["rel"] != _SAME else phase
            text = " ".join([src(cls.bases[0]) if cls and cls.bases else "", cls.name if cls
                             else "", fn.name if fn else "", *s["via"], *s["conds"], s["call"]])
            kind = s["kind"] or kind_of(text) or UNKNOWN
            conds = s["conds"] + s.get("inner_conds", [])
            sites.append({
                "line": s["line"], "class": cls.name if cls else None,
                "function": fn.name if fn else None, "phase": p,
                "phase_basis": _basis(s, p, phase, why),
                "op": s["op"], "kind": kind, "async": s["asynchronous"],
                "condition": " and ".join(f"({c})" if " or " in c and len(conds) > 1 else c
                                          for c in conds) or None, "via": s["via"],
                "helper": helper, "call": s["call"], "arg": s["arg"],
                "inner_line": s.get("inner_line"), "moved": s.get("moved"),
                "fn_line": fn.lineno if fn else None})
    sites.sort(key=lambda s: (s["line"], s["op"]))
    return sites
