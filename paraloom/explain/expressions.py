"""Expressions the source reader carries: names replaced by what a caller passed
(:func:`substitute`, with the markers of arguments that travel through ``*args`` / ``**kwargs``),
constants folded and conditions written as a user would (:func:`simplify`), and written back
(:func:`show`). Pure functions over ``ast`` nodes; a node is never changed in place, so unchanged
subtrees are shared.
"""

from __future__ import annotations

import ast

from .values import never_none

__all__ = ["KWARG", "ARG", "MISSING", "dotted", "size", "substitute", "simplify", "conjuncts",
           "show", "resolve_marker", "COMPARE", "never_none"]

KWARG = "__kwarg__"  # __kwarg__(kwargs, "name", default): the callee's parameter from **kwargs
ARG = "__arg__"  # __arg__(args, j, fallback): args[j] if passed, else fallback
MISSING = "__missing__"  # no default: an argument never passed


def dotted(node) -> str | None:
    """``a.b.c`` for a plain attribute chain (or a name), else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _const(v) -> ast.Constant:
    return ast.Constant(value=v)


def _is_const(node) -> bool:
    return isinstance(node, ast.Constant)


def size(node) -> int:
    return sum(1 for _ in ast.walk(node))


def _sub(node, mapping: dict):
    """``node`` with ``mapping`` applied; unchanged subtrees are shared, never copied (the
    reader builds new nodes and never changes one in place)."""
    if isinstance(node, ast.Name):
        if getattr(node, "pl_local", False):
            return node
        return mapping.get(node.id, node)
    if isinstance(node, ast.Attribute):
        key = dotted(node)
        if key is not None and key in mapping:
            return mapping[key]
    changed, fields = False, {}
    for name, value in ast.iter_fields(node):
        if isinstance(value, ast.AST):
            new = _sub(value, mapping)
            changed |= new is not value
        elif isinstance(value, list):
            new = [_sub(v, mapping) if isinstance(v, ast.AST) else v for v in value]
            changed |= any(a is not b for a, b in zip(new, value, strict=True))
        else:
            new = value
        fields[name] = new
    if not changed:
        return node
    out = type(node)(**fields)
    return resolve_marker(out) if isinstance(out, ast.Call) else out


def resolve_marker(node: ast.Call):
    """``__kwarg__(dict, k, default)`` / ``__arg__(tuple, j, fallback)`` once the container is
    known; otherwise the marker stays."""
    name = node.func.id if isinstance(node.func, ast.Name) else None
    if name == KWARG and isinstance(node.args[0], ast.Dict):
        key = node.args[1].value
        spreads = []
        for k, v in zip(node.args[0].keys, node.args[0].values, strict=True):
            if k is None:
                spreads.append(v)
            elif isinstance(k, ast.Constant) and k.value == key:
                return v
        if spreads:  # not among the named keywords: maybe in the spread mapping
            return ast.Call(func=ast.Name(id=KWARG, ctx=ast.Load()),
                            args=[spreads[0], node.args[1], node.args[2]], keywords=[])
        return node.args[2]
    if name == ARG and isinstance(node.args[0], (ast.Tuple, ast.List)) \
            and not any(isinstance(e, ast.Starred) for e in node.args[0].elts):
        j = node.args[1].value
        elts = node.args[0].elts
        return elts[j] if j < len(elts) else node.args[2]
    return node


def substitute(node: ast.expr, mapping: dict[str, ast.expr]) -> ast.expr:
    """``node`` with names / dotted chains replaced by the expressions of ``mapping``."""
    return _sub(node, mapping) if mapping else node


_INVERSE = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
            ast.In: ast.NotIn, ast.NotIn: ast.In}
COMPARE = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b,
            ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
            ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b,
            ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b,
            ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b}
_LITERALS = (ast.Dict, ast.List, ast.Tuple, ast.ListComp, ast.DictComp, ast.Lambda)


def _not(node):
    if _is_const(node):
        return _const(not node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return node.operand
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _INVERSE:
        return ast.Compare(left=node.left, ops=[_INVERSE[type(node.ops[0])]()],
                           comparators=node.comparators)
    return ast.UnaryOp(op=ast.Not(), operand=node)


def _boolop(op, values):
    """``and`` / ``or`` of simplified operands: constants folded, nested ones flattened,
    duplicates merged."""
    flat, seen = [], set()
    absorbing = isinstance(op, ast.Or)  # a true operand decides an or, a false one an and
    for v in values:
        parts = v.values if isinstance(v, ast.BoolOp) and type(v.op) is type(op) else [v]
        for p in parts:
            if _is_const(p):
                if bool(p.value) == absorbing:
                    return _const(absorbing)
                continue
            text = ast.dump(p)
            if text not in seen:
                seen.add(text)
                flat.append(p)
    if not flat:
        return _const(not absorbing)
    if len(flat) == 1:
        return flat[0]
    return _factored(flat) if absorbing else ast.BoolOp(op=op, values=flat)


def _factored(disjuncts: list) -> ast.expr:
    """``(a and x) or (b and x)`` -> ``x and (a or b)``; ``p or not p`` -> True; ``p or (not p
    and x)`` -> ``p or x``."""
    alone = {ast.dump(_not(d)) for d in disjuncts if len(conjuncts(d)) == 1}
    kept = [[c for c in conjuncts(d) if ast.dump(c) not in alone] if len(conjuncts(d)) > 1
            else conjuncts(d) for d in disjuncts]
    if any(len(k) < len(conjuncts(d)) for k, d in zip(kept, disjuncts, strict=True)):
        return _boolop(ast.Or(), [_boolop(ast.And(), k) for k in kept])
    texts = [{ast.dump(c): c for c in conjuncts(d)} for d in disjuncts]
    common = [t for t in texts[0] if all(t in other for other in texts[1:])]
    rests = [[c for t, c in parts.items() if t not in common] for parts in texts]
    if common and any(not r for r in rests):
        return _boolop(ast.And(), [texts[0][t] for t in common])
    alone = {ast.dump(r[0]) for r in rests if len(r) == 1}
    if any(ast.dump(_not(r[0])) in alone for r in rests if len(r) == 1):
        either = _const(True)
    else:
        either = ast.BoolOp(op=ast.Or(), values=[
            r[0] if len(r) == 1 else ast.BoolOp(op=ast.And(), values=r) for r in rests])
    if not common:
        return either
    return _boolop(ast.And(), [texts[0][t] for t in common] + [either])


def _fold_compare(node: ast.Compare):
    left, right = node.left, node.comparators[0]
    op = type(node.ops[0])
    if op in (ast.Is, ast.IsNot) and (
            (_is_const(left) and isinstance(right, _LITERALS))
            or (_is_const(right) and right.value is None and isinstance(left, _LITERALS))):
        return _const(op is ast.IsNot)  # a literal is never None
    if op in (ast.Is, ast.IsNot) and _is_const(right) and right.value is None \
            and never_none(left):
        return _const(op is ast.IsNot)
    if _is_const(left) and _is_const(right) and op in COMPARE:
        try:
            return _const(COMPARE[op](left.value, right.value))
        except TypeError:
            return node
    return node


def simplify(node: ast.expr, boolean: bool = True) -> ast.expr:
    """Constants folded and the condition written as a user would (``boolean``: the value is
    only tested for truth, so ``x if t else False`` reads ``t and x``)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return _not(simplify(node.operand))
    if isinstance(node, ast.BoolOp):
        return _boolop(node.op, [simplify(v, boolean) for v in node.values])
    if isinstance(node, ast.IfExp):
        test = simplify(node.test)
        body, orelse = simplify(node.body, boolean), simplify(node.orelse, boolean)
        if _is_const(test):
            return body if test.value else orelse
        if boolean and _is_const(body):
            return _boolop(ast.Or(), [test, orelse]) if body.value \
                else _boolop(ast.And(), [_not(test), orelse])
        if boolean and _is_const(orelse):
            return _boolop(ast.And(), [test, body]) if not orelse.value \
                else _boolop(ast.Or(), [_not(test), body])
        return ast.IfExp(test=test, body=body, orelse=orelse)
    if isinstance(node, ast.Compare):
        parts = [simplify(node.left, False)] + [simplify(c, False) for c in node.comparators]
        node = ast.Compare(left=parts[0], ops=node.ops, comparators=parts[1:])
        if len(node.ops) == 1 and isinstance(parts[0], ast.IfExp) and _is_const(parts[1]):
            pushed = simplify(ast.IfExp(test=parts[0].test, body=ast.Compare(
                left=parts[0].body, ops=node.ops, comparators=parts[1:]), orelse=ast.Compare(
                left=parts[0].orelse, ops=node.ops, comparators=parts[1:])))
            if not any(isinstance(n, ast.IfExp) for n in ast.walk(pushed)):
                return pushed  # len(ops) > 0, ops a list built under ifs: which ifs held
        return _fold_compare(node) if len(node.ops) == 1 else node
    if isinstance(node, ast.Subscript):
        base, index = simplify(node.value, False), simplify(node.slice, False)
        if isinstance(base, (ast.Tuple, ast.List)) and _is_const(index) \
                and isinstance(index.value, int) and -len(base.elts) <= index.value \
                < len(base.elts) and not any(isinstance(e, ast.Starred) for e in base.elts):
            return base.elts[index.value]
        return ast.Subscript(value=base, slice=index, ctx=ast.Load())
    if isinstance(node, ast.Call):
        return _fold_call(node)
    if isinstance(node, ast.Attribute):
        base = simplify(node.value, False)
        return node if base is node.value else ast.Attribute(value=base, attr=node.attr,
                                                             ctx=ast.Load())
    return node


def _fold_call(node: ast.Call):
    func = simplify(node.func, False)
    args = [simplify(a, False) for a in node.args]
    node = resolve_marker(ast.Call(func=func, args=args, keywords=node.keywords))
    if not isinstance(node, ast.Call):
        return simplify(node, False)
    if isinstance(func, ast.Name) and func.id == "len" and len(args) == 1 \
            and isinstance(args[0], (ast.Tuple, ast.List)) \
            and not any(isinstance(e, ast.Starred) for e in args[0].elts):
        return _const(len(args[0].elts))
    if isinstance(func, ast.Name) and func.id == "len" and len(args) == 1 \
            and isinstance(args[0], ast.IfExp):
        t = args[0]
        return simplify(ast.IfExp(test=t.test, body=ast.Call(func=func, args=[t.body],
                                                             keywords=[]),
                                  orelse=ast.Call(func=func, args=[t.orelse], keywords=[])),
                        False)
    if isinstance(func, ast.Attribute) and func.attr in ("startswith", "endswith") \
            and len(args) == 1 and _is_const(func.value) and isinstance(func.value.value, str) \
            and _is_const(args[0]) and isinstance(args[0].value, str):
        return _const(getattr(func.value.value, func.attr)(args[0].value))
    return node


def conjuncts(node: ast.expr) -> list[ast.expr]:
    """The parts of a top-level ``and``."""
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
        return [p for v in node.values for p in conjuncts(v)]
    return [node]


class _Show(ast.NodeTransformer):
    def visit_Call(self, node):
        self.generic_visit(node)
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name == KWARG:
            return ast.Subscript(value=node.args[0], slice=node.args[1], ctx=ast.Load())
        if name == ARG:  # args[j], or the keyword it falls back to (args is mostly empty)
            fallback = node.args[2]
            if isinstance(fallback, ast.Subscript):
                return fallback
            return ast.Subscript(value=node.args[0], slice=node.args[1], ctx=ast.Load())
        return node


def _copy(node):
    """The node's syntax only: the reader's own attributes (``pl_def``: a whole function) are
    not copied."""
    if isinstance(node, ast.AST):
        return type(node)(**{k: _copy(v) for k, v in ast.iter_fields(node)})
    return [_copy(v) for v in node] if isinstance(node, list) else node


def show(node: ast.expr) -> str:
    """The expression as source, markers written as ``kwargs['name']`` / ``args[j]``."""
    try:
        return ast.unparse(_Show().visit(_copy(node)))
    except (ValueError, RecursionError):  # an f-string ast cannot write back, say
        return "<expression>"
