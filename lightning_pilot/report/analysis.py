"""Pure analysis of what was read (DataFrames in, DataFrames or small dataclasses out; what was
not measured stays null): reductions that skip nulls, one run's gate, the rows sampled out, each
phase's summary, the memory peak, the step time and the updates counted; each variant's costs
and standing; and the campaign packages priced from a pilot."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import pandas as pd

from lightning_pilot.core.compare import FAILED_STATUSES, Comparison
from lightning_pilot.report.units import is_null
from lightning_pilot.schemas import STATUSES
from lightning_pilot.vocabulary import phase_rank, verdict_rank


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


#: Ledger statuses that fail the command line's gate: the run did not train to its end.
GATE_STATUSES: Final = FAILED_STATUSES


def _no_checks(value: Any) -> bool:
    return is_null(value) or len(value) == 0


def sampled_out(frame: pd.DataFrame) -> pd.Series:
    """A boolean Series aligned with ``frame``: the phase rows of later occurrences that
    happened but were, by design, not measured (docs/cli.md)."""
    if frame.empty:
        return pd.Series(False, index=frame.index, dtype=bool)
    later = ~frame["first"].fillna(True).astype(bool)
    happened = frame["occurrences"].fillna(0).astype("int64") > 0
    unmeasured = frame["measured_occurrences"].fillna(-1).astype("int64") == 0
    unchecked = (frame["verdict"] == "not_checked") & frame["checks"].map(_no_checks)
    return (later & happened & unmeasured & unchecked).astype(bool)


@dataclass(frozen=True)
class Gate:
    """What fails the command line's gate: ``failed_rows``, the phase rows with verdict
    ``fail`` and their ``failed_checks``, and ``failed_runs``, the ledger runs with a status in
    :data:`GATE_STATUSES` or one the ledger does not define (``judged`` false)."""

    failed_rows: pd.DataFrame
    failed_runs: pd.DataFrame

    @property
    def failed(self) -> bool:
        """A phase row failed or a run did not end well."""
        return not (self.failed_rows.empty and self.failed_runs.empty)


def gate(phases: pd.DataFrame | None, runs: pd.DataFrame | None) -> Gate:
    """The :class:`Gate` of these phase rows and ledger runs (``None``: not read)."""
    rows = []
    if phases is not None and not phases.empty:
        for data in phases[phases["verdict"] == "fail"].to_dict("records"):
            checks: Any = [] if _no_checks(data["checks"]) else data["checks"]
            failed = [check["name"] for check in checks if check["verdict"] == "fail"]
            rows.append((data["run_id"], data["phase"], data["first"], failed))
    failed_runs = pd.DataFrame(columns=["run_id", "status", "judged"])
    if runs is not None and not runs.empty:
        status = runs["status"].astype(object)
        judged = status.isin(GATE_STATUSES)
        bad = judged | (status.notna() & ~status.isin(STATUSES))
        failed_runs = runs[bad].assign(judged=judged[bad])
    columns = ["run_id", "phase", "first", "failed_checks"]
    return Gate(pd.DataFrame(rows, columns=columns), failed_runs)


def steady_medians(phases: pd.DataFrame) -> pd.Series:
    """Each phase's steady-state median duration: the largest median of its later occurrences
    (over runs, attempts and ranks), else of its first."""
    first = phases["first"].fillna(False).astype(bool)
    medians = phases["duration_median_s"]
    later = medians.where(~first).groupby(phases["phase"], sort=False).max()
    return later.fillna(medians.groupby(phases["phase"], sort=False).max())


def _phase_verdict(rows: pd.DataFrame) -> str | None:
    """The worst verdict of a phase's rows, the sampled-out ones left out when others exist."""
    measured = rows[~sampled_out(rows)]
    known = [str(v) for v in (measured if len(measured) else rows)["verdict"].dropna()]
    return min(known, key=verdict_rank) if known else None


def phase_summary(phases: pd.DataFrame) -> pd.DataFrame:
    """One row per phase in campaign order, over every run, attempt and rank: the largest
    peaks, the first occurrence's ``first_s``, the steady ``median_s`` and the worst
    ``verdict``."""
    groups = phases.assign(
        first_s=phases["duration_s"].where(phases["first"].fillna(True).astype(bool))
    ).groupby("phase", sort=False)
    summary = groups[["peak_allocated_bytes", "peak_reserved_bytes", "first_s"]].max()
    summary["median_s"] = steady_medians(phases)
    verdicts = [_phase_verdict(rows) for _, rows in groups]
    summary["verdict"] = pd.Series(verdicts, index=summary.index, dtype=object)
    summary = summary.reset_index()
    order = sorted(range(len(summary)), key=lambda i: phase_rank(summary["phase"][i]))
    return summary.iloc[order].reset_index(drop=True)


@dataclass(frozen=True)
class Peak:
    """The largest memory peak of a phase table, its ``kind`` and the ``phase`` that set it."""

    kind: str
    bytes: int
    phase: str


def memory_peak(
    summary: pd.DataFrame, kinds: tuple[str, ...] = ("reserved", "allocated")
) -> Peak | None:
    """The largest peak in a phase table or :func:`phase_summary` of the first of ``kinds`` any
    phase measured; ``None``: none did."""
    for kind in kinds:
        column = f"peak_{kind}_bytes"
        measured = summary.dropna(subset=[column])
        if len(measured):
            top = measured.iloc[int(measured[column].astype("float64").to_numpy().argmax())]
            return Peak(kind, int(top[column]), str(top["phase"]))
    return None


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer update: ``accumulate`` micro-batches of data, forward and
    backward, then one optimizer step, from each phase's steady median (``parts``)."""

    accumulate: int
    parts: Mapping[str, float | None]

    @property
    def missing(self) -> list[str]:
        """The phases without a duration."""
        return [phase for phase, value in self.parts.items() if value is None]

    @property
    def seconds(self) -> float | None:
        """One update's time; ``None`` when a phase has no duration."""
        if self.missing:
            return None
        micro = sum(v for p, v in self.parts.items() if p != "optimizer_step" and v is not None)
        return self.accumulate * micro + (self.parts["optimizer_step"] or 0.0)


def step_time(phases: pd.DataFrame, accumulate: int) -> StepTime:
    """The :class:`StepTime` of a phase table with ``accumulate`` micro-batches per update."""
    medians = steady_medians(phases)
    parts = ("data", "forward", "backward", "optimizer_step")
    return StepTime(accumulate, {phase: value_at(medians, phase) for phase in parts})


def accumulation(record: Mapping[str, Any] | None, updates: pd.DataFrame | None) -> int:
    """Micro-batches per update: the ledger record's, else the largest counted, else 1."""
    if record is not None and not is_null(record.get("accumulate_grad_batches")):
        return int(record["accumulate_grad_batches"])
    counted = None if updates is None else largest(updates["accumulate_grad_batches"])
    return 1 if counted is None else int(counted)


@dataclass(frozen=True)
class UpdateCount:
    """The updates of ``updates.parquet`` (rank 0), an update run again by a later attempt
    counted once: K and the replicas seen, the ``examples`` over all replicas, the updates
    ``replayed`` and the examples with them; ``steps_per_row``: how far ``global_step``
    typically (the median) advanced between two rows of an attempt, over 1 when a manually
    optimized module steps several optimizers per batch (each row then a batch window)."""

    updates: int
    ks: list[int]
    replicas: list[int]
    examples: int | None
    replayed: int
    with_replays: int | None
    steps_per_row: int = 1


def count_updates(updates: pd.DataFrame) -> UpdateCount:
    """The :class:`UpdateCount` of an updates table: a replayed update counts as the latest
    attempt ran it."""
    rank0 = updates[updates["rank"] == updates["rank"].min()]
    order = [c for c in ("attempt", "update") if c in rank0.columns]
    latest = rank0.sort_values(order).drop_duplicates("update", keep="last")

    def total(examples: pd.Series) -> int | None:
        return None if examples.isna().any() else int(examples.sum())

    attempts = latest["attempt"] if "attempt" in latest else pd.Series(0, index=latest.index)
    gaps = latest["update"].groupby(attempts).diff().dropna()

    return UpdateCount(
        updates=len(latest),
        ks=sorted({int(k) for k in updates["accumulate_grad_batches"].dropna()}),
        replicas=sorted({int(r) for r in updates["dp_replicas"].dropna()}),
        examples=total(latest["examples_all_ranks"]),
        replayed=len(rank0) - len(latest),
        with_replays=total(rank0["examples_all_ranks"]),
        steps_per_row=max(round(gaps.median()), 1) if len(gaps) else 1,
    )


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


def _same_experiment(
    row: Mapping[Any, Any], reference: Mapping[Any, Any] | None, by: str, control: str | None
) -> tuple[bool | None, str]:
    """Whether a variant answers the control's question (a plain bool), and why: its data shape
    differs when truncation differs by 5 points or loss positions by 5 %."""
    if reference is None:
        return None, "no control to compare with"
    if row[by] == control:
        return True, "the control"
    if is_null(row["truncated_fraction"]) and is_null(row["loss_positions"]):
        return None, "not measured (no BatchInspector examples)"
    reasons = []
    mine, theirs = row["truncated_fraction"], reference["truncated_fraction"]
    if not (is_null(mine) or is_null(theirs)) and abs(mine - theirs) > 0.05:
        reasons.append(f"truncated {mine:.0%} vs {theirs:.0%} in the control")
    mine, theirs = row["loss_positions"], reference["loss_positions"]
    if not (is_null(mine) or is_null(theirs)) and abs(mine - theirs) > 0.05 * max(
        abs(theirs), 1e-9
    ):
        reasons.append(f"loss positions {mine:.3g} vs {theirs:.3g} per example in the control")
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
