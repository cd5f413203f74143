"""What run folders and ledgers hold, read through :mod:`lightning_pilot.storage` and
:class:`lightning_pilot.Ledger` (the report reads no file itself), for the command line and the
choice sheet; :class:`Reads` collects what the readers skipped as unreadable."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import pyarrow as pa

from lightning_pilot import storage
from lightning_pilot.core.compare import Comparison
from lightning_pilot.core.ids import validate_run_id
from lightning_pilot.ledger import Ledger
from lightning_pilot.report.analysis import accumulation, run_costs, summarize_costs
from lightning_pilot.report.units import records, terminal_safe
from lightning_pilot.schemas import upgrade_estimate


class Reads:
    """What one command could not read: the readers' warnings (a skipped file is a
    ``RuntimeWarning`` starting ``lightning-pilot: skipped``), and the misplaced entries the
    scans find (a folder named like a record, a phase table replaced by a file), which a reader
    may pass over in silence."""

    def __init__(self) -> None:
        self._caught: list[list[warnings.WarningMessage]] = []
        self._strays: dict[str, str] = {}  # path: why

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record the warnings raised inside."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self._caught.append(caught)
            yield

    def _messages(self) -> dict[str, bool]:
        """Each distinct warning's message, and whether it skipped a file, in order."""
        seen: dict[str, bool] = {}
        for warning in (warning for caught in self._caught for warning in caught):
            if issubclass(warning.category, (RuntimeWarning, UserWarning)):
                message = str(warning.message).removeprefix("lightning-pilot: ")
                skipped = message.startswith("skipped ")
                seen.setdefault(message, issubclass(warning.category, RuntimeWarning) and skipped)
        return seen

    def skipped(self) -> list[str]:
        """One description per file in scope that could not be read, each file once."""
        lost = [m.removeprefix("skipped ") for m, skipped in self._messages().items() if skipped]
        strays = [  # a stray a reader also reported is named once, as the reader said it
            f"{path}: {why}"
            for path, why in self._strays.items()
            if not any(path in message for message in lost)
        ]
        return strays + lost

    def notes(self) -> list[str]:
        """The other warnings (a hint where the ledger is, say)."""
        return [message for message, skipped in self._messages().items() if not skipped]

    def scan_folder(self, folder: storage.Location) -> None:
        """Entries of a table folder named like Parquet files that are not files."""
        entries: Iterable[storage.Location] = folder.iterdir() if folder.is_dir() else []
        for entry in sorted(entries, key=str):
            visible = not entry.name.startswith((".", "_")) and entry.suffix == ".parquet"
            if visible and not entry.is_file():
                self._strays.setdefault(str(entry), "not a file (a Parquet file is expected here)")

    def scan_run(self, run: storage.Location) -> None:
        """A run folder's phase table: a folder of Parquet files, never a plain file."""
        table = run / "phases.parquet"
        if table.is_dir():
            self.scan_folder(table)
        elif table.exists() or table.is_symlink():
            why = "not a folder (a phase table is a folder of Parquet files)"
            self._strays.setdefault(str(table), why)


def _run_folder(out_dir: storage.Location, run_id: Any) -> storage.Location | None:
    """``out_dir/runs/<run_id>``; ``None`` when ``run_id`` is not a run id."""
    try:
        validate_run_id(str(run_id), "run_id")
    except (TypeError, ValueError):
        return None
    return out_dir / "runs" / str(run_id)


def compared_runs(out_dir: storage.Location, run_ids: Iterable[Any]) -> list[storage.Location]:
    """The run folders under ``out_dir/runs`` of these ledger runs (ids that are run ids)."""
    folders = [_run_folder(out_dir, run_id) for run_id in dict.fromkeys(str(r) for r in run_ids)]
    return [folder for folder in folders if folder is not None and folder.is_dir()]


def phases_of(run_dirs: Sequence[storage.Location]) -> pd.DataFrame | None:
    """The phase rows of these run folders (``None`` when there are none)."""
    frames = []
    for run in run_dirs:
        if (run / "phases.parquet").is_dir():
            with contextlib.suppress(ValueError):
                frames.append(storage.read_phase_table(run))
    frames = [frame for frame in frames if len(frame)]
    return pd.concat(frames, ignore_index=True) if frames else None


def _ledger_of(path: storage.Location, run_only: bool) -> storage.Location | None:
    if (path / "ledger").is_dir():
        return path / "ledger"
    if run_only and (path.parent.parent / "ledger").is_dir():
        return path.parent.parent / "ledger"
    if run_only or (path / "runs").is_dir():
        return None
    # The ledger folder itself: record files, or index segments only once compacted.
    if any(path.glob("*.parquet")) or (path / storage.LEDGER_INDEX_DIR).is_dir():
        return path
    return None


def load_scope(
    path: storage.Location, reads: Reads
) -> tuple[pd.DataFrame | None, pd.DataFrame | None, storage.Location | None]:
    """What ``show PATH`` reads from an output, run or ledger folder: the phase rows (``None``:
    none readable), the ledger runs (``None``: no ledger) and the ledger folder.

    Raises:
        ValueError: ``path`` holds neither a phase table nor a ledger, or none of it is read.
    """
    run_only = (path / "phases.parquet").exists()  # a plain file there: a damaged run
    ledger_dir = _ledger_of(path, run_only)
    run_dirs = storage.run_folders(path)
    tables = [run / "phases.parquet" for run in run_dirs if (run / "phases.parquet").exists()]
    if not tables and ledger_dir is None:
        raise ValueError(
            f"{path} holds neither a phase table (<out_dir>/runs/<run_id>/phases.parquet)"
            " nor a ledger (<out_dir>/ledger)."
        )
    for run in run_dirs:
        reads.scan_run(run)
    if ledger_dir is not None:
        reads.scan_folder(ledger_dir)
    phases = None
    if any(table.is_dir() for table in tables):
        with contextlib.suppress(ValueError):
            phases = storage.read_phase_table(path)
        if phases is not None and phases.empty:
            phases = None  # every file was skipped: never shown as a table
    runs = None if ledger_dir is None else Ledger(ledger_dir).runs()
    if runs is not None and run_only:
        runs = runs[runs["run_id"] == path.name]
    if phases is None and (runs is None or runs.empty):
        missing = ["the phase table has no readable rows"] if tables else []
        if ledger_dir is not None:
            mine = " of this run" if run_only else ""
            where = "" if ledger_dir == path else f" {ledger_dir}"
            missing.append(f"the ledger{where} has no readable record{mine}")
        raise ValueError(f"{path}: nothing to check: {'; '.join(missing)}.")
    return phases, runs, ledger_dir


@dataclass(frozen=True)
class RunFolder:
    """What a run folder and the ledger beside it hold: the ``phases`` (never empty), the
    ``updates`` and ``model`` tables, the folded ledger ``record`` and the ``last`` point of
    each curve, every ledger run, the ``experiment`` compared and its ``comparison`` (or why
    there is none), and the ``estimate`` on target GPUs with the ``largest`` sizes that fit
    (``None``: absent)."""

    path: storage.Location
    phases: pd.DataFrame
    updates: pd.DataFrame | None
    model: pd.DataFrame | None
    record: dict[str, Any] | None
    last: dict[str, tuple[Any, Any]]
    runs: pd.DataFrame | None
    experiment: Any
    comparison: Comparison | str
    estimate: pd.DataFrame | None = None
    largest: pd.DataFrame | None = None


def _detail(run: storage.Location, name: str) -> pd.DataFrame | None:
    """A run's ``<name>.parquet`` snapshot table; ``None`` when absent or empty."""
    if not (run / f"{name}.parquet").is_dir():
        return None
    if name == "estimate":
        return read_estimate(run / "estimate.parquet")
    frame: pd.DataFrame = storage.read_snapshot_table(run / f"{name}.parquet").to_pandas()
    return frame if len(frame) else None


def read_estimate(path: storage.PathLike) -> pd.DataFrame | None:
    """An estimate table (an ``estimate.parquet`` folder or file) with the columns of
    :data:`~lightning_pilot.schemas.ESTIMATE_SCHEMA`, whatever version wrote it; ``None`` when
    it holds no row."""
    location = storage.location(path)
    files = storage.list_snapshot_files(location) if location.is_dir() else [location]
    tables = [upgrade_estimate(storage.read_parquet_files([file])) for file in files]
    if not tables:
        return None
    frame: pd.DataFrame = pa.concat_tables(tables).to_pandas()
    return frame if len(frame) else None


def load_run(
    run_dir: storage.PathLike, *, metric: str = "val_loss", experiment: str | None = None
) -> RunFolder:
    """Read a run folder and ``<out_dir>/ledger`` into a :class:`RunFolder`, comparing the
    variants of ``experiment`` (default: the run's) on ``metric``.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist.
        ValueError: ``run_dir`` is not a run folder, or its phase table has no readable rows.
    """
    run = storage.location(run_dir)
    if not run.exists():
        raise FileNotFoundError(f"run_dir={str(run)!r} does not exist.")
    if not (run / "phases.parquet").is_dir():
        runs = run / "runs"
        found = sorted(p.name for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else []
        hint = f"; runs here: {', '.join(found)}" if found else ""
        raise ValueError(
            f"run_dir={str(run)!r} is not a run folder: expected <out_dir>/runs/<run_id> holding"
            f" phases.parquet{hint}."
        )
    phases = storage.read_phase_table(run)
    if phases.empty:
        raise ValueError(f"{run / 'phases.parquet'} holds no readable phase rows.")
    folder = run.parent.parent / "ledger"
    ledger = Ledger(folder) if folder.is_dir() else None
    all_runs = None if ledger is None else ledger.runs()
    record: dict[str, Any] | None = None
    last: dict[str, tuple[Any, Any]] = {}
    if ledger is not None and all_runs is not None and run.name in set(all_runs["run_id"]):
        mine = all_runs[all_runs["run_id"] == run.name].iloc[-1]
        record = {str(key): value for key, value in mine.to_dict().items()}
        curves = ledger.curves()
        for name, points in curves[curves["run_id"] == run.name].groupby("name", sort=True):
            point = points.sort_values("step", kind="stable").iloc[-1]
            last[str(name)] = (point["step"], point["value"])
    updates, model = _detail(run, "updates"), _detail(run, "model")
    wanted = experiment if experiment is not None else (record or {}).get("experiment")
    comparison: Comparison | str = "no ledger for this run's experiment."
    if ledger is not None and wanted is not None:
        try:
            comparison = ledger.compare(metric, experiment=str(wanted))
        except ValueError as err:
            comparison = terminal_safe(err)
    estimate, largest = _detail(run, "estimate"), _detail(run, "estimate_largest")
    return RunFolder(
        run, phases, updates, model, record, last, all_runs, wanted, comparison, estimate, largest
    )


def variant_costs(
    out_dir: storage.PathLike,
    runs: pd.DataFrame,
    *,
    by: str = "variant",
    control: str | None = None,
) -> pd.DataFrame:
    """Each variant's memory, step time and data shape, from the phase tables and
    BatchInspector's examples of ``runs`` (``Ledger.runs()``) under ``<out_dir>/runs``
    (:func:`~lightning_pilot.report.analysis.summarize_costs`)."""
    rows = []
    for run in records(runs):
        folder = _run_folder(storage.location(out_dir), run["run_id"])
        if folder is None:
            continue
        try:
            phases = storage.read_phase_table(folder)
        except (TypeError, FileNotFoundError, ValueError):
            continue
        if len(phases):
            k = accumulation(run, None)
            rows.append({by: run[by]} | run_costs(phases, _detail(folder, "examples"), k))
    return summarize_costs(pd.DataFrame(rows), by=by, control=control)
