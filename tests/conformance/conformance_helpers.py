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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pandas as pd
import torch
from torch.utils.data import DataLoader

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

    def build(fit: PilotFit) -> dict[str, Any]:
        fit.model = model()
        fit.datamodule = datamodule() if datamodule is not None else None
        return {"datamodule": fit.datamodule}

    return _seeded_fit(name, root, build, pilot=pilot, trainer=trainer, after=after, seed=seed)


def run_pilot_on_loaders(
    name: str,
    root: Path,
    model: Callable[[], pl.LightningModule],
    loaders: Callable[[], tuple[DataLoader[Any], DataLoader[Any]]],
    *,
    pilot: dict[str, Any] | None = None,
    trainer: dict[str, Any] | None = None,
    seed: int = 0,
) -> PilotFit:
    """:func:`run_pilot` for ``trainer.fit(model, train_loader, val_loader)``: seeded, one
    thread, the exception kept in the returned :class:`PilotFit`."""

    def build(fit: PilotFit) -> dict[str, Any]:
        fit.model = model()
        train_loader, val_loader = loaders()
        return {"train_dataloaders": train_loader, "val_dataloaders": val_loader}

    return _seeded_fit(name, root, build, pilot=pilot, trainer=trainer, after=None, seed=seed)


def _seeded_fit(
    name: str,
    root: Path,
    build: Callable[[PilotFit], dict[str, Any]],
    *,
    pilot: dict[str, Any] | None,
    trainer: dict[str, Any] | None,
    after: Callable[[PilotFit], None] | None,
    seed: int,
) -> PilotFit:
    """Seed, ``build(fit)`` (it sets ``fit.model`` and returns the rest of ``trainer.fit``'s
    arguments), fit with the pilot's callbacks on one thread, then ``after(fit)``; the
    exception is kept in the returned :class:`PilotFit`, the seed variables restored."""
    fit = PilotFit(name=name, out_dir=root / name)
    threads = torch.get_num_threads()
    environ = {key: os.environ.get(key) for key in _SEED_VARIABLES}
    torch.set_num_threads(1)  # tiny models: a second thread only adds synchronisation
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pl.seed_everything(seed, verbose=False)
            fit_inputs = build(fit)
            fit.callbacks = pilot_callbacks(fit.out_dir, seed=seed, **(pilot or {}))
            fit.trainer = pl.Trainer(
                **{
                    **QUIET_CPU,
                    "default_root_dir": root / f"{name}-root",
                    "callbacks": fit.callbacks,
                    **(trainer or {}),
                }
            )
            fit.trainer.fit(fit.model, **fit_inputs)
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


def shared_fits(root: Path, specs: Mapping[str, Any]) -> Callable[[str], PilotFit]:
    """One fit per spec of ``specs``, made when a test first asks for it, shared by the others.

    A spec is a dict or an object with ``model`` and, where it has them, ``datamodule`` or
    ``loaders`` (then :func:`run_pilot_on_loaders`), ``pilot``, ``trainer`` and ``after``.
    """
    done: dict[str, PilotFit] = {}

    def get(name: str) -> PilotFit:
        if name not in done:
            spec = specs[name]

            def field(key: str) -> Any:
                return spec.get(key) if isinstance(spec, Mapping) else getattr(spec, key, None)

            options = {"pilot": field("pilot"), "trainer": field("trainer")}
            if field("loaders") is not None:
                done[name] = run_pilot_on_loaders(
                    name, root, field("model"), field("loaders"), **options
                )
            else:
                done[name] = run_pilot(
                    name, root, field("model"), field("datamodule"), after=field("after"), **options
                )
        return done[name]

    return get


def worst_check(fit: PilotFit, name: str | Callable[[str], bool], phase: str) -> dict[str, Any]:
    """The check ``name`` of ``phase`` (its first failing one if any); the message shows what
    was written instead."""
    table = fit.table()
    found = check_named(table, name, phase=phase)
    assert found, (
        f"[{fit.name}] no check {name!r} in phase {phase!r}; the {phase} checks:\n"
        f"{checks_text(checks(table, phase))}\n{fit.describe()}"
    )
    return ([c for c in found if c["verdict"] == "fail"] or found)[0]


def assert_check(
    fit: PilotFit,
    name: str | Callable[[str], bool],
    phase: str,
    verdicts: set[str],
    *causes: str,
) -> dict[str, Any]:
    """The worst check ``name`` of ``phase`` has a verdict in ``verdicts`` and names ``causes``."""
    check = worst_check(fit, name, phase)
    message = f"[{fit.name}] {checks_text([check])}\n{fit.describe()}"
    assert check["verdict"] in verdicts, message
    detail = str(check.get("detail") or "").lower()
    for cause in causes:
        assert cause.lower() in detail, f"{cause!r} not in the reason: {message}"
    return check


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
