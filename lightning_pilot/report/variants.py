"""The variants of an experiment side by side: each run's measured costs (memory, step time,
data shape), their summary per variant with whether a variant asks the control's question,
and where the variants stand on the agreed metric.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import pandas as pd

from lightning_pilot.core.compare import Comparison
from lightning_pilot.report.analysis import memory_peak, step_time
from lightning_pilot.report.measured import largest, median
from lightning_pilot.report.units import is_null

#: The costs reduced to their median over a variant's runs, those measured per run, and the
#: columns of :func:`summarize_costs`.
_MEDIANS: Final = ("step_s", "truncated_fraction", "loss_positions")
_MEASURED: Final = ("peak_allocated_bytes", "peak_phase", "peak_reserved_bytes", *_MEDIANS)
_SUMMARY: Final = ("runs_measured", *_MEASURED, "same_experiment", "why")


def standing(comparison: Comparison) -> pd.DataFrame:
    """Where the variants stand: the comparison's summary, best median first (none: last)."""
    return comparison.summary.sort_values("median", kind="stable", na_position="last")


def run_costs(
    phases: pd.DataFrame, examples: pd.DataFrame | None, accumulate: int
) -> dict[str, Any]:
    """One run's measured costs: the peaks and ``peak_phase``, ``step_s``, and from
    BatchInspector's ``examples`` the ``truncated_fraction`` of training sequences and the mean
    ``loss_positions`` per example."""
    costs: dict[str, Any] = {}
    if phases.empty:
        return costs
    top = memory_peak(phases, ("allocated",))
    if top is not None:
        costs["peak_allocated_bytes"], costs["peak_phase"] = top.bytes, top.phase
    reserved = largest(phases["peak_reserved_bytes"])
    costs["peak_reserved_bytes"] = None if reserved is None else int(reserved)
    costs["step_s"] = step_time(phases, accumulate).seconds
    if examples is not None:
        train = examples[examples["split"] == "train"] if "split" in examples else examples
        if len(train) and train["truncated"].notna().any():
            costs["truncated_fraction"] = float(train["truncated"].dropna().astype(bool).mean())
        if len(train) and train["loss_tokens"].notna().any():
            costs["loss_positions"] = float(train["loss_tokens"].dropna().mean())
    return costs


def _differences(row: Mapping[Any, Any], control: Mapping[Any, Any]) -> list[str]:
    """How a variant's data shape differs from the control's (5 points, or 5 %)."""
    reasons = []
    mine, theirs = row["truncated_fraction"], control["truncated_fraction"]
    if not (is_null(mine) or is_null(theirs)) and abs(mine - theirs) > 0.05:
        reasons.append(f"truncated {mine:.0%} vs {theirs:.0%} in the control")
    mine, theirs = row["loss_positions"], control["loss_positions"]
    if not (is_null(mine) or is_null(theirs)) and abs(mine - theirs) > 0.05 * max(
        abs(theirs), 1e-9
    ):
        reasons.append(f"loss positions {mine:.3g} vs {theirs:.3g} per example in the control")
    return reasons


def _same_experiment(
    row: Mapping[Any, Any], reference: Mapping[Any, Any] | None, by: str, control: str | None
) -> tuple[bool | None, str]:
    """Whether a variant answers the control's question (a plain bool), and why."""
    if reference is None:
        return None, "no control to compare with"
    if row[by] == control:
        return True, "the control"
    if is_null(row["truncated_fraction"]) and is_null(row["loss_positions"]):
        return None, "not measured (no BatchInspector examples)"
    reasons = _differences(row, reference)
    return not reasons, "; ".join(reasons) or "same data shape"


def summarize_costs(
    per_run: pd.DataFrame, *, by: str = "variant", control: str | None = None
) -> pd.DataFrame:
    """Per variant, over its runs' :func:`run_costs` (a row per run, with a ``by`` column):
    ``runs_measured``, the largest peaks, the most frequent ``peak_phase``, the medians, and
    ``same_experiment`` (``None``: unknown) with ``why``."""
    columns = [by, *_SUMMARY]
    if per_run.empty:
        return pd.DataFrame(columns=columns)
    frame = per_run.assign(**{c: None for c in _MEASURED if c not in per_run})
    grouped = []
    for name, group in frame.groupby(by, sort=False):
        phase = group["peak_phase"].dropna()
        peaks = [largest(group[f"peak_{kind}_bytes"]) for kind in ("allocated", "reserved")]
        mode = phase.mode().iloc[0] if len(phase) else None
        medians = [median(group[column]) for column in _MEDIANS]
        grouped.append((name, len(group), peaks[0], mode, peaks[1], *medians))
    result = pd.DataFrame(grouped, columns=[by, *_SUMMARY[:-2]])
    reference = (
        result[result[by] == control].iloc[0].to_dict() if control in set(result[by]) else None
    )
    verdicts = [_same_experiment(row, reference, by, control) for row in result.to_dict("records")]
    same = pd.Series([verdict[0] for verdict in verdicts], dtype=object)
    return result.assign(same_experiment=same, why=[verdict[1] for verdict in verdicts])[columns]
