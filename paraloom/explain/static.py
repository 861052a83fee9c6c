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
the guarding conditions (enclosing ``if``s, ``if ...: return`` guards before it, and the callee's
own conditions carried into the caller's names: :mod:`.walker`, :mod:`.scope`), decided where
constants or the user's settings decide them (``active``; what stays open is listed). A path the
constants rule out gives no site. Whatever the snippet does not decide is reported as
:data:`UNKNOWN`.
"""

from __future__ import annotations

import ast

from .calls import classify
from .conditions import OPEN, phrase, phrases
from .constants import name_phases
from .module import Module, src
from .rules import UNKNOWN, context_phase
from .scope import Scope
from .walker import SAME, Walker, kind_from, words

__all__ = ["find_sites"]


def _basis(site: dict, phase: str, context: str, why: str) -> str:
    if site.get("explicit"):
        return "explicit phase argument"
    if site["rel"] in (SAME, context):
        return why
    if site["via"] and phase == "backward":
        return f"backward of {site['via'][-1]}"
    return "via " + " -> ".join(site["via"]) if site["via"] else why


def _decided(conds, settings: dict, home: str) -> tuple[bool | None, list, list]:
    """(active, parts of the open conditions, parts of every condition) under ``settings``
    (parts: :meth:`~.conditions.Cond.parts`, written by :func:`~.conditions.phrases`)."""
    every, still, active = [], [], True
    for c in conds:
        parts = c.parts(home)
        every.append(parts)
        got = c.decided(settings)
        if got is OPEN:
            still.append(c.partial(settings).parts(home))
        elif not got:
            active = False
    if active and still:
        active = None
    return active, still, every


def find_sites(mod: Module, settings: dict | None = None) -> tuple[list[dict], list[dict]]:
    """Every communication site of the snippet, in source order (see the module docstring),
    and the calls whose source was not found (``{"line", "call", "function", "why"}``).
    ``settings`` (``{name as written: value}``) decide open conditions: each site gets
    ``active`` True / False / None (still open, its ``open`` conditions listed)."""
    walker = Walker(mod)
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
        home = mod.qualname(fn) if fn is not None else "<module>"
        raw = walker.stmts(body, [], (mod, None, (), False), Scope.of(mod, None, home))[0] \
            if fn is None else walker.function(fn)
        cls, _ = mod.enclosing(fn) if fn is not None else (None, None)
        phase, why = context_phase(mod, fn)
        helper = fn is not None and id(fn) in called
        if helper and phase == UNKNOWN:
            why = "helper: its call sites in the snippet carry the phase"
        for s in raw:
            p = s["rel"] if s["rel"] != SAME else phase
            if p == "forward+backward":  # send_forward_recv_backward: each direction its own
                p = name_phases(fn.name).get(s["op"], p)
            text = " ".join([src(cls.bases[0]) if cls and cls.bases else "", cls.name if cls
                             else "", fn.name if fn else "", *s["via"], *words(s["conds"]),
                             s["call"]])
            kind = s["kind"] or kind_from(s, text) or UNKNOWN
            active, still, every = _decided(s["conds"], settings or {}, home)
            sites.append({
                "line": s["line"], "class": cls.name if cls else None,
                "function": fn.name if fn else None, "phase": p,
                "phase_basis": _basis(s, p, phase, why),
                "op": s["op"], "kind": kind, "async": s["asynchronous"],
                "condition": phrases(still if settings else every), "active": active,
                "open": [phrase(p) for p in still], "parts": still if settings else every,
                "via": s["via"],
                "helper": helper, "call": s["call"], "arg": s["arg"],
                "inner_line": s.get("inner_line"), "moved": s.get("moved"),
                "through": s["through"], "assumed": s.get("assumed"),
                "fn_line": fn.lineno if fn else None})
    sites.sort(key=lambda s: (s["line"], s["op"]))
    unresolved = sorted(walker.unresolved.values(), key=lambda u: (u["line"], u["call"]))
    return sites, unresolved
