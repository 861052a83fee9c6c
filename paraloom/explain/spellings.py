"""Reading one collective call the way its code decides it: the direction of a ``P2POp`` in
every spelling, whether the returned handle outlives the call (async), the parallel type named
by its group expression, and the communication a ``parallelize_module`` plan installs.
"""

from __future__ import annotations

import ast
import re

from .module import Module, src
from .names import COLLECTIVES, PLAN_STYLES
from .rules import async_flag

__all__ = ["p2p_directions", "async_of", "group_kind", "batch_kind", "plan_sites"]

_GROUP_ARGS = ("group", "process_group", "pg", "mesh", "device_mesh", "group_name")
_TOKENS = [("dp", {"dp", "data"}), ("ep", {"ep", "expert"}), ("cp", {"cp", "context"}),
           ("pp", {"pp", "pipeline", "p2p"}), ("sp", {"sp", "sequence"}),
           ("tp", {"tp", "tensor", "model"})]


def p2p_directions(mod: Module, call: ast.Call) -> list[tuple[str, ast.expr | None]]:
    """``[(op, condition as an expression)]`` of ``P2POp(dist.isend if c else dist.irecv, ...)``,
    ``P2POp(op=dist.isend, ...)``, ``P2POp(dist.irecv, ...)``."""
    arg = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "op"),
                                              None)

    def one(node) -> str:
        return COLLECTIVES.get(mod.dotted(node).rpartition(".")[2], "p2p_op")

    if isinstance(arg, ast.IfExp):
        return [(one(arg.body), arg.test),
                (one(arg.orelse), ast.UnaryOp(op=ast.Not(), operand=arg.test))]
    return [(one(arg), None)] if arg is not None else [("p2p_op", None)]


def _waited_at_once(mod: Module, call: ast.Call) -> bool:
    """``x(...).wait()``, ``[r.wait() for r in x(...)]``, ``for r in x(...): r.wait()``."""
    up = mod.parent.get(call)
    if isinstance(up, ast.Attribute) and up.attr == "wait":
        return True
    if isinstance(up, ast.comprehension) and up.iter is call:
        comp = mod.parent.get(up)
        elt = getattr(comp, "elt", None)
        return isinstance(elt, ast.Call) and src(elt.func).endswith(".wait")
    if isinstance(up, ast.For) and up.iter is call:
        return any(isinstance(n, ast.Call) and src(n.func).endswith(".wait")
                   for n in ast.walk(ast.Module(body=up.body, type_ignores=[])))
    return False


def async_of(mod: Module, call: ast.Call, name: str, fn):
    """True only when the handle outlives the call; a ``P2POp`` is as async as the
    ``batch_isend_irecv`` calls of its function that run it."""
    if name == "P2POp" and fn is not None:
        batches = [n for n in ast.walk(fn) if isinstance(n, ast.Call)
                   and src(n.func).rpartition(".")[2] == "batch_isend_irecv"]
        return not (batches and all(_waited_at_once(mod, b) for b in batches))
    flag = async_flag(call, name)
    return False if flag is True and _waited_at_once(mod, call) else flag


def group_kind(call: ast.Call) -> str | None:
    """tp/cp/pp/dp/ep/sp from the names in the group (or mesh) argument, "group" if it names
    none, None without one (``cp_dp_group`` is data-parallel: Megatron's data-parallel group
    with context parallel)."""
    exprs = [k.value for k in call.keywords if k.arg in _GROUP_ARGS]
    exprs += [a for a in call.args if re.search(r"group|mesh|\bpg\b|_pg\b", src(a))]
    for expr in exprs:
        tokens = {t.lower() for t in re.findall(r"[A-Za-z]+", src(expr).replace("_", " "))}
        for kind, names in _TOKENS:
            if tokens & names:
                return kind
    return "group" if exprs else None


def batch_kind(mod: Module, fn) -> str | None:
    """The kind of the ``P2POp`` groups in the function (or its class) that a
    ``batch_isend_irecv`` runs, when they agree."""
    if fn is None:
        return None
    cls, _ = mod.enclosing(fn)
    kinds = {group_kind(n) for n in ast.walk(cls or fn) if isinstance(n, ast.Call)
             and src(n.func).endswith("P2POp")}
    return kinds.pop() if len(kinds) == 1 else None


def _styles(mod: Module, call: ast.Call, fn) -> list[tuple[str, ast.Call | ast.AST]]:
    plan = call.args[2] if len(call.args) > 2 else next(
        (k.value for k in call.keywords if k.arg == "parallelize_plan"), None)
    if isinstance(plan, ast.Name) and fn is not None:
        plan = next((a.value for a in ast.walk(fn) if isinstance(a, ast.Assign)
                     and any(src(t) == plan.id for t in a.targets)), plan)
    if isinstance(plan, ast.Dict):
        return [(src(k), v) for k, v in zip(plan.keys, plan.values, strict=True)]
    return [("", plan)] if plan is not None else []


def plan_sites(mod: Module, call: ast.Call, fn) -> tuple[list[dict], list[str]]:
    """Sites ``{"line", "op", "rel", "via"}`` of a ``parallelize_module`` call, and the plan
    entries that cannot be read (a plan built elsewhere, a style not known by name)."""
    out, unknown = [], []
    for key, style in _styles(mod, call, fn):
        name = src(style.func).rpartition(".")[2] if isinstance(style, ast.Call) else ""
        if name not in PLAN_STYLES:
            unknown.append(f"plan entry {key or src(style)[:60]}")
            continue
        kws = {k.arg: src(k.value) for k in style.keywords}
        ops = PLAN_STYLES[name]
        if name == "ColwiseParallel" and "Shard" in kws.get("input_layouts", ""):
            ops = [("forward", "all_gather"), ("backward", "reduce_scatter")]
        if name == "RowwiseParallel" and "Shard" in kws.get("output_layouts", ""):
            ops = [("forward", "reduce_scatter"), ("backward", "all_gather")]
        for rel, op in ops:
            out.append({"line": style.lineno, "op": op, "rel": rel,
                        "via": [f"{name}{' for ' + key if key else ''}"]})
    return out, unknown
