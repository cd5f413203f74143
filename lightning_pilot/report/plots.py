"""PNG plots of a pilot folder (docs/plots.md), laying out what
:mod:`lightning_pilot.report.plot_data` prepares. matplotlib is optional (extra
``lightning-pilot[plots]``), imported only to draw, through the Agg canvas: no global backend is
switched and no window opens. Nothing here imports torch or Lightning."""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pandas as pd

from lightning_pilot import storage
from lightning_pilot.core.compare import Comparison
from lightning_pilot.report.plot_data import (
    CATEGORIES,
    OTHER,
    ComparisonPlot,
    LossCurves,
    comparison_plot,
    loss_curves,
    memory_stack,
)
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
#: How each mark of :func:`~lightning_pilot.report.plot_data.curve_marks` is drawn.
_MARK_STYLE: Final = {
    "diverged": ("X", "red", "diverged here (the divergence rule fired)"),
    "stopped": ("s", "black", "training stopped here"),
    "failed": ("X", "black", "failed here (exception)"),
    "oom": ("X", "darkorange", "out of memory here"),
    "interrupted": ("s", "grey", "interrupted (last record)"),
}
_NO_VALUE: Final = "no value (running, interrupted, or metric not logged)"
#: The strips of a comparison plot: a run's height on the axes, marker, face, band, and the
#: legend's marker size and text.
_STRIPS: Final = {
    "worst": (0.95, "X", "red", (0.91, 1.0), 9, "diverged or failed: counted as the worst value"),
    "no value": (0.05, "o", "none", (0.0, 0.09), None, _NO_VALUE),
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


def _key(marker: str, color: str, label: str, edge: str | None = "black", **style: Any) -> Any:
    """A legend entry of one marker, no line."""
    from matplotlib.lines import Line2D

    return Line2D(
        [], [], marker=marker, linestyle="", color=color, markeredgecolor=edge, label=label, **style
    )


def _figure(width: float, height: float) -> tuple[Figure, Axes]:
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def _png(figure: Figure) -> bytes:
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _publish(data: bytes, path: storage.PathLike) -> storage.Location:
    """Replace ``path`` atomically (on an object store, one whole-object write)."""
    return storage.publish_file(path, lambda handle: handle.write(data), replace=True)


def _save(figure: Figure, path: str | os.PathLike[str]) -> Path:
    _publish(_png(figure), path)
    return Path(path)


def _loss_figure(data: LossCurves, *, title: str, val_metric: str) -> Figure:
    from matplotlib.ticker import MaxNLocator

    figure, axes = _figure(12.0, 5.4)
    log = data.log
    variants = [run.variant for run in data.runs]
    colors = {v: f"C{i % 10}" for i, v in enumerate(dict.fromkeys(variants))}
    handles: list[Any] = []
    no_points: list[str] = []
    named: set[str] = set()  # variants with a legend entry
    for run in data.runs:
        color = colors[run.variant]
        if not run.recorded:
            no_points.append(f"{_label(run.variant, 20)} s{_label(run.seed)}")
        drawn = axes.plot(
            run.train["step"].astype(float), run.train["value"], color=color, linewidth=1.0,
            alpha=0.8
        )  # fmt: skip
        if run.variant not in named:
            named.add(run.variant)
            n = variants.count(run.variant)
            drawn[0].set_label(f"{_label(run.variant)} ({n} run{'s' if n > 1 else ''})")
            handles.append(drawn[0])
        axes.plot(
            run.val["step"].astype(float), run.val["value"], "o", color=color, markersize=5,
            markeredgecolor="black", markeredgewidth=0.5
        )  # fmt: skip
    if data.validated:
        handles.append(_key("o", "grey", f"{_label(val_metric)} (validation)"))
    marks = data.marks
    for i, mark in enumerate(marks.to_dict("records")):
        marker, color, text = _MARK_STYLE.get(mark["kind"], ("X", "purple", mark["kind"]))
        if i < _ANNOTATED:  # each mark named in the legend; past that, one entry per kind
            text = (
                f"{_label(mark['variant'], 20)} s{_label(mark['seed'], 8)}: {_label(mark['label'])}"
            )
            handles.append(_key(marker, color, text, markersize=9))
        elif mark["kind"] not in set(marks["kind"].iloc[_ANNOTATED:i]):
            handles.append(_key(marker, color, f"{text} (and others)", markersize=9))
        if is_null(mark["step"]):
            continue
        y = mark["value"]
        drawable = math.isfinite(y) and (y > 0 or not log)
        # A run with no finite loss before the mark: drawn at the bottom edge of the axes.
        transform = axes.transData if drawable else axes.get_xaxis_transform()
        axes.plot(
            [mark["step"]], [y if drawable else 0.03], marker, color=color, markersize=11,
            markeredgecolor="black", transform=transform, zorder=5
        )  # fmt: skip
    if log:
        axes.set_yscale("log")
    axes.set_xlabel("optimizer update (step)")
    axes.set_ylabel(f"training loss{' (log scale)' if log else ''}")
    counts = ", ".join(f"{n} {status}" for status, n in data.statuses.items())
    missing = f"; no loss points: {', '.join(no_points[:4])}" if no_points else ""
    axes.set_title(f"{title}\n{len(data.runs)} run(s): {counts}{missing}", fontsize="medium")
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
    """Draw the training loss of ``runs`` (``Ledger.runs()`` rows; their ``Ledger.curves()``),
    one colour per variant, with the ``val_metric`` points and where runs diverged, stopped or
    failed (:func:`~lightning_pilot.report.plot_data.loss_curves`), into the PNG file ``path``;
    return it."""
    figure = _loss_figure(loss_curves(curves, runs, val_metric), title=title, val_metric=val_metric)
    return _save(figure, path)


def _memory_figure(stack: pd.DataFrame, *, title: str) -> Figure:
    figure, axes = _figure(9.0, 5.0)
    measured = stack[stack["measured"]]
    largest = float(measured["peak_bytes"].max()) if len(measured) else 0.0
    unit = format_bytes(largest).split(" ")[-1] if largest > 0 else "B"  # the y axis' unit
    divisor = float(1024 ** ("B", "KiB", "MiB", "GiB", "TiB").index(unit))
    axes.set_ylabel(f"peak allocated memory ({unit})")
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
                textcoords="offset points", xytext=(0, 3), ha="center", fontsize="small"
            )  # fmt: skip
        else:  # no bar: a phase without a measurement is never drawn as 0
            axes.text(
                position, 0.02 * top, "not measured", rotation=90, ha="center", va="bottom",
                color="grey", fontsize="small"
            )  # fmt: skip
    axes.set_xticks(x, [_label(p, 24) for p in stack["phase"]], rotation=30, ha="right")
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
    (:func:`~lightning_pilot.report.plot_data.memory_stack`; ``placement``: the run's
    ``placement.parquet``), into the PNG file ``path`` and return it; a phase whose memory was
    not measured gets no bar, only the words "not measured"."""
    return _save(_memory_figure(memory_stack(table, placement), title=title), path)


def _comparison_figure(data: ComparisonPlot, *, title: str) -> Figure:
    from matplotlib.lines import Line2D

    figure, axes = _figure(12.0, 5.4)
    points, strip = data.points, axes.get_xaxis_transform()
    groups = list(data.medians.index)
    measured = points[points["place"] == "measured"]
    low, high = (measured["y"].min(), measured["y"].max()) if len(measured) else (0.0, 1.0)
    span = (high - low) or abs(high) or 1.0
    # Room above and below the measured points for the strips of the worst and of no value.
    axes.set_ylim(low - 0.3 * span, high + 0.3 * span)
    handles: list[Any] = [
        _key("o", "C0", "one run (s = seed)"),
        Line2D([], [], color="black", linewidth=2, label="median over the group's runs"),
    ]
    for index, (group, median) in enumerate(data.medians.items()):
        own = points[points["group"] == group]
        color = "C1" if own["control"].any() else "C0"
        if own["control"].any():
            axes.axvspan(index - 0.4, index + 0.4, color="C1", alpha=0.12, zorder=0)
        mine = own[own["place"] == "measured"]
        axes.plot(
            mine["x"], mine["y"], "o", color=color, markeredgecolor="black", markersize=7,
            zorder=3
        )  # fmt: skip
        if not is_null(median) and math.isfinite(median):
            axes.hlines(median, index - 0.3, index + 0.3, color="black", linewidth=2, zorder=4)
        elif not is_null(median):  # the median run diverged or failed: the worst value
            axes.text(
                index, 0.89, "median: worst", ha="center", va="top", fontsize="small",
                transform=strip
            )  # fmt: skip
        for place, (y, marker, face, *_) in _STRIPS.items():
            part = own[own["place"] == place]
            axes.plot(
                part["x"], [y] * len(part), marker, color=face, markeredgecolor="black",
                markersize=9, transform=strip, zorder=3
            )  # fmt: skip
        for row in own.to_dict("records"):
            inside = row["place"] == "measured"
            axes.annotate(
                f"s{_label(row['seed'], 8)}",
                (row["x"], row["y"] if inside else _STRIPS[row["place"]][0]),
                xycoords=axes.transData if inside else strip,
                textcoords="offset points", xytext=(5, 3), fontsize="x-small"
            )  # fmt: skip
    for place, (_, marker, face, band, size, label) in _STRIPS.items():
        if (points["place"] == place).any():
            axes.fill_between(
                [0, 1], *band, color="grey", alpha=0.12, linewidth=0, transform=axes.transAxes
            )
            handles.append(_key(marker, face, label, markersize=size))
    control = data.control
    if points["control"].any():
        label = f"the control: {_label(control)}"
        handles.append(_key("s", "C1", label, edge=None, alpha=0.4, markersize=12))
    ticks = [
        f"{_label(g, 24)}\n(control)" if control is not None and g == control else _label(g, 24)
        for g in groups
    ]
    axes.set_xticks(list(range(len(groups))), ticks)
    axes.set_xlim(-0.6, len(groups) - 0.4)
    better = "lower" if data.mode == "min" else "higher"
    axes.set_ylabel(f"{_label(data.metric)} ({better} is better)")
    axes.set_xlabel(_label(data.by))
    if control is None:
        note = "no control given"
    elif points["control"].any():
        note = f"control {_label(control)} shaded"
    else:
        note = f"control {_label(control)} not in this comparison"
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
    """Draw a comparison (``Ledger.compare``) into the PNG file ``path`` and return it: every
    run's point at its group, each group's median, the worst and the valueless runs in strips
    (:func:`~lightning_pilot.report.plot_data.comparison_plot`) and the ``control`` shaded."""
    text = title or f"{_label(comparison.metric)} per variant, every seed"
    return _save(_comparison_figure(comparison_plot(comparison, control), title=text), path)


# -- a whole pilot folder -------------------------------------------------------------------


@dataclass
class Drawn:
    """What :func:`plot_folder` did for one folder: the PNG files ``written`` and, for each
    plot it did not draw there, why (``skipped``: file name -> reason)."""

    folder: storage.Location
    written: list[storage.Location] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def scope(path: storage.Location) -> tuple[storage.Location, list[storage.Location]]:
    """The output folder and the run folders :func:`plot_folder` draws for ``path`` (a local
    ``Path`` or a :class:`~lightning_pilot.storage.RemotePath`): a run folder (that run), an
    output folder (every run) or its ``ledger/`` folder (every run of the output folder)."""
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
    metric: str,
    control: Any,
) -> tuple[dict[str, bytes], dict[str, str]]:
    """The loss-curve and comparison PNGs of one experiment's runs, and why one is missing."""
    chosen = runs if is_null(experiment) else runs[runs["experiment"] == experiment]
    name = "runs without an experiment" if is_null(experiment) else f"experiment {experiment}"
    title = f"training loss per run, {_label(name)}"
    data = loss_curves(curves, chosen, metric)
    pngs = {LOSS_CURVES: _png(_loss_figure(data, title=title, val_metric=metric))}
    if is_null(experiment):
        return pngs, {COMPARISON: "the run has no experiment in the ledger"}
    known = control if control in set(chosen["variant"].dropna()) else None
    try:
        comparison = ledger.compare(metric, experiment=str(experiment), control=known)
    except ValueError as err:
        return pngs, {COMPARISON: terminal_safe(err)}
    text = f"{_label(metric)} per variant, every seed; {_label(name)}"
    pngs[COMPARISON] = _png(_comparison_figure(comparison_plot(comparison, control), title=text))
    return pngs, {}


def plot_folder(
    path: storage.PathLike,
    *,
    metric: str = "val_loss",
    control: str | None = None,
    experiment: str | None = None,
) -> list[Drawn]:
    """Draw the plots of a pilot folder (:func:`scope`; local or at a URL fsspec understands)
    next to each run's choice sheet and return what was drawn where (docs/plots.md): each run
    folder gets ``phase_memory.png``, and ``loss_curves.png`` and ``comparison.png`` of its
    experiment (``experiment``, default the run's own) on ``metric`` with ``control`` marked;
    an experiment without run folders gets them in ``<out_dir>/plots/<experiment>/``.

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
    runs, curves = (None, None) if ledger is None else (ledger.runs(), ledger.curves())
    if experiment is not None and (runs is None or not (runs["experiment"] == experiment).any()):
        known = [] if runs is None else sorted(runs["experiment"].dropna().unique().tolist())
        raise ValueError(f"experiment={experiment!r} is not in the ledger; known: {known}.")
    experiments: dict[Any, tuple[dict[str, bytes], dict[str, str]]] = {}

    def of_experiment(name: Any) -> tuple[dict[str, bytes], dict[str, str]]:
        key = "" if is_null(name) else name  # drawn once per experiment
        if key not in experiments:
            assert runs is not None
            assert curves is not None
            experiments[key] = _experiment_plots(ledger, runs, curves, name, metric, control)
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
            stack = memory_stack(phases, _detail(run_dir, "placement"))
            figure = _memory_figure(
                stack, title=f"peak allocated memory per phase, run {run_dir.name}"
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
    """The plot files of :data:`PLOT_FILES` that exist in ``folder``, with what each shows."""
    base = storage.location(folder)
    return [(name, text) for name, text in PLOT_FILES.items() if (base / name).is_file()]
