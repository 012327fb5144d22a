"""Counts and sizes as a person reads them: ``1.23M`` parameters, ``4.71 MB``."""

from __future__ import annotations

__all__ = ["MB", "count", "size"]


MB = 2**20
"""Bytes in a megabyte, as the sizes of models are given here (``size_mb``): 1,048,576."""


def _scaled(n: int, base: int, units: tuple[str, ...]) -> str:
    """``n`` in the first unit where it reads below ``base``, to three significant digits."""
    for power, unit in enumerate(units):
        value = n / base**power
        text = f"{value:.3g}" if value < 99.95 else f"{value:.0f}"
        if float(text) < base or power == len(units) - 1:
            return text + unit
    raise AssertionError("unreachable")  # pragma: no cover


def count(n: int) -> str:
    """``860``, ``12.3k``, ``1.23M``, ``7.1B``."""
    return _scaled(n, 1000, ("", "k", "M", "B", "T"))


def size(n: int) -> str:
    """``240 B``, ``12.3 kB``, ``4.71 MB``, ``1.2 GB`` (kB = 1024 bytes, MB = 1024 kB, ...)."""
    return _scaled(n, 1024, (" B", " kB", " MB", " GB", " TB"))
