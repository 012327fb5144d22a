"""Plain-text ``key=value`` lines, as the console writes them (:mod:`hookfit.plugins.console`
states the rule): a key or a value as it is, or in double quotes with its special characters
escaped, so that a line stays one line and splits into its fields; numbers and durations as
those lines show them."""

from __future__ import annotations

__all__ = ["duration", "field", "number", "quote"]

_PLAIN_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def number(value: float) -> str:
    """A metric's value: four or five significant digits, ``nan``, or in exponent form when
    very small or large."""
    if value != value:  # NaN
        return "nan"
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}" if abs(value) < 1 else f"{value:.5g}"
    return f"{value:.3e}"


def duration(seconds: float) -> str:
    """``h:mm:ss``."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def quote(text: str, always: bool = False) -> str:
    """``text`` as a key or a value of a ``key=value`` field (the console's one rule): as it is,
    or, when it is empty or has white space, a quote, ``=``, a backslash or a character that does
    not print (``always``: whatever it has), in double quotes with those characters escaped."""
    if not always and text and text.isprintable() and not any(c.isspace() or c in "\"'=\\" for c in text):
        return text
    escaped = "".join(c if c.isprintable() and c not in '"\\' else _PLAIN_ESCAPES.get(c) or _escape(c)
                      for c in text)
    return f'"{escaped}"'


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def field(key: str, value: str, always: bool = False) -> str:
    """``key=value``, each part quoted by :func:`quote` (a metric name with a space, a path)."""
    return f"{quote(key)}={quote(value, always)}"
