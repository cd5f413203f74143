"""PilotRun, the context every pilot callback of a fit shares, and PilotCallback, their base
(docs/architecture.md, "PilotRun: the shared context")."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final

import lightning.pytorch as pl
import pyarrow as pa
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_pilot import schemas, storage
from lightning_pilot.core import validate
from lightning_pilot.core.ids import new_run_id, validate_run_id
from lightning_pilot.core.phases import CheckResult, judge
from lightning_pilot.core.summary import Summary
from lightning_pilot.storage.paths import _LOCAL_URL
from lightning_pilot.storage.publish import reserve_file
from lightning_pilot.vocabulary import worst_verdict

PHASE_TABLE: Final = "phases"

#: ``fn(pl_module, directory) -> path``: the user's export, writing the final artifact.
ExportFn = Callable[[pl.LightningModule, Path], "str | os.PathLike[str] | None"]

_RUNS: weakref.WeakKeyDictionary[pl.Trainer, PilotRun] = weakref.WeakKeyDictionary()
_RUNS_LOCK = threading.Lock()


def _warn(message: str, stacklevel: int = 2) -> None:
    warnings.warn(f"lightning-pilot: {message}", RuntimeWarning, stacklevel=stacklevel + 1)


def _out_dir(owner: str, value: object, name: str = "out_dir", optional: bool = True) -> Any:
    """``value`` checked and resolved once (a link swapped there later is not followed)."""
    if isinstance(value, storage.RemotePath):
        return value
    folder = validate.path(owner, name, value, optional=optional)
    if folder is None:
        return None
    if isinstance(value, str):
        folder = storage.location(value)  # a URL: remote; file://: local
        if isinstance(folder, storage.RemotePath):
            return folder
    return Path(os.path.realpath(os.path.expanduser(folder)))


_WARNED_ROOTS: set[str] = set()


def _default_out_dir(trainer: pl.Trainer) -> storage.Location:
    """``<trainer.default_root_dir>/pilot``, where Lightning's checkpoints go, read as fsspec
    reads it; says once when Lightning's normalisation moves a ``file:`` root (``file://runs``)."""
    root = os.fspath(trainer.default_root_dir)
    folder = storage.location(root)
    given = getattr(trainer, "_default_root_dir", None)  # what the user wrote
    if isinstance(given, str) and given != root and _LOCAL_URL.match(given):
        with contextlib.suppress(ImportError, ValueError):
            meant = storage.location(given)
            if meant != folder and given not in _WARNED_ROOTS:
                _WARNED_ROOTS.add(given)
                _warn(
                    f"Trainer(default_root_dir={given!r}) is read by Lightning as {str(folder)!r},"
                    f" not {str(meant)!r}: its checkpoints go there, and so does the pilot folder."
                    " Write file:///absolute/path (three slashes) or a plain path for the folder"
                    " you mean.",
                    stacklevel=1,
                )
    return folder / "pilot"


class PilotRun:
    """The shared context of one fit: identity, output folder and buffered rows.

    Get it with :meth:`PilotRun.of`; construct it directly only to write a run without a
    Trainer (``default_out_dir``: when no callback names an ``out_dir``).

    Example:
        >>> import tempfile
        >>> run = PilotRun(default_out_dir=tempfile.mkdtemp())
        >>> run.attempt, run.rank, run.resumed
        (1, 0, False)
        >>> run.put_phase_row({"phase": "setup", "counter": "none", "verdict": "not_checked",
        ...                    "reason": "example"}, source="doctest")
        >>> [path.name.startswith("part-a0001-r00000-") for path in run.flush()]
        [True]
        >>> from lightning_pilot import read_phase_table
        >>> read_phase_table(run.run_dir)[["phase", "verdict", "attempt"]].to_dict("records")
        [{'phase': 'setup', 'verdict': 'not_checked', 'attempt': 1}]
    """

    def __init__(
        self,
        *,
        default_out_dir: storage.PathLike,
        rank: int = 0,
        world_size: int = 1,
        stage: str | None = None,
    ) -> None:
        self._default_out_dir: storage.Location = _out_dir(
            "PilotRun", default_out_dir, "default_out_dir", optional=False
        )
        self.rank = validate.integer("PilotRun", "rank", rank, minimum=0)
        self.world_size = validate.integer(
            "PilotRun", "world_size", world_size, minimum=rank + 1, hint="> rank"
        )
        self.stage = stage
        self.attempt_id = new_run_id()
        self.run_id = self.attempt_id
        self.attempt = 1
        self.resumed = False
        self.closed = False
        self.exception: BaseException | None = None
        self._explicit_out_dir: tuple[str, storage.Location] | None = None
        self._attached: dict[int, str] = {}
        self._synchronized = False
        self._published = False
        self._phase_rows: dict[tuple[str, bool], dict[str, Any]] = {}
        self._tables: dict[str, list[dict[str, Any]]] = {}
        self._schemas: dict[str, pa.Schema | None] = {PHASE_TABLE: storage.PHASE_SCHEMA}
        self._seq: dict[str, int] = {}
        self._dirty: set[str] = set()
        self._ledger_fields: dict[str, Any] = {}
        #: What callbacks add to the summary the Trainer's loggers receive when the run closes.
        self.summary = Summary()
        self._lock = threading.RLock()
        self._closers: list[Callable[[OSError | None], None]] = []  # see on_close
        self._reserve: Path | None = None
        self._closing = False
        self._exports: dict[int, tuple[ExportFn, Path | None, str | None]] = {}
        #: Set by the memory monitor: a context manager that measures the ``export`` phase.
        self.measure_export: Callable[[], contextlib.AbstractContextManager[Any]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__ | {"_closers": [], "_exports": {}, "measure_export": None}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    @classmethod
    def of(cls, trainer: pl.Trainer) -> PilotRun:
        """The open run of ``trainer``'s current fit, created on first use; ``validate``,
        ``test`` or ``predict`` after a fit that ended cleanly reopen that fit's run."""
        with _RUNS_LOCK:
            run = _RUNS.get(trainer)
            stage = trainer.state.fn.value if trainer.state.fn is not None else None
            if run is not None and run.closed and run.exception is None and stage != "fit":
                run.closed = False
                run.stage = stage
            if run is None or run.closed:
                run = cls(
                    default_out_dir=_default_out_dir(trainer),
                    rank=trainer.global_rank,
                    world_size=trainer.world_size,
                    stage=stage,
                )
                _RUNS[trainer] = run
            return run

    @classmethod
    def last(cls, trainer: pl.Trainer) -> PilotRun | None:
        """The most recent run of ``trainer``, open or closed (``None`` if it never had one)."""
        with _RUNS_LOCK:
            return _RUNS.get(trainer)

    @property
    def out_dir(self) -> storage.Location:
        """The output folder: the ``out_dir`` a callback named, else the default."""
        return self._explicit_out_dir[1] if self._explicit_out_dir else self._default_out_dir

    @property
    def run_dir(self) -> storage.Location:
        """``<out_dir>/runs/<run_id>``: the phase table and per-callback details."""
        return storage.safe_join(self.out_dir, "runs", self.run_id)

    @property
    def ledger_dir(self) -> storage.Location:
        """``<out_dir>/ledger``: the append-only run ledger (a link there is refused)."""
        return storage.safe_join(self.out_dir, "ledger")

    @property
    def is_global_zero(self) -> bool:
        """Whether this process writes the shared files (the ledger)."""
        return self.rank == 0

    @property
    def writer(self) -> str:
        """This process's snapshot writer name: attempt, rank and the unique attempt id."""
        return f"a{self.attempt:04d}-r{self.rank:05d}-{self.attempt_id}"

    def attach(self, callback: object, out_dir: storage.PathLike | None = None) -> None:
        """Register a callback with this run; an ``out_dir`` it names must be the one every
        other callback names (else ``ValueError``)."""
        name = type(callback).__name__
        wanted: storage.Location | None = _out_dir(name, out_dir)
        with self._lock:
            if wanted is not None:
                if self._explicit_out_dir is not None and self._explicit_out_dir[1] != wanted:
                    other, other_dir = self._explicit_out_dir
                    raise ValueError(
                        f"{other}(out_dir={str(other_dir)!r}) and {name}(out_dir={str(wanted)!r})"
                        " are in the same Trainer but name different output folders; one fit"
                        " writes one run into one folder. Give them the same out_dir, or leave"
                        f" it unset to use {str(self._default_out_dir)!r}."
                    )
                if self._published and wanted != self.out_dir:
                    raise ValueError(
                        f"{name}(out_dir={str(wanted)!r}) joined run {self.run_id} after it had"
                        f" already written to {str(self.out_dir)!r}; give every pilot callback"
                        " the same out_dir."
                    )
                self._explicit_out_dir = (name, wanted)
            self._attached[id(callback)] = name

    def synchronize(self, trainer: pl.Trainer) -> None:
        """Make every rank use global rank 0's ids: a collective, called from ``setup`` (every
        rank runs the same hooks there, in the same order)."""
        with self._lock:
            already = self._synchronized
            self._synchronized = True
        if already or self.world_size == 1:
            return
        shared = trainer.strategy.broadcast(self.attempt_id, src=0)
        attempt_id = validate_run_id(shared, "broadcast attempt_id")
        with self._lock:
            if not self.resumed:
                self.run_id = attempt_id
            self.attempt_id = attempt_id

    def close(
        self,
        callback: object,
        *,
        failing: bool = False,
        loggers: Sequence[Any] = (),
        step: int | None = None,
    ) -> None:
        """Detach a callback; the last one to leave flushes the run, calls the closers, logs the
        summary (a clean close only) and closes it (``failing=True``: a failed write warns)."""
        with self._lock:
            if self._attached.pop(id(callback), None) is None or self._attached:
                return
            self._closing = True  # the final flush must not reserve anew
            self.release_space()
            error: OSError | None = None
            try:
                self.flush()
            except OSError as err:
                error = err
            closers, self._closers = self._closers, []
            try:
                for closer in closers:
                    try:
                        closer(error)
                    except OSError as err:
                        error = error or err
                    except Exception as err:  # one closer must not cost the others
                        _warn(f"closing run {self.run_id} failed: {err!r}")
            finally:
                self.closed = True
            if not failing:
                self._log_summary(loggers, step)
                if error is not None:
                    raise error
            elif error is not None:
                _warn(
                    f"could not write run {self.run_id} to {self.out_dir} while the fit was"
                    f" failing: {error}"
                )

    def _log_summary(self, loggers: Sequence[Any], step: int | None) -> None:
        """Give every logger the summary; one that refuses it is a warning, never an error."""
        if not loggers:
            return
        summary = Summary.of_phase_rows(self.phase_rows())
        summary.update(self.summary)
        for logger in loggers:
            try:
                logger.log_metrics(dict(summary.metrics), step=step)
                if summary.texts:
                    logger.log_hyperparams(dict(summary.texts))
            except Exception as err:
                _warn(
                    f"could not log run {self.run_id}'s summary to {type(logger).__name__}: {err!r}"
                )

    def on_close(self, closer: Callable[[OSError | None], None]) -> None:
        """Call ``closer(error)`` (the final flush's ``OSError`` or ``None``) when the run closes;
        an ``OSError`` it raises is raised by the close."""
        with self._lock:
            self._closers.append(closer)

    def reserve_space(self, size: int = 1 << 20) -> None:
        """Hold ``size`` bytes of disk in ``out_dir`` until the run closes, so a disk that fills
        during the fit still has room for the tables and the ledger's end record."""
        with self._lock:
            if self._reserve is not None or self.closed or self._closing:
                return
            path = self.out_dir / f".reserve-{self.attempt_id}-r{self.rank:05d}"
            if isinstance(path, storage.RemotePath):
                return  # no disk of ours to hold on an object store
            self._reserve = path
            reserve_file(path, size)  # no room, or not Linux: nothing is reserved

    def release_space(self) -> None:
        """Give back the space :meth:`reserve_space` held, if any."""
        with self._lock:
            try:
                if self._reserve is not None:
                    self._reserve.unlink(missing_ok=True)
            except OSError as err:
                _warn(f"could not release the reserved space {self._reserve}: {err}")

    def export(
        self, fn: ExportFn, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> tuple[Path | None, str | None]:
        """Run the user's ``fn(pl_module, directory)`` once for this run, into
        ``<run_dir>/export`` on global rank 0 (the others wait at a barrier), measured by
        :attr:`measure_export`; return (path, error): an error is returned, never raised."""
        with self._lock:
            done = self._exports.get(id(fn))
            if done is not None and done[0] is fn:
                return done[1], done[2]
            path: Path | None = None
            error: str | None = None
            if self.is_global_zero:  # into a local folder: the user's fn writes local files
                directory = storage.work_folder(self.run_dir, "export")
                measure = self.measure_export() if self.measure_export else contextlib.nullcontext()
                try:
                    with measure:
                        result = fn(pl_module, directory)
                except Exception as err:  # the user's export function
                    error = f"export(pl_module, directory) raised {type(err).__name__}: {err}"
                else:
                    if result is None or not Path(os.fspath(result)).exists():
                        error = (
                            f"export(pl_module, directory) returned {result!r}, which names no"
                            " file or folder"
                        )
                    else:
                        path = Path(os.fspath(result))
            if trainer.world_size > 1:
                trainer.strategy.barrier("lightning_pilot.export")
            self._exports[id(fn)] = (fn, path, error)
            return path, error

    def record_exception(self, exception: BaseException) -> None:
        """Remember the exception that ended the fit (for ledger end records)."""
        with self._lock:
            if self.exception is None:
                self.exception = exception

    def identity(self) -> dict[str, Any]:
        """The identity saved in checkpoints (weights-only-safe types only)."""
        return {"run_id": self.run_id, "attempt": self.attempt}

    def adopt(self, identity: Mapping[str, Any]) -> None:
        """Continue the run a checkpoint came from: same ``run_id``, the next attempt (once for
        several callbacks carrying it); an invalid saved identity is a ``ValueError``."""
        run_id = validate_run_id(identity.get("run_id"), "checkpoint pilot run_id")
        attempt = identity.get("attempt", 1)
        if not isinstance(attempt, int) or attempt < 1:
            raise ValueError(
                f"checkpoint pilot attempt={attempt!r} is invalid: expected a positive integer."
            )
        with self._lock:
            if self.resumed:
                if run_id != self.run_id:
                    _warn(
                        f"the checkpoint carries two run ids ({self.run_id} and {run_id});"
                        f" keeping {self.run_id}."
                    )
                return
            if self._published:
                _warn(
                    f"rows were already written under run {self.run_id} before the checkpoint"
                    f" of run {run_id} was loaded; they stay there."
                )
            self.run_id = run_id
            self.attempt = attempt + 1
            self.resumed = True

    def set_ledger_fields(self, **fields: Any) -> None:
        """Hand facts of this run (ledger columns, later values replacing earlier ones) to the
        ledger callback, which reads :attr:`ledger_fields`."""
        unknown = sorted(set(fields) - set(storage.LEDGER_SCHEMA.names))
        if unknown:
            raise ValueError(
                f"unknown ledger field(s) {unknown}; valid fields are"
                f" {storage.LEDGER_SCHEMA.names}."
            )
        with self._lock:
            self._ledger_fields.update(fields)

    @property
    def ledger_fields(self) -> dict[str, Any]:
        """A copy of the facts handed over with :meth:`set_ledger_fields`."""
        with self._lock:
            return dict(self._ledger_fields)

    def put_phase_row(self, row: Mapping[str, Any], *, source: str) -> None:
        """Add or merge the row of ``(phase, first)`` (docs/architecture.md, "The phase table")."""
        storage.validate_phase_row(row)
        key = (str(row["phase"]), bool(row.get("first") or False))
        with self._lock:
            current = self._phase_rows.get(key)
            merged = dict(row) if current is None else _merge_phase_rows(current, row)
            sources = [s for s in (merged.get("source") or "").split(",") if s]
            if source not in sources:
                sources.append(source)
            merged["source"] = ",".join(sources)
            merged["first"] = key[1]
            self._phase_rows[key] = merged
            self._dirty.add(PHASE_TABLE)

    def phase_rows(self) -> list[dict[str, Any]]:
        """A copy of the buffered phase rows of this process."""
        with self._lock:
            return [dict(row) for row in self._phase_rows.values()]

    def register_table(self, name: str, schema: pa.Schema | None = None) -> None:
        """Declare a detail table ``runs/<run_id>/<name>.parquet`` (schema inferred if None)."""
        storage.safe_path_component(name, "table name")
        with self._lock:
            if name == PHASE_TABLE:
                raise ValueError(f"table name {name!r} is reserved for the phase table.")
            self._schemas.setdefault(name, schema)
            self._tables.setdefault(name, [])

    def append_rows(self, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """Append rows to a registered detail table."""
        with self._lock:
            if name not in self._tables:
                raise ValueError(
                    f"table {name!r} is not registered; call register_table({name!r}) first"
                    f" (registered: {sorted(self._tables)})."
                )
            self._tables[name].extend(dict(row) for row in rows)
            self._dirty.add(name)

    def flush(self) -> list[storage.Location]:
        """Publish a snapshot of every table changed since the last flush; return the files (on
        an ``OSError`` the tables stay buffered)."""
        self.reserve_space()
        with self._lock:
            written = []
            for name in sorted(self._dirty):
                table = self._build_table(name)
                seq = self._seq.get(name, 0) + 1
                path = storage.write_snapshot(
                    self.run_dir / f"{name}.parquet", table, writer=self.writer, seq=seq
                )
                self._seq[name] = seq
                self._published = True
                self._dirty.discard(name)
                written.append(path)
            return written

    def _stamp(self, row: Mapping[str, Any], now: datetime) -> dict[str, Any]:
        identity = {"run_id": self.run_id, "attempt": self.attempt, "attempt_id": self.attempt_id}
        stamped = {**row, **identity, "rank": self.rank}
        stamped.setdefault("world_size", self.world_size)
        stamped.setdefault("written_at", now)
        return stamped

    def _build_table(self, name: str) -> pa.Table:
        now = datetime.now(timezone.utc)
        if name == PHASE_TABLE:
            current = {"schema_version": storage.PHASE_SCHEMA_VERSION}
            rows = [self._stamp(row, now) | current for row in self._phase_rows.values()]
            return storage.rows_to_table(rows, storage.PHASE_SCHEMA)
        schema = self._schemas.get(name)
        if schema is None:
            return pa.Table.from_pylist([self._stamp(row, now) for row in self._tables[name]])
        return self.stamped_table(self._tables[name], schema, now=now)

    def stamped_table(
        self, rows: Sequence[Mapping[str, Any]], schema: pa.Schema, *, now: datetime | None = None
    ) -> pa.Table:
        """``rows`` as a table of ``schema``, with this run's identity columns and the schema's
        version filled in."""
        now = now or datetime.now(timezone.utc)
        stamped = [self._stamp(row, now) for row in rows]
        version = schemas.schema_version(schema)
        if version is not None and "schema_version" in schema.names:
            stamped = [r | {"schema_version": r.get("schema_version", version)} for r in stamped]
        return storage.rows_to_table(stamped, schema)


def _merge_phase_rows(current: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(current)
    special = ("verdict", "checks", "reason", "source")  # merged below, or by put_phase_row
    merged.update({k: v for k, v in new.items() if v is not None and k not in special})
    verdicts = [v for v in (current.get("verdict"), new.get("verdict")) if v is not None]
    if verdicts:
        merged["verdict"] = worst_verdict(verdicts)
    checks = {c["name"]: c for c in [*(current.get("checks") or []), *(new.get("checks") or [])]}
    if checks:
        merged["checks"] = list(checks.values())
        judged, _ = judge(
            str(merged.get("phase")),
            ((c["name"], c["verdict"], c.get("detail") or "") for c in checks.values()),
        )
        merged["verdict"] = worst_verdict([judged, *(v for v in verdicts if v in ("fail", "warn"))])
    reasons = [r for r in (current.get("reason"), new.get("reason")) if r]
    if reasons:
        merged["reason"] = "; ".join(dict.fromkeys(reasons))
    return merged


_ABSENT: Final = object()  # a hook the instance did not hold


class PilotRefusalError(RuntimeError):
    """Raised on purpose by a pilot callback to stop a fit before it runs (such as
    ``DivergenceLedger(on_repeat="error")``); never turned into a verdict."""


#: The hooks whose exceptions become a ``not_checked`` check of the phase row ``pilot`` (see
#: :func:`_guard`); not ``setup`` nor the checkpoint state, whose errors are raised.
GUARDED_HOOKS: Final = frozenset(
    name
    for name in dir(Callback)
    if (name.startswith("on_") or name == "teardown") and callable(getattr(Callback, name))
)

#: Hooks that close the run: they run even after an error, and close it if they fail.
_CLOSING: Final = frozenset({"teardown", "on_exception"})


def _guard(name: str, hook: Any) -> Any:
    """Wrap a hook so that an exception in it never breaks the fit (but ``OSError``, the
    pilot's own writes failing, and :class:`PilotRefusalError` pass through)."""
    if getattr(hook, "_pilot_guarded", False):
        return hook

    @functools.wraps(hook)
    def guarded(self: PilotCallback, *args: Any, **kwargs: Any) -> Any:
        try:
            return hook(self, *args, **kwargs)
        except (OSError, PilotRefusalError):
            raise
        except Exception as err:
            self._hook_failed(name, err)
            run = self._run
            if name in _CLOSING:
                self._unmute()
                if run is not None:
                    run.close(self, failing=True)
            elif run is not None and run.world_size > 1:
                raise  # a rank that swallowed it would skip a collective the others wait in
            return None

    guarded._pilot_guarded = True  # type: ignore[attr-defined]
    return guarded


class PilotCallback(Callback):
    """Base of every pilot callback: joins the fit's :class:`PilotRun` and leaves it cleanly.

    Subclasses that override ``setup``, ``teardown``, ``on_exception`` or the state hooks call
    ``super()`` (docs/architecture.md). ``out_dir``: ``<default_root_dir>/pilot``.

    Example:
        >>> import tempfile
        >>> import lightning.pytorch as pl
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> from lightning_pilot import PilotCallback
        >>> folder = tempfile.mkdtemp()
        >>> callback = PilotCallback(out_dir=folder)
        >>> trainer = pl.Trainer(max_steps=2, callbacks=[callback], logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, default_root_dir=folder)
        >>> trainer.fit(BoringModel())
        >>> callback.run.closed, callback.run.out_dir == Path(folder).resolve()
        (True, True)
    """

    STATE_VERSION: Final = 1

    #: The hooks Lightning calls on every callback for every micro-batch or update.
    PER_UPDATE_HOOKS: Final = (
        "on_train_batch_start",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_before_zero_grad",
        "on_train_batch_end",
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in GUARDED_HOOKS:
            hook = cls.__dict__.get(name)
            if callable(hook):
                setattr(cls, name, _guard(name, hook))

    def _hook_failed(self, hook: str, err: Exception) -> None:
        """Record an exception raised inside ``hook``: a warning (once per hook) and a counted
        ``not_checked`` check on the phase table's ``pilot`` row."""
        counts = self.__dict__.setdefault("_hook_errors", {})
        counts[hook] = counts.get(hook, 0) + 1
        name = f"{type(self).__name__}.{hook}"
        what = f"raised {type(err).__name__}: {str(err)[:500]}"
        went_on = "the fit went on without what this hook would have checked or written"
        detail = f"{what} ({counts[hook]} time(s)); {went_on}"
        if counts[hook] == 1:
            _warn(f"{name} {detail} (phase table row 'pilot')", stacklevel=3)
        run = self._run
        if run is None:
            return
        try:
            check = CheckResult(name, "not_checked", detail)
            # The count lives in the check; the reason stays the same text at every repeat.
            reason = f"{name} {what}; {went_on} (count: check {name})"
            self._put_checks("pilot", [check], counter="none", reason=reason)
            if run.closed:
                run.flush()
        except (OSError, ValueError) as inner:  # recording must not break the fit either
            _warn(f"could not record {name}'s error: {inner}", stacklevel=3)

    def __init__(self, *, out_dir: storage.PathLike | None = None) -> None:
        self._out_dir: storage.Location | None = _out_dir(type(self).__name__, out_dir)
        self._run: PilotRun | None = None
        self._pending_identity: Mapping[str, Any] | None = None

    def _mute(self, *hooks: str) -> None:
        """Have Lightning skip these per-update hooks of this instance until :meth:`_unmute`
        (its dispatcher calls no hook set to ``None``)."""
        muted = self.__dict__.setdefault("_muted_hooks", {})
        for hook in hooks:
            held = self.__dict__.get(hook, _ABSENT)
            if hook in muted or held is None:
                continue
            muted[hook] = held
            self.__dict__[hook] = None

    def _unmute(self, *hooks: str) -> None:
        """Give back the hooks this instance muted (all when none are named); one replaced since
        keeps its replacement."""
        muted = self.__dict__.setdefault("_muted_hooks", {})
        for hook in hooks or tuple(muted):
            held = muted.pop(hook, None)  # never None when muted
            if held is None or self.__dict__.get(hook, _ABSENT) is not None:
                continue  # not muted, or someone set the hook since: theirs stays
            if held is _ABSENT:
                del self.__dict__[hook]
            else:
                self.__dict__[hook] = held

    def _mute_unused(self) -> None:
        """Mute the per-update hooks the class does not override (Lightning's no-ops)."""
        for hook in self.PER_UPDATE_HOOKS:
            if getattr(type(self), hook) is getattr(Callback, hook) and hook not in self.__dict__:
                self._mute(hook)

    def _put_checks(
        self, phase: str, results: Sequence[CheckResult], **columns: Any
    ) -> tuple[str, str | None]:
        """Judge ``results`` into the phase row of ``phase`` (first occurrence unless ``columns``
        say otherwise); return the verdict and the reason."""
        verdict, reason = judge(phase, ((c.name, c.verdict, c.detail) for c in results))
        row = {"phase": phase, "first": True, "verdict": verdict, "reason": reason}
        checks = [c.as_row() for c in results]
        self.run.put_phase_row(row | {"checks": checks} | columns, source=type(self).__name__)
        return verdict, reason

    @property
    def out_dir(self) -> storage.Location | None:
        """The ``out_dir`` this callback was given (``None``: the run's default)."""
        return self._out_dir

    @property
    def run(self) -> PilotRun:
        """The run this callback writes into (the last one, after the fit ended)."""
        if self._run is None:
            raise RuntimeError(
                f"{type(self).__name__} has no run yet: the run starts when a Trainer calls"
                " setup() (trainer.fit/validate/test/predict)."
            )
        return self._run

    @functools.cached_property
    def state_key(self) -> str:
        # Built once: Lightning reads it for every hook of every callback (its profiler label).
        return self._generate_state_key(**self._state_key_fields())

    def _state_key_fields(self) -> dict[str, Any]:
        """The options that tell two instances of this callback apart in a checkpoint."""
        return {"out_dir": str(self._out_dir)}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._unmute()  # a new fit: every hook back, then the unused ones muted
        self._mute_unused()
        run = PilotRun.of(trainer)
        run.attach(self, self._out_dir)
        run.synchronize(trainer)
        if self._pending_identity is not None:
            run.adopt(self._pending_identity)
            self._pending_identity = None
        self._run = run
        _ = run.run_dir, run.ledger_dir  # a link inside out_dir is refused before training

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._unmute()
        if self._run is not None:
            self._run.close(self, loggers=trainer.loggers, step=trainer.global_step)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._unmute()
        if self._run is not None:
            self._run.record_exception(exception)
            self._run.close(self, failing=True)

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._run is None:
            return {}
        return {"version": self.STATE_VERSION, "pilot_run": self._run.identity()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        identity = state_dict.get("pilot_run")
        if not isinstance(identity, Mapping):
            return
        if self._run is not None and not self._run.closed:
            self._run.adopt(identity)
        else:
            self._pending_identity = identity


for _name in GUARDED_HOOKS:
    if callable(PilotCallback.__dict__.get(_name)):
        setattr(PilotCallback, _name, _guard(_name, PilotCallback.__dict__[_name]))
del _name
