"""Every communication site in a Python snippet, read with ``ast`` (nothing is imported or run).

A site is a call of a collective or point-to-point function (``torch.distributed``, also through
an alias such as ``dist_all_gather_func = torch.distributed.all_gather_into_tensor``; functional
collectives; symmetric-memory fused ops; DTensor ``redistribute`` / ``full_tensor``; the styles
of a ``parallelize_module`` plan; ``paraloom.comm``), of a known region helper ("forward: X /
backward: Y"), or a call that leads to one: a function of the snippet (``_reduce`` calling
``all_reduce``), ``_Region.apply`` (the Function's forward, and its backward in backward — unless
the ``apply`` itself runs inside another Function, where autograd records nothing), a method of
an object whose class the code shows, or a function / Function in another module whose source
can be found (the site says which file and line it came ``through``). A call into a module whose
source is not found is listed in ``unresolved`` as "needs more context", never dropped.

For each site: line, enclosing class and function, phase, primitive, parallel type, async flag and
the guarding conditions (enclosing ``if``s, and ``if ...: return`` guards before it). Whatever the
snippet does not decide is reported as :data:`UNKNOWN`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .calls import classify, label
from .constants import bindings, excluded, pipeline_phases
from .module import Module, src
from .names import (
    COLLECTIVES,
    DISTRIBUTE,
    FORWARD_HOOKS,
    FSDP_METHODS,
    FUNCOL,
    HOOK_REGISTRARS,
    KINDS,
    PARALOOM_COMM,
    PHASES,
    SYMM_MEM,
    region_semantics,
)
from .rules import UNKNOWN, context_phase, kind_of, region_condition
from .spellings import async_of, batch_kind, group_kind, p2p_directions, plan_sites

__all__ = ["find_sites"]

_SAME = "same"  # a helper's site runs in the phase of its caller


def _autograd_method(mod: Module, fn) -> bool:
    """``fn`` is the forward or backward of an autograd.Function (autograd records nothing
    inside it, so an ``apply`` there runs only its forward)."""
    cls, _ = mod.enclosing(fn)
    return fn.name in ("forward", "backward") and cls is not None and bool(
        re.search(r"\bFunction\b", " ".join(src(b) for b in cls.bases)))


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it is under it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _kind(site: dict, text: str, final: bool = True) -> str | None:
    """The kind the names around a site give; a tp group stays tp unless they say sp; a group
    that names no kind gives "group" when nothing around it does."""
    named, group = kind_of(text), site.get("group_kind")
    if group == "tp":
        return "sp" if named == "sp" else "tp"
    return named or (group if final or group != "group" else None)  # callers may name it


class _Walker:
    """Raw sites of one function body: dicts with line, op, kind, async, conds, via, rel."""

    def __init__(self, root: Module) -> None:
        self.root, self.memo, self.unresolved = root, {}, {}

    def function(self, fn, stack: tuple = (), nograd: bool = False) -> list[dict]:
        mod = fn.pl_module
        nograd = nograd or _autograd_method(mod, fn)
        key = (fn, nograd)
        if key in self.memo:
            return self.memo[key]
        if fn in stack:
            return []
        self.memo[key] = []  # recursion guard while walking
        sites = self.stmts(fn.body, [], (mod, fn, stack + (fn,), nograd))
        phase, _ = context_phase(mod, fn)
        cls, _ = mod.enclosing(fn)
        for s in sites:
            if s["kind"] is None:
                s["kind"] = _kind(s, " ".join([cls.name if cls else "", fn.name, *s["via"],
                                               *s["conds"], *s.get("inner_conds", []),
                                               s["call"]]), final=False)
        absolute = phase == "backward" or (phase == "forward" and fn.name != "forward")
        for s in sites:
            if s["rel"] == _SAME and absolute:
                s["rel"] = phase
        self.memo[key] = sites
        return sites

    def stmts(self, body, conds, ctx) -> list[dict]:
        out, conds = [], list(conds)
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(stmt, ast.If):
                test = src(stmt.test)
                out += self.exprs(stmt.test, conds, ctx)
                out += self.stmts(stmt.body, conds + [test], ctx)
                out += self.stmts(stmt.orelse, conds + [f"not ({test})"], ctx)
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
                        out += self.exprs(sub, conds, ctx)
                for block in [b for b in blocks if b] + [h.body for h in handlers]:
                    out += self.stmts(block, conds, ctx)
                continue
            out += self.exprs(stmt, conds, ctx)
        return out

    def exprs(self, node, conds, ctx, hook=False) -> list[dict]:
        out = []
        if isinstance(node, ast.IfExp):
            test = src(node.test)
            return (self.exprs(node.test, conds, ctx, hook)
                    + self.exprs(node.body, conds + [test], ctx, hook)
                    + self.exprs(node.orelse, conds + [f"not ({test})"], ctx, hook))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return out
        if isinstance(node, ast.Call):
            out += self.call(node, conds, ctx, hook)
            name = src(node.func).rpartition(".")[2] if isinstance(node.func, ast.Attribute) \
                else ""
            hook = hook or (bool(HOOK_REGISTRARS.search(name))
                            and not FORWARD_HOOKS.search(name))
        for child in ast.iter_child_nodes(node):
            out += self.exprs(child, conds, ctx, hook)
        return out

    def call(self, call, conds, ctx, hook) -> list[dict]:
        mod, fn, stack, nograd = ctx
        base = {"line": call.lineno, "conds": list(conds), "via": [], "call": src(call)[:120],
                "arg": src(call.args[0]) if call.args else None, "through": [],
                "rel": "backward" if hook else _SAME, "kind": None, "explicit": False}
        strings = [n.value for n in ast.walk(call) if isinstance(n, ast.Constant)
                   and isinstance(n.value, str)]
        explicit_phase = next((s for s in strings if s in PHASES), None)
        named_kind = next((s for s in strings if s in KINDS), None)
        base["group_kind"] = group_kind(call)  # Megatron's sp runs on the tp group: context wins
        if base["group_kind"] is None and src(call.func).endswith("batch_isend_irecv"):
            base["group_kind"] = batch_kind(mod, fn)
        if named_kind is None and base["group_kind"] not in (None, "tp", "group"):
            named_kind = base["group_kind"]
        targets, assumed = classify(mod, call, fn)
        if assumed:
            base["assumed"] = assumed
        out = []
        for what, target, owner in targets:
            if what in ("dist", "comm", "funcol", "symm", "dtensor", "fsdp", "distribute"):
                table = {"dist": COLLECTIVES, "comm": PARALOOM_COMM, "funcol": FUNCOL,
                         "symm": SYMM_MEM, "fsdp": FSDP_METHODS,
                         "distribute": DISTRIBUTE}.get(what, {})
                directions = (p2p_directions(mod, call) if target == "P2POp"
                              else [(table.get(target, "redistribute"), None)])
                flag = (async_of(mod, call, target, fn) if what in ("dist", "comm", "dtensor",
                                                                     "fsdp")
                        else what == "funcol")
                for op, cond in directions:
                    out.append(dict(base, op=op, asynchronous=flag,
                                    kind=named_kind, conds=base["conds"] + ([cond] if cond
                                                                            else []),
                                    rel=explicit_phase or base["rel"],
                                    explicit=bool(explicit_phase),
                                    moved=src(call.keywords[0].value) if what == "dtensor"
                                    and call.keywords else None))
            elif what == "plan":
                sites, unknown = plan_sites(mod, call, fn)
                out += [dict(base, asynchronous=False, kind=named_kind or "tp", **s)
                        for s in sites]
                for u in unknown:
                    self._unresolved(mod, call, fn, f"{u}: {UNKNOWN}")
            elif what == "region":
                fwd, bwd, kind, moved = region_semantics(target)
                cond = region_condition(target, call)
                for op, rel in ((fwd, base["rel"]), (None if nograd else bwd, "backward")):
                    if op:
                        out.append(dict(base, op=op, asynchronous=False, kind=kind,
                                        rel=rel, via=[target], moved=moved,
                                        conds=base["conds"] + ([cond] if cond and
                                                               rel == "backward" else [])))
            elif what == "unresolved":
                self._unresolved(mod, call, fn, f"{UNKNOWN}: {target}")
            elif not (what == "apply_backward" and nograd):
                out += self._inner(mod, target, owner, base, conds, stack, nograd, call)
        unique: dict[tuple, dict] = {}
        for s in out:  # aliases bound to several equivalent functions give one site per op
            key = (s["line"], s["op"], s["rel"], str(s["asynchronous"]), s["kind"],
                   tuple(s["conds"]))
            if key in unique and unique[key].get("inner_conds") != s.get("inner_conds"):
                unique[key].update(inner_conds=[], via=s["via"][:1])  # several paths: no guard
            unique.setdefault(key, s)
        return list(unique.values())

    def _inner(self, mod, target, owner, base, conds, stack, nograd, call) -> list[dict]:
        name = label(mod, owner, target)
        elsewhere = owner.path != mod.path and owner.path is not None
        out, env, pipe = [], bindings(target, call), pipeline_phases(call)
        for inner in self.function(target, stack, nograd):
            if excluded(inner["conds"], env):
                continue  # a guard the constant arguments decide against
            rel = inner["rel"] if inner["rel"] != _SAME else (
                pipe.get(inner["op"], base["rel"]) if base["rel"] == _SAME else base["rel"])
            through = ([f"{_shown(owner.path)}:{inner['line']}"] if elsewhere else []) \
                + inner["through"]
            out.append(dict(inner, line=base["line"], conds=list(conds), rel=rel,
                            via=[name] + inner["via"], call=base["call"], arg=base["arg"],
                            through=through, inner_line=inner.get("inner_line", inner["line"]),
                            inner_conds=[f"in {name}: {c}" for c in inner["conds"]]
                            + inner.get("inner_conds", [])))
        return out

    def _unresolved(self, mod, call, fn, why: str) -> None:
        if mod is self.root:
            key = (call.lineno, src(call.func))
            self.unresolved.setdefault(key, {"line": call.lineno, "call": src(call.func),
                                             "function": fn.name if fn else None, "why": why})


def _basis(site: dict, phase: str, context: str, why: str) -> str:
    if site.get("explicit"):
        return "explicit phase argument"
    if site["rel"] in (_SAME, context):
        return why
    if site["via"] and phase == "backward":
        return f"backward of {site['via'][-1]}"
    return "via " + " -> ".join(site["via"]) if site["via"] else why


def find_sites(mod: Module) -> tuple[list[dict], list[dict]]:
    """Every communication site of the snippet, in source order (see the module docstring),
    and the calls whose source was not found (``{"line", "call", "function", "why"}``)."""
    walker = _Walker(mod)
    called = set()
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Call):
            _, fn = mod.enclosing(node)
            called.update(id(t) for w, t, _o in classify(mod, node, fn)[0]
                          if w in ("helper", "apply_forward", "apply_backward"))
    sites = []
    bodies = [(None, mod.tree.body)] + [
        (fn, None) for defs in mod.funcs.values() for fn in defs if fn.pl_module is mod]
    for fn, body in bodies:
        raw = walker.stmts(body, [], (mod, None, (), False)) if fn is None \
            else walker.function(fn)
        cls, _ = mod.enclosing(fn) if fn is not None else (None, None)
        phase, why = context_phase(mod, fn)
        helper = fn is not None and id(fn) in called
        if helper and phase == UNKNOWN:
            why = "helper: its call sites in the snippet carry the phase"
        for s in raw:
            p = s["rel"] if s["rel"] != _SAME else phase
            text = " ".join([src(cls.bases[0]) if cls and cls.bases else "", cls.name if cls
                             else "", fn.name if fn else "", *s["via"], *s["conds"], s["call"]])
            kind = s["kind"] or _kind(s, text) or UNKNOWN
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
                "through": s["through"], "assumed": s.get("assumed"),
                "fn_line": fn.lineno if fn else None})
    sites.sort(key=lambda s: (s["line"], s["op"]))
    unresolved = sorted(walker.unresolved.values(), key=lambda u: (u["line"], u["call"]))
    return sites, unresolved
