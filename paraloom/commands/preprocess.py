"""``paraloom preprocess`` (moving here from ``paraloom.data.preprocess``)."""

from ..data.preprocess import preprocess_main as main

__all__ = ["main"]
