"""One run's phase table and updates: the gate, the rows sampled out, each phase's summary,
the memory peak, the step time and the updates counted. DataFrames in, DataFrames or small
dataclasses out; what was not measured stays null."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import pandas as pd

from lightning_pilot.core.compare import FAILED_STATUSES
from lightning_pilot.report.measured import largest, value_at
from lightning_pilot.report.units import is_null
from lightning_pilot.schemas import STATUSES
from lightning_pilot.vocabulary import phase_rank, verdict_rank

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
