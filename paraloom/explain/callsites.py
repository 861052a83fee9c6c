"""The sites one call gives, for the walk (:mod:`.walker`): a collective's (one per direction of
a ``P2POp``, each with the condition that picks it), a region helper's (its forward op, and its
backward op under the condition the call passes), and :func:`merged`, which joins the sites of a
name bound to several equivalent functions (their differing conditions joined with ``or``).
"""

from __future__ import annotations

import ast

from .conditions import Cond
from .expressions import conjuncts, dotted, show, simplify
from .module import src
from .names import (
    COLLECTIVES,
    DISTRIBUTE,
    FSDP_METHODS,
    FUNCOL,
    PARALOOM_COMM,
    SYMM_MEM,
    region_semantics,
)
from .rules import region_condition
from .scope import test_conds
from .spellings import async_of, p2p_directions

__all__ = ["collective_sites", "region_sites", "merged", "alias_picks"]


def alias_picks(scope, func) -> dict:
    """``{function name: [Cond] or False}`` for a call of a local name that ``if``s bound to one
    of several functions (``p2p_func = _batched_p2p_ops`` in one branch, ``_p2p_ops`` in the
    other): the conditions under which the name holds each (False: never). Empty when the name
    is not such a pick."""
    paths: dict[str, list] = {}

    def leaves(node, tests) -> bool:
        if isinstance(node, ast.IfExp):
            return leaves(node.body, tests + [node.test]) and leaves(
                node.orelse, tests + [ast.UnaryOp(op=ast.Not(), operand=node.test)])
        name = dotted(node)  # _p2p_ops, self._plain: the function's own name picks it
        if name is not None:
            paths.setdefault(name.rpartition(".")[2], []).append(
                ast.BoolOp(op=ast.And(), values=tests) if tests else ast.Constant(True))
            return True
        return False

    value = scope.values.get(func.id) if isinstance(func, ast.Name) else None
    if not isinstance(value, ast.IfExp) or not leaves(value, []):
        return {}
    out = {}
    for name, ways in paths.items():
        either = simplify(ast.BoolOp(op=ast.Or(), values=ways) if len(ways) > 1 else ways[0])
        out[name] = (bool(either.value) and []) if isinstance(either, ast.Constant) else [
            Cond([(p, scope.where, p)]) for p in conjuncts(either)]
    return out


def collective_sites(mod, call, fn, what, target, scope, base) -> list[dict]:
    table = {"dist": COLLECTIVES, "comm": PARALOOM_COMM, "funcol": FUNCOL, "symm": SYMM_MEM,
             "fsdp": FSDP_METHODS, "distribute": DISTRIBUTE}.get(what, {})
    directions = (p2p_directions(mod, call) if target == "P2POp"
                  else [(table.get(target, "redistribute"), None)])
    flag = async_of(mod, call, target, fn) if what in ("dist", "comm", "dtensor", "fsdp") \
        else what == "funcol"
    out = []
    for op, test in directions:
        more = test_conds(scope, test) if test is not None else []
        if more is not False:
            out.append(dict(base, op=op, asynchronous=flag, conds=base["conds"] + more,
                            moved=src(call.keywords[0].value) if what == "dtensor"
                            and call.keywords else None))
    return out


def region_sites(call, target, nograd, scope, base) -> list[dict]:
    fwd, bwd, kind, moved = region_semantics(target)
    test = region_condition(target, call)
    out = []
    for op, rel in ((fwd, base["rel"]), (None if nograd else bwd, "backward")):
        more = test_conds(scope, test) if test is not None and rel == "backward" else []
        if op and more is not False:
            out.append(dict(base, op=op, asynchronous=False, kind=kind, rel=rel,
                            via=[target], moved=moved, conds=base["conds"] + more))
    return out


def merged(sites: list[dict], outer: int, where: str) -> list[dict]:
    """One site per op and path: the same op reached along the same calls under different
    conditions (the branches of an ``if`` both sending, say) is one site, its conditions
    joined with ``or``; reached through different functions (a name bound to one of several by
    ``if``s) it stays one site per function, each with the condition that picks it."""
    unique: dict[tuple, dict] = {}
    for s in sites:
        key = (s["line"], s["op"], s["rel"], str(s["asynchronous"]), s["kind"],
               tuple(c.key() for c in s["conds"][:outer]), tuple(s["via"]))
        if key not in unique:
            unique[key] = s
            continue
        had, mine = unique[key]["conds"][outer:], s["conds"][outer:]
        if [c.key() for c in had] != [c.key() for c in mine]:
            either = simplify(ast.BoolOp(op=ast.Or(), values=[
                _all(had), _all(mine)]))
            rest = [] if isinstance(either, ast.Constant) else [
                Cond([(either, where, show(either))])]
            unique[key] = dict(unique[key], conds=s["conds"][:outer] + rest)
    return list(unique.values())


def _all(conds) -> ast.expr:
    if not conds:
        return ast.Constant(True)
    return conds[0].expr if len(conds) == 1 else ast.BoolOp(op=ast.And(),
                                                            values=[c.expr for c in conds])
