"""One pilot fit per module and the readers the conformance tests assert on.

A fit never raises here: its exception and traceback are kept in :class:`PilotFit`, so several
tests can share one fit (module-scoped fixtures) and each says what went wrong in its message.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pandas as pd
import torch

from lightning_pilot import Ledger, pilot_callbacks, read_phase_table
from lightning_pilot.cli import main as cli_main

QUIET_CPU: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "max_steps": 8,
    "limit_val_batches": 2,
}

_SEED_VARIABLES = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@dataclass
class PilotFit:
    """What one pilot fit left: its folder, callbacks, Trainer and exception (if any)."""

    name: str
    out_dir: Path
    callbacks: list[Any] = field(default_factory=list)
    trainer: pl.Trainer | None = None
    model: pl.LightningModule | None = None
    datamodule: pl.LightningDataModule | None = None
    error: BaseException | None = None
    error_text: str = ""
    seconds: float = 0.0

    def callback(self, cls_name: str) -> Any:
        return next(c for c in self.callbacks if type(c).__name__ == cls_name)

    def table(self) -> pd.DataFrame:
        """Every phase row written under the fit's folder (empty when none was written)."""
        try:
            return read_phase_table(self.out_dir)
        except (FileNotFoundError, ValueError):
            return pd.DataFrame(columns=["phase", "first", "verdict", "reason", "checks"])

    def runs(self) -> pd.DataFrame:
        return Ledger(self.out_dir).runs() if self.out_dir.exists() else pd.DataFrame()

    def show(self) -> tuple[int, str]:
        """``lightning-pilot show <out_dir>``, in this process: exit code and its output."""
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = cli_main(["show", str(self.out_dir)])
        return code, out.getvalue()

    def describe(self) -> str:
        """The fit's exception (traceback tail) and every row that did not pass, for messages."""
        lines = [f"[{self.name}] out_dir={self.out_dir} ({self.seconds:.1f} s)"]
        if self.error is not None:
            lines.append("fit raised:\n" + tail(self.error_text, 25))
        lines.append(rows_text(self.table(), verdicts=("fail", "warn", "not_checked")))
        return "\n".join(lines)


def run_pilot(
    name: str,
    root: Path,
    model: Callable[[], pl.LightningModule],
    datamodule: Callable[[], pl.LightningDataModule] | None = None,
    *,
    pilot: dict[str, Any] | None = None,
    trainer: dict[str, Any] | None = None,
    after: Callable[[PilotFit], None] | None = None,
    seed: int = 0,
) -> PilotFit:
    """Fit ``model()`` with ``pilot_callbacks(out_dir=root / name, **pilot)``, seeded, 1 thread.

    ``after(fit)`` runs once the fit returned (e.g. ``trainer.test``) under the same capture.
    """
    fit = PilotFit(name=name, out_dir=root / name)
    threads = torch.get_num_threads()
    environ = {key: os.environ.get(key) for key in _SEED_VARIABLES}
    torch.set_num_threads(1)  # tiny models: a second thread only adds synchronisation
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pl.seed_everything(seed, verbose=False)
            fit.model = model()
            fit.datamodule = datamodule() if datamodule is not None else None
            fit.callbacks = pilot_callbacks(fit.out_dir, seed=seed, **(pilot or {}))
            fit.trainer = pl.Trainer(
                **{
                    **QUIET_CPU,
                    "default_root_dir": root / f"{name}-root",
                    "callbacks": fit.callbacks,
                    **(trainer or {}),
                }
            )
            fit.trainer.fit(fit.model, datamodule=fit.datamodule)
            if after is not None:
                after(fit)
    except Exception as err:
        fit.error = err
        fit.error_text = traceback.format_exc()
    finally:
        torch.set_num_threads(threads)
        for key, value in environ.items():  # seed_everything's variables: not for later tests
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        fit.seconds = time.perf_counter() - start
    return fit


def tail(text: str, lines: int) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def rows_text(table: pd.DataFrame, verdicts: tuple[str, ...] = ("fail",)) -> str:
    """``phase (first|later) verdict: reason`` for every row with one of ``verdicts``."""
    if table.empty:
        return "no phase row was written"
    shown = table[table["verdict"].isin(verdicts)]
    if shown.empty:
        return f"no row with verdict in {verdicts}"
    return "\n".join(
        f"  {row.phase} ({'first' if row.first else 'later'}) {row.verdict}: {row.reason}"
        for row in shown.itertuples(index=False)
    )


def checks(table: pd.DataFrame, phase: str | None = None) -> list[dict[str, Any]]:
    """Every check of every row (of ``phase``), with the row's phase added."""
    found = []
    for row in table.itertuples(index=False):
        if phase is not None and row.phase != phase:
            continue
        for check in row.checks if row.checks is not None else []:
            found.append({"phase": row.phase, "first": row.first, **dict(check)})
    return found


def check_named(
    table: pd.DataFrame, name: str | Callable[[str], bool], phase: str | None = None
) -> list[dict[str, Any]]:
    """The checks named ``name`` (or whose name passes the predicate)."""
    match = name if callable(name) else (lambda found: found == name)
    return [c for c in checks(table, phase) if match(c["name"])]


def checks_text(found: list[dict[str, Any]]) -> str:
    if not found:
        return "  (no such check)"
    return "\n".join(
        f"  {c['phase']}: {c['name']} {c['verdict']}: {c.get('detail', '')}" for c in found
    )


def runs_text(runs: pd.DataFrame) -> str:
    if runs.empty:
        return "the ledger holds no run"
    columns = [
        c
        for c in ("run_id", "status", "stop_cause", "stop_step", "stop_detail", "exception_type")
        if c in runs.columns
    ]
    return runs[columns].to_string(index=False)
