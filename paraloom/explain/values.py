"""What the source reader knows of a value without running anything: that it is never None
(:func:`never_none`: a tensor operation's result, a function the code defines, the call of one
that returns tensors), and how a container built in the function grows (:func:`mutable`,
:func:`appended`: ``ops = []`` then ``ops.append(x)`` under ``if``s is a list whose length each
``if`` decides, so ``len(ops) > 0`` reads as which ``if``s held).
"""

from __future__ import annotations

import ast

__all__ = ["TENSOR_OPS", "never_none", "mutable", "appended", "MUTABLE"]

MUTABLE = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)

TENSOR_OPS = {"matmul", "mm", "bmm", "t", "view", "reshape", "clone", "contiguous", "empty",
              "zeros", "ones", "randn", "empty_like", "zeros_like", "ones_like", "cat", "stack",
              "transpose", "permute", "detach", "narrow", "chunk", "split", "float", "to",
              "tensor"}


def never_none(node) -> bool:
    """A value that is never None: a tensor operation's result (``grad.matmul(w)``,
    ``torch.empty(...)``), a function defined in the code (the reader marks a nested ``def``'s
    name with ``pl_def``), or the call of such a function whose every ``return`` gives a tensor
    operation's result."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr in TENSOR_OPS
    if getattr(node, "pl_def", None) is not None:
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.IfExp):  # (f if t else None)()
        picks = [node.func.body, node.func.orelse]
        return all(isinstance(f, ast.Constant) and f.value is None or never_none(ast.Call(
            func=f, args=node.args, keywords=node.keywords)) for f in picks)
    fn = getattr(node.func, "pl_def", None) if isinstance(node, ast.Call) else None
    if fn is None:
        return False
    returns = [r.value for r in ast.walk(fn) if isinstance(r, ast.Return)]
    return bool(returns) and all(r is not None and never_none(r) for r in returns)


def mutable(v) -> bool:
    """A container built here (also one of several, picked by ``if``s)."""
    if isinstance(v, ast.IfExp):
        return mutable(v.body) and mutable(v.orelse)
    return isinstance(v, MUTABLE)


def appended(v, item):
    """``v`` after ``.append(item)``: a list one longer (each list an ``if`` may have built);
    None when ``v`` is not such a list."""
    if isinstance(v, ast.IfExp):
        body, orelse = appended(v.body, item), appended(v.orelse, item)
        return None if body is None or orelse is None else ast.IfExp(
            test=v.test, body=body, orelse=orelse)
    if isinstance(v, ast.List) and not any(isinstance(e, ast.Starred) for e in v.elts):
        return ast.List(elts=[*v.elts, item], ctx=ast.Load())
    return None
