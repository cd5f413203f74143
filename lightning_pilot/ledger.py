"""Ledger: read, fold and compare the run ledger without a Trainer, torch or Lightning
(docs/ledger.md, "Reading with Ledger", "Comparing across seeds")."""

from __future__ import annotations

import hashlib
import warnings
from datetime import datetime, timedelta, timezone
from typing import Any, Final, Literal

import numpy as np
import pandas as pd

from lightning_pilot import storage
from lightning_pilot.core import validate
from lightning_pilot.core.compare import Comparison, compare_runs
from lightning_pilot.schemas import PREDICTIONS_SCHEMA
from lightning_pilot.storage.ledger_store import LEDGER_GRACE_SECONDS, _ledger_folder
from lightning_pilot.storage.paths import _location_argument
from lightning_pilot.storage.tables import _to_pandas

#: Columns that describe what happened last: taken from the latest record as they are.
OUTCOME_COLUMNS: Final = (
    "event",
    "written_at",
    "attempt",
    "attempt_id",
    "status",
    "stop_cause",
    "stop_step",
    "stop_detail",
    "updates_done",
    "examples_seen",
    "tokens_seen",
    "exception_type",
    "exception_message",
    "predictions_uri",
    "predictions_sha256",
    "checkpoint_uri",
    "checkpoint_sha256",
)
CURVE_COLUMNS: Final = ("train_loss", "lr_curve", "val_points")
_RUN_COLUMNS_FIRST: Final = (
    "run_id",
    "experiment",
    "variant",
    "seed",
    "status",
    "stop_cause",
    "stop_step",
    "updates_done",
    "planned_updates",
)


def fold_records(
    records: pd.DataFrame, *, now: datetime | None = None, stale_after: float = 1800.0
) -> pd.DataFrame:
    """Fold ledger records (oldest first) into one row per run, in start order; see :class:`Ledger`.

    Columns: the ledger's (curves excluded) plus ``started_at``, ``last_event``, ``records`` and
    ``attempts``; a run with no ``end`` record and none for ``stale_after`` seconds before ``now``
    is ``interrupted``.
    """
    scalar = [c for c in records.columns if c not in CURVE_COLUMNS]
    if records.empty:
        return pd.DataFrame(columns=[*scalar, "started_at", "last_event", "records", "attempts"])
    frame = records[scalar]
    groups = frame.groupby("run_id", sort=False)
    config = groups.last()  # latest non-null value of every column
    # Aligned once to the runs' order: every assignment below then needs no index lookup
    # (22 lookups of 100,000 run ids took most of the fold).
    latest = frame.drop_duplicates("run_id", keep="last").set_index("run_id").reindex(config.index)
    outcome = [c for c in OUTCOME_COLUMNS if c in latest.columns]
    config[outcome] = latest[outcome]
    config["started_at"] = groups["written_at"].first()
    config["records"] = groups.size().astype("int64")
    config["attempts"] = groups["attempt"].max().astype("Int32")
    config["last_event"] = latest["event"]
    now = now or datetime.now(timezone.utc)
    cutoff = pd.Timestamp(now - timedelta(seconds=stale_after))
    open_runs = config["last_event"] != "end"
    stale = open_runs & (config["written_at"] < cutoff)
    config.loc[stale, "status"] = "interrupted"
    config.loc[stale, "stop_cause"] = "heartbeat_lost"
    config.loc[open_runs & ~stale, "status"] = "running"
    config = config.reset_index()
    ordered = [c for c in _RUN_COLUMNS_FIRST if c in config.columns]
    return config[ordered + [c for c in config.columns if c not in ordered]]


class Ledger:
    """Read a run ledger: one row per run, the curves, and comparisons across seeds.

    ``path`` is the ledger folder or the output folder holding ``ledger/``. A run with no
    ``end`` record reads as ``interrupted`` / ``heartbeat_lost`` after ``stale_after`` seconds
    without any record (choose a few heartbeat intervals of your slowest run). ``skipped``
    lists the record files the latest read skipped (also in the frames' ``attrs["skipped"]``).

    Example:
        >>> import tempfile
        >>> from lightning_pilot.core.ids import new_run_id
        >>> from lightning_pilot.storage import write_ledger_record
        >>> folder, run = tempfile.mkdtemp(), {"run_id": new_run_id(), "variant": "ctl"}
        >>> _ = write_ledger_record(folder, {**run, "event": "start", "status": "running"})
        >>> _ = write_ledger_record(folder, {**run, "event": "end", "status": "completed",
        ...                                  "train_loss": [{"step": 4, "value": 1.5}]})
        >>> Ledger(folder).runs()[["variant", "status", "records"]]
          variant     status  records
        0     ctl  completed        2
        >>> Ledger(folder).curves()[["curve", "step", "value"]]
                curve  step  value
        0  train_loss     4    1.5
    """

    def __init__(self, path: storage.PathLike, *, stale_after: float = 1800.0) -> None:
        root = _location_argument("Ledger", "path", path, "the ledger folder")
        self.path = _ledger_folder(root, "Ledger")  # FileNotFoundError when missing
        self.stale_after = validate.number(
            "Ledger", "stale_after", stale_after, minimum=0, finite=False, hint="seconds"
        )
        self.skipped: list[str] = []
        nested = root / "pilot" / "ledger"
        if self.path == root and nested.is_dir() and not any(root.glob("*.parquet")):
            # A Trainer's default_root_dir instead of its pilot folder: say where the ledger is.
            warnings.warn(
                f"lightning-pilot: {root} holds no ledger records; the ledger is in {nested}"
                f" (pass {root / 'pilot'})",
                UserWarning,
                stacklevel=2,
            )

    def __repr__(self) -> str:
        return f"Ledger({str(self.path)!r})"

    def records(self) -> pd.DataFrame:
        """Every record once, oldest first (files skipped: listed in :attr:`skipped`)."""
        records = storage.read_ledger_records(self.path)
        self.skipped = list(records.attrs.get("skipped", []))
        return records

    def _table(self, columns: tuple[str, ...]) -> Any:
        skipped: list[str] = []
        table = storage.read_ledger_table(self.path, columns=columns, skipped=skipped)
        self.skipped = skipped
        return table

    def index(self) -> storage.Location | None:
        """Copy records not yet indexed into index segments, so later reads are fast; return
        the last new one, or ``None`` (:func:`~lightning_pilot.storage.index_ledger`)."""
        return storage.index_ledger(self.path)

    def compact(self, *, grace: float | None = LEDGER_GRACE_SECONDS) -> list[Any]:
        """Compact the ledger (:func:`~lightning_pilot.storage.compact_ledger`), safe beside
        writers, readers and other compactors; return the new segments."""
        return storage.compact_ledger(self.path, grace=grace)

    def runs(self, *, now: datetime | None = None) -> pd.DataFrame:
        """One row per run (:func:`fold_records`); ``now`` is for tests and replays."""
        scalar = tuple(c for c in storage.LEDGER_SCHEMA.names if c not in CURVE_COLUMNS)
        records = _to_pandas(self._table(scalar))
        runs = fold_records(records, now=now, stale_after=self.stale_after)
        runs.attrs["skipped"] = list(self.skipped)
        return runs

    def curves(self, *, all_attempts: bool = False) -> pd.DataFrame:
        """The curves in long format, one row per point (``curve`` is ``train_loss``, ``lr`` or
        ``val``; ``name`` the metric name for ``val``); ``all_attempts`` keeps every attempt's."""
        columns = (*_CURVE_IDENTITY, "attempt_id", "curves_delta", *CURVE_COLUMNS)
        curves = _curves_table(self._table(columns), all_attempts=all_attempts)
        curves.attrs["skipped"] = list(self.skipped)
        return curves

    def predictions(self, run_id: str) -> pd.DataFrame:
        """The validation predictions a run's latest record references, checked by sha256
        (``KeyError``: unknown run; ``ValueError``: none saved, changed since, or unreadable)."""
        latest = self.records().drop_duplicates("run_id", keep="last").set_index("run_id")
        if run_id not in latest.index:
            raise KeyError(f"run_id={run_id!r} is not in {self}.")
        uri = latest.at[run_id, "predictions_uri"]
        expected = str(latest.at[run_id, "predictions_sha256"])
        if not isinstance(uri, str):
            raise ValueError(
                f"run {run_id} recorded no predictions (no ValidationPredictionWriter in its fit?)."
            )
        actual = file_sha256(uri)
        if actual != expected:
            raise ValueError(f"{uri} has sha256 {actual}, but the ledger recorded {expected}.")
        skipped: list[str] = []
        table = storage.read_parquet_files([uri], PREDICTIONS_SCHEMA, skipped=skipped)
        if skipped:
            raise ValueError(f"{uri} could not be read (unreadable, or over DETAIL_FILE_LIMITS).")
        frame: pd.DataFrame = table.to_pandas()
        return frame

    def compare(
        self,
        metric: str,
        by: str = "variant",
        control: str | None = None,
        *,
        mode: Literal["min", "max"] = "min",
        reduce: Literal["last", "min", "max"] = "last",
        failures: Literal["worst", "exclude"] = "worst",
        experiment: str | None = None,
        min_runs_for_ci: int = 5,
        n_boot: int = 2000,
        random_state: int = 0,
    ) -> Comparison:
        """Compare groups of runs (the column ``by`` of :meth:`runs`) on ``metric`` across seeds.

        ``metric`` is a validation metric name, ``"train_loss"`` or a numeric column of
        :meth:`runs`; ``reduce`` picks a curve's ``last`` point or its ``min`` / ``max``; the
        other options are those of :func:`~lightning_pilot.core.compare.compare_runs`.
        """
        validate.choice("Ledger.compare", "reduce", reduce, ("last", "min", "max"))
        records = self.records()
        runs = fold_records(records, stale_after=self.stale_after)
        if experiment is not None:
            known = sorted(runs["experiment"].dropna().unique().tolist())
            if experiment not in known:
                raise ValueError(f"experiment={experiment!r} is not in the ledger; known: {known}.")
            runs = runs[runs["experiment"] == experiment]
        if by not in runs.columns:
            raise ValueError(f"by={by!r} is not a column of runs(); columns: {list(runs.columns)}.")
        runs = runs.assign(value=_metric_values(records, runs, metric, reduce, mode))
        columns = ["run_id", by, "seed", "status", "stop_cause", "value"]
        table = runs[list(dict.fromkeys(columns))].sort_values("run_id", kind="stable")
        return compare_runs(
            table,
            value="value",
            by=by,
            control=control,
            mode=mode,
            failures=failures,
            min_runs_for_ci=min_runs_for_ci,
            n_boot=n_boot,
            random_state=random_state,
            metric=metric,
        )


def find_failed_runs(
    path: storage.PathLike,
    variant_key: str,
    statuses: tuple[str, ...] = ("diverged", "failed"),
) -> pd.DataFrame:
    """Runs of ``variant_key`` whose latest ``end`` record has one of ``statuses``; reads only
    the ``end`` records (cheap on a large ledger); ``path`` may not exist yet."""
    folder = storage.location(path)
    columns = ["run_id", "status", "stop_cause", "stop_step"]
    if not folder.is_dir():
        return pd.DataFrame(columns=columns)
    records = storage.read_ledger_records(folder, events=("end",))  # sorted, index-aware
    frame = records[[*columns, "variant_key"]].drop_duplicates("run_id", keep="last")
    hit = (frame["variant_key"] == variant_key) & frame["status"].isin(statuses)
    found: pd.DataFrame = frame.loc[hit, columns].reset_index(drop=True)
    return found


def file_sha256(path: storage.PathLike) -> str:
    """The sha256 of a file's bytes, in hex (a local path or a URL: :func:`storage.location`)."""
    digest = hashlib.sha256()
    with storage.location(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def latest_with_curves(records: pd.DataFrame, *, all_attempts: bool = False) -> pd.DataFrame:
    """The latest record of each run (or attempt), its curve columns holding the whole curve.

    A heartbeat carries only the points since the attempt's previous record (``curves_delta``):
    they are joined to those of the records before it, back to the last record that carried the
    whole curve. ``all_attempts``: one row per attempt.

    Example:
        >>> import pandas as pd
        >>> records = pd.DataFrame({"run_id": ["r"] * 3, "attempt_id": ["a"] * 3,
        ...     "curves_delta": [False, True, True], "lr_curve": [[], [], []],
        ...     "val_points": [[], [], []], "train_loss": [[{"step": 1, "value": 3.0}],
        ...     [{"step": 2, "value": 2.5}], [{"step": 3, "value": 2.0}]]})
        >>> [p["step"] for p in latest_with_curves(records)["train_loss"].iloc[0]]
        [1, 2, 3]
    """
    keys = ["run_id", "attempt_id"] if all_attempts else ["run_id"]
    latest = records.drop_duplicates(keys, keep="last")
    if "curves_delta" not in records.columns or latest.empty:
        return latest
    partial = latest["curves_delta"].astype("boolean").fillna(False).to_numpy(dtype=bool)
    if not partial.any():
        return latest
    latest = latest.copy()
    attempt = "attempt_id" if "attempt_id" in records.columns else "attempt"
    pairs = set(zip(latest["run_id"][partial], latest[attempt][partial], strict=True))
    chosen = records[
        [(r, a) in pairs for r, a in zip(records["run_id"], records[attempt], strict=True)]
    ]
    joined: dict[tuple[Any, Any], dict[str, list[Any]]] = {}
    for key, group in chosen.groupby(["run_id", attempt], sort=False, dropna=False):
        curves: dict[str, list[Any]] = {column: [] for column in CURVE_COLUMNS}
        deltas = group["curves_delta"].astype("boolean").fillna(False).tolist()
        for delta, (_, row) in zip(deltas, group.iterrows(), strict=True):
            for column in CURVE_COLUMNS:
                points = row[column] if column in group.columns else None
                points = list(points) if isinstance(points, list | np.ndarray) else []
                curves[column] = [*curves[column], *points] if delta else points
        joined[key] = curves  # type: ignore[index]
    keys_of_rows = list(zip(latest["run_id"], latest[attempt], strict=True))
    for column in CURVE_COLUMNS:
        if column in latest.columns:
            values = latest[column].tolist()
            for position in np.flatnonzero(partial):
                values[position] = joined[keys_of_rows[position]][column]
            latest[column] = pd.Series(values, index=latest.index, dtype=object)
    return latest


_CURVE_IDENTITY: Final = ("run_id", "attempt", "experiment", "variant", "seed")


def _curves_table(table: Any, *, all_attempts: bool) -> pd.DataFrame:
    """The curves (one row per point) of an Arrow table of records (oldest first), as
    :func:`latest_with_curves` joins them, with no Python loop per record or point."""
    import pyarrow as pa
    import pyarrow.compute as pc

    identity = list(_CURVE_IDENTITY)
    columns = [*identity, "curve", "name", "step", "value"]
    if table.num_rows == 0:
        return pd.DataFrame(columns=columns)
    meta = _to_pandas(table.select([*identity, "attempt_id", "curves_delta"]))
    meta["_pos"] = np.arange(len(meta))
    meta["attempt_id"] = meta["attempt_id"].fillna("\0")  # records without one: one attempt
    keys = ["run_id", "attempt_id"] if all_attempts else ["run_id"]
    latest = meta.drop_duplicates(keys, keep="last")
    # Records after (and including) their attempt's last record with whole curves: the chain
    # a delta heartbeat joins to.
    delta = meta["curves_delta"].fillna(False).to_numpy(dtype=bool)
    resets = meta["_pos"].where(~delta)
    groups = [meta["run_id"], meta["attempt_id"]]
    last_reset = resets.groupby(groups, sort=False).transform("max").fillna(-1)
    chain = meta.loc[meta["_pos"] >= last_reset, ["run_id", "attempt_id", "_pos"]]
    chosen = latest[[*identity, "attempt_id"]].assign(_order=np.arange(len(latest)))
    chosen = chain.merge(chosen, on=["run_id", "attempt_id"], how="inner")
    chosen = chosen.sort_values(["_order", "_pos"], kind="stable").reset_index(drop=True)
    positions = pa.array(chosen["_pos"].to_numpy(dtype=np.int64))
    parts = []
    for column, curve in (("train_loss", "train_loss"), ("lr_curve", "lr"), ("val_points", "val")):
        lists = table.column(column).take(positions).combine_chunks()
        flat = pc.list_flatten(lists)
        if len(flat) == 0:
            continue
        parents = pc.list_parent_indices(lists)
        valid = pc.is_valid(flat)
        flat, parents = flat.filter(valid), parents.filter(valid)
        if len(flat) == 0:
            continue
        rows = parents.to_numpy(zero_copy_only=False)
        part = chosen[identity].iloc[rows].reset_index(drop=True)
        part["curve"] = curve
        names = flat.field("name").to_pandas() if "name" in flat.type.names else None
        part["name"] = names.astype(object) if names is not None else curve
        part["step"] = flat.field("step").to_pandas().astype("Int64")
        # float64, not Float64: a NaN loss is a finding and must not turn into <NA>.
        part["value"] = flat.field("value").to_pandas().astype("float64")
        parts.append(part)
    if not parts:
        return pd.DataFrame(columns=columns)
    frame: pd.DataFrame = pd.concat(parts, ignore_index=True)[columns]
    return frame


def _reduce_points(points: Any, name: str | None, reduce: str, mode: str) -> float:
    values = [
        float(p["value"])
        for p in (points if points is not None else [])
        if (name is None or p["name"] == name) and p["value"] is not None
    ]
    if not values:
        return np.nan
    # A non-finite point is the finding (the metric blew up): the run's value is the worst.
    if not all(np.isfinite(values)):
        return np.inf if mode == "min" else -np.inf
    return {"last": values[-1], "min": min(values), "max": max(values)}[reduce]


def _metric_values(
    records: pd.DataFrame, runs: pd.DataFrame, metric: str, reduce: str, mode: str
) -> pd.Series:
    if metric in runs.columns and metric not in CURVE_COLUMNS:
        column = runs[metric]
        if not pd.api.types.is_numeric_dtype(column):
            raise ValueError(f"metric={metric!r} is a column of runs() but is not numeric.")
        return pd.to_numeric(column, errors="coerce").astype(float)
    latest = latest_with_curves(records).set_index("run_id")
    curve, name = "train_loss", None
    if metric != "train_loss":
        names = {p["name"] for points in latest["val_points"].dropna() for p in points}
        if metric not in names:
            numeric = [c for c in runs.columns if pd.api.types.is_numeric_dtype(runs[c])]
            raise ValueError(
                f"metric={metric!r} is neither a validation metric of the ledger ({sorted(names)}),"
                f" 'train_loss', nor a numeric column of runs() ({numeric})."
            )
        curve, name = "val_points", metric
    values = {
        rid: _reduce_points(latest.at[rid, curve], name, reduce, mode) for rid in runs["run_id"]
    }
    return runs["run_id"].map(values).astype(float)
