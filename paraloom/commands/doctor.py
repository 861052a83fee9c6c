"""``paraloom doctor`` (moving here from ``paraloom.explain``)."""

from ..explain import doctor_main as main

__all__ = ["main"]
