"""Layout errors in the words of the command line: the flags and the values the user typed.

:func:`paraloom.config.check_layout` speaks of the configuration's fields (``num_layers``,
``pp * vpp``); a user of ``paraloom train`` or ``paraloom eval`` typed ``--num-layers 4 --pp 2
--vpp 3``, so the commands check the pipeline split first and name the flags, with what would
be valid.
"""

from __future__ import annotations

from ..utils import divisors, either

__all__ = ["check_layout_flags"]


def check_layout_flags(model, parallel, *, shape_from: str | None = None) -> None:
    """``ValueError`` naming the flags when ``model`` does not split as ``parallel`` says.

    ``shape_from``: where the model shape came from when it was not typed (``"the checkpoint"``),
    so the message does not tell the user to change a flag they did not give.
    """
    pp, vpp = parallel.pp, parallel.vpp or 1
    src = f" (from {shape_from})" if shape_from else ""
    problems = []
    L = model.num_layers
    if L % (pp * vpp):
        chunks = f"--pp {pp} * --vpp {vpp} = {pp * vpp}" if vpp > 1 else f"--pp {pp}"
        fixes = []
        if vpp > 1 and L % pp == 0:
            good = [v for v in divisors(L // pp) if v > 1]
            fixes.append(f"with --pp {pp}, --vpp can be {either(good)}" if good else
                         f"with --pp {pp} and {L} layers there is one layer per stage: drop --vpp")
        good_pp = [p for p in divisors(L) if p > 1 and L % (p * vpp) == 0]
        if good_pp:
            fixes.append(f"--pp can be {either(good_pp)}" + (f" with --vpp {vpp}" * (vpp > 1)))
        if not shape_from:
            fixes.append(f"or use a multiple of {pp * vpp} for --num-layers")
        problems.append(f"--num-layers {L}{src} is not divisible by {chunks} (every one of the "
                        f"{pp * vpp} pipeline chunks needs the same number of layers); "
                        + "; ".join(fixes))
    if problems:
        raise ValueError("; ".join(problems))
