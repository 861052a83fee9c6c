"""Tiny helpers shared by every layer: exact division with errors that name both numbers."""

from __future__ import annotations

__all__ = ["divide", "ensure_divisibility"]


def ensure_divisibility(numerator: int, denominator: int, what: str = "") -> None:
    """Raise ``ValueError`` naming both numbers unless ``denominator`` divides ``numerator``."""
    if not isinstance(numerator, int) or not isinstance(denominator, int):
        raise TypeError(f"divide needs integers, got {numerator!r} and {denominator!r}")
    if denominator <= 0:
        raise ValueError(f"cannot divide {what or numerator} by {denominator}: "
                         f"the denominator must be a positive integer")
    if numerator % denominator != 0:
        label = f"{what} = " if what else ""
        raise ValueError(f"{label}{numerator} is not divisible by {denominator} "
                         f"({numerator} % {denominator} = {numerator % denominator}); "
                         f"valid values are multiples of {denominator}")


def divide(numerator: int, denominator: int, what: str = "") -> int:
    """``numerator // denominator``, after checking that the division is exact.

    ``what`` names the quantity in the error (``"hidden_size"``), so a user reads which of their
    settings is wrong, e.g. ``hidden_size = 100 is not divisible by 3``.
    """
    ensure_divisibility(numerator, denominator, what)
    return numerator // denominator
