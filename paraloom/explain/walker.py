"""The walk behind :func:`~.static.find_sites`: each function's body read once, statement by
statement, with a :class:`~.scope.Scope` of what its names hold; each call classified
(:func:`~.calls.classify`) into a collective, a region helper or code to follow, and a followed
callee's sites brought to the call's line with its conditions carried into the caller's names
(:func:`~.scope.translate`). A branch the constants decide against is not walked.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .calls import classify, label
from .callsites import alias_picks, collective_sites, merged, region_sites
from .constants import pipeline_phases
from .expressions import show
from .module import Module, src
from .names import FORWARD_HOOKS, HOOK_REGISTRARS, KINDS, PHASES
from .rules import UNKNOWN, context_phase, kind_of
from .scope import Scope, bind, bound_names, test_conds, translate
from .spellings import batch_kind, group_kind, plan_sites

__all__ = ["Walker", "SAME", "kind_from", "words"]

SAME = "same"  # a helper's site runs in the phase of its caller


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


def kind_from(site: dict, text: str, final: bool = True) -> str | None:
    """The kind the names around a site give; a tp group stays tp unless they say sp; a group
    that names no kind gives "group" when nothing around it does."""
    named, group = kind_of(text), site.get("group_kind")
    if group == "tp":
        return "sp" if named == "sp" else "tp"
    return named or (group if final or group != "group" else None)  # callers may name it


class Walker:
    """Raw sites of one function body: dicts with line, op, kind, async, conds (a list of
    :class:`~.conditions.Cond`), via, rel. Each function is read once with its own
    :class:`~.scope.Scope`; a call translates its callee's conditions into the caller's names."""

    def __init__(self, root: Module) -> None:
        self.root, self.memo, self.unresolved, self.ends = root, {}, {}, {}

    def function(self, fn, stack: tuple = (), nograd: bool = False) -> list[dict]:
        mod = fn.pl_module
        nograd = nograd or _autograd_method(mod, fn)
        key = (fn, nograd)
        if key in self.memo:
            return self.memo[key]
        if fn in stack:
            return []
        self.memo[key] = []  # recursion guard while walking
        scope = Scope.of(mod, fn, mod.qualname(fn))
        sites, _ = self.stmts(fn.body, [], (mod, fn, stack + (fn,), nograd), scope)
        self.ends[fn] = scope
        phase, _ = context_phase(mod, fn)
        cls, _ = mod.enclosing(fn)
        for s in sites:
            if s["kind"] is None:
                s["kind"] = kind_from(s, " ".join([cls.name if cls else "", fn.name, *s["via"],
                                               *words(s["conds"]), s["call"]]), final=False)
        absolute = phase == "backward" or (phase == "forward" and fn.name != "forward")
        for s in sites:
            if s["rel"] == SAME and absolute:
                s["rel"] = phase
        self.memo[key] = sites
        return sites

    def stmts(self, body, conds, ctx, scope: Scope) -> tuple[list[dict], bool]:
        """Sites of a block and whether it always ends in ``return`` / ``raise``."""
        out, conds = [], list(conds)
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(stmt, (ast.Return, ast.Raise)):
                out += self.exprs(stmt, conds, ctx, scope)
                return out, True
            if isinstance(stmt, ast.If):
                out += self.exprs(stmt.test, conds, ctx, scope)
                yes, no = test_conds(scope, stmt.test), test_conds(scope, stmt.test, True)
                ends = []
                for block, more in ((stmt.body, yes), (stmt.orelse, no)):
                    if more is False:  # decided against: nothing under it runs
                        ends.append(None)
                        continue
                    inner = scope.copy()
                    sites, done = self.stmts(block, conds + more, ctx, inner)
                    out += sites
                    ends.append(None if done else inner)
                if ends == [None, None]:
                    return out, True
                if ends[0] is None and yes is not False and no:
                    conds += no  # an early-return guard covers what follows
                elif ends[1] is None and no is not False and yes:
                    conds += yes
                scope.merge(stmt.test, *ends)
                continue
            if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While, ast.Try)):
                scope.forget([stmt])  # a loop may run any number of times; a try may stop
            heads = [getattr(stmt, k, None) for k in ("iter", "test")]
            heads += [item.context_expr for item in getattr(stmt, "items", [])]
            blocks = [getattr(stmt, k, None) for k in ("body", "orelse", "finalbody")]
            if any(b for b in blocks if isinstance(b, list)):
                for sub in heads:
                    if sub is not None:
                        out += self.exprs(sub, conds, ctx, scope)
                for block in [b for b in blocks if b] + [h.body for h in
                                                         getattr(stmt, "handlers", [])]:
                    out += self.stmts(block, conds, ctx, scope)[0]
                if not isinstance(stmt, (ast.With, ast.AsyncWith)):
                    scope.forget([stmt])
                continue
            out += self.exprs(stmt, conds, ctx, scope)
            self._assign(stmt, scope, ctx[1])
        return out, False

    @staticmethod
    def _assign(stmt, scope: Scope, fn) -> None:
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                scope.assign(target, stmt.value)
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            scope.assign(stmt.target, stmt.value)
        elif isinstance(stmt, ast.AugAssign):
            scope.forget([stmt])
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and fn is not None \
                and fn.args.args and src(stmt.value.func) == \
                f"{fn.args.args[0].arg}.save_for_backward":
            scope.values[f"{fn.args.args[0].arg}.saved_tensors"] = ast.Tuple(
                elts=[scope.read(a) for a in stmt.value.args], ctx=ast.Load())
        elif isinstance(stmt, ast.Delete):
            scope.forget([stmt])

    def exprs(self, node, conds, ctx, scope, hook=False) -> list[dict]:
        out = []
        if isinstance(node, ast.IfExp):
            out = self.exprs(node.test, conds, ctx, scope, hook)
            for branch, negate in ((node.body, False), (node.orelse, True)):
                more = test_conds(scope, node.test, negate)
                if more is not False:
                    out += self.exprs(branch, conds + more, ctx, scope, hook)
            return out
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return out
        if isinstance(node, ast.NamedExpr):
            scope.opaque(node.target.id)
        if isinstance(node, ast.Call):
            out += self.call(node, conds, ctx, scope, hook)
            scope.mutated(node)
            name = src(node.func).rpartition(".")[2] if isinstance(node.func, ast.Attribute) \
                else ""
            hook = hook or (bool(HOOK_REGISTRARS.search(name))
                            and not FORWARD_HOOKS.search(name))
        for child in ast.iter_child_nodes(node):
            out += self.exprs(child, conds, ctx, scope, hook)
        return out

    def call(self, call, conds, ctx, scope, hook) -> list[dict]:
        mod, fn, stack, nograd = ctx
        base = {"line": call.lineno, "conds": list(conds), "via": [], "call": src(call)[:120],
                "arg": src(call.args[0]) if call.args else None, "through": [],
                "rel": "backward" if hook else SAME, "kind": None, "explicit": False}
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
        picks = alias_picks(scope, call.func)
        if assumed:
            base["assumed"] = assumed
        out = []
        for what, target, owner in targets:
            if what in ("dist", "comm", "funcol", "symm", "dtensor", "fsdp", "distribute"):
                out += collective_sites(mod, call, fn, what, target, scope, dict(
                    base, kind=named_kind, rel=explicit_phase or base["rel"],
                    explicit=bool(explicit_phase)))
            elif what == "plan":
                sites, unknown = plan_sites(mod, call, fn)
                out += [dict(base, asynchronous=False, kind=named_kind or "tp", **s)
                        for s in sites]
                for u in unknown:
                    self._unresolved(mod, call, fn, f"{u}: {UNKNOWN}")
            elif what == "region":
                out += region_sites(call, target, nograd, scope, base)
            elif what == "unresolved":
                self._unresolved(mod, call, fn, f"{UNKNOWN}: {target}")
            elif not (what == "apply_backward" and nograd):
                more = picks.get(target.name, [])  # the branch that bound the name to target
                if more is not False:
                    out += self._inner(mod, target, owner, dict(
                        base, conds=base["conds"] + more), stack, nograd, call, scope, what)
        return merged(out, len(conds), mod.qualname(fn) if fn is not None else "")

    def _inner(self, mod, target, owner, base, stack, nograd, call, scope, what) -> list[dict]:
        name = label(mod, owner, target)
        elsewhere = owner.path != mod.path and owner.path is not None
        out, pipe = [], pipeline_phases(call)
        steps = self._steps(target, call, scope, what)
        for inner in self.function(target, stack, nograd):
            conds = _carried(inner["conds"], steps)
            if conds is False:
                continue  # a guard the caller's values decide against
            rel = inner["rel"] if inner["rel"] != SAME else (
                pipe.get(inner["op"], base["rel"]) if base["rel"] == SAME else base["rel"])
            through = ([f"{_shown(owner.path)}:{inner['line']}"] if elsewhere else []) \
                + inner["through"]
            out.append(dict(inner, line=base["line"], conds=base["conds"] + conds, rel=rel,
                            via=[name] + inner["via"], call=base["call"], arg=base["arg"],
                            through=through, inner_line=inner.get("inner_line", inner["line"])))
        return out

    def _steps(self, target, call, scope, what) -> list[tuple]:
        """``[(mapping, callee's own names, caller)]`` that carry a callee's condition up: for
        a Function's backward first through what its forward stored on ``ctx``."""
        mod = target.pl_module
        params = [a.arg for a in [*target.args.posonlyargs, *target.args.args]]
        caller = scope.where
        if what in ("apply_forward", "apply_backward"):
            cls, _ = mod.enclosing(target)
            forward = next((f for f in cls.body if isinstance(f, ast.FunctionDef)
                            and f.name == "forward"), None) if cls is not None else None
            if forward is None:
                return []
            steps = [(bind(forward, call, scope, True), bound_names(forward), caller)]
            if what == "apply_forward":
                return steps
            stored = self.ends.get(forward)
            fctx = forward.args.args[0].arg if forward.args.args else "ctx"
            mapping = {(params[0] if params else "ctx") + k[len(fctx):]: v for k, v in
                       (stored.values.items() if stored else ()) if k.startswith(fctx + ".")}
            return [(mapping, bound_names(target), mod.qualname(forward))] + steps
        drop = bool(params) and params[0] in ("self", "cls") and isinstance(
            call.func, (ast.Attribute, ast.Name))  # f = self.method; f(x): a bound method
        first = None
        if drop and params[0] == "self":
            first = call.func.value if isinstance(call.func, ast.Attribute) else next(
                (n.value for n in ast.walk(scope.values.get(call.func.id, call.func))
                 if isinstance(n, ast.Attribute) and n.attr == target.name), None)
        return [(bind(target, call, scope, drop, first), bound_names(target), caller)]

    def _unresolved(self, mod, call, fn, why: str) -> None:
        if mod is self.root:
            key = (call.lineno, src(call.func))
            self.unresolved.setdefault(key, {"line": call.lineno, "call": src(call.func),
                                             "function": fn.name if fn else None, "why": why})


def words(conds) -> list[str]:
    return [w for c in conds for e, _where, written in c.forms
            for w in (written if isinstance(written, str) else show(written), show(e)) if w]


def _carried(conds, steps):
    """A callee's conditions through ``steps`` (see ``_Walker._steps``): False when one is
    decided false, else the ones still open."""
    for mapping, own, where in steps:
        out = []
        for c in conds:
            got = translate(c, mapping, own, where)
            if got is False:
                return False
            out += [] if got is True else got
        conds = out
    return conds
