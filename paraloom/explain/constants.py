"""The phase a pipeline communication helper runs in, named by a constant argument
(``pipeline_communicate(operation="recv_forward")``: activations move in forward, gradients in
backward). Guards decided by constant arguments are :mod:`.scope`'s: the callee's conditions are
carried into the caller's names and decided there.
"""

from __future__ import annotations

import ast
import re

__all__ = ["pipeline_phases", "name_phases"]

_PIPE = re.compile(r"(send|recv)_(fwd|bwd|forward|backward)")


def pipeline_phases(call: ast.Call) -> dict[str, str]:
    """``{"send": phase, "recv": phase, "batch_p2p": phase}`` named by a constant argument of a
    pipeline communication helper (``"recv_forward"``, ``"send_fwd_recv_bwd"``): activations
    move in forward, gradients in backward."""
    return name_phases(*[node.value for node in [*call.args, *(k.value for k in call.keywords)]
                         if isinstance(node, ast.Constant) and isinstance(node.value, str)])


def name_phases(*names: str) -> dict[str, str]:
    """The same, read from names (``send_forward_recv_backward``: send forward, recv
    backward, batch_p2p both)."""
    out: dict[str, str] = {}
    for name in names:
        for direction, phase in _PIPE.findall(name):
            out[direction] = "forward" if phase.startswith("f") else "backward"
    if out:
        both = set(out.values())
        out["batch_p2p"] = both.pop() if len(both) == 1 else "forward+backward"
    return out
