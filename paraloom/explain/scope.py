"""What a function's names hold along its body, and how a call hands values to its callee: the
path-sensitive part of the source reader.

* :class:`Scope`: the value of each local (and ``ctx.NAME`` / ``self.NAME`` set in the function)
  as an expression over the function's parameters, after the statements read so far; an ``if``
  merges its branches into ``x if test else y``; a name changed in a loop, by ``+=`` or by
  anything the reader does not follow becomes opaque (kept as itself, never taken for the
  parameter of the same name). Module constants (``NAME = literal`` once at top level) start in
  every scope.
* :func:`bind`: the callee's parameters as the caller's expressions — positional, keyword,
  ``*args`` of a list the caller built, ``**kwargs`` passed on (markers resolved a level up),
  defaults for what is not passed.
* :func:`translate`: a :class:`~.conditions.Cond` of the callee rewritten in the caller's names
  (or decided).
"""

from __future__ import annotations

import ast

from .conditions import Cond
from .expressions import ARG, KWARG, MISSING, conjuncts, dotted, simplify, size, substitute
from .values import appended, mutable

__all__ = ["Scope", "bind", "translate", "bound_names", "test_conds"]

_MAX_NODES = 400  # a value larger than this is not carried further
_PURE = {"len", "tuple", "list", "sorted", "isinstance", "print", "any", "all", "sum", "zip",
         "enumerate", "range", "str", "repr", "bool", "int", "float", "min", "max", "set", "dict"}



def _marker(name: str, *args) -> ast.Call:
    return ast.Call(func=ast.Name(id=name, ctx=ast.Load()), args=list(args), keywords=[])


def _opaque(key: str) -> ast.Name:
    node = ast.Name(id=key, ctx=ast.Load())
    node.pl_local = True
    return node


def _entry(key: str) -> ast.expr:
    """A name's value where the function starts: itself."""
    return ast.parse(key, mode="eval").body


def _defined(fn) -> ast.Name:
    node = ast.Name(id=fn.name, ctx=ast.Load())
    node.pl_def = fn
    return node


def bound_names(fn) -> frozenset[str]:
    """Parameters and locals of ``fn``: names a caller's value cannot stand for unless bound."""
    if not hasattr(fn, "pl_bound"):  # kept on the node: it lives as long as the parse
        names = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
        names |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
                  and isinstance(n.ctx, ast.Store)}
        fn.pl_bound = frozenset(names)
    return fn.pl_bound


def module_constants(mod) -> dict[str, ast.expr]:
    """``NAME = literal`` assigned once, at the module's top level."""
    if not hasattr(mod, "pl_constants"):
        counts: dict[str, int] = {}
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                counts[node.id] = counts.get(node.id, 0) + 1
        out = {}
        for stmt in mod.tree.body:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
                    and isinstance(stmt.targets[0], ast.Name) \
                    and isinstance(stmt.value, ast.Constant) \
                    and counts.get(stmt.targets[0].id) == 1:
                out[stmt.targets[0].id] = stmt.value
        mod.pl_constants = out
    return mod.pl_constants


class Scope:
    """Values of one function's names at a point of its body (see the module docstring)."""

    def __init__(self, values: dict[str, ast.expr] | None = None, where: str = "") -> None:
        self.values, self.where = dict(values or {}), where

    @classmethod
    def of(cls, mod, fn, where: str) -> Scope:
        names = bound_names(fn) if fn is not None else frozenset()
        values = {k: v for k, v in module_constants(mod).items() if k not in names}
        for node in ast.walk(fn) if fn is not None else ():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not fn:
                values[node.name] = _defined(node)  # a nested def: a function, never None
        return cls(values, where)

    def copy(self) -> Scope:
        return Scope(self.values, self.where)

    def read(self, node, boolean: bool = False) -> ast.expr:
        return simplify(substitute(node, self.values), boolean)

    def opaque(self, key: str) -> None:
        self.values[key] = _opaque(key)
        for k in [k for k in self.values if k.startswith(key + ".")]:
            del self.values[k]

    def assign(self, target, value) -> None:
        """``target = value`` (``value`` as written; read here)."""
        if isinstance(target, (ast.Tuple, ast.List)):
            v = self.read(value) if value is not None else None
            if isinstance(v, (ast.Tuple, ast.List)) and len(v.elts) == len(target.elts):
                for t, e in zip(target.elts, v.elts, strict=True):
                    self._set(t, e)
            else:
                for i, t in enumerate(target.elts):
                    self._set(t, None if v is None else ast.Subscript(
                        value=v, slice=ast.Constant(i), ctx=ast.Load()))
            return
        self._set(target, self.read(value) if value is not None else None)

    def _set(self, target, v) -> None:
        key = dotted(target)
        if key is None:  # x[i] = ..., *rest: the container changes
            base = target.value if isinstance(target, (ast.Subscript, ast.Starred)) else None
            while isinstance(base, ast.Subscript):
                base = base.value
            if dotted(base) is not None:
                self.opaque(dotted(base))
            return
        if v is None or size(v) > _MAX_NODES:
            self.opaque(key)
            return
        self.values[key] = v
        for k in [k for k in self.values if k.startswith(key + ".")]:
            del self.values[k]

    def mutated(self, call: ast.Call) -> None:
        """``xs.append(...)`` or ``f(xs)``: a container built here may change, so it is no
        longer the literal it was assigned."""
        if isinstance(call.func, ast.Name) and call.func.id in _PURE:
            return
        key = dotted(call.func.value) if isinstance(call.func, ast.Attribute) else None
        if key is not None and call.func.attr == "append" and len(call.args) == 1 \
                and not call.keywords and not isinstance(call.args[0], ast.Starred):
            item = self.read(call.args[0])  # kept when small: only the length is asked, mostly
            grown = appended(self.values.get(key), item if size(item) <= 6
                              else _opaque(f"{key}[...]"))
            if grown is not None and size(grown) <= _MAX_NODES:
                self.values[key] = grown
                return
        heads = [call.func.value] if isinstance(call.func, ast.Attribute) else []
        for node in [*heads, *call.args, *(k.value for k in call.keywords)]:
            node = node.value if isinstance(node, ast.Starred) else node
            key = dotted(node)
            if key is not None and mutable(self.values.get(key)):
                self.opaque(key)

    def forget(self, stmts) -> None:
        """Every name the statements may assign becomes opaque (a loop, a try)."""
        for stmt in stmts:
            for node in ast.walk(stmt):
                if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(
                        node.ctx, (ast.Store, ast.Del)):
                    key = dotted(node)
                    if key is not None:
                        self.opaque(key)

    def merge(self, test, body: Scope | None, orelse: Scope | None) -> None:
        """After ``if test:``: each branch that falls through (None: it returned) joins."""
        if body is None or orelse is None:
            self.values = dict((body or orelse or self).values)
            return
        merged = {}
        for k in set(body.values) | set(orelse.values):
            a = body.values.get(k) or self.values.get(k) or _entry(k)
            b = orelse.values.get(k) or self.values.get(k) or _entry(k)
            if a is b or ast.dump(a) == ast.dump(b):
                merged[k] = a
            elif getattr(a, "pl_local", False) or getattr(b, "pl_local", False):
                merged[k] = _opaque(k)
            else:
                v = simplify(ast.IfExp(test=self.read(test, True), body=a, orelse=b), False)
                merged[k] = v if size(v) <= _MAX_NODES else _opaque(k)
        self.values = merged


def test_conds(scope: Scope, test, negate: bool = False):
    """The conditions an ``if`` adds (``negate``: its else branch): ``False`` when the branch
    is dead, else ``[Cond]`` (empty when decided true)."""
    node = ast.UnaryOp(op=ast.Not(), operand=test) if negate else test
    out = []
    for part in conjuncts(simplify(node)):
        v = scope.read(part, True)
        if isinstance(v, ast.Constant):
            if not v.value:
                return False
            continue
        out += [Cond([(p, scope.where, part if len(conjuncts(v)) == 1 else p)])
                for p in conjuncts(v)]
    return out


def _fn_params(fn):
    a = fn.args
    params = [p.arg for p in [*a.posonlyargs, *a.args]]
    defaults = dict(zip(params[len(params) - len(a.defaults):], a.defaults, strict=True))
    defaults.update({k.arg: d for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)
                     if d is not None})
    return params, [k.arg for k in a.kwonlyargs], defaults


def bind(fn, call: ast.Call, scope: Scope, drop_first: bool,
         first=None) -> dict[str, ast.expr]:
    """The callee's parameters as the caller's expressions (``first``: what the dropped first
    parameter is, ``obj`` of ``obj.method(...)``)."""
    params, kwonly, defaults = _fn_params(fn)
    mapping: dict[str, ast.expr] = {}
    if drop_first and params:
        name = params.pop(0)
        if first is not None:
            mapping[name] = scope.read(first)
    positional, star = [], None
    for arg in call.args:
        value = scope.read(arg.value if isinstance(arg, ast.Starred) else arg)
        if not isinstance(arg, ast.Starred):
            positional.append(value)
        elif isinstance(value, (ast.Tuple, ast.List)) and not any(
                isinstance(e, ast.Starred) for e in value.elts):
            positional += value.elts
        else:
            star = value  # of unknown length: later parameters are args[j] or keywords
            break
    keywords, spreads = {}, []
    for k in call.keywords:
        value = scope.read(k.value)
        if k.arg is not None:
            keywords[k.arg] = value
        elif isinstance(value, ast.Dict) and all(isinstance(x, ast.Constant) for x in value.keys):
            keywords.update({x.value: v for x, v in zip(value.keys, value.values, strict=True)})
        else:
            spreads.append(value)

    def unpassed(name: str) -> ast.expr:
        if name in keywords:
            return keywords[name]
        default = defaults.get(name, ast.Name(id=MISSING, ctx=ast.Load()))
        return _marker(KWARG, spreads[0], ast.Constant(name), default) if spreads else default

    for i, name in enumerate(params):
        if i < len(positional):
            mapping[name] = positional[i]
        elif star is not None:
            mapping[name] = _marker(ARG, star, ast.Constant(i - len(positional)), unpassed(name))
        else:
            mapping[name] = unpassed(name)
    for name in kwonly:
        mapping[name] = unpassed(name)
    if fn.args.vararg is not None and star is None:
        mapping[fn.args.vararg.arg] = ast.Tuple(elts=positional[len(params):], ctx=ast.Load())
    if fn.args.kwarg is not None:
        extra = [(k, v) for k, v in keywords.items() if k not in params and k not in kwonly]
        mapping[fn.args.kwarg.arg] = ast.Dict(
            keys=[ast.Constant(k) for k, _ in extra] + [None] * len(spreads),
            values=[v for _, v in extra] + spreads)
    return mapping


def _unresolved(node, mapping: dict, blockers: frozenset) -> bool:
    """A name of ``node`` that stays the callee's own after ``mapping``."""
    key = dotted(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
    if key is not None and key in mapping:
        return False
    if isinstance(node, ast.Name):
        return getattr(node, "pl_local", False) or node.id in blockers
    return any(_unresolved(c, mapping, blockers) for c in ast.iter_child_nodes(node))


def translate(cond: Cond, mapping: dict, blockers: frozenset, where: str):
    """``cond`` in the caller's names: ``True`` / ``False`` when decided, else ``[Cond]`` (the
    cond unchanged when one of its names is the callee's own)."""
    new = simplify(substitute(cond.expr, mapping))
    if isinstance(new, ast.Constant):
        return bool(new.value)
    if _unresolved(cond.expr, mapping, blockers):
        return [cond]
    return [Cond(cond.forms + [(new, where, "")])]
