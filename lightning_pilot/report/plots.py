"""PNG plots of a pilot folder (docs/plots.md): the loss curves of every run with where each
diverged, stopped or failed; per-phase peak memory stacked by category; the variant comparison
with every seed's point and the control marked.

The data behind each plot comes from a pure function tested on its own (:func:`curve_marks`,
:func:`memory_stack`, :func:`comparison_points`); the drawing functions only lay it out.
matplotlib is optional (extra ``lightning-pilot[plots]``), imported only to draw, through the
Agg canvas directly: no global backend is switched and no window opens. Nothing here imports
torch or Lightning.

Example:
    >>> import pandas as pd
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

import io
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pandas as pd

from lightning_pilot import storage
from lightning_pilot.core.compare import FAILED_STATUSES, Comparison
from lightning_pilot.report.analysis import PHASE_ORDER
from lightning_pilot.report.units import as_text, format_bytes, is_null, terminal_safe

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: The message of the :class:`ModuleNotFoundError` raised when matplotlib is missing (what the
#: demo prints and ``lightning-pilot plot`` exits with).
MATPLOTLIB_MISSING: Final = "plots skipped: matplotlib not installed (pip install matplotlib)"
#: The files ``lightning-pilot plot`` writes next to a run's choice sheet, and what each shows.
LOSS_CURVES: Final = "loss_curves.png"
PHASE_MEMORY: Final = "phase_memory.png"
COMPARISON: Final = "comparison.png"
PLOT_FILES: Final = {
    LOSS_CURVES: "training loss per run; where runs diverged, stopped or failed",
    PHASE_MEMORY: "peak memory per phase, stacked by category",
    COMPARISON: "the variant comparison: every seed's value, the control marked",
}
#: The memory categories stacked in :func:`plot_phase_memory`: column, legend label, and the
#: kinds of ``placement.parquet`` (and phase-table columns) each one adds up.
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
#: How each mark of :func:`curve_marks` is drawn: marker, colour, legend text.
_MARK_STYLE: Final = {
    "diverged": ("X", "red", "diverged here (the divergence rule fired)"),
    "stopped": ("s", "black", "training stopped here"),
    "failed": ("X", "black", "failed here (exception)"),
    "oom": ("X", "darkorange", "out of memory here"),
    "interrupted": ("s", "grey", "interrupted (last record)"),
}
_ANNOTATED: Final = 8  # marks named one by one in a loss plot's legend
_TEXT: Final = 60  # the longest label from a file drawn on a plot


def require_matplotlib() -> None:
    """Import matplotlib, or raise :class:`ModuleNotFoundError` with :data:`MATPLOTLIB_MISSING`."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ModuleNotFoundError(MATPLOTLIB_MISSING) from error


def _label(value: Any, limit: int = _TEXT) -> str:
    """A value from a file as plot text: safe, short, and never read as mathtext (``$``)."""
    return terminal_safe(as_text(value), limit=limit).replace("$", r"\$")


def _step(value: Any) -> int | None:
    return None if is_null(value) else int(value)


# -- the data behind the plots (pure) -------------------------------------------------------


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
            finite = _drawable(own, log=False)
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


# -- drawing --------------------------------------------------------------------------------


def _figure(width: float, height: float) -> Figure:
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    return figure


def _png(figure: Figure) -> bytes:
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _publish(data: bytes, path: storage.PathLike) -> storage.Location:
    # Drawn again from the tables on every run: replaced atomically, never half-written (on an
    # object store, one whole-object write).
    return storage.publish_file(path, lambda handle: handle.write(data), replace=True)


def _byte_axis(axes: Axes, largest: float) -> float:
    """Label the y axis in the unit :func:`format_bytes` picks for ``largest``; return the
    divisor to plot values in that unit."""
    unit = format_bytes(largest).split(" ")[-1] if largest > 0 else "B"
    divisor = float(1024 ** ("B", "KiB", "MiB", "GiB", "TiB").index(unit))
    axes.set_ylabel(f"peak allocated memory ({unit})")
    return divisor


def _counts(statuses: Iterable[Any]) -> str:
    counts = pd.Series([as_text(s) for s in statuses], dtype=object).value_counts(sort=False)
    return ", ".join(f"{n} {status}" for status, n in counts.items())


def _drawable(points: pd.DataFrame, log: bool) -> pd.DataFrame:
    """The points of a curve that can be drawn: finite values (> 0 on a log axis). An empty
    frame stays a frame with its columns (an empty mask of objects would select columns)."""
    keep = [
        not is_null(v) and math.isfinite(float(v)) and (float(v) > 0 or not log)
        for v in points["value"]
    ]
    return points.loc[pd.Series(keep, index=points.index, dtype=bool)]


def _loss_figure(
    curves: pd.DataFrame, runs: pd.DataFrame, *, title: str, val_metric: str
) -> Figure:
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    figure = _figure(12.0, 5.4)
    axes = figure.add_subplot()
    train = curves[curves["curve"] == "train_loss"] if len(curves) else curves
    values = train["value"].astype("float64") if len(train) else pd.Series(dtype="float64")
    finite = values[values.map(math.isfinite)]
    log = bool(len(finite)) and bool((finite > 0).all())
    variants = [as_text(v) for v in runs["variant"]]
    colors = {v: f"C{i % 10}" for i, v in enumerate(dict.fromkeys(variants))}
    handles: list[Any] = []
    no_points: list[str] = []
    named: set[str] = set()
    for variant, run in zip(variants, runs.to_dict("records"), strict=True):
        color = colors[variant]
        own = curves[curves["run_id"] == run["run_id"]] if len(curves) else curves
        line = own[own["curve"] == "train_loss"].sort_values("step", kind="stable")
        shown = _drawable(line, log)
        if line.empty:
            no_points.append(f"{_label(variant, 20)} s{_label(run.get('seed'))}")
        drawn = axes.plot(
            shown["step"].astype(float), shown["value"], color=color, linewidth=1.0, alpha=0.8
        )
        if variant not in named:
            named.add(variant)
            n = variants.count(variant)
            drawn[0].set_label(f"{_label(variant)} ({n} run{'s' if n > 1 else ''})")
            handles.append(drawn[0])
        val = own[(own["curve"] == "val") & (own["name"] == val_metric)]
        val = _drawable(val, log)
        axes.plot(
            val["step"].astype(float), val["value"], "o", color=color, markersize=5,
            markeredgecolor="black", markeredgewidth=0.5,
        )  # fmt: skip
    if len(curves) and ((curves["curve"] == "val") & (curves["name"] == val_metric)).any():
        handles.append(
            Line2D([], [], marker="o", linestyle="", color="grey", markeredgecolor="black",
                   label=f"{_label(val_metric)} (validation)")
        )  # fmt: skip
    marks = curve_marks(runs, curves)
    for i, mark in enumerate(marks.to_dict("records")):
        marker, color, text = _MARK_STYLE.get(mark["kind"], ("X", "purple", mark["kind"]))
        if i < _ANNOTATED:  # each mark named in the legend; past that, one entry per kind
            text = (
                f"{_label(mark['variant'], 20)} s{_label(mark['seed'], 8)}: {_label(mark['label'])}"
            )
        elif mark["kind"] not in set(marks["kind"].iloc[_ANNOTATED:i]):
            text = f"{text} (and others)"
        else:
            text = ""
        if text:
            handles.append(
                Line2D([], [], marker=marker, linestyle="", color=color, markeredgecolor="black",
                       markersize=9, label=text)
            )  # fmt: skip
        if is_null(mark["step"]):
            continue
        y = mark["value"]
        drawable = math.isfinite(y) and (y > 0 or not log)
        # A run with no finite loss before the mark: drawn at the bottom edge of the axes.
        transform = axes.transData if drawable else axes.get_xaxis_transform()
        axes.plot(
            [mark["step"]], [y if drawable else 0.03], marker, color=color, markersize=11,
            markeredgecolor="black", transform=transform, zorder=5,
        )  # fmt: skip
    if log:
        axes.set_yscale("log")
    axes.set_xlabel("optimizer update (step)")
    axes.set_ylabel(f"training loss{' (log scale)' if log else ''}")
    counts = _counts(runs["status"])
    missing = f"; no loss points: {', '.join(no_points[:4])}" if no_points else ""
    axes.set_title(f"{title}\n{len(runs)} run(s): {counts}{missing}", fontsize="medium")
    axes.grid(True, which="both", alpha=0.3)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    if handles:
        axes.legend(handles=handles, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    return figure


def plot_loss_curves(
    curves: pd.DataFrame,
    runs: pd.DataFrame,
    path: str | os.PathLike[str],
    *,
    title: str = "training loss per run",
    val_metric: str = "val_loss",
) -> Path:
    """Draw the training loss of each of ``runs`` (``Ledger.runs()`` rows; their
    ``Ledger.curves()``), one colour per variant, the ``val_metric`` points, and the marks of
    :func:`curve_marks` (diverged, stopped, failed), into the PNG file ``path``; return it.
    The y axis is logarithmic when every loss is positive, so a blown-up run stays readable;
    non-finite losses cannot be drawn (the mark then sits on the last finite one)."""
    figure = _loss_figure(curves, runs, title=title, val_metric=val_metric)
    _publish(_png(figure), path)
    return Path(path)


def _memory_figure(stack: pd.DataFrame, *, title: str) -> Figure:
    figure = _figure(9.0, 5.0)
    axes = figure.add_subplot()
    measured = stack[stack["measured"]]
    largest = float(measured["peak_bytes"].max()) if len(measured) else 0.0
    divisor = _byte_axis(axes, largest)
    x = list(range(len(stack)))
    bottom = [0.0] * len(stack)
    layers = [*((c, label) for c, label, _ in CATEGORIES), OTHER]
    for i, (column, label) in enumerate(layers):
        heights = [0.0 if math.isnan(v) else v / divisor for v in stack[column]]
        axes.bar(x, heights, bottom=bottom, color=f"C{i}", label=label, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    top = largest / divisor if largest > 0 else 1.0
    for position, row in zip(x, stack.to_dict("records"), strict=True):
        if row["measured"]:
            axes.annotate(
                format_bytes(row["peak_bytes"]), (position, row["peak_bytes"] / divisor),
                textcoords="offset points", xytext=(0, 3), ha="center", fontsize="small",
            )  # fmt: skip
        else:
            # No bar: a phase without a measurement is never drawn as 0.
            axes.text(
                position, 0.02 * top, "not measured", rotation=90, ha="center", va="bottom",
                color="grey", fontsize="small",
            )  # fmt: skip
    axes.set_xticks(x, [_label(p, 24) for p in stack["phase"]])
    for tick in axes.get_xticklabels():
        tick.set_rotation(30)
        tick.set_horizontalalignment("right")
    axes.set_ylim(0, top * 1.15)
    axes.set_xlabel("phase (highest peak of each)")
    notes = [f"{_label(r['phase'], 24)}: {_label(r['note'], 90)}" for r in
             measured.to_dict("records") if not is_null(r["note"])]  # fmt: skip
    subtitle = "; ".join(notes[:2]) + (f"; {len(notes) - 2} more" if len(notes) > 2 else "")
    axes.set_title(f"{title}\n{subtitle}" if subtitle else title, fontsize="medium")
    axes.legend(fontsize="small")
    axes.grid(True, axis="y", alpha=0.3)
    return figure


def plot_phase_memory(
    table: pd.DataFrame,
    path: str | os.PathLike[str],
    *,
    title: str = "peak allocated memory per phase",
    placement: pd.DataFrame | None = None,
) -> Path:
    """Draw each phase's highest peak allocated memory of a phase table, stacked by category
    (:func:`memory_stack`; ``placement`` is the run's ``placement.parquet``, ``None`` when
    absent), into the PNG file ``path`` and return it. The y axis is in the binary unit that
    fits the largest peak; a phase whose memory was not measured gets no bar, only the words
    "not measured"."""
    figure = _memory_figure(memory_stack(table, placement), title=title)
    _publish(_png(figure), path)
    return Path(path)


def _comparison_figure(comparison: Comparison, *, control: str | None, title: str) -> Figure:
    from matplotlib.lines import Line2D

    figure = _figure(12.0, 5.4)
    axes = figure.add_subplot()
    points = comparison_points(comparison, control)
    by = str(comparison.summary.columns[0])
    groups = list(comparison.summary[by])
    measured = points[points["place"] == "measured"]
    low, high = (measured["y"].min(), measured["y"].max()) if len(measured) else (0.0, 1.0)
    span = (high - low) or abs(high) or 1.0
    # Room above and below the measured points for the strips of the worst and of no value.
    axes.set_ylim(low - 0.3 * span, high + 0.3 * span)
    handles: list[Any] = [
        Line2D([], [], marker="o", linestyle="", color="C0", markeredgecolor="black",
               label="one run (s = seed)"),
        Line2D([], [], color="black", linewidth=2, label="median over the group's runs"),
    ]  # fmt: skip
    for index, group in enumerate(groups):
        own = points[points["group"] == group]
        color = "C1" if own["control"].any() else "C0"
        if own["control"].any():
            axes.axvspan(index - 0.4, index + 0.4, color="C1", alpha=0.12, zorder=0)
        mine = own[own["place"] == "measured"]
        axes.plot(
            mine["x"], mine["y"], "o", color=color, markeredgecolor="black", markersize=7,
            zorder=3,
        )  # fmt: skip
        median = comparison.summary.loc[comparison.summary[by] == group, "median"].iloc[0]
        if not is_null(median) and math.isfinite(median):
            axes.hlines(median, index - 0.3, index + 0.3, color="black", linewidth=2, zorder=4)
        elif not is_null(median):  # the median run diverged or failed: the worst value
            axes.text(
                index, 0.89, "median: worst", ha="center", va="top", fontsize="small",
                transform=axes.get_xaxis_transform(),
            )  # fmt: skip
        for place, y, marker in (("worst", 0.95, "X"), ("no value", 0.05, "o")):
            part = own[own["place"] == place]
            axes.plot(
                part["x"], [y] * len(part), marker, color="red" if place == "worst" else "none",
                markeredgecolor="black", markersize=9, transform=axes.get_xaxis_transform(),
                zorder=3,
            )  # fmt: skip
        for row in own.to_dict("records"):
            y, transform = row["y"], axes.transData
            if row["place"] != "measured":
                y, transform = (
                    (0.95 if row["place"] == "worst" else 0.05),
                    axes.get_xaxis_transform(),
                )
            axes.annotate(
                f"s{_label(row['seed'], 8)}", (row["x"], y), xycoords=transform,
                textcoords="offset points", xytext=(5, 3), fontsize="x-small",
            )  # fmt: skip
    for y, place in ((0.91, "worst"), (0.09, "no value")):
        if (points["place"] == place).any():
            band = (y, 1.0) if place == "worst" else (0.0, y)
            axes.fill_between(
                [0, 1], *band, color="grey", alpha=0.12, linewidth=0, transform=axes.transAxes
            )
    if (points["place"] == "worst").any():
        handles.append(
            Line2D([], [], marker="X", linestyle="", color="red", markeredgecolor="black",
                   markersize=9, label="diverged or failed: counted as the worst value")
        )  # fmt: skip
    if (points["place"] == "no value").any():
        handles.append(
            Line2D([], [], marker="o", linestyle="", color="none", markeredgecolor="black",
                   label="no value (running, interrupted, or metric not logged)")
        )  # fmt: skip
    control_name = control if control is not None else comparison.control
    if points["control"].any():
        handles.append(
            Line2D([], [], marker="s", linestyle="", color="C1", alpha=0.4, markersize=12,
                   label=f"the control: {_label(control_name)}")
        )  # fmt: skip
    ticks = [
        f"{_label(g, 24)}\n(control)" if control_name is not None and g == control_name
        else _label(g, 24)
        for g in groups
    ]  # fmt: skip
    axes.set_xticks(list(range(len(groups))), ticks)
    axes.set_xlim(-0.6, len(groups) - 0.4)
    better = "lower" if comparison.mode == "min" else "higher"
    axes.set_ylabel(f"{_label(comparison.metric)} ({better} is better)")
    axes.set_xlabel(_label(by))
    if control_name is None:
        note = "no control given"
    elif points["control"].any():
        note = f"control {_label(control_name)} shaded"
    else:
        note = f"control {_label(control_name)} not in this comparison"
    axes.set_title(f"{title}\n{len(points)} run(s); {note}", fontsize="medium")
    axes.grid(True, axis="y", alpha=0.3)
    axes.legend(handles=handles, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    return figure


def plot_comparison(
    comparison: Comparison,
    path: str | os.PathLike[str],
    *,
    control: str | None = None,
    title: str | None = None,
) -> Path:
    """Draw a comparison (``Ledger.compare``) into the PNG file ``path`` and return it: one
    point per run at its group (every seed, labelled ``s<seed>``), each group's median, runs
    counted as the worst value in a strip at the top and runs without a value at the bottom
    (:func:`comparison_points`), and the ``control`` group (default: the comparison's) shaded
    and named."""
    text = title or f"{_label(comparison.metric)} per variant, every seed"
    figure = _comparison_figure(comparison, control=control, title=text)
    _publish(_png(figure), path)
    return Path(path)


# -- a whole pilot folder -------------------------------------------------------------------


@dataclass
class Drawn:
    """What :func:`plot_folder` did for one folder: the PNG files ``written`` and, for each
    plot it did not draw there, why (``skipped``: file name -> reason).

    Example:
        >>> Drawn(Path("runs/r1")).skipped
        {}
    """

    folder: storage.Location
    written: list[storage.Location] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def scope(path: storage.Location) -> tuple[storage.Location, list[storage.Location]]:
    """The output folder and the run folders :func:`plot_folder` draws for ``path`` (a local
    ``Path`` or a :class:`~lightning_pilot.storage.RemotePath`): a run folder (that run), an
    output folder (every run) or its ``ledger/`` folder (every run of the output folder).

    Example:
        >>> scope(Path("out/runs/20261130T092309763Z-a1fe91cb433ec8b4"))
        (PosixPath('out'), [PosixPath('out/runs/20261130T092309763Z-a1fe91cb433ec8b4')])
    """
    if (path / "phases.parquet").exists() or path.parent.name == "runs":
        return path.parent.parent, [path]
    if path.name == "ledger" and not (path / "runs").is_dir():
        path = path.parent
    return path, storage.run_folders(path)


def _experiment_plots(
    ledger: Any,
    runs: pd.DataFrame,
    curves: pd.DataFrame,
    experiment: Any,
    *,
    metric: str,
    control: str | None,
) -> tuple[dict[str, bytes], dict[str, str]]:
    """The loss-curve and comparison PNGs of one experiment's runs, drawn once."""
    chosen = runs if is_null(experiment) else runs[runs["experiment"] == experiment]
    name = "runs without an experiment" if is_null(experiment) else f"experiment {experiment}"
    pngs: dict[str, bytes] = {}
    skipped: dict[str, str] = {}
    title = f"training loss per run, {_label(name)}"
    pngs[LOSS_CURVES] = _png(_loss_figure(curves, chosen, title=title, val_metric=metric))
    if is_null(experiment):
        skipped[COMPARISON] = "the run has no experiment in the ledger"
        return pngs, skipped
    variants = set(chosen["variant"].dropna())
    try:
        comparison = ledger.compare(
            metric, experiment=str(experiment), control=control if control in variants else None
        )
    except ValueError as err:
        skipped[COMPARISON] = terminal_safe(err)
        return pngs, skipped
    text = f"{_label(metric)} per variant, every seed; {_label(name)}"
    pngs[COMPARISON] = _png(_comparison_figure(comparison, control=control, title=text))
    return pngs, skipped


def plot_folder(
    path: storage.PathLike,
    *,
    metric: str = "val_loss",
    control: str | None = None,
    experiment: str | None = None,
) -> list[Drawn]:
    """Draw the plots of a pilot folder next to each run's choice sheet and return what was
    drawn where (docs/plots.md).

    ``path`` is an output folder (every run under ``runs/``), a run folder
    (``<out_dir>/runs/<run_id>``: that run) or the ledger folder, local or at a URL fsspec
    understands (``s3://``, ``memory://``: read there, and the PNGs written there, each in one
    whole-object write; :func:`lightning_pilot.storage.location`). Each run folder gets
    ``phase_memory.png`` (its phase table; :func:`plot_phase_memory`), and
    ``loss_curves.png`` and ``comparison.png`` of its experiment (``experiment``, default
    the run's own, from the ledger; :func:`plot_loss_curves`, :func:`plot_comparison` on
    ``metric`` with ``control`` marked). An experiment none of whose runs has a run folder
    (runs with only a ledger) gets its two plots in ``<out_dir>/plots/<experiment>/``.

    Raises:
        ModuleNotFoundError: matplotlib is not installed (:data:`MATPLOTLIB_MISSING`).
        ValueError: ``path`` holds neither a run folder nor a ledger.
    """
    require_matplotlib()
    from lightning_pilot.ledger import Ledger
    from lightning_pilot.report.load import _detail, phases_of

    where = storage.location(path)
    out_dir, run_dirs = scope(where)
    ledger = Ledger(out_dir) if (out_dir / "ledger").is_dir() else None
    if not run_dirs and ledger is None:
        raise ValueError(
            f"{path} holds neither a run folder (<out_dir>/runs/<run_id>) nor a ledger"
            " (<out_dir>/ledger): nothing to plot."
        )
    runs = ledger.runs() if ledger is not None else None
    curves = ledger.curves() if ledger is not None else None
    if experiment is not None and (runs is None or not (runs["experiment"] == experiment).any()):
        known = [] if runs is None else sorted(runs["experiment"].dropna().unique().tolist())
        raise ValueError(f"experiment={experiment!r} is not in the ledger; known: {known}.")
    experiments: dict[Any, tuple[dict[str, bytes], dict[str, str]]] = {}

    def of_experiment(name: Any) -> tuple[dict[str, bytes], dict[str, str]]:
        key = "" if is_null(name) else name
        if key not in experiments:
            assert runs is not None
            assert curves is not None
            experiments[key] = _experiment_plots(
                ledger, runs, curves, name, metric=metric, control=control
            )
        return experiments[key]

    done: list[Drawn] = []
    with_folder: set[Any] = set()
    for run_dir in run_dirs:
        drawn = Drawn(run_dir)
        done.append(drawn)
        phases = phases_of([run_dir])
        if phases is None:
            drawn.skipped[PHASE_MEMORY] = "no readable phase table (PhaseMemoryMonitor writes it)"
        else:
            title = f"peak allocated memory per phase, run {run_dir.name}"
            figure = _memory_figure(
                memory_stack(phases, _detail(run_dir, "placement")), title=title
            )
            drawn.written.append(_publish(_png(figure), run_dir / PHASE_MEMORY))
        mine = None if runs is None else runs[runs["run_id"] == run_dir.name]
        if mine is None or mine.empty:
            why = "no ledger record for this run (DivergenceLedger writes it)"
            drawn.skipped |= {LOSS_CURVES: why, COMPARISON: why}
            continue
        name = experiment if experiment is not None else mine["experiment"].iloc[-1]
        with_folder.add("" if is_null(name) else name)
        pngs, skipped = of_experiment(name)
        drawn.written += [_publish(data, run_dir / file) for file, data in pngs.items()]
        drawn.skipped |= skipped
    single = (where / "phases.parquet").exists() or where.parent.name == "runs"
    if runs is not None and not single:
        # An experiment none of whose runs has a run folder (a ledger alone): its own folder.
        wanted = [experiment] if experiment is not None else list(dict.fromkeys(runs["experiment"]))
        for name in wanted:
            if is_null(name) or name in with_folder:
                continue
            folder = out_dir / "plots" / storage.sanitize_name(str(name))
            pngs, skipped = of_experiment(name)
            written = [_publish(data, folder / file) for file, data in pngs.items()]
            done.append(Drawn(folder, written, skipped))
    return done


def existing_plots(folder: storage.PathLike) -> list[tuple[str, str]]:
    """The plot files of :data:`PLOT_FILES` that exist in ``folder``, with what each shows.

    Example:
        >>> import tempfile
        >>> existing_plots(tempfile.mkdtemp())
        []
    """
    base = storage.location(folder)
    return [(name, text) for name, text in PLOT_FILES.items() if (base / name).is_file()]
