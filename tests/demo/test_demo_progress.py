"""The demo's progress: each fit's updates and updates per second, and a tqdm bar of its updates
on a terminal (real fits of the demo's comparison; the whole demo's lines: test_pilot_demo.py)."""

from __future__ import annotations

import io
import re
from pathlib import Path

from lightning_pilot import Ledger
from lightning_pilot.core.progress import BarReporter
from lightning_pilot.demo import pilot


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_meter_counts_the_updates_and_moves_a_bar(tmp_path: Path) -> None:
    size = pilot.DemoSize.of(True)
    control, *_, unstable = pilot.lr_variants()
    terminal = Tty()
    meter = pilot.fit_meter(terminal, "[3/6] control", size.updates)
    assert isinstance(meter.bar, BarReporter)
    with pilot._quiet():
        run_id, took = pilot._comparison_fit(tmp_path, control, size, meter)
    runs = Ledger(tmp_path).runs().set_index("run_id")
    assert meter.updates == runs.loc[run_id, "updates_done"] == size.updates
    assert meter.seconds is not None
    assert 0 < meter.seconds < took  # the training loop, not the Trainer's setup
    rate = re.fullmatch(r"(\d+\.\d) updates/s", meter.rate_text())
    assert rate is not None, meter.rate_text()
    assert float(rate[1]) == round(size.updates / meter.seconds, 1)
    parts = [p for p in terminal.getvalue().split("\r") if p.strip()]
    assert parts[0].startswith("[3/6] control:   0%|")
    assert any(f"{size.updates}/{size.updates}" in part and "update/s" in part for part in parts)
    assert terminal.getvalue().endswith("\r")  # leave=False: the bar is cleared for the line

    # A fit the divergence rules stop: the updates it did, whatever was planned; no terminal,
    # no bar (a pipe gets the lines alone).
    meter = pilot.fit_meter(io.StringIO(), "[6/6] unstable", size.updates)
    assert type(meter.bar).__name__ == "Reporter"
    with pilot._quiet():
        run_id, _ = pilot._comparison_fit(tmp_path, unstable, size, meter)
    assert meter.updates == Ledger(tmp_path).runs().set_index("run_id").loc[run_id, "updates_done"]


def test_a_fit_without_updates_has_no_rate() -> None:
    meter = pilot.FitMeter()
    assert meter.updates == 0
    assert meter.rate_text() == "updates/s not measured (no update ran)"


def test_the_learning_rates_compared() -> None:
    assert [variant.name for variant in pilot.lr_variants()] == [
        "lr=3e-3 (control)",
        "lr=1.5e-3 (half)",
        "lr=6e-3 (double)",
        "lr=5 (unstable)",
    ]
