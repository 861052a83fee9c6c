"""``paraloom eval`` (moving here from ``paraloom.training.evaluate``)."""

from ..training.evaluate import eval_main as main

__all__ = ["main"]
