"""Pure analysis for the tables, the sheet and the plots: DataFrames in, DataFrames or small
dataclasses out. Nothing here reads a file, formats a unit or prints; what was not measured
stays null.

Example:
    >>> import pandas as pd
    >>> phases = pd.DataFrame({"phase": ["forward", "forward"], "first": [True, False],
    ...                        "duration_median_s": [0.5, 0.1]})
    >>> steady_medians(phases).to_dict()
    {'forward': 0.1}
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import pandas as pd

from lightning_pilot.core.compare import FAILED_STATUSES, Comparison
from lightning_pilot.core.phases import PHASES
from lightning_pilot.report.units import as_text, format_bytes, is_null
from lightning_pilot.schemas import STATUSES, checkpointing_mode

#: Ledger statuses that fail the command line's exit code (the CI gate): the run did not train
#: to its end (``diverged``, ``oom``, ``failed``).
GATE_STATUSES: Final = FAILED_STATUSES
#: Phases in campaign order (an unknown phase sorts last) and verdicts worst first.
PHASE_ORDER: Final = {phase: index for index, phase in enumerate(PHASES)}
VERDICT_RANK: Final = {"fail": 0, "warn": 1, "not_checked": 2, "pass": 3}
_MEDIANS: Final = ("step_s", "truncated_fraction", "loss_positions")
_MEASURED: Final = ("peak_allocated_bytes", "peak_phase", "peak_reserved_bytes", *_MEDIANS)
_SUMMARY: Final = ("runs_measured", *_MEASURED, "same_experiment", "why")


def _no_checks(value: Any) -> bool:
    return is_null(value) or len(value) == 0


def _max(series: pd.Series) -> Any:
    values = series.dropna()
    return None if values.empty else values.max()


def _min(series: pd.Series) -> Any:
    values = series.dropna()
    return None if values.empty else values.min()


def _median(series: pd.Series) -> Any:
    return series.dropna().median() if series.notna().any() else None


def sampled_out(frame: pd.DataFrame) -> pd.Series:
    """A boolean Series aligned with ``frame``: the phase rows of later occurrences that
    happened but were, by design, not measured (docs/cli.md); the tables list them apart."""
    if frame.empty:
        return pd.Series(False, index=frame.index, dtype=bool)
    later = ~frame["first"].fillna(True).astype(bool)
    happened = frame["occurrences"].fillna(0).astype("int64") > 0
    unmeasured = frame["measured_occurrences"].fillna(-1).astype("int64") == 0
    unchecked = (frame["verdict"] == "not_checked") & frame["checks"].map(_no_checks)
    mask: pd.Series = (later & happened & unmeasured & unchecked).astype(bool)
    return mask


@dataclass(frozen=True)
class Gate:
    """What fails the command line's gate: ``failed_rows``, the phase rows with verdict
    ``fail`` (``run_id``, ``phase``, ``first``, the names of the ``failed_checks``), and
    ``failed_runs``, the ledger runs with a status in :data:`GATE_STATUSES` or one the ledger
    does not define (``judged`` false: it cannot be judged, so it never passes).

    Example:
        >>> runs = pd.DataFrame({"run_id": ["r1", "r2"], "status": ["completed", "oom"]})
        >>> verdict = gate(None, runs)
        >>> verdict.failed, verdict.failed_runs["run_id"].tolist()
        (True, ['r2'])
    """

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
    """Each phase's steady-state median duration, indexed by phase: the largest median of its
    later occurrences (over runs, attempts and ranks), else of its first."""
    first = phases["first"].fillna(False).astype(bool)
    medians = phases["duration_median_s"]
    later = medians.where(~first).groupby(phases["phase"], sort=False).max()
    return later.fillna(medians.groupby(phases["phase"], sort=False).max())


def _phase_verdict(rows: pd.DataFrame) -> str | None:
    """The worst verdict of a phase's rows, leaving out the sampled-out ones when others exist."""
    measured = rows[~sampled_out(rows)]
    known = [str(v) for v in (measured if len(measured) else rows)["verdict"].dropna()]
    return min(known, key=lambda v: VERDICT_RANK.get(v, 9)) if known else None


def phase_summary(phases: pd.DataFrame) -> pd.DataFrame:
    """One row per phase in campaign order, over every run, attempt and rank: the largest
    ``peak_allocated_bytes`` and ``peak_reserved_bytes``, the first occurrence's time
    ``first_s``, the steady ``median_s`` and the worst ``verdict`` (``None``: none recorded)."""
    groups = phases.assign(
        first_s=phases["duration_s"].where(phases["first"].fillna(True).astype(bool))
    ).groupby("phase", sort=False)
    summary = groups[["peak_allocated_bytes", "peak_reserved_bytes", "first_s"]].max()
    summary["median_s"] = steady_medians(phases)
    verdicts = [_phase_verdict(rows) for _, rows in groups]
    summary["verdict"] = pd.Series(verdicts, index=summary.index, dtype=object)
    summary = summary.reset_index()
    order = sorted(range(len(summary)), key=lambda i: PHASE_ORDER.get(summary["phase"][i], 99))
    return summary.iloc[order].reset_index(drop=True)


@dataclass(frozen=True)
class Peak:
    """The largest memory peak of a phase table, its ``kind`` and the ``phase`` that set it.

    Example:
        >>> summary = pd.DataFrame({"phase": ["forward", "backward"],
        ...     "peak_allocated_bytes": [10, 30], "peak_reserved_bytes": [None, None]})
        >>> memory_peak(summary)
        Peak(kind='allocated', bytes=30, phase='backward')
    """

    kind: str
    bytes: int
    phase: str


def memory_peak(
    summary: pd.DataFrame, kinds: tuple[str, ...] = ("reserved", "allocated")
) -> Peak | None:
    """The largest peak in a phase table or :func:`phase_summary` of the first of ``kinds`` any
    phase measured (reserved first: what a caching allocator holds); ``None``: none did."""
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
    backward, then one optimizer step, from each phase's steady median (``parts``, ``None``
    where a phase has no duration).

    Example:
        >>> frame = pd.DataFrame({"phase": ["data", "forward", "backward", "optimizer_step"],
        ...                       "first": [False] * 4, "duration_median_s": [1.0, 2.0, 3.0, 4.0]})
        >>> step_time(frame, 2).seconds
        16.0
    """

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


def _median_of(medians: pd.Series, phase: str) -> float | None:
    value = medians.get(phase)
    return None if value is None or is_null(value) else float(value)


def step_time(phases: pd.DataFrame, accumulate: int) -> StepTime:
    """The :class:`StepTime` of a phase table with ``accumulate`` micro-batches per update."""
    medians = steady_medians(phases)
    parts = ("data", "forward", "backward", "optimizer_step")
    return StepTime(accumulate, {phase: _median_of(medians, phase) for phase in parts})


def accumulation(record: Mapping[str, Any] | None, updates: pd.DataFrame | None) -> int:
    """Micro-batches per update: the ledger record's, else the largest counted, else 1."""
    if record is not None and not is_null(record.get("accumulate_grad_batches")):
        return int(record["accumulate_grad_batches"])
    if updates is not None and updates["accumulate_grad_batches"].notna().any():
        return int(updates["accumulate_grad_batches"].dropna().max())
    return 1


@dataclass(frozen=True)
class UpdateCount:
    """The updates of ``updates.parquet`` (rank 0), an update run again by a later attempt
    counted once: the values of K and of the replicas, the ``examples`` over all replicas
    (``None`` when one is null), the updates ``replayed`` and the examples with them.

    Example:
        >>> updates = pd.DataFrame({"rank": [0, 0, 0], "attempt": [1, 1, 2], "update": [1, 2, 2],
        ...     "accumulate_grad_batches": [2] * 3, "dp_replicas": [1] * 3,
        ...     "examples_all_ranks": [8, 8, 8]})
        >>> count_updates(updates)
        UpdateCount(updates=2, ks=[2], replicas=[1], examples=16, replayed=1, with_replays=24)
    """

    updates: int
    ks: list[int]
    replicas: list[int]
    examples: int | None
    replayed: int
    with_replays: int | None


def count_updates(updates: pd.DataFrame) -> UpdateCount:
    """The :class:`UpdateCount` of an updates table: a replayed update counts as the latest
    attempt ran it, the trajectory the final model followed."""
    rank0 = updates[updates["rank"] == updates["rank"].min()]
    order = [c for c in ("attempt", "update") if c in rank0.columns]
    latest = rank0.sort_values(order).drop_duplicates("update", keep="last")

    def total(examples: pd.Series) -> int | None:
        return None if examples.isna().any() else int(examples.sum())

    return UpdateCount(
        updates=len(latest),
        ks=sorted({int(k) for k in updates["accumulate_grad_batches"].dropna()}),
        replicas=sorted({int(r) for r in updates["dp_replicas"].dropna()}),
        examples=total(latest["examples_all_ranks"]),
        replayed=len(rank0) - len(latest),
        with_replays=total(rank0["examples_all_ranks"]),
    )


def campaign_variants(runs: pd.DataFrame | None, experiment: Any) -> pd.DataFrame:
    """The variants of ``experiment`` with planned updates in ledger runs (``None``: no
    ledger), each once in ledger order: ``variant`` (a run without one: its id),
    ``planned_updates`` and ``status``."""
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
    """Every variant priced at one run's speed, and the variants each package holds.

    ``per_update_s`` is the step (``step_s``) with validation and checkpoints at the run's rate
    (each ``(occurrences per update, seconds)``); ``variants`` holds, in priority order,
    ``variant``, ``status``, ``planned_updates``, ``hours``, ``device_hours``, ``packaged`` and
    ``cumulative_hours``; ``packages`` maps 3, 7 and 30 days to the variants that fit.

    Example:
        >>> phases = pd.DataFrame({"phase": ["optimizer_step"], "first": [False],
        ...                        "occurrences": [10], "duration_median_s": [1.0]})
        >>> variants = pd.DataFrame({"variant": ["a", "b"], "planned_updates": [3600, 36000],
        ...                          "status": ["completed", "diverged"]})
        >>> plan = campaign(phases, variants, 2.0, reserve=0.5)
        >>> plan.variants["hours"].tolist(), plan.packages
        ([2.0, 20.0], {3: ['a'], 7: ['a'], 30: ['a']})
    """

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
    """How often ``phase`` happened per update in this run, and its median duration."""
    median = _median_of(medians, phase)
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
    """Add a variant of ``hours`` to every 3/7/30-day package it still fits in (after the
    ones before it); a variant that diverged, failed or has an unknown status is never
    packaged. Returns whether it was packaged and the hours packaged so far."""
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
    and fill the 3, 7 and 30 day packages in priority order, ``reserve`` of each kept back; a
    variant that diverged, failed or has an unknown status is never packaged."""
    medians = steady_medians(phases)
    updates = _max(phases.loc[phases["phase"] == "optimizer_step", "occurrences"])
    done = int(updates) if updates is not None else 0
    validation = _rate(phases, medians, "validation", done)
    checkpoint = _rate(phases, medians, "checkpoint_save", done)
    per_update = step_s + validation[0] * validation[1] + checkpoint[0] * checkpoint[1]
    export = _median_of(medians, "export") or 0.0
    packages: dict[int, list[str]] = {3: [], 7: [], 30: []}
    rows, cumulative = [], 0.0
    for name, planned, status in variants.itertuples(index=False):
        hours = (int(planned) * per_update + export) / 3600.0
        packaged, cumulative = _package(packages, name, status, hours, cumulative, reserve)
        rows.append((name, status, int(planned), hours, hours * devices, packaged, cumulative))
    columns = ["variant", "status", "planned_updates", "hours", "device_hours", "packaged",
               "cumulative_hours"]  # fmt: skip
    table = pd.DataFrame(rows, columns=columns)
    return Campaign(step_s, per_update, validation, checkpoint, export, table, packages)


def standing(comparison: Comparison) -> pd.DataFrame:
    """Where the variants stand: the comparison's summary, best median first (none: last)."""
    return comparison.summary.sort_values("median", kind="stable", na_position="last")


def run_costs(
    phases: pd.DataFrame, examples: pd.DataFrame | None, accumulate: int
) -> dict[str, Any]:
    """One run's costs (only what was measured): ``peak_allocated_bytes`` and its
    ``peak_phase``, ``peak_reserved_bytes``, ``step_s``, and from BatchInspector's
    ``examples`` the ``truncated_fraction`` of training sequences and the mean
    ``loss_positions`` per example."""
    costs: dict[str, Any] = {}
    if phases.empty:
        return costs
    top = memory_peak(phases, ("allocated",))
    if top is not None:
        costs["peak_allocated_bytes"], costs["peak_phase"] = top.bytes, top.phase
    reserved = _max(phases["peak_reserved_bytes"])
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
    """Whether a variant answers the control's question, and why (plain bools, never numpy's)."""
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
    """Per variant, over its runs' :func:`run_costs` (one row per run, with a ``by`` column):
    ``runs_measured``, the largest peaks, the most frequent ``peak_phase``, the medians, and
    ``same_experiment`` (``None``: unknown) with ``why`` (docs/cli.md, cost per variant)."""
    columns = [by, *_SUMMARY]
    if per_run.empty:
        return pd.DataFrame(columns=columns)
    frame = per_run.assign(**{c: None for c in _MEASURED if c not in per_run})
    grouped = []
    for name, group in frame.groupby(by, sort=False):
        phase = group["peak_phase"].dropna()
        grouped.append(
            {
                by: name,
                "runs_measured": len(group),
                "peak_allocated_bytes": _max(group["peak_allocated_bytes"]),
                "peak_phase": phase.mode().iloc[0] if len(phase) else None,
                "peak_reserved_bytes": _max(group["peak_reserved_bytes"]),
                **{column: _median(group[column]) for column in _MEDIANS},
            }
        )
    result = pd.DataFrame(grouped)
    reference = (
        result[result[by] == control].iloc[0].to_dict() if control in set(result[by]) else None
    )
    verdicts = [_same_experiment(row, reference, by, control) for row in result.to_dict("records")]
    same = pd.Series([verdict[0] for verdict in verdicts], dtype=object)
    return result.assign(same_experiment=same, why=[verdict[1] for verdict in verdicts])[columns]


#: The columns of an estimate that name one configuration on one target.
TARGET_KEYS: Final = (
    "target", "precision", "micro_batch", "seq_len", "checkpointing", "strategy", "devices",
)  # fmt: skip


def checkpointing_name(value: object) -> str | None:
    """An estimate table's ``checkpointing`` value by its name (``off``, ``full``,
    ``selective``; the boolean of schema version 1 too); a value of no known mode as it is.

    Example:
        >>> [checkpointing_name(v) for v in (True, "selective", "later")]
        ['full', 'selective', 'later']
    """
    try:
        return checkpointing_mode(value)
    except ValueError:
        return str(value)


def on_target(estimate: pd.DataFrame) -> pd.DataFrame:
    """One row per target x configuration of an estimate table (``estimate.parquet``): the
    largest estimated reserved bytes per GPU over its phases and the phase that sets it,
    ``fits`` (every phase fits; ``None`` when a phase could not be estimated), the smallest
    ``headroom_bytes``, the training step-time band (``step_low_s``, ``step_high_s``) and
    ``status`` (``ok``, or the first other status with its ``reason``). ``checkpointing`` is
    named ``off``, ``full`` or ``selective`` (:func:`~lightning_pilot.schemas.checkpointing_mode`:
    an ``Estimate``'s own rows, and files with the boolean column of schema version 1, too).

    Example:
        >>> rows = pd.DataFrame({"target": ["L4-24GB"] * 2, "precision": ["bf16-mixed"] * 2,
        ...     "micro_batch": [8, 8], "seq_len": [512, 512], "checkpointing": [False] * 2,
        ...     "strategy": ["single"] * 2, "devices": [1, 1], "phase": ["forward", "backward"],
        ...     "status": ["ok", "ok"], "reason": [None, None],
        ...     "estimated_reserved_bytes": [3 << 30, 5 << 30], "fits": [True, True],
        ...     "headroom_bytes": [21 << 30, 19 << 30], "step_time_low_s": [None, 0.2],
        ...     "step_time_high_s": [None, 0.4]})
        >>> on_target(rows)[["checkpointing", "phase", "fits", "step_high_s"]].to_dict("records")
        [{'checkpointing': 'off', 'phase': 'backward', 'fits': True, 'step_high_s': 0.4}]
    """
    columns = [*TARGET_KEYS, "reserved_bytes", "phase", "fits", "headroom_bytes",
               "step_low_s", "step_high_s", "status", "reason"]  # fmt: skip
    rows = []
    named = estimate.assign(checkpointing=estimate["checkpointing"].map(checkpointing_name))
    for key, group in named.groupby(list(TARGET_KEYS), sort=False, dropna=False):
        ok = group[group["status"] == "ok"]
        bad = group[group["status"] != "ok"]
        reserved = ok["estimated_reserved_bytes"].dropna()
        top = ok.loc[[reserved.idxmax()]].iloc[0] if len(reserved) else None
        fits = None if len(bad) or ok["fits"].isna().any() else bool(ok["fits"].all())
        rows.append(
            [
                *key,
                None if top is None else int(top["estimated_reserved_bytes"]),
                None if top is None else top["phase"],
                fits,
                _min(ok["headroom_bytes"]),
                _max(ok["step_time_low_s"]),
                _max(ok["step_time_high_s"]),
                "ok" if bad.empty else str(bad.iloc[0]["status"]),
                None if bad.empty else bad.iloc[0]["reason"],
            ]
        )
    return pd.DataFrame(rows, columns=columns)


def target_campaign(
    variants: pd.DataFrame,
    step_low_s: float,
    step_high_s: float,
    *,
    devices: int,
    reserve: float,
    price_per_gpu_hour: float | None = None,
) -> tuple[pd.DataFrame, dict[int, list[str]]]:
    """Price the variants (:func:`campaign_variants`) at an estimated step-time band on
    ``devices`` GPUs each: per variant ``hours_low``/``hours_high``, ``gpu_hours_low``/``_high``
    and, with a price, ``cost_low``/``cost_high``; the 3, 7 and 30 day packages are filled at
    the slow end of the band (``reserve`` kept back). Training updates only: validation,
    checkpoints and export are not in the estimate.

    Example:
        >>> variants = pd.DataFrame({"variant": ["a"], "planned_updates": [36000],
        ...                          "status": ["completed"]})
        >>> table, packages = target_campaign(variants, 0.1, 0.2, devices=8, reserve=0.25,
        ...                                   price_per_gpu_hour=2.0)
        >>> table[["hours_high", "gpu_hours_high", "cost_high"]].to_dict("records")
        [{'hours_high': 2.0, 'gpu_hours_high': 16.0, 'cost_high': 32.0}]
        >>> packages
        {3: ['a'], 7: ['a'], 30: ['a']}
    """
    packages: dict[int, list[str]] = {3: [], 7: [], 30: []}
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


#: The memory categories stacked in ``report.plots.plot_phase_memory``: column, legend label,
#: and the kinds of ``placement.parquet`` (and phase-table columns) each one adds up.
CATEGORIES: Final = (
    ("weights", "weights (parameters and buffers)", ("param", "buffer")),
    ("gradients", "gradients", ("grad",)),
    ("optimizer_state", "optimizer state", ("optimizer_state",)),
)
OTHER: Final = ("activations_other", "activations and other tensors")
_STATE_COLUMNS: Final = {
    "param": "param_bytes",
    "buffer": "buffer_bytes",
    "grad": "grad_bytes",
    "optimizer_state": "optimizer_state_bytes",
}

# -- the data behind the plots (report.plots draws them) -----------------------------------


def drawable_points(points: pd.DataFrame, log: bool) -> pd.DataFrame:
    """The points of a curve that can be drawn: finite values (> 0 on a log axis). An empty
    frame stays a frame with its columns (an empty mask of objects would select columns)."""
    keep = [
        not is_null(v) and math.isfinite(float(v)) and (float(v) > 0 or not log)
        for v in points["value"]
    ]
    return points.loc[pd.Series(keep, index=points.index, dtype=bool)]


def _step(value: Any) -> int | None:
    return None if is_null(value) else int(value)


def curve_marks(runs: pd.DataFrame, curves: pd.DataFrame) -> pd.DataFrame:
    """Where each run of ``runs`` (``Ledger.runs()`` rows) is marked on its loss curve
    (``Ledger.curves()``), one row per mark: ``run_id``, ``variant``, ``seed``, ``kind``,
    ``step``, ``value`` and ``label``.

    ``kind`` is ``diverged`` at ``stop_step`` (the update where the divergence rule fired),
    plus ``stopped`` at the last update when training went on after it (``action="record"``);
    ``failed`` or ``oom`` at ``stop_step``; ``stopped`` (EarlyStopping, a stop request) at
    ``stop_step``; ``interrupted`` at the last update recorded. A run's last update is
    ``updates_done``, else its last training-loss point. ``value`` is the last finite
    training loss at or before ``step`` (NaN when there is none: a loss that was NaN from the
    start); a completed or running run has no mark.

    Example:
        >>> runs = pd.DataFrame({"run_id": ["a"], "variant": ["hot"], "seed": [0],
        ...     "status": ["diverged"], "stop_cause": ["loss_blowup"], "stop_step": [4],
        ...     "updates_done": [8]})
        >>> curves = pd.DataFrame({"run_id": ["a"] * 3, "curve": ["train_loss"] * 3,
        ...     "step": [3, 4, 8], "value": [2.0, float("nan"), 9.0]})
        >>> curve_marks(runs, curves)[["kind", "step", "value"]]
               kind  step  value
        0  diverged     4    2.0
        1   stopped     8    9.0
    """
    columns = ["run_id", "variant", "seed", "kind", "step", "value", "label"]
    train = curves[curves["curve"] == "train_loss"] if len(curves) else curves
    rows: list[dict[str, Any]] = []
    for run in runs.to_dict("records"):
        status = run.get("status")
        if is_null(status) or status not in (*FAILED_STATUSES, "stopped", "interrupted"):
            continue
        own = train[train["run_id"] == run["run_id"]].sort_values("step", kind="stable")
        steps = [int(s) for s in own["step"].dropna()]
        last = _step(run.get("updates_done"))
        if last is None and steps:
            last = steps[-1]
        stop = _step(run.get("stop_step"))
        at = stop if stop is not None else last
        cause = "" if is_null(run.get("stop_cause")) else f" ({as_text(run['stop_cause'])})"
        where = "at an unknown update" if at is None else f"at update {at}"
        marks = [(str(status), at, f"{status}{cause} {where}")]
        if status == "diverged" and at is not None and last is not None and last > at:
            marks.append(("stopped", last, f"stopped at update {last}, after the divergence"))
        for kind, step, label in marks:
            finite = drawable_points(own, log=False)
            before = finite if step is None else finite[finite["step"] <= step]
            value = float(before["value"].iloc[-1]) if len(before) else math.nan
            rows.append(
                {
                    "run_id": run["run_id"],
                    "variant": run.get("variant"),
                    "seed": run.get("seed"),
                    "kind": kind,
                    "step": step,
                    "value": value,
                    "label": label,
                }
            )
    frame = pd.DataFrame(rows, columns=columns)
    frame["step"] = frame["step"].astype("Int64")
    frame["value"] = frame["value"].astype("float64")
    return frame


def _on_device_share(
    placement: pd.DataFrame | None, device: Any, rank: Any, attempt: Any
) -> tuple[dict[str, float], list[str]]:
    """The fraction of each state kind that sits on ``device`` (``placement.parquet`` at the
    fit's end, else after the first update), and a note per kind held elsewhere."""
    if placement is None or placement.empty or is_null(device):
        return {}, []
    rows = placement
    for column, value in (("rank", rank), ("attempt", attempt)):
        if column in rows.columns and not is_null(value):
            rows = rows[rows[column] == value]
    if "moment" in rows.columns and len(rows):
        moment = "fit_end" if (rows["moment"] == "fit_end").any() else rows["moment"].iloc[-1]
        rows = rows[rows["moment"] == moment]
    measured = str(device).split(" ")[0]
    shares: dict[str, float] = {}
    notes = []
    for kind, group in rows.groupby("kind", sort=True):
        total = float(group["bytes"].sum())
        here = float(group.loc[group["device"].astype(str) == measured, "bytes"].sum())
        if total > 0:
            shares[str(kind)] = here / total
        if total > here:
            elsewhere = ", ".join(sorted({str(d) for d in group["device"] if str(d) != measured}))
            notes.append(f"{format_bytes(total - here)} of {kind} on {elsewhere}, not in this peak")
    return shares, notes


def memory_stack(phases: pd.DataFrame, placement: pd.DataFrame | None = None) -> pd.DataFrame:
    """Each phase's highest peak allocated memory, split by category, one row per phase in
    campaign order: ``phase``, ``peak_bytes``, ``weights``, ``gradients``,
    ``optimizer_state``, ``activations_other`` (float bytes), ``measured`` and ``note``.

    The row with the highest ``peak_allocated_bytes`` of the phase (over occurrences,
    attempts and ranks) is split: the training state it held (``param_bytes`` +
    ``buffer_bytes``, ``grad_bytes``, ``optimizer_state_bytes``), counted only for the share
    that ``placement`` (``placement.parquet``) puts on the measured device, and the rest of
    the peak as activations and other tensors, so the categories sum to the peak. The state is
    read at the phase's end: when it is larger than the peak, ``activations_other`` is 0 and
    the note says by how much. A phase whose peak was not measured has null values (NaN),
    never 0, and ``measured`` false.
    """
    columns = ["phase", "peak_bytes", *(c for c, _, _ in CATEGORIES), OTHER[0], "measured"]
    rows: list[dict[str, Any]] = []
    order = sorted(dict.fromkeys(phases["phase"]), key=lambda p: PHASE_ORDER.get(p, 99))
    for phase in order:
        own = phases[phases["phase"] == phase]
        peaks = pd.to_numeric(own["peak_allocated_bytes"], errors="coerce").astype("float64")
        row: dict[str, Any] = dict.fromkeys(columns[1:-1], math.nan)
        row |= {"phase": phase, "measured": False, "note": "not measured"}
        if peaks.notna().any():
            best = own.loc[peaks.idxmax()]
            peak = float(peaks.max())
            shares, notes = _on_device_share(
                placement, best.get("device"), best.get("rank"), best.get("attempt")
            )
            state = 0.0
            for column, _, kinds in CATEGORIES:
                total = 0.0
                for kind in kinds:
                    value = best.get(_STATE_COLUMNS[kind])
                    if not is_null(value):
                        total += float(value) * shares.get(kind, 1.0)
                row[column] = total
                state += total
            if state > peak:
                notes.append(
                    f"the state at the phase end ({format_bytes(state)}) exceeds this peak by"
                    f" {format_bytes(state - peak)}"
                )
            row |= {
                "peak_bytes": peak,
                OTHER[0]: max(0.0, peak - state),
                "measured": True,
                "note": "; ".join(notes) or None,
            }
        rows.append(row)
    frame = pd.DataFrame(rows, columns=[*columns, "note"])
    frame["measured"] = frame["measured"].astype(bool)
    return frame


def phase_peaks(table: pd.DataFrame) -> pd.Series:
    """The highest ``peak_allocated_bytes`` of each phase of a phase table, as floats in the
    order the phases first appear; phases without a measurement left out.

    Example:
        >>> table = pd.DataFrame(
        ...     {"phase": ["forward", "backward"], "peak_allocated_bytes": [2**20, None]}
        ... )
        >>> phase_peaks(table)
        phase
        forward    1048576.0
        Name: peak_allocated_bytes, dtype: float64
    """
    measured = table.dropna(subset=["peak_allocated_bytes"])
    order = list(dict.fromkeys(measured["phase"]))
    peaks: pd.Series = (
        measured.groupby("phase", sort=False)["peak_allocated_bytes"].max().astype(float)
    )
    return peaks.reindex(order)


def comparison_points(comparison: Comparison, control: str | None = None) -> pd.DataFrame:
    """Every run of a comparison (``Ledger.compare``) as a point to draw, in the groups'
    order: ``group``, ``x`` (the group's position, spread a little by seed), ``seed``,
    ``status``, ``run_id``, ``value`` (the run's metric as read), ``y`` (what is drawn:
    the value of a measured run, NaN otherwise), ``place`` and ``control``.

    ``place`` is ``measured``; ``worst`` for a run counted as the worst value (diverged, out
    of memory, failed, or a non-finite metric), drawn in a strip at the top; or ``no value``
    for a run not in the statistics (still running, interrupted, or the metric never logged),
    drawn in a strip at the bottom. ``control`` marks the runs of ``control`` (default: the
    comparison's own).

    Example:
        >>> from lightning_pilot.core.compare import compare_runs
        >>> runs = pd.DataFrame({"variant": ["a", "a", "b"], "seed": [0, 1, 0],
        ...     "status": ["completed", "completed", "diverged"], "value": [1.0, 1.2, 9e9]})
        >>> points = comparison_points(compare_runs(runs, control="a"))
        >>> points[["group", "seed", "y", "place", "control"]]
          group  seed    y     place  control
        0     a     0  1.0  measured     True
        1     a     1  1.2  measured     True
        2     b     0  NaN     worst    False
    """
    by = str(comparison.summary.columns[0])
    control = control if control is not None else comparison.control
    groups = list(comparison.summary[by])
    runs = comparison.runs
    rows = []
    for index, group in enumerate(groups):
        own = runs[runs[by] == group]
        width = 0.5 / max(1, len(own))
        for i, run in enumerate(own.to_dict("records")):
            score = run.get("score")
            value = run.get("value")
            if is_null(score):
                place, y = "no value", math.nan
            elif math.isinf(float(score)):
                place, y = "worst", math.nan
            else:
                place, y = "measured", float(score)
            rows.append(
                {
                    "group": group,
                    "x": index + (i - (len(own) - 1) / 2) * width,
                    "seed": run.get("seed"),
                    "status": run.get("status"),
                    "run_id": run.get("run_id"),
                    "value": math.nan if is_null(value) else float(value),
                    "y": y,
                    "place": place,
                    "control": control is not None and group == control,
                }
            )
    columns = ["group", "x", "seed", "status", "run_id", "value", "y", "place", "control"]
    frame = pd.DataFrame(rows, columns=columns)
    frame["control"] = frame["control"].astype(bool)
    return frame
