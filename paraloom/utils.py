"""Tiny helpers shared by every layer: exact division with errors that name both numbers, divisors,
and the words lists are written in."""

from __future__ import annotations

__all__ = ["divide", "ensure_divisibility", "divisors", "either"]


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


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending (``divisors(12) == [1, 2, 3, 4, 6, 12]``)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"divisors needs a positive integer, got {n!r}")
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def either(values) -> str:
    """``"2"``, ``"2 or 4"``, ``"1, 2 or 4"``: the valid choices in an error message."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
