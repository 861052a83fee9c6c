"""The sites one call gives, for the walk (:mod:`.walker`): a collective's (one per direction of
a ``P2POp``, each with the condition that picks it), a region helper's (its forward op, and its
backward op under the condition the call passes), and :func:`merged`, which joins the sites of a
name bound to several equivalent functions (their differing conditions joined with ``or``).
"""

from __future__ import annotations

import ast

from .conditions import Cond
from .expressions import show, simplify
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

__all__ = ["collective_sites", "region_sites", "merged"]


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
    """Aliases bound to several equivalent functions give one site per op; paths that differ
    in their own conditions are joined with ``or``."""
    unique: dict[tuple, dict] = {}
    for s in sites:
        key = (s["line"], s["op"], s["rel"], str(s["asynchronous"]), s["kind"],
               tuple(c.key() for c in s["conds"][:outer]))
        if key not in unique:
            unique[key] = s
            continue
        had, mine = unique[key]["conds"][outer:], s["conds"][outer:]
        if [c.key() for c in had] != [c.key() for c in mine]:
            either = simplify(ast.BoolOp(op=ast.Or(), values=[
                _all(had), _all(mine)]))
            rest = [] if isinstance(either, ast.Constant) else [
                Cond([(either, where, show(either))])]
            unique[key] = dict(unique[key], conds=s["conds"][:outer] + rest,
                               via=s["via"][:1])
    return list(unique.values())


def _all(conds) -> ast.expr:
    if not conds:
        return ast.Constant(True)
    return conds[0].expr if len(conds) == 1 else ast.BoolOp(op=ast.And(),
                                                            values=[c.expr for c in conds])
