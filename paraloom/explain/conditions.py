"""The condition a communication site runs under, as expressions the reader can carry and decide.

A site's condition is a list of :class:`Cond` (all must hold). Each holds its *forms*: the test as
written in the function where the site is, then the same test rewritten in each caller's names
as the reader goes up the calls (a parameter replaced by the argument the caller passed,
``ctx.NAME`` by what the Function's forward stored there; :mod:`.scope`). A form whose value the
constants decide is dropped (true) or drops the site (false); what is left is open, and the
user's settings (``--set NAME=VALUE``) are tried on every form, so ``ctx.sequence_parallel``,
``sequence_parallel`` and ``self.sequence_parallel`` all name the same condition.

:func:`value` decides an expression under settings (or :data:`OPEN`), :func:`parse_settings`
reads ``--set``, :func:`phrase` / :func:`phrases` write a condition in English or Chinese. The
expressions themselves are :mod:`.expressions`'.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from .expressions import ARG, COMPARE, KWARG, dotted, never_none, show, simplify

__all__ = ["OPEN", "Cond", "value", "partial", "parse_settings", "phrase", "phrases"]

OPEN = object()
"""A value the constants and settings leave undecided."""



# ------------------------------------------------------------------ deciding under settings
def _lookup(node, settings: dict):
    """The set value of a name, a dotted chain (also a suffix: ``config.sequence_parallel``
    names ``self.config.sequence_parallel``), a call written as set (``group.size()``), or a
    parameter that travelled through ``**kwargs`` (by its name)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == KWARG:
        return settings.get(node.args[1].value, OPEN)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == ARG:
        return _lookup(node.args[2], settings)
    text = dotted(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
    if text is None and isinstance(node, (ast.Call, ast.Subscript)):
        text = show(node)  # group.size(), ctx.needs_input_grad[0]
    if text is None:
        return OPEN
    if text in settings:
        return settings[text]
    parts = text.split(".")
    for k in range(1, len(parts)):
        suffix = ".".join(parts[k:])
        if suffix in settings:
            return settings[suffix]
    return OPEN


def value(node: ast.expr, settings: dict):
    """The value of ``node`` under ``settings`` (``{name as written: value}``), or :data:`OPEN`."""
    if isinstance(node, ast.Constant):
        return node.value
    found = _lookup(node, settings) if settings else OPEN
    if found is not OPEN:
        return found
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        v = value(node.operand, settings)
        return OPEN if v is OPEN else not v
    if isinstance(node, ast.BoolOp):
        values = [value(v, settings) for v in node.values]
        want = isinstance(node.op, ast.Or)
        if any(v is not OPEN and bool(v) == want for v in values):
            return want
        return OPEN if any(v is OPEN for v in values) else not want
    if isinstance(node, ast.IfExp):
        t = value(node.test, settings)
        return OPEN if t is OPEN else value(node.body if t else node.orelse, settings)
    if isinstance(node, ast.Compare) and len(node.ops) == 1 \
            and isinstance(node.ops[0], (ast.Is, ast.IsNot)) \
            and isinstance(node.comparators[0], ast.Constant) \
            and node.comparators[0].value is None:
        none = _is_none(node.left, settings)
        if none is not OPEN:
            return none == isinstance(node.ops[0], ast.Is)
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in COMPARE:
        a, b = value(node.left, settings), value(node.comparators[0], settings)
        if a is OPEN or b is OPEN:
            return OPEN
        try:
            return COMPARE[type(node.ops[0])](a, b)
        except TypeError:
            return OPEN
    return OPEN


def _is_none(node, settings: dict):
    """Whether ``node`` is None: through ``a if t else b`` once ``t`` is decided, and False for a
    tensor operation's result or a function the code defines (:func:`~.expressions.never_none`)."""
    if isinstance(node, ast.IfExp):
        t = value(node.test, settings)
        return OPEN if t is OPEN else _is_none(node.body if t else node.orelse, settings)
    if never_none(node):
        return False
    v = value(node, settings)
    return OPEN if v is OPEN else v is None


def partial(node: ast.expr, settings: dict) -> ast.expr:
    """``node`` with what ``settings`` decide folded in: the part of a condition they leave
    open (``(a and x) or y`` with ``a=False`` -> ``y``)."""
    v = value(node, settings)
    if v is not OPEN and isinstance(v, (bool, int, float, str, type(None))):
        return ast.Constant(v)
    if isinstance(node, ast.BoolOp):
        return simplify(ast.BoolOp(op=node.op, values=[partial(x, settings)
                                                       for x in node.values]))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return simplify(ast.UnaryOp(op=node.op, operand=partial(node.operand, settings)))
    if isinstance(node, ast.IfExp):
        return simplify(ast.IfExp(test=partial(node.test, settings),
                                  body=partial(node.body, settings),
                                  orelse=partial(node.orelse, settings)))
    return node


def parse_settings(items: list[str] | None) -> dict:
    """``["self.sequence_parallel=True", "tp=2"]`` -> ``{name: value}``; VALUE a Python literal
    (a bare word is read as a string). Raises ValueError naming a malformed item."""
    out = {}
    for item in items or ():
        name, eq, text = item.partition("=")
        name = name.strip()
        if not eq or not name or dotted(_parse_name(name)) is None and not isinstance(
                _parse_name(name), (ast.Call, ast.Subscript)):
            raise ValueError(f"--set {item!r}: expected NAME=VALUE with NAME as written in the "
                             "code (self.sequence_parallel, ctx.allreduce_dgrad, "
                             "sequence_parallel) and VALUE a Python literal (True, 2, None)")
        try:
            out[name] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            out[name] = text.strip()
    return out


def _parse_name(name: str):
    try:
        return ast.parse(name, mode="eval").body
    except SyntaxError:
        return None


# ------------------------------------------------------------------ a site's condition
@dataclass
class Cond:
    """One part of a site's condition: ``forms`` is ``[(expression, function, written)]``,
    innermost first; the last is the one the reader carries further up. ``written`` is the
    test as the code spells it (a node, written out only when shown) or "" for a form the
    reader derived."""

    forms: list[tuple[ast.expr, str, str]] = field(default_factory=list)

    @property
    def expr(self) -> ast.expr:
        return self.forms[-1][0]

    @property
    def where(self) -> str:
        return self.forms[-1][1]

    def decided(self, settings: dict):
        """True / False when a form is decided (the outermost first), else :data:`OPEN`."""
        for expr, _where, written in reversed(self.forms):
            v = value(expr, settings)
            if v is OPEN and settings and written:
                parsed = _parse_name(written) if isinstance(written, str) else written
                v = value(parsed, settings) if parsed is not None else OPEN
            if v is OPEN and settings:  # (a and x) or (a and not x): decided once a is
                rest = partial(expr, settings)
                v = rest.value if isinstance(rest, ast.Constant) else OPEN
            if v is not OPEN:
                return bool(v)
        return OPEN

    def partial(self, settings: dict) -> Cond:
        """This condition with what ``settings`` decide folded into its outermost form (the
        forms before it kept, so the reader still sees where it came from)."""
        if not settings:
            return self
        new = partial(self.expr, settings)
        if ast.dump(new) == ast.dump(self.expr):
            return self
        written = self.forms[0][2]
        if len(self.forms) == 1 and (not written or _text(written) == show(self.expr)):
            return Cond([(new, self.where, "")])  # a derived form: the residue replaces it
        return Cond(self.forms + [(new, self.where, "")])

    def key(self) -> str:
        return f"{ast.dump(self.expr)}@{self.where}"

    def parts(self, home: str | None) -> tuple:
        """``(text, where, first, first_where)`` for :func:`phrase`: the outermost form and the
        function whose names it uses (None when ``home``, the site's function), and the test as
        first written with its function when that text differs (else None, None)."""
        first_expr, first_where, written = self.forms[0]
        first = _text(written) or show(first_expr)
        if len(self.forms) == 1:
            return first, None if first_where == home else first_where, None, None
        expr, where, _ = self.forms[-1]
        outer = show(expr)
        if len(outer) > 90:
            return first, None if first_where == home else first_where, None, None
        return (outer, None if where == home else where,
                *((first, first_where) if outer != first else (None, None)))


def _text(written) -> str:
    return written if isinstance(written, str) else show(written)


_PHRASE = {"en": ("in {}", "read as {0} in {1}"), "zh": ("在 {} 中", "即 {1} 中的 {0}")}


def phrase(parts: tuple, lang: str = "en") -> str:
    """One condition as a user reads it: ``self.sequence_parallel (in ColumnParallelLinear.
    forward; read as ctx.sequence_parallel in LinearWith...backward)``; ``lang`` en or zh."""
    text, where, first, first_where = parts
    words = _PHRASE.get(lang, _PHRASE["en"])
    note = ([words[0].format(where)] if where else []) + (
        [words[1].format(first, first_where)] if first else [])
    return f"{text} ({'; '.join(note)})" if note else text


def phrases(all_parts: list, lang: str = "en") -> str | None:
    """A site's conditions joined with ``and`` (None when it has none)."""
    texts = [phrase(p, lang) for p in all_parts]
    return " and ".join(f"({t})" if " or " in t and len(texts) > 1 else t
                        for t in texts) or None
