"""An estimate (``estimate.parquet``) read per target x configuration (:func:`on_target`): one
rule for :class:`~lightning_pilot.TargetEstimator`'s summary and the report."""

from __future__ import annotations

from typing import Any, Final

import pandas as pd

from lightning_pilot.schemas import checkpointing_mode

#: The columns of an estimate that name one configuration on one target.
TARGET_KEYS: Final = (
    "target", "precision", "micro_batch", "seq_len", "checkpointing", "strategy", "devices",
)  # fmt: skip


def _reduced(series: pd.Series, how: str) -> Any:
    """The ``how`` (``"max"`` or ``"min"``) of ``series``' non-null values; ``None`` if none."""
    values = series.dropna()
    return None if values.empty else getattr(values, how)()


def checkpointing_name(value: object) -> str | None:
    """An estimate table's ``checkpointing`` value by its name (``off``, ``full``,
    ``selective``; the boolean of schema version 1 too); a value of no known mode as it is."""
    try:
        return checkpointing_mode(value)
    except ValueError:
        return str(value)


def on_target(estimate: pd.DataFrame) -> pd.DataFrame:
    """One row per target x configuration of an estimate table (``estimate.parquet``): the
    largest estimated reserved bytes per GPU over its phases and the phase that sets it,
    ``fits`` (every phase fits; ``None`` when a phase could not be estimated), the smallest
    ``headroom_bytes``, the training step-time band (``step_low_s``, ``step_high_s``) and
    ``status`` (``ok``, or the first other status with its ``reason``); ``checkpointing`` by
    name, as :func:`checkpointing_name` gives it."""
    columns = [*TARGET_KEYS, "reserved_bytes", "phase", "fits", "headroom_bytes",
               "step_low_s", "step_high_s", "status", "reason"]  # fmt: skip
    rows = []
    named = estimate.assign(checkpointing=estimate["checkpointing"].map(checkpointing_name))
    for key, group in named.groupby(list(TARGET_KEYS), sort=False, dropna=False):
        ok = group[group["status"] == "ok"]
        bad = group[group["status"] != "ok"]
        reserved = ok["peak_reserved_bytes"].dropna()
        top = ok.loc[[reserved.idxmax()]].iloc[0] if len(reserved) else None
        fits = None if len(bad) or ok["fits"].isna().any() else bool(ok["fits"].all())
        rows.append(
            [
                *key,
                None if top is None else int(top["peak_reserved_bytes"]),
                None if top is None else top["phase"],
                fits,
                _reduced(ok["headroom_bytes"], "min"),
                _reduced(ok["step_time_low_s"], "max"),
                _reduced(ok["step_time_high_s"], "max"),
                "ok" if bad.empty else str(bad.iloc[0]["status"]),
                None if bad.empty else bad.iloc[0]["reason"],
            ]
        )
    return pd.DataFrame(rows, columns=columns)
