"""Compare variants across seeds, failed runs ranked worst (docs/ledger.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, Literal

import numpy as np
import pandas as pd

MEASURED_STATUSES: Final = ("completed", "stopped")
FAILED_STATUSES: Final = ("diverged", "oom", "failed")
STATUS_ORDER: Final = (*MEASURED_STATUSES, *FAILED_STATUSES, "interrupted", "running")

Mode = Literal["min", "max"]


def iqm(values: np.ndarray[Any, Any], axis: int = -1) -> Any:
    """Interquartile mean along ``axis``: trim ``floor(n / 4)`` values at each end, average."""
    ordered = np.sort(values, axis=axis)
    n = ordered.shape[axis]
    return np.mean(np.take(ordered, np.arange(n // 4, n - n // 4), axis=axis), axis=axis)


_STATISTICS: Final[dict[str, Callable[..., Any]]] = {
    "median": np.median,
    "mean": np.mean,
    "iqm": iqm,
}


def bootstrap_ci(
    values: np.ndarray[Any, Any],
    statistic: Callable[..., Any],
    *,
    n_boot: int = 2000,
    confidence: float = 0.95,
    rng: np.random.Generator,
) -> tuple[float, float]:
    """Percentile-bootstrap interval of ``statistic(values, axis=-1)``, ``n_boot`` resamples in
    one draw (inverted-CDF quantiles: infinite values never turn into NaN)."""
    index = rng.integers(0, len(values), size=(n_boot, len(values)))
    stats = np.asarray(statistic(values[index], axis=-1), dtype=float)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(stats, [alpha, 1.0 - alpha], method="inverted_cdf")
    return float(low), float(high)


@dataclass(frozen=True)
class _Settings:
    """What every group's summary shares (``interval``: :func:`bootstrap_ci`, one generator)."""

    by: str
    control: str | None
    mode: Mode
    min_runs: int
    interval: Callable[[np.ndarray[Any, Any], Callable[..., Any]], tuple[float, float]]


@dataclass(frozen=True)
class Comparison:
    """The result of :func:`compare_runs`: ``summary``, ``runs`` and ``paired`` tables.

    Example:
        >>> runs = pd.DataFrame({"variant": ["a", "b"], "seed": [0, 0],
        ...                      "status": ["completed", "failed"], "value": [1.0, None]})
        >>> compare_runs(runs, control="a")
        Comparison(metric='value', mode='min', control='a', groups=2, runs=2)
    """

    summary: pd.DataFrame
    runs: pd.DataFrame
    paired: pd.DataFrame
    metric: str
    mode: str
    control: str | None

    def __repr__(self) -> str:
        return (
            f"Comparison(metric={self.metric!r}, mode={self.mode!r}, control={self.control!r},"
            f" groups={len(self.summary)}, runs={len(self.runs)})"
        )


def _scores(frame: pd.DataFrame, value: str, mode: Mode) -> pd.Series:
    worst = np.inf if mode == "min" else -np.inf
    raw = pd.to_numeric(frame[value], errors="coerce").astype(float).to_numpy()
    status = frame["status"].astype(object)
    # A measured run without a value at all (metric never logged) cannot be ranked: NaN.
    score = np.where(status.isin(MEASURED_STATUSES), np.where(np.isinf(raw), worst, raw), np.nan)
    score = np.where(status.isin(FAILED_STATUSES), worst, score)
    return pd.Series(score, index=frame.index, dtype=float)


def _require_column(frame: pd.DataFrame, column: str) -> None:
    if column not in frame.columns:
        raise ValueError(f"runs has no column {column!r}; columns are {list(frame.columns)}.")


def compare_runs(
    runs: pd.DataFrame,
    *,
    value: str = "value",
    by: str = "variant",
    control: str | None = None,
    mode: Mode = "min",
    failures: Literal["worst", "exclude"] = "worst",
    min_runs_for_ci: int = 5,
    n_boot: int = 2000,
    confidence: float = 0.95,
    random_state: int = 0,
    metric: str | None = None,
) -> Comparison:
    """Compare groups of runs (variants) across seeds; see docs/ledger.md.

    Args:
        runs: one row per run with columns ``by``, ``seed``, ``status``, ``value`` (and
            ``run_id`` if available). Rows are in start order: when a group ran one seed
            twice, the later run is the one paired with the control.
        control: the group the others are paired against, seed by seed.
        mode: ``"min"`` when lower is better, ``"max"`` when higher is better.
        failures: ``"worst"`` counts failed runs as the worst value in the statistics;
            ``"exclude"`` leaves them out of the statistics (they stay counted and ranked).
        min_runs_for_ci: runs (or pairs) needed before intervals are computed.
        random_state: seed of the bootstrap (the same input gives the same intervals).
        metric: the metric's name, kept in the result (default: ``value``).

    Raises:
        ValueError: an unknown column, mode, failure policy or control, or a bad number.
    """
    for column in (by, "seed", "status"):
        _require_column(runs, column)
    if mode not in ("min", "max"):
        raise ValueError(f"mode={mode!r} is invalid; expected 'min' or 'max'.")
    if failures not in ("worst", "exclude"):
        raise ValueError(f"failures={failures!r} is invalid; expected 'worst' or 'exclude'.")
    groups = list(pd.unique(runs[by].astype(object)))
    if control is not None and control not in groups:
        raise ValueError(f"control={control!r} is not a {by}; the {by}s are {groups}.")
    _require_column(runs, value)
    if not isinstance(min_runs_for_ci, int) or min_runs_for_ci < 2:
        raise ValueError(f"min_runs_for_ci={min_runs_for_ci!r} is invalid: expected an int >= 2.")
    if not isinstance(n_boot, int) or n_boot < 100:
        raise ValueError(f"n_boot={n_boot!r} is invalid: expected an int >= 100.")
    if not isinstance(confidence, float) or not 0.5 <= confidence < 1.0:
        raise ValueError(f"confidence={confidence!r} is invalid: expected a float in [0.5, 1).")
    rng = np.random.default_rng(random_state)
    interval = partial(bootstrap_ci, n_boot=n_boot, confidence=confidence, rng=rng)
    settings = _Settings(by, control, mode, min_runs_for_ci, interval)
    table = runs.reset_index(drop=True).copy()
    table["score"] = _scores(table, value, mode)
    in_stats = table["score"].notna()
    if failures == "exclude":
        in_stats &= ~table["status"].astype(object).isin(FAILED_STATUSES)
    table["in_statistics"] = in_stats
    table["rank"] = table["score"].rank(ascending=mode == "min", method="min").astype("Int64")
    pairs = _pairs(table, by, control)
    summary = pd.DataFrame([_summarise(table, pairs, group, settings) for group in groups])
    for column in ("n_runs", "n_in_statistics", *(f"n_{s}" for s in STATUS_ORDER)):
        summary[column] = summary[column].astype("int64")
    for column in ("paired_n", "paired_wins", "paired_losses"):
        summary[column] = summary[column].astype("Int64")
    return Comparison(summary, table, pairs, metric=metric or value, mode=mode, control=control)


def _pairs(table: pd.DataFrame, by: str, control: str | None) -> pd.DataFrame:
    columns = [by, "seed", "control_score", "score", "difference"]
    if control is None:
        return pd.DataFrame(columns=columns)
    usable = table[table["in_statistics"] & table["seed"].notna()]
    latest = usable.drop_duplicates(subset=[by, "seed"], keep="last")
    base = latest[latest[by] == control][["seed", "score"]]
    others = latest[latest[by] != control][[by, "seed", "score"]]
    merged = others.merge(base.rename(columns={"score": "control_score"}), on="seed", how="inner")
    with np.errstate(invalid="ignore"):
        merged["difference"] = merged["score"] - merged["control_score"]
    return merged[columns].reset_index(drop=True)


def _summarise(
    table: pd.DataFrame, pairs: pd.DataFrame, group: Any, settings: _Settings
) -> dict[str, Any]:
    rows = table[table[settings.by] == group]
    counts = rows["status"].astype(object).value_counts()
    row: dict[str, Any] = {settings.by: group, "n_runs": len(rows)}
    for status in STATUS_ORDER:
        row[f"n_{status}"] = int(counts.get(status, 0))
    values = rows.loc[rows["in_statistics"], "score"].to_numpy(dtype=float)
    row["n_in_statistics"] = len(values)
    notes = []
    if other := len(rows) - len(values):
        notes.append(f"{other} run(s) not in the statistics (unfinished, excluded or no value)")
    min_runs = settings.min_runs
    for name, statistic in _STATISTICS.items():
        row[name] = float(statistic(values)) if len(values) else np.nan
        row[f"{name}_ci_low"] = row[f"{name}_ci_high"] = np.nan
        if len(values) >= min_runs:
            row[f"{name}_ci_low"], row[f"{name}_ci_high"] = settings.interval(values, statistic)
    if 0 < len(values) < min_runs:
        notes.append(f"intervals need >= {min_runs} runs, got {len(values)}")
    row.update(_paired(pairs, group, settings, notes))
    row["notes"] = "; ".join(notes) or None
    return row


def _paired(
    pairs: pd.DataFrame, group: Any, settings: _Settings, notes: list[str]
) -> dict[str, Any]:
    diffs_unknown = ("paired_mean_diff", "paired_median_diff", "paired_ci_low", "paired_ci_high")
    out: dict[str, Any] = {
        "paired_n": pd.NA,
        **dict.fromkeys(diffs_unknown, np.nan),
        "paired_wins": pd.NA,
        "paired_losses": pd.NA,
    }
    control = settings.control
    if control is None or group == control:
        return out
    mine = pairs[pairs[settings.by] == group]
    both_failed = int(mine["difference"].isna().sum())
    diffs = mine["difference"].dropna().to_numpy(dtype=float)
    better = diffs < 0 if settings.mode == "min" else diffs > 0
    worse = diffs > 0 if settings.mode == "min" else diffs < 0
    out.update(paired_n=len(diffs), paired_wins=int(better.sum()), paired_losses=int(worse.sum()))
    if both_failed:
        notes.append(f"{both_failed} seed(s) failed in both {group!r} and the control")
    if len(diffs):
        out["paired_mean_diff"] = float(np.mean(diffs))
        out["paired_median_diff"] = float(np.median(diffs))
    if len(diffs) >= settings.min_runs:
        out["paired_ci_low"], out["paired_ci_high"] = settings.interval(diffs, np.mean)
    elif len(diffs):
        notes.append(f"paired interval needs >= {settings.min_runs} seeds, got {len(diffs)}")
    else:
        notes.append(f"no seed shared with the control {control!r}")
    return out
