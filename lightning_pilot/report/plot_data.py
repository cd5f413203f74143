"""The data behind the plots (:mod:`lightning_pilot.report.plots` only draws it), one pure
function per plot over what the readers return; what was not measured stays NaN, never 0.

Example:
    >>> phases = pd.DataFrame({
    ...     "phase": ["forward", "data"], "device": ["cpu", "cpu"], "rank": [0, 0],
    ...     "attempt": [1, 1], "peak_allocated_bytes": [10_000, None],
    ...     "param_bytes": [2_000, 2_000], "buffer_bytes": [0, 0], "grad_bytes": [2_000, 2_000],
    ...     "optimizer_state_bytes": [4_000, 4_000]})
    >>> memory_stack(phases)[["phase", "weights", "activations_other", "peak_bytes"]]
         phase  weights  activations_other  peak_bytes
    0     data      NaN                NaN         NaN
    1  forward   2000.0             2000.0     10000.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

import pandas as pd

from lightning_pilot.core.compare import FAILED_STATUSES, Comparison
from lightning_pilot.report.units import as_text, format_bytes, is_null
from lightning_pilot.vocabulary import CATEGORY_COLUMNS, phase_rank

#: The memory categories stacked in ``report.plots.plot_phase_memory``: column, legend label,
#: and the categories (:data:`lightning_pilot.vocabulary.CATEGORIES`) each one adds up.
CATEGORIES: Final = (
    ("weights", "weights (parameters and buffers)", ("param", "buffer")),
    ("gradients", "gradients", ("grad",)),
    ("optimizer_state", "optimizer state", ("optimizer_state",)),
)
OTHER: Final = ("activations_other", "activations and other tensors")


def drawable_points(points: pd.DataFrame, log: bool) -> pd.DataFrame:
    """The points of a curve that can be drawn: finite values (> 0 on a log axis)."""
    keep = [
        not is_null(v) and math.isfinite(float(v)) and (float(v) > 0 or not log)
        for v in points["value"]
    ]
    return points.loc[pd.Series(keep, index=points.index, dtype=bool)]


def curve_marks(runs: pd.DataFrame, curves: pd.DataFrame) -> pd.DataFrame:
    """Where each run of ``runs`` (``Ledger.runs()`` rows) is marked on its loss curve
    (``Ledger.curves()``), one row per mark: ``run_id``, ``variant``, ``seed``, ``kind``,
    ``step``, ``value`` and ``label``.

    ``kind`` is the run's status (``diverged``, ``failed``, ``oom``, ``stopped``) at
    ``stop_step``, ``interrupted`` at the last update, plus ``stopped`` at the last update when
    training went on after a divergence. A run's last update is ``updates_done``, else its last
    training-loss point; ``value`` is the last finite training loss at or before ``step`` (else
    NaN). A completed or running run has no mark.

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
    rows: list[tuple[Any, ...]] = []
    for run in runs.to_dict("records"):
        status = run.get("status")
        if is_null(status) or status not in (*FAILED_STATUSES, "stopped", "interrupted"):
            continue
        own = train[train["run_id"] == run["run_id"]].sort_values("step", kind="stable")
        steps = [int(s) for s in own["step"].dropna()]
        done: Any = run.get("updates_done")
        stop: Any = run.get("stop_step")
        last = int(done) if not is_null(done) else (steps[-1] if steps else None)
        at = int(stop) if not is_null(stop) else last
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
                (run["run_id"], run.get("variant"), run.get("seed"), kind, step, value, label)
            )
    frame = pd.DataFrame(rows, columns=columns)
    frame["step"] = frame["step"].astype("Int64")
    frame["value"] = frame["value"].astype("float64")
    return frame


@dataclass(frozen=True)
class RunCurve:
    """One run of a loss plot: its ``variant`` as text, its ``seed``, the training-loss and
    validation points that can be drawn (``train`` in update order, ``val``), and ``recorded``:
    whether the ledger holds any training-loss point of the run."""

    run_id: Any
    variant: str
    seed: Any
    train: pd.DataFrame
    val: pd.DataFrame
    recorded: bool


@dataclass(frozen=True)
class LossCurves:
    """The data of a loss plot: one :class:`RunCurve` per run, ``log`` (every finite training
    loss is positive: a logarithmic axis), ``validated`` (some run has a validation point), the
    ``marks`` (:func:`curve_marks`) and the number of runs per status (``statuses``)."""

    runs: list[RunCurve]
    log: bool
    validated: bool
    marks: pd.DataFrame
    statuses: pd.Series


def loss_curves(curves: pd.DataFrame, runs: pd.DataFrame, val_metric: str) -> LossCurves:
    """The :class:`LossCurves` of ``runs`` (``Ledger.runs()`` rows) from their curves
    (``Ledger.curves()``), with ``val_metric`` as the validation points."""
    train = curves[curves["curve"] == "train_loss"] if len(curves) else curves
    values = train["value"].astype("float64") if len(train) else pd.Series(dtype="float64")
    finite = values[values.map(math.isfinite)]
    log = bool(len(finite)) and bool((finite > 0).all())
    per_run = []
    for variant, run in zip(runs["variant"], runs.to_dict("records"), strict=True):
        own = curves[curves["run_id"] == run["run_id"]] if len(curves) else curves
        line = own[own["curve"] == "train_loss"].sort_values("step", kind="stable")
        val = own[(own["curve"] == "val") & (own["name"] == val_metric)]
        train, drawn = drawable_points(line, log), drawable_points(val, log)
        per_run.append(
            RunCurve(run["run_id"], as_text(variant), run.get("seed"), train, drawn, not line.empty)
        )
    validated = bool(len(curves)) and bool(
        ((curves["curve"] == "val") & (curves["name"] == val_metric)).any()
    )
    statuses = pd.Series([as_text(s) for s in runs["status"]], dtype=object)
    return LossCurves(
        per_run, log, validated, curve_marks(runs, curves), statuses.value_counts(sort=False)
    )


def _on_device_share(
    placement: pd.DataFrame | None, device: Any, rank: Any, attempt: Any
) -> tuple[dict[str, float], list[str]]:
    """The fraction of each state kind on ``device`` (``placement.parquet`` at the fit's end,
    else after the first update), and a note per kind held elsewhere."""
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
    """Each phase's highest peak allocated memory split by category, one row per phase in
    campaign order: ``phase``, ``peak_bytes``, the :data:`CATEGORIES` (the training state on
    the measured device, by ``placement``), ``activations_other`` (the rest, at least 0),
    ``measured`` and ``note``; NaN where the peak was not measured."""
    columns = ["phase", "peak_bytes", *(c for c, _, _ in CATEGORIES), OTHER[0], "measured"]
    rows: list[dict[str, Any]] = []
    order = sorted(dict.fromkeys(phases["phase"]), key=phase_rank)
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
            state = 0.0  # running sums, added in order (sum() compensates from Python 3.12)
            for column, _, kinds in CATEGORIES:
                total = 0.0
                for kind in kinds:
                    value = best.get(CATEGORY_COLUMNS[kind])
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


def comparison_points(comparison: Comparison, control: str | None = None) -> pd.DataFrame:
    """Every run of a comparison (``Ledger.compare``) as a point, in the groups' order:
    ``group``, ``x`` (the group's position, spread by seed), ``seed``, ``status``, ``run_id``,
    ``value`` (as read), ``y`` (the value of a measured run, else NaN), ``place`` and
    ``control`` (the runs of ``control``, default the comparison's).

    ``place`` is ``measured``, ``worst`` (counted as the worst value: diverged, out of memory,
    failed, or a non-finite metric) or ``no value`` (not in the statistics).

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
    rows = []
    for index, group in enumerate(groups):
        own = comparison.runs[comparison.runs[by] == group]
        width = 0.5 / max(1, len(own))
        for i, run in enumerate(own.to_dict("records")):
            score, value = run.get("score"), run.get("value")
            if is_null(score):
                place, y = "no value", math.nan
            elif math.isinf(float(score)):
                place, y = "worst", math.nan
            else:
                place, y = "measured", float(score)
            x = index + (i - (len(own) - 1) / 2) * width
            value = math.nan if is_null(value) else float(value)
            mark = control is not None and group == control
            about = [run.get(key) for key in ("seed", "status", "run_id")]
            rows.append((group, x, *about, value, y, place, mark))
    columns = ["group", "x", "seed", "status", "run_id", "value", "y", "place", "control"]
    frame = pd.DataFrame(rows, columns=columns)
    frame["control"] = frame["control"].astype(bool)
    return frame


@dataclass(frozen=True)
class ComparisonPlot:
    """The data of a comparison plot: the column the runs are grouped ``by``, the ``metric``
    and its ``mode``, the ``control`` marked, every run's point (:func:`comparison_points`)
    and each group's median (``medians``, indexed by group)."""

    by: str
    metric: str
    mode: str
    control: str | None
    points: pd.DataFrame
    medians: pd.Series


def comparison_plot(comparison: Comparison, control: str | None = None) -> ComparisonPlot:
    """The :class:`ComparisonPlot` of a comparison (``Ledger.compare``), ``control`` marked
    (default: the comparison's own)."""
    by = str(comparison.summary.columns[0])
    return ComparisonPlot(
        by=by,
        metric=comparison.metric,
        mode=comparison.mode,
        control=control if control is not None else comparison.control,
        points=comparison_points(comparison, control),
        medians=comparison.summary.set_index(by)["median"],
    )
