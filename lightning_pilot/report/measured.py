"""Reductions over what was measured: a null value is left out, and a Series with no value
left reduces to ``None`` (not measured), never to 0 or NaN."""

from __future__ import annotations

from typing import Any

import pandas as pd

from lightning_pilot.report.units import is_null


def largest(series: pd.Series) -> Any:
    """The largest value measured; ``None`` when none was."""
    values = series.dropna()
    return None if values.empty else values.max()


def median(series: pd.Series) -> Any:
    """The median of the values measured; ``None`` when none was."""
    return series.dropna().median() if series.notna().any() else None


def value_at(series: pd.Series, key: Any) -> float | None:
    """The value of ``series`` at ``key`` as a float; ``None`` when absent or null."""
    value = series.get(key)
    return None if value is None or is_null(value) else float(value)
