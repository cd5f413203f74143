"""Human units (bytes, durations, sizes) and values from files made safe to print; a value
that was not measured (null) prints ``n/m``, never 0."""

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
# DEL, C1 controls, Unicode line separators, bidirectional overrides and isolates, and lone
# surrogates (file name bytes that are not UTF-8); each pattern adds the C0 controls.
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

    Control characters, DEL, Unicode line separators, bidirectional overrides and lone
    surrogates become visible escapes (``\x1b``, ``\u202e``), so a file can neither drive the
    terminal nor break a table's row; ``keep_newlines`` keeps ``\n``. Text longer than ``limit``
    (``None``: no limit) is cut, saying how much was left out. Applying it twice changes nothing.

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
    sign, size = "-" if float(value) < 0 else "", abs(float(value))
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
    """A count with thousands separators; a float (inf too) or null as :func:`as_text`."""
    if is_null(value) or isinstance(value, float):
        return as_text(value)
    return f"{int(value):,}"


#: Why a largest-size row has no sequence length: the batch has no dimension to grow.
NO_SEQUENCE: Final = "the batch has no sequence dimension"
#: Below this, an amount prints as ``< 0.0001``: further digits say nothing a reader can use.
SMALLEST_AMOUNT: Final = 0.0001


def format_amount(value: Any, digits: int = 2) -> str:
    """An amount of money or GPU-hours, never ``0`` for a small non-zero one: from 100 up whole,
    from 1 up with ``digits`` decimals, below 1 with ``digits`` significant digits down to
    :data:`SMALLEST_AMOUNT`, below that ``< 0.0001``; ``n/m`` when null."""
    if is_null(value):
        return NOT_MEASURED
    amount = float(value)
    size = abs(amount)
    if size == 0:
        return "0"
    if size >= 100:
        return f"{amount:,.0f}"
    if size >= 1:
        return f"{amount:,.{digits}f}"
    if size < SMALLEST_AMOUNT:
        return f"{'> -' if amount < 0 else '< '}{SMALLEST_AMOUNT:g}"
    decimals = digits - 1 - math.floor(math.log10(size))
    return f"{amount:.{decimals}f}"


def amount_range(low: Any, high: Any, digits: int = 2) -> str:
    """``low to high`` with :func:`format_amount`; one figure when both print the same."""
    first, second = format_amount(low, digits), format_amount(high, digits)
    return first if first == second else f"{first} to {second}"


def size_text(value: Any) -> str:
    """A micro-batch or a sequence length as written in a configuration; ``n/m`` when null."""
    return NOT_MEASURED if is_null(value) else str(int(value))


def seq_text(value: Any) -> str:
    """A configuration's sequence length: ``as given`` when null, else :func:`size_text`."""
    return "as given" if is_null(value) else size_text(value)


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


def records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """The rows of ``frame`` as dicts keyed by column name as text."""
    return [{str(k): v for k, v in row.items()} for row in frame.to_dict("records")]
