"""The judgement calls of the source reader, each with the reason it reports.

* phase: what runs a function (autograd.Function forward/backward, a Module's forward, a gradient
  hook, a constructor, a pipeline send/recv named for its direction);
* parallel type: an explicit ``kind`` argument, else names in the group, guard, class or function
  (``tp_group``, ``if ctx.sequence_parallel:``, ``_CopyToModelParallelRegion``);
* async: ``async_op=True`` or a call that always returns a handle (isend, batch_isend_irecv).
"""

from __future__ import annotations

import ast
import re

from .names import ASYNC_BY_NATURE

__all__ = ["UNKNOWN", "context_phase", "kind_of", "async_flag", "region_condition"]

UNKNOWN = "needs more context"
_GROUP_KINDS = [
    (r"sequence_parallel|SequenceParallel|\bsp\b", "sp"),
    (r"tensor_model|tensor_parallel|TensorParallel|ModelParallel|model_parallel|\btp(_group)?\b",
     "tp"),
    (r"pipeline|Pipeline|\bpp(_group)?\b|p2p|P2P", "pp"),
    (r"data_parallel|DataParallel|\bdp(_group)?\b", "dp"), (r"embedding_group|\bemb\b", "emb"),
    (r"context_parallel|\bcp(_group)?\b", "cp"), (r"expert|\bep(_group)?\b", "ep")]


def _src(node) -> str:
    return ast.unparse(node) if node is not None else ""


def context_phase(mod, fn) -> tuple[str, str]:
    """(phase, why) of code running in ``fn`` when nothing calls it from the snippet."""
    if fn is None:
        return UNKNOWN, "module level"
    cls, _ = mod.enclosing(fn)
    bases = " ".join(_src(b) for b in cls.bases) if cls is not None else ""
    outer = fn
    while outer in mod.parent and not isinstance(mod.parent[outer], ast.ClassDef):
        if isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef)) and outer.name in mod.hooks:
            return "backward", f"{outer.name} is registered as a gradient hook"
        outer = mod.parent[outer]
    if fn.name in mod.hooks:
        return "backward", f"{fn.name} is registered as a gradient hook"
    if fn.name in getattr(mod, "fwd_hooks", ()):
        return "forward", f"{fn.name} runs as a forward hook (module or DTensor input/output)"
    is_function = cls is not None and re.search(r"\bFunction\b", bases)
    if fn.name == "forward":
        return "forward", "inside a forward method"
    if fn.name == "backward" and is_function:
        return "backward", f"{cls.name}.backward of an autograd.Function"
    if fn.name == "__init__":
        return "setup", "constructor"
    m = re.search(r"(send|recv)_(forward|backward)(_(send|recv)_(forward|backward))?$", fn.name)
    if m:
        both = {m[2], m[5]} - {None}
        phase = both.pop() if len(both) == 1 else "forward+backward"
        return phase, "pipeline send/recv of activations (forward) or gradients (backward)"
    if fn.name == "symbolic" and is_function:
        return "symbolic", "ONNX export (not training)"
    why = ("class not in the snippet" if fn.name == "backward" and cls is None
           else "no caller in the snippet")
    return UNKNOWN, why


def kind_of(text: str) -> str | None:
    for pattern, kind in _GROUP_KINDS:
        if re.search(pattern, text):
            return kind
    return None


def async_flag(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == "async_op":
            if isinstance(kw.value, ast.Constant):
                return bool(kw.value.value)
            return f"{UNKNOWN} (async_op={_src(kw.value)})"
    return name in ASYNC_BY_NATURE


def region_condition(name: str, call: ast.Call) -> ast.expr | None:
    """``gather_from_sequence_parallel_region`` reduce-scatters its gradient only when
    ``tensor_parallel_output_grad`` (default True): the argument's expression, if passed."""
    if name != "gather_from_sequence_parallel_region":
        return None
    return next((kw.value for kw in call.keywords if kw.arg == "tensor_parallel_output_grad"),
                call.args[2] if len(call.args) > 2 else None)
