r"""Human units (bytes, durations, sizes) and values from files made safe to print; a value
that was not measured (null) prints ``n/m``, never 0.

Example:
    >>> from lightning_pilot.report import format_bytes, format_duration, parse_size
    >>> parse_size("80GiB"), parse_size("80GB"), parse_size("24000MiB")
    (85899345920, 80000000000, 25165824000)
    >>> format_bytes(parse_size("141G")), format_bytes(None)
    ('141.0 GiB', 'n/m')
    >>> format_duration(0.0123), format_duration(2.5), format_duration(None)
    ('12.3 ms', '2.50 s', 'n/m')
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any, Final

import pandas as pd

#: How a null (not measured) value prints.
NOT_MEASURED: Final = "n/m"
#: The longest a value from a file prints (:func:`terminal_safe`), in a line and in a table cell.
TEXT_LIMIT: Final = 2000
CELL_LIMIT: Final = 200
# C1 controls, DEL, the Unicode line and paragraph separators, the bidirectional overrides and
# isolates (text that reads reversed) and lone surrogates (bytes of a file name that are not
# UTF-8, which no terminal can print); each pattern adds the C0 controls, newline or not.
_OTHERS: Final = "\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_UNSAFE: Final = re.compile(f"[\x00-\x1f{_OTHERS}]")
_UNSAFE_BUT_NEWLINE: Final = re.compile(f"[\x00-\x09\x0b-\x1f{_OTHERS}]")
_NAMED_ESCAPES: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED_ESCAPES.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def terminal_safe(
    text: object, *, limit: int | None = TEXT_LIMIT, keep_newlines: bool = False
) -> str:
    r"""``str(text)`` from a file, made safe to print on a terminal.

    Every C0 and C1 control character (an escape sequence's ESC, a carriage return, a bell, a
    newline inside a value), DEL, the Unicode line separators, the bidirectional overrides and
    lone surrogates become visible escapes (``\x1b``, ``\u202e``), so a file can neither drive
    the terminal nor break a table's row in two; ``keep_newlines`` keeps ``\n`` (for whole
    blocks of output whose lines are ours). Text longer than ``limit`` (``None``: no limit) is
    cut, saying how much was left out. Applying it twice changes nothing.

    Example:
        >>> print(terminal_safe("ctl\x1b[2J\r\nFAKE"))
        ctl\x1b[2J\r\nFAKE
        >>> terminal_safe("x" * 50, limit=20)
        'xx...[48 more chars]'
    """
    value = (_UNSAFE_BUT_NEWLINE if keep_newlines else _UNSAFE).sub(_escape, str(text))
    if limit is not None and len(value) > limit:
        keep = max(0, limit - len(f"...[{len(value)} more chars]"))
        value = value[:keep] + f"...[{len(value) - keep} more chars]"
    return value


def is_null(value: Any) -> bool:
    """``None``, ``pd.NA``, ``NaT`` or a float NaN: a value that was not measured."""
    if value is None or value is pd.NA or value is pd.NaT:
        return True
    return isinstance(value, float) and math.isnan(value)


def format_bytes(value: Any) -> str:
    """Bytes in B/KiB/MiB/GiB/TiB with one decimal; null prints ``n/m``."""
    if is_null(value):
        return NOT_MEASURED
    size = float(value)
    sign = "-" if size < 0 else ""
    size = abs(size)
    if size < 1024:
        return f"{sign}{size:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{sign}{size:.1f} {unit}"


def format_duration(value: Any) -> str:
    """Seconds as ms below one second, s below ten minutes, else minutes; null prints ``n/m``."""
    if is_null(value):
        return NOT_MEASURED
    seconds = float(value)
    if seconds < 1.0:
        return f"{seconds * 1000:.1f} ms"
    if seconds < 600.0:
        return f"{seconds:.2f} s"
    return f"{seconds / 60:.1f} min"


def as_text(value: Any) -> str:
    """A value from a file as text: ``n/m`` when null, floats to 4 digits, else safe text."""
    if is_null(value):
        return NOT_MEASURED
    if isinstance(value, float):
        return f"{value:.4g}"
    return terminal_safe(value)


def as_number(value: Any) -> str:
    """A count with thousands separators, a float to 4 digits; ``n/m`` when null."""
    if is_null(value):
        return NOT_MEASURED
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, float):
        return f"{value:.4g}"
    return f"{int(value):,}"


def joined(values: Iterable[Any]) -> str:
    """Distinct non-null values from a file, sorted and joined; ``n/m`` when there are none."""
    return ", ".join(sorted({as_text(v) for v in values if not is_null(v)})) or NOT_MEASURED


def occurrence(first: Any) -> str:
    """A phase row's occurrence: ``first``, ``later``, or ``all`` when not told apart."""
    return "all" if is_null(first) else ("first" if bool(first) else "later")


def shown(value: object) -> str:
    """``repr`` of a user's value for a message, cut when absurdly long."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}...{text[-12:]} ({len(text)} chars)"
