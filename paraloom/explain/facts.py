"""World sizes, partitions and local weights of a snippet, and :func:`extract` (all facts).

* world sizes: names bound from ``get_*_world_size()``, ``dist.get_world_size(group)``,
  ``get_pg_size(group)`` or ``group.size()``;
* partitions: ``divide(x, n)`` and ``x // world_size``: what is split, into how many parts (and
  where that number comes from), which name receives it;
* local weights: ``torch.empty(a, b)`` (``zeros``, ``randn``, ...) assigned to a ``*weight``
  name, with the dimension that is per-partition, and ``set_tensor_model_parallel_attributes(
  weight, ..., dim)`` (Megatron's and paraloom's partition_dim contract).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .module import Module, src
from .names import WORLD_SIZE_CALL
from .source import Snippet, parse_snippet
from .static import find_sites

__all__ = ["extract", "world_sizes", "partitions", "weights", "sp_async_guards"]

_FACTORY = {"empty", "zeros", "ones", "randn", "rand", "full", "Tensor", "FloatTensor",
            "HalfTensor", "BFloat16Tensor"}
_WORLD_ATTR = re.compile(r"(^|_)world_size$")


def _where(mod: Module, node) -> dict:
    cls, fn = mod.enclosing(node)
    return {"line": node.lineno, "class": cls.name if cls else None,
            "function": fn.name if fn else None}


def _assigns(mod: Module):
    """(statement, target, value) of every assignment; ``a, b = x, y`` gives one per pair, and
    ``a, b = f()`` gives ``(a, f()[0])``, ``(b, f()[1])``."""
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
                    and len(target.elts) == len(value.elts):
                yield from ((node, t, v) for t, v in zip(target.elts, value.elts, strict=True))
            elif isinstance(target, ast.Tuple) and isinstance(value, ast.Call):
                yield from ((node, t, ast.Subscript(value=value, slice=ast.Constant(i)))
                            for i, t in enumerate(target.elts))
            else:
                yield node, target, value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            yield node, node.target, node.value


def _is_world_size(call) -> bool:
    if isinstance(call, ast.Attribute) and _WORLD_ATTR.search(call.attr):
        return True  # pgm.process_group_manager.tp_world_size
    if isinstance(call, ast.Subscript) and isinstance(call.value, ast.Call):
        return False  # an element of a returned tuple: only by the name it is bound to
    if not isinstance(call, ast.Call):
        return False
    name = src(call.func).rpartition(".")[2]
    return bool(WORLD_SIZE_CALL.match(name)) or (
        name == "size" and isinstance(call.func, ast.Attribute) and not call.args
        and "group" in src(call.func.value))


def world_sizes(mod: Module) -> list[dict]:
    out = []
    for node, target, value in _assigns(mod):
        call = value.args[0] if isinstance(value, ast.Call) and src(value.func) == "int" \
            and value.args else value
        unpacked = isinstance(call, ast.Subscript) and isinstance(call.value, ast.Call) \
            and _WORLD_ATTR.search(src(target))
        if not (_is_world_size(call) or unpacked) \
                or not isinstance(target, (ast.Name, ast.Attribute)):
            continue
        if isinstance(call, (ast.Attribute, ast.Subscript)):
            group = f"the one {src(call)} names" if isinstance(call, ast.Attribute) \
                else f"needs more context (unpacked from {src(call.value)})"
        else:
            group = (src(call.func.value) if src(call.func).endswith(".size")
                     else ", ".join(src(a) for a in [*call.args, *call.keywords]) or None)
        out.append(dict(_where(mod, node), name=src(target), source=src(value),
                        group=group or "default (the getter's own group)"))
    return out


def _binding(mod: Module, name: str, node) -> dict | None:
    """The last assignment to ``name`` before ``node`` in the same function (or module)."""
    _, fn = mod.enclosing(node)
    best = None
    for a, target, value in _assigns(mod):
        if src(target) == name and a.lineno <= node.lineno and mod.enclosing(a)[1] is fn:
            if best is None or a.lineno > best["line"]:
                best = {"line": a.lineno, "source": src(value)}
    return best


def _divisor_origin(mod: Module, expr, node) -> dict | None:
    root = expr
    while isinstance(root, (ast.Attribute, ast.Call)):
        root = root.value if isinstance(root, ast.Attribute) else root.func
    for name in dict.fromkeys([src(expr), src(root)]):
        found = _binding(mod, name, node)
        if found:
            return dict(found, name=name)
    return None


def partitions(mod: Module) -> list[dict]:
    sizes = {w["name"] for w in world_sizes(mod)}
    targets = {}
    for _node, target, value in _assigns(mod):
        for sub in ast.walk(value):
            targets[id(sub)] = src(target)
    out = []
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Call) and src(node.func).rpartition(".")[2] == "divide" \
                and len(node.args) >= 2:
            what, parts = node.args[0], node.args[1]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv) and (
                src(node.right) in sizes or _is_world_size(node.right)
                or re.search(r"world_size|\.size\b", src(node.right))):
            what, parts = node.left, node.right
        else:
            continue
        out.append(dict(_where(mod, node), what=src(what), parts=src(parts),
                        into=targets.get(id(node)), parts_from=_divisor_origin(mod, parts, node)))
    return sorted(out, key=lambda p: p["line"])


def _dim_meaning(text: str, dim: int, ndim: int) -> str:
    low = text.lower()
    if "embedding" in low or "vocab" in low:
        return "vocabulary rows"
    if "output" in low:
        return "output dim"
    if "input" in low:
        return "input dim"
    if ndim == 2:
        return ("output dim", "input dim")[dim] + " (by position: [out, in] like nn.Linear)"
    return f"dim {dim}"


_LAYOUT = {"output dim": "column-parallel", "input dim": "row-parallel",
           "vocabulary rows": "vocab-parallel embedding"}


def weights(mod: Module, parts: list[dict]) -> list[dict]:
    split_names = {p["into"].rpartition(".")[2] for p in parts if p["into"]}
    out = []
    for _node, target, value in _assigns(mod):
        name = src(target)
        if "weight" not in name.lower() or "grad" in name.lower():
            continue
        for call in ast.walk(value):
            if isinstance(call, ast.Call) and src(call.func).rpartition(".")[2] in _FACTORY \
                    and mod.dotted(call.func).startswith("torch.") and call.args:
                shape = [src(a) for a in call.args]
                dims = [i for i, s in enumerate(shape) if "per_partition" in s
                        or s.rpartition(".")[2] in split_names]
                dim = dims[0] if dims else None
                meaning = _dim_meaning(shape[dim], dim, len(shape)) if dim is not None else None
                out.append(dict(_where(mod, call), name=name, shape=shape, partition_dim=dim,
                                meaning=meaning, basis="per-partition size in the shape"
                                if dim is not None else "no per-partition size in the shape",
                                layout=_LAYOUT.get((meaning or "").split(" (")[0],
                                                   "full (not partitioned)" if dim is None
                                                   else f"split on dim {dim}")))
                break
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Call) and src(node.func).endswith(
                "set_tensor_model_parallel_attributes"):
            args = {k.arg: k.value for k in node.keywords}
            tensor = args.get("tensor", node.args[0] if node.args else None)
            dim = args.get("dim", node.args[2] if len(node.args) > 2 else None)
            if tensor is None or not isinstance(dim, ast.Constant) \
                    or "weight" not in src(tensor).lower():
                continue
            cls = _where(mod, node)["class"] or ""
            meaning = _dim_meaning(cls + " " + src(tensor), dim.value, 2) \
                if re.search(r"Embedding|Vocab", cls) else ("output dim", "input dim")[
                    dim.value] + " ([out, in] like nn.Linear)" if dim.value in (0, 1) else None
            out.append(dict(_where(mod, node), name=src(tensor), shape=None,
                            partition_dim=dim.value, meaning=meaning,
                            basis="set_tensor_model_parallel_attributes(..., dim)",
                            layout=_LAYOUT.get((meaning or "").split(" (")[0],
                                               f"split on dim {dim.value}")))
    return sorted(out, key=lambda w: w["line"])


_SP = re.compile(r"sequence_parallel|\bsp\b")
_ASYNC = re.compile(r"async|allreduce_dgrad|all_reduce_dgrad")


def sp_async_guards(mod: Module) -> list[int]:
    """Lines that reject sequence parallelism together with an async input-grad all-reduce:
    ``if sp and async...: raise`` and ``assert not async...`` under ``if sp``."""
    lines = []
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.If) and _SP.search(src(node.test)) \
                and _ASYNC.search(src(node.test)) \
                and any(isinstance(n, ast.Raise) for n in ast.walk(node)):
            lines.append(node.lineno)
        elif isinstance(node, ast.Assert) and _ASYNC.search(src(node.test)):
            up = mod.parent.get(node)
            while up is not None and not isinstance(up, ast.If):
                up = mod.parent.get(up)
            if up is not None and _SP.search(src(up.test)) or _SP.search(src(node.test)):
                lines.append(node.lineno)
    return sorted(lines)


def extract(snippet: Snippet, settings: dict | None = None) -> dict:
    """All facts of a snippet: ``sites`` (decided under ``settings``), ``world_sizes``,
    ``partitions``, ``weights``, ``guards`` (see :func:`sp_async_guards`)."""
    path = Path(snippet.name).resolve() if snippet.name != "-" else None
    context = None
    if snippet.full is not None:
        try:
            context = Module(ast.parse(snippet.full), path=path)
        except (SyntaxError, ValueError):
            context = None  # the range parses on its own; the rest of the file does not
    mod = Module(parse_snippet(snippet), path=path,
                 project=context.project if context else None, context=context)
    parts = partitions(mod)
    sites, unresolved = find_sites(mod, settings)
    return {"file": snippet.name, "lines": [snippet.first, snippet.last],
            "world_sizes": world_sizes(mod), "partitions": parts,
            "weights": weights(mod, parts), "sites": sites, "unresolved": unresolved,
            "guards": sp_async_guards(mod)}
