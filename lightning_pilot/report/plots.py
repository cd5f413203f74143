"""PNG plots of a pilot: loss curves per variant and peak memory per phase (docs/demo.md).

matplotlib is optional (extra ``lightning-pilot[plots]``), imported only to draw, through the
Agg canvas directly: no global backend is switched and no window opens.

Example:
    >>> import pandas as pd
    >>> table = pd.DataFrame(
    ...     {"phase": ["forward", "backward"], "peak_allocated_bytes": [2**20, None]}
    ... )
    >>> phase_peaks(table)
    phase
    forward    1048576.0
    Name: peak_allocated_bytes, dtype: float64
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from lightning_pilot import storage
from lightning_pilot.core.compare import FAILED_STATUSES

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: The :class:`ModuleNotFoundError` of drawing without matplotlib (what the demo prints).
MATPLOTLIB_MISSING = "plots skipped: matplotlib not installed (pip install matplotlib)"


def require_matplotlib() -> None:
    """Import matplotlib, or raise :class:`ModuleNotFoundError` saying how to install it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ModuleNotFoundError(MATPLOTLIB_MISSING) from error


def _figure(width: float, height: float) -> Figure:
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    return figure


def _save(figure: Figure, path: str | os.PathLike[str]) -> Path:
    figure.tight_layout()
    # Drawn again from the tables on every run: replaced atomically, never half-written.
    return storage.publish_file(
        path, lambda handle: figure.savefig(handle, format="png"), replace=True
    )


def plot_loss_curves(
    curves: pd.DataFrame,
    runs: pd.DataFrame,
    path: str | os.PathLike[str],
    *,
    title: str = "training loss per variant",
    val_metric: str = "val_loss",
) -> Path:
    """Draw the training loss and ``val_metric`` points of the ``runs`` (``Ledger.runs()``
    rows, their ``Ledger.curves()``) into the PNG file ``path`` and return it. The y axis is
    logarithmic, so a blown-up run stays readable; non-finite losses cannot be drawn, so a
    marker shows where each failed run stopped."""
    figure = _figure(8.0, 4.8)
    axes = figure.add_subplot()
    for i, run in enumerate(runs.itertuples(index=False)):
        color = f"C{i % 10}"
        own = curves[curves["run_id"] == run.run_id]
        train = own[own["curve"] == "train_loss"].sort_values("step")
        finite = train[train["value"].map(lambda v: math.isfinite(v) and v > 0)]
        label = str(run.variant)
        axes.plot(
            finite["step"], finite["value"], color=color, linewidth=1.0, alpha=0.8, label=label
        )
        val = own[(own["curve"] == "val") & (own["name"] == val_metric)]
        if not val.empty:
            axes.plot(
                val["step"],
                val["value"],
                "o",
                color=color,
                markersize=6,
                markeredgecolor="black",
                label=f"{label} {val_metric}",
            )
        if run.status in FAILED_STATUSES:
            stop: Any = run.stop_step
            last = int(finite["step"].iloc[-1]) if not finite.empty else 0
            step = last if stop is None or pd.isna(stop) else int(stop)
            at = finite[finite["step"] <= step]["value"]
            y = float(at.iloc[-1]) if not at.empty else 1.0
            axes.plot([step], [y], "X", color="red", markersize=12, markeredgecolor="black")
            axes.annotate(
                f"{label}: {run.status!s} ({run.stop_cause!s}) at update {step}",
                (step, y),
                textcoords="offset points",
                xytext=(8, 4),
                color="red",
            )
    axes.set_yscale("log")
    axes.set_xlabel("optimizer update")
    axes.set_ylabel("training loss (log scale)")
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small", ncol=2)
    return _save(figure, path)


def phase_peaks(table: pd.DataFrame) -> pd.Series:
    """The highest ``peak_allocated_bytes`` of each phase of a phase table, as floats in the
    order the phases first appear; phases without a measurement left out."""
    measured = table.dropna(subset=["peak_allocated_bytes"])
    order = list(dict.fromkeys(measured["phase"]))
    peaks: pd.Series = (
        measured.groupby("phase", sort=False)["peak_allocated_bytes"].max().astype(float)
    )
    return peaks.reindex(order)


def plot_phase_memory(
    table: pd.DataFrame,
    path: str | os.PathLike[str],
    *,
    title: str = "peak allocated memory per phase",
) -> Path:
    """Draw a bar per phase of a phase table into the PNG file ``path``: its highest peak
    allocated memory in MiB, the peak phase in red; returns ``path``. A phase whose memory was
    not measured (null) gets no bar; the title names it."""
    peaks = phase_peaks(table)
    unmeasured = sorted(set(table["phase"]) - set(peaks.index))
    figure = _figure(8.0, 4.2)
    axes = figure.add_subplot()
    mib = peaks / 2**20
    top = mib.idxmax() if not mib.empty else None
    colors = ["C3" if phase == top else "C0" for phase in mib.index]
    bars = axes.bar(list(mib.index), list(mib.values), color=colors)
    axes.bar_label(bars, labels=[f"{v:.2f}" for v in mib.values], fontsize="small")
    axes.set_ylabel("MiB (peak allocated)")
    note = f"; not measured: {', '.join(unmeasured)}" if unmeasured else ""
    axes.set_title(f"{title}{note}", fontsize="medium")
    for label in axes.get_xticklabels():
        label.set_rotation(30)
        label.set_horizontalalignment("right")
    return _save(figure, path)
