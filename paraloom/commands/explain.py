"""``paraloom explain`` (moving here from ``paraloom.explain``)."""

from ..explain import explain_main as main

__all__ = ["main"]
