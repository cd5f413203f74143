"""The demo's plots, drawn by :mod:`lightning_pilot.report.plots` (this name stays for callers)."""

from lightning_pilot.report.plots import (  # noqa: F401  (re-exported)
    MATPLOTLIB_MISSING,
    phase_peaks,
    plot_loss_curves,
    plot_phase_memory,
    require_matplotlib,
)
