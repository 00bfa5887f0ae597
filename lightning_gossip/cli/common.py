"""What the ``lightning-gossip`` commands share: the user-error type, argument types, output
formatting and file checks. Imports neither torch nor matplotlib."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CLIError",
    "check_writable",
    "count",
    "fmt",
    "fmt_bytes",
    "fraction",
    "jsonable",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "table",
]

_SUFFIXES = {"k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9}


class CLIError(Exception):
    """A user error: printed as ``lightning-gossip COMMAND: error: ...`` with exit code 2."""


# ---------------------------------------------------------------------------------------------
# Argument types
# ---------------------------------------------------------------------------------------------


def _number_type(
    cast: Callable[[str], Any], accept: Callable[[Any], bool], expected: str
) -> Callable[[str], Any]:
    """An argparse ``type=`` that parses with ``cast`` and checks ``accept(value)``."""

    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    return parse


#: argparse type: an integer >= 1
positive_int = _number_type(int, lambda v: v >= 1, "a positive integer")
#: argparse type: an integer >= 0
non_negative_int = _number_type(int, lambda v: v >= 0, "an integer >= 0")
#: argparse type: a finite number > 0
positive_float = _number_type(float, lambda v: v > 0 and math.isfinite(v), "a positive number")
#: argparse type: a finite number >= 0
non_negative_float = _number_type(float, lambda v: v >= 0 and math.isfinite(v),
                                  "a number >= 0")
#: argparse type: a number strictly between 0 and 1
fraction = _number_type(float, lambda v: 0.0 < v < 1.0, "a number in (0, 1)")


def count(text: str) -> int:
    """argparse type: ``25.6M``, ``1e6``, ``350k``: a number of parameters.

    Example::

        >>> count("25.6M"), count("350k"), count("1e6")
        (25600000, 350000, 1000000)
    """
    raw = text.strip().lower()
    scale = 1.0
    if raw and raw[-1] in _SUFFIXES:
        scale, raw = _SUFFIXES[raw[-1]], raw[:-1]
    try:
        value = float(raw) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a parameter count such as 25.6M, 350k or 1e6, got {text!r}"
        ) from None
    if not value >= 1 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a parameter count >= 1, got {text!r}")
    return int(round(value))


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------


def fmt_bytes(n: int | None) -> str:
    """``8.0 MB``-style sizes (``-`` for ``None``).

    Example::

        >>> fmt_bytes(8_000_000), fmt_bytes(512), fmt_bytes(None)
        ('8.0 MB', '512 B', '-')
    """
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def fmt(x: float | None, digits: int = 4) -> str:
    """A table cell: ``digits`` decimals, scientific for tiny values, ``-`` for ``None``.

    Example::

        >>> fmt(0.19526), fmt(2.5e-13, 3), fmt(None), fmt(7)
        ('0.1953', '2.5e-13', '-', '7')
    """
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    if isinstance(x, int):
        return str(x)
    if x != 0 and abs(x) < 10 ** -(digits - 1):
        return f"{x:.{digits - 2}e}"
    return f"{x:.{digits}f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) if i else h.ljust(w)
                     for i, (h, w) in enumerate(zip(headers, widths)))
    out = [line, "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append("  ".join(c.rjust(w) if i else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(out)


def check_writable(path: str | None, flag: str) -> Path | None:
    """``path`` as a :class:`Path` if a file can be written there (``None`` stays ``None``)."""
    if path is None:
        return None
    p = Path(path)
    if p.is_dir():
        raise CLIError(f"{flag} {path}: is a directory, expected a file name")
    if not p.parent.exists():
        raise CLIError(f"{flag} {path}: directory {p.parent} does not exist")
    return p


def jsonable(d: dict) -> dict:
    """The parsed arguments without the command function (for the JSON outputs)."""
    return {k: v for k, v in d.items() if k != "func"}
