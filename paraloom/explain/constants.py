"""Guards a call site decides: a helper called with constant arguments
(``pipeline_communicate(operation="recv_forward")``) never reaches the sites its guards exclude
for those values (``is_send = operation.startswith("send")`` ... ``if is_send``).

Only what the code spells is evaluated — constants, parameters bound to constants, names
assigned once from those, comparisons, ``not`` / ``and`` / ``or``, and ``str.startswith`` /
``endswith`` — with a small interpreter (nothing from the file is executed); anything else is
unknown and keeps the site.
"""

from __future__ import annotations

import ast
import re

__all__ = ["bindings", "excluded", "pipeline_phases"]

_UNKNOWN = object()
_PIPE = re.compile(r"(send|recv)_(fwd|bwd|forward|backward)")
_COMPARE = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b,
            ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
            ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b}


def _value(node, env: dict):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return env.get(node.id, _UNKNOWN)
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_value(e, env) for e in node.elts]
        return _UNKNOWN if any(i is _UNKNOWN for i in items) else tuple(items)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        v = _value(node.operand, env)
        return _UNKNOWN if v is _UNKNOWN else not v
    if isinstance(node, ast.BoolOp):
        values = [_value(v, env) for v in node.values]
        want = isinstance(node.op, ast.Or)
        if any(v is not _UNKNOWN and bool(v) == want for v in values):
            return want  # decided by one operand whatever the others are
        return _UNKNOWN if any(v is _UNKNOWN for v in values) else not want
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
        a, b = _value(node.left, env), _value(node.comparators[0], env)
        if a is _UNKNOWN or b is _UNKNOWN:
            return _UNKNOWN
        try:
            return _COMPARE[type(node.ops[0])](a, b)
        except TypeError:
            return _UNKNOWN
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr in ("startswith", "endswith") and len(node.args) == 1:
        s, arg = _value(node.func.value, env), _value(node.args[0], env)
        if isinstance(s, str) and isinstance(arg, (str, tuple)):
            return getattr(s, node.func.attr)(arg)
    return _UNKNOWN


def bindings(fn, call: ast.Call) -> dict:
    """Parameters of ``fn`` bound to constants by ``call``, and names ``fn`` assigns exactly
    once (at its top level) from them."""
    params = [a.arg for a in [*fn.args.posonlyargs, *fn.args.args]]
    kwonly = {a.arg for a in fn.args.kwonlyargs} | set(params)
    if params and params[0] in ("self", "cls") and isinstance(call.func, ast.Attribute):
        params = params[1:]
    env = {}
    for name, arg in zip(params, call.args, strict=False):
        if isinstance(arg, ast.Constant):
            env[name] = arg.value
    env.update({k.arg: k.value.value for k in call.keywords
                if k.arg and isinstance(k.value, ast.Constant)})
    if not env:
        return env
    counts: dict[str, int] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            counts[node.id] = counts.get(node.id, 0) + 1
    for stmt in fn.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
                and isinstance(stmt.targets[0], ast.Name) and counts[stmt.targets[0].id] == 1:
            value = _value(stmt.value, env)
            if value is not _UNKNOWN:
                env[stmt.targets[0].id] = value
    return {k: v for k, v in env.items()  # a parameter assigned again is not the argument
            if counts.get(k, 0) == (0 if k in params or k in kwonly else 1)}


def excluded(conds: list[str], env: dict) -> bool:
    """True when one of the site's guards is False for these bindings."""
    for cond in conds if env else ():
        try:
            tree = ast.parse(cond, mode="eval").body
        except SyntaxError:
            continue
        value = _value(tree, env)
        if value is not _UNKNOWN and not value:
            return True
    return False


def pipeline_phases(call: ast.Call) -> dict[str, str]:
    """``{"send": phase, "recv": phase, "batch_p2p": phase}`` named by a constant argument of a
    pipeline communication helper (``"recv_forward"``, ``"send_fwd_recv_bwd"``): activations
    move in forward, gradients in backward."""
    out: dict[str, str] = {}
    for node in [*call.args, *(k.value for k in call.keywords)]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for direction, phase in _PIPE.findall(node.value):
                out[direction] = "forward" if phase.startswith("f") else "backward"
    if out:
        both = set(out.values())
        out["batch_p2p"] = both.pop() if len(both) == 1 else "forward+backward"
    return out
