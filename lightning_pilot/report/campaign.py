"""The campaign priced from a pilot: every variant of the experiment (ledger order is
priority order) priced at one run's measured speed, or at a target's estimated step-time band,
and the 3, 7 and 30 day packages filled with the variants that fit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import pandas as pd

from lightning_pilot.report.analysis import GATE_STATUSES, steady_medians
from lightning_pilot.report.measured import largest, value_at
from lightning_pilot.report.units import is_null
from lightning_pilot.schemas import STATUSES

#: The length of each campaign package in days.
PACKAGE_DAYS: Final = (3, 7, 30)


def campaign_variants(runs: pd.DataFrame | None, experiment: Any) -> pd.DataFrame:
    """The variants of ``experiment`` with planned updates in ledger runs (``None``: no
    ledger), each once in ledger order: ``variant`` (else the run id), ``planned_updates`` and
    ``status``."""
    found: dict[str, tuple[int, Any]] = {}
    mine = [] if runs is None else runs[runs["experiment"] == experiment].to_dict("records")
    for row in mine:
        planned, variant, status = row.get("planned_updates"), row.get("variant"), row["status"]
        name = str(row["run_id"] if is_null(variant) or variant == "" else variant)
        if not is_null(planned) and name not in found:
            found[name] = (int(planned), None if is_null(status) else status)
    rows = [(name, planned, status) for name, (planned, status) in found.items()]
    return pd.DataFrame(rows, columns=["variant", "planned_updates", "status"])


@dataclass(frozen=True)
class Campaign:
    """Every variant priced at one run's speed (``per_update_s``: the step with validation and
    checkpoints at the run's rate, each ``(occurrences per update, seconds)``), in priority
    order, and the variants each 3, 7 and 30 day package holds."""

    step_s: float
    per_update_s: float
    validation: tuple[float, float]
    checkpoint: tuple[float, float]
    export_s: float
    variants: pd.DataFrame
    packages: dict[int, list[str]]


def _rate(
    phases: pd.DataFrame, medians: pd.Series, phase: str, updates: int
) -> tuple[float, float]:
    """How often ``phase`` happened per update, and its median duration."""
    median = value_at(medians, phase)
    occurrences = phases.loc[phases["phase"] == phase, "occurrences"]
    if occurrences.empty or median is None or updates <= 0:
        return 0.0, 0.0
    return float(occurrences.fillna(0).sum()) / updates, median


def _package(
    packages: dict[int, list[str]],
    name: str,
    status: Any,
    hours: float,
    cumulative: float,
    reserve: float,
) -> tuple[bool, float]:
    """Add a variant of ``hours`` to every package it still fits in, unless it diverged, failed
    or has an unknown status; whether it was packaged, and the hours packaged so far."""
    if status in GATE_STATUSES or not (status in STATUSES or is_null(status)):
        return False, cumulative
    cumulative += hours
    for days, members in packages.items():
        if cumulative <= days * 24.0 * (1.0 - reserve):
            members.append(name)
    return True, cumulative


def campaign(
    phases: pd.DataFrame, variants: pd.DataFrame, step_s: float, *, reserve: float, devices: int = 1
) -> Campaign:
    """Price the variants (:func:`campaign_variants`) at this run's speed on ``devices`` each,
    and fill the 3, 7 and 30 day packages in priority order, ``reserve`` of each kept back."""
    medians = steady_medians(phases)
    updates = largest(phases.loc[phases["phase"] == "optimizer_step", "occurrences"])
    done = int(updates) if updates is not None else 0
    validation = _rate(phases, medians, "validation", done)
    checkpoint = _rate(phases, medians, "checkpoint_save", done)
    per_update = step_s + validation[0] * validation[1] + checkpoint[0] * checkpoint[1]
    export = value_at(medians, "export") or 0.0
    packages: dict[int, list[str]] = {days: [] for days in PACKAGE_DAYS}
    rows, cumulative = [], 0.0
    for name, planned, status in variants.itertuples(index=False):
        hours = (int(planned) * per_update + export) / 3600.0
        packaged, cumulative = _package(packages, name, status, hours, cumulative, reserve)
        rows.append((name, status, int(planned), hours, hours * devices, packaged, cumulative))
    columns = ["variant", "status", "planned_updates", "hours", "device_hours", "packaged",
               "cumulative_hours"]  # fmt: skip
    table = pd.DataFrame(rows, columns=columns)
    return Campaign(step_s, per_update, validation, checkpoint, export, table, packages)


def target_campaign(
    variants: pd.DataFrame,
    step_low_s: float,
    step_high_s: float,
    *,
    devices: int,
    reserve: float,
    price_per_gpu_hour: float | None = None,
) -> tuple[pd.DataFrame, dict[int, list[str]]]:
    """Price the variants at an estimated step-time band on ``devices`` GPUs each (hours,
    GPU-hours and, with a price, cost, low and high), training updates only; the packages are
    filled at the slow end of the band (``reserve`` kept back)."""
    packages: dict[int, list[str]] = {days: [] for days in PACKAGE_DAYS}
    rows, cumulative = [], 0.0
    for name, planned, status in variants.itertuples(index=False):
        low, high = int(planned) * step_low_s / 3600.0, int(planned) * step_high_s / 3600.0
        packaged, cumulative = _package(packages, name, status, high, cumulative, reserve)
        cost = (None, None) if price_per_gpu_hour is None else (
            low * devices * price_per_gpu_hour, high * devices * price_per_gpu_hour
        )  # fmt: skip
        rows.append((name, status, int(planned), low, high, low * devices, high * devices,
                     *cost, packaged))  # fmt: skip
    columns = ["variant", "status", "planned_updates", "hours_low", "hours_high",
               "gpu_hours_low", "gpu_hours_high", "cost_low", "cost_high", "packaged"]  # fmt: skip
    return pd.DataFrame(rows, columns=columns), packages
