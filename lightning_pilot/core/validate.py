"""Argument checks for the public constructors and functions: each returns the value as the plain
Python type or raises ``TypeError`` (a wrong type; ``bool`` is never a number) or ``ValueError``
(a wrong value) with ``Owner(name=value) is invalid: expected ...``. Integers fit in 64 bits;
floats are finite unless said otherwise."""

from __future__ import annotations

import math
import numbers
import operator
import os
import re
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from fractions import Fraction
from pathlib import Path
from typing import Any, Final, Literal, TypeVar, overload

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1
#: Longest experiment or variant name (see :func:`run_name`).
MAX_NAME: Final = 200
# A value's repr in a message is cut here: 10**400 would fill the screen.
_MAX_REPR: Final = 80

T = TypeVar("T")


def _shown(value: object) -> str:
    """``repr(value)``, shortened; never raises (a broken ``__repr__``, a 5000-digit int)."""
    try:
        text = repr(value)
    except Exception:  # the user's object: its repr is theirs
        return f"<{type(value).__name__} object>"
    if len(text) > _MAX_REPR:
        text = f"{text[: _MAX_REPR - 13]}...{text[-10:]}"
    return text


def invalid(owner: str, name: str, value: object, expected: str) -> str:
    """The one message format: ``Owner(name=value) is invalid: expected <expected>.``"""
    return f"{owner}({name}={_shown(value)}) is invalid: expected {expected}."


def _wrong_type(owner: str, name: str, value: object, expected: str) -> TypeError:
    return TypeError(invalid(owner, name, value, f"{expected}, got {type(value).__name__}"))


def _with(expected: str, optional: bool, hint: str | None) -> str:
    return expected + (" or None" if optional else "") + (f" ({hint})" if hint else "")


def _range_text(noun: str, minimum: float | None, maximum: float | None, above: bool) -> str:
    if minimum is not None and maximum is not None:
        if above:
            return f"{noun} in ({minimum:g}, {maximum:g}]"
        return f"{noun} from {minimum:g} to {maximum:g}"
    if minimum is not None:
        return f"{noun} {'>' if above else '>='} {minimum:g}"
    if maximum is not None:
        return f"{noun} <= {maximum:g}"
    return noun


@overload
def integer(
    owner: str,
    name: str,
    value: object,
    *,
    minimum: int | None = ...,
    maximum: int | None = ...,
    optional: Literal[False] = ...,
    hint: str | None = ...,
) -> int: ...
@overload
def integer(
    owner: str,
    name: str,
    value: object,
    *,
    minimum: int | None = ...,
    maximum: int | None = ...,
    optional: Literal[True],
    hint: str | None = ...,
) -> int | None: ...
def integer(
    owner: str,
    name: str,
    value: object,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    optional: bool = False,
    hint: str | None = None,
) -> int | None:
    """An integer (not a bool) from ``minimum`` to ``maximum``, within int64."""
    if value is None and optional:
        return None
    expected = _with(_range_text("an integer", minimum, maximum, False), optional, hint)
    # numpy integers are Integral; bool (and numpy bool) are not counts.
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise _wrong_type(owner, name, value, expected)
    number_ = operator.index(value)
    if (minimum is not None and number_ < minimum) or (maximum is not None and number_ > maximum):
        raise ValueError(invalid(owner, name, value, expected))
    if not INT64_MIN <= number_ <= INT64_MAX:
        bound = f"at most {INT64_MAX}" if number_ > 0 else f"at least {INT64_MIN}"
        raise ValueError(invalid(owner, name, value, f"{expected} ({bound}: 64 bits)"))
    return number_


@overload
def number(
    owner: str,
    name: str,
    value: object,
    *,
    minimum: float | None = ...,
    maximum: float | None = ...,
    allow_minimum: bool = ...,
    finite: bool = ...,
    optional: Literal[False] = ...,
    hint: str | None = ...,
) -> float: ...
@overload
def number(
    owner: str,
    name: str,
    value: object,
    *,
    minimum: float | None = ...,
    maximum: float | None = ...,
    allow_minimum: bool = ...,
    finite: bool = ...,
    optional: Literal[True],
    hint: str | None = ...,
) -> float | None: ...
def number(
    owner: str,
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    allow_minimum: bool = True,
    finite: bool = True,
    optional: bool = False,
    hint: str | None = None,
) -> float | None:
    """A real number (not a bool), finite unless ``finite=False``, from ``minimum`` (excluded
    when ``allow_minimum=False``) to ``maximum`` (included)."""
    if value is None and optional:
        return None
    noun = "a finite number" if finite else "a number"
    expected = _with(_range_text(noun, minimum, maximum, not allow_minimum), optional, hint)
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise _wrong_type(owner, name, value, expected)
    try:
        converted = float(value)
    except (OverflowError, ValueError):  # an int beyond the float range: 10**400
        converted = -math.inf if value < 0 else math.inf
    if math.isnan(converted) or (finite and math.isinf(converted)):
        raise ValueError(invalid(owner, name, value, expected))
    below = minimum is not None and (
        converted < minimum or (not allow_minimum and converted == minimum)
    )
    if below or (maximum is not None and converted > maximum):
        raise ValueError(invalid(owner, name, value, expected))
    return converted


def boolean(owner: str, name: str, value: object) -> bool:
    """``True`` or ``False`` only: ``"no"``, ``1`` and ``None`` are not booleans here."""
    if not isinstance(value, bool):
        raise _wrong_type(owner, name, value, "True or False")
    return value


def choice(
    owner: str, name: str, value: object, options: Sequence[str], *, optional: bool = False
) -> Any:
    """One of ``options`` (strings); ``TypeError`` for a value that is not a string."""
    if value is None and optional:
        return None
    expected = _with("one of " + ", ".join(repr(option) for option in options), optional, None)
    if not isinstance(value, str):
        raise _wrong_type(owner, name, value, expected)
    if value not in options:
        raise ValueError(invalid(owner, name, value, expected))
    return value


def callable_or_none(owner: str, name: str, value: T | None, what: str = "a callable") -> T | None:
    """A callable or ``None``; ``what`` describes the call, e.g. ``"fn(batch) -> str"``."""
    if value is not None and not callable(value):
        raise _wrong_type(owner, name, value, f"{what} or None")
    return value


def instance(
    owner: str, name: str, value: object, cls: type[T], *, optional: bool = True
) -> T | None:
    """An instance of ``cls`` (or ``None`` when ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, cls):
        article = "an" if cls.__name__[:1].lower() in ("a", "e", "i", "o", "u") else "a"
        raise _wrong_type(owner, name, value, _with(f"{article} {cls.__name__}", optional, None))
    return value


@overload
def text(
    owner: str,
    name: str,
    value: object,
    *,
    optional: Literal[False] = ...,
    max_length: int | None = ...,
    hint: str | None = ...,
) -> str: ...
@overload
def text(
    owner: str,
    name: str,
    value: object,
    *,
    optional: Literal[True],
    max_length: int | None = ...,
    hint: str | None = ...,
) -> str | None: ...
def text(
    owner: str,
    name: str,
    value: object,
    *,
    optional: bool = False,
    max_length: int | None = None,
    hint: str | None = None,
) -> str | None:
    """A non-empty string (not only spaces), at most ``max_length`` characters."""
    if value is None and optional:
        return None
    size = "a non-empty string" if max_length is None else f"1 to {max_length} characters"
    expected = _with(size, optional, hint)
    if not isinstance(value, str):
        raise _wrong_type(owner, name, value, expected)
    if not value.strip() or (max_length is not None and len(value) > max_length):
        raise ValueError(invalid(owner, name, value, expected))
    return value


def run_name(owner: str, name: str, value: object) -> str:
    """An experiment or variant name: 1 to 200 printable characters on one line."""
    expected = f"1 to {MAX_NAME} printable characters on one line (not only spaces)"
    if not isinstance(value, str):
        raise _wrong_type(owner, name, value, f"a string of {expected}")
    if not value.strip() or len(value) > MAX_NAME or not value.isprintable():
        raise ValueError(invalid(owner, name, value, expected))
    return value


def path(
    owner: str, name: str, value: object, *, optional: bool = True, hint: str | None = None
) -> Any:
    """A folder path (a non-empty ``str`` or ``os.PathLike`` without NUL) as a ``Path``."""
    if value is None and optional:
        return None
    expected = _with("a folder path (str or os.PathLike)", optional, hint)
    if not isinstance(value, str | os.PathLike):
        raise _wrong_type(owner, name, value, expected)
    spelled = os.fspath(value)
    if not isinstance(spelled, str) or not spelled.strip() or "\x00" in spelled:
        raise ValueError(invalid(owner, name, value, f"a non-empty {expected[2:]}"))
    return Path(spelled)


def strings(
    owner: str, name: str, value: object, *, optional: bool = True, hint: str | None = None
) -> tuple[str, ...] | None:
    """A list, tuple or set of non-empty strings (a bare string is refused: not a list)."""
    if value is None and optional:
        return None
    expected = _with("a list of non-empty strings", optional, hint)
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | AbstractSet):
        raise _wrong_type(owner, name, value, expected)
    for item in value:
        if not isinstance(item, str):
            raise _wrong_type(owner, name, value, f"{expected}; {_shown(item)} is not a string")
        if not item.strip():
            raise ValueError(invalid(owner, name, value, f"{expected}; {item!r} is empty"))
    return tuple(value)


_SCALARS: Final = (
    "a dict of str -> scalar (str, int, float, bool or None, or lists and dicts of them)"
)


def _not_json(owner: str, name: str, root: object, where: str, problem: str) -> str:
    return invalid(owner, name, root, f"{_SCALARS}; {name}{where}{problem}")


def _json_value(owner: str, name: str, root: object, where: str, value: object) -> Any:
    """``value`` as plain JSON types; errors name ``root`` and the path ``where`` inside it."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        if not math.isfinite(float(value)):
            raise ValueError(_not_json(owner, name, root, where, f"={value!r} is not finite"))
        return float(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(_not_json(owner, name, root, where, f" has the key {key!r}"))
            out[key] = _json_value(owner, name, root, f"{where}[{key!r}]", item)
        return out
    if isinstance(value, list | tuple):
        return [
            _json_value(owner, name, root, f"{where}[{index}]", item)
            for index, item in enumerate(value)
        ]
    item_fn = getattr(value, "item", None)  # numpy / 0-d torch scalars
    if callable(item_fn):
        try:
            plain = item_fn()
        except (TypeError, ValueError, RuntimeError):
            plain = value
        if plain is not value and not isinstance(plain, Mapping | list | tuple):
            return _json_value(owner, name, root, where, plain)
    problem = f" is a {type(value).__name__}, not a JSON value"
    raise TypeError(_not_json(owner, name, root, where, problem))


def mapping_of_scalars(
    owner: str, name: str, value: object, *, optional: bool = True
) -> dict[str, Any]:
    """A dict of string keys and JSON values (numpy and 0-d torch scalars as Python numbers);
    ``None``, when ``optional``, is the empty dict."""
    if value is None and optional:
        return {}
    if not isinstance(value, Mapping):
        raise _wrong_type(owner, name, value, _SCALARS + (" or None" if optional else ""))
    plain = _json_value(owner, name, value, "", value)
    assert isinstance(plain, dict)
    return plain


_POWERS: Final = {"k": 1, "m": 2, "g": 3, "t": 4}
_UNITS: Final[dict[str, int]] = {
    "": 1,
    "b": 1,
    **{letter: 1024**power for letter, power in _POWERS.items()},
    **{f"{letter}ib": 1024**power for letter, power in _POWERS.items()},
    **{f"{letter}b": 1000**power for letter, power in _POWERS.items()},
}
# ASCII only: "\d" would take "١٢" (Arabic-Indic digits) for 12, and "\s" a no-break space.
_SIZE: Final = re.compile(r"[ \t]*([0-9]+)(?:\.([0-9]{1,30}))?[ \t]*([A-Za-z]{0,3})[ \t]*")
# More integer digits than this is more than 8 EiB in any unit (and int() refuses 4300).
_SIZE_DIGITS: Final = 30


def parse_size(value: object, name: str = "size") -> int:
    """A memory size in bytes, from ``"80GiB"``, ``"80GB"``, ``"141G"``, ``"24000MiB"``.

    ``K``/``KiB`` (``M``, ``G``, ``T`` alike) are powers of 1024, ``KB`` of 1000, no unit is bytes,
    any case; ASCII digits, at most 30 decimals, rounded to whole bytes from 1 to 8 EiB.

    Example:
        >>> parse_size("1.5 GiB")
        1610612736
        >>> parse_size("١٢G", "gpu_memory")
        Traceback (most recent call last):
        ...
        ValueError: gpu_memory='١٢G' is not a size: expected a number and a unit ...
    """
    if not isinstance(value, str):
        raise TypeError(
            f"{name}={_shown(value)} is not a size: expected a string such as '80GiB', got"
            f" {type(value).__name__}."
        )
    match = _SIZE.fullmatch(value)
    unit = match.group(3).lower() if match else ""
    whole = match.group(1).lstrip("0") if match else ""
    if match is not None and unit in _UNITS and len(whole) <= _SIZE_DIGITS:
        size = round(Fraction(f"{whole or 0}.{match.group(2) or 0}") * _UNITS[unit])
    elif match is not None and unit in _UNITS:
        size = INT64_MAX + 1
    else:
        size = 0
    if size < 1:
        raise ValueError(
            f"{name}={_shown(value)} is not a size: expected a number and a unit such as 80GiB,"
            " 80GB, 141G or 24000MiB (K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB"
            " powers of 1000, no unit is bytes; ASCII digits), of at least 1 byte."
        )
    if size > INT64_MAX:
        raise ValueError(
            f"{name}={_shown(value)} is too large: at most {INT64_MAX:,} bytes (8 EiB)."
        )
    return size
