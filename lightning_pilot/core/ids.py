"""Run ids, ``YYYYMMDDTHHMMSSmmmZ-<16 hex digits>``: the UTC creation time to the millisecond,
then 64 random bits; time-sortable, unique across processes, safe as path components.

Example:
    >>> validate_run_id(new_run_id(), "run_id")[8]
    'T'
    >>> validate_run_id("../../etc", "run_id")
    Traceback (most recent call last):
    ...
    ValueError: run_id='../../etc' is not a run id: expected 'YYYYMMDDTHHMMSSmmmZ-' and 16 ...
"""

from __future__ import annotations

import os
import re
import time
from typing import Final

_RUN_ID: Final = re.compile(r"\d{8}T\d{9}Z-[0-9a-f]{16}")


def new_run_id(now_ns: int | None = None) -> str:
    """Make a new run id from the current time (or ``now_ns``, for tests) and 64 random bits."""
    seconds, rest = divmod(time.time_ns() if now_ns is None else now_ns, 1_000_000_000)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(seconds))
    return f"{stamp}{rest // 1_000_000:03d}Z-{os.urandom(8).hex()}"


def validate_run_id(value: object, argument: str) -> str:
    """``value`` if it is a run id made by :func:`new_run_id`, else raise (before an id read
    back from a file becomes part of a path)."""
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a string run id, got {type(value).__name__}.")
    if not _RUN_ID.fullmatch(value):
        raise ValueError(
            f"{argument}={value!r} is not a run id: expected 'YYYYMMDDTHHMMSSmmmZ-' and"
            " 16 hex digits, as made by new_run_id()."
        )
    return value
