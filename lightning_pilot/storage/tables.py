"""Tables of rows: built from row dicts, published as snapshots (each writer's newest kept), and
the phase table of a run or an output folder (docs/architecture.md, "Output folder")."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, overload

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from lightning_pilot.core import validate
from lightning_pilot.core.phases import COUNTERS
from lightning_pilot.schemas import PHASE_SCHEMA
from lightning_pilot.storage.limits import (
    DETAIL_FILE_LIMITS,
    PHASE_FILE_LIMITS,
    ReadLimits,
    _footer_bytes,
    _skip,
    _visible_parquet_files,
    read_parquet_files,
)
from lightning_pilot.storage.paths import (
    Location,
    PathLike,
    RemotePath,
    _location_argument,
    _refuse_link,
    location,
    safe_path_component,
)
from lightning_pilot.storage.publish import publish_table
from lightning_pilot.vocabulary import PHASE_RANK, PHASES, VERDICTS

#: Metadata key under which a snapshot file records its writer and sequence number.
SNAPSHOT_METADATA_KEY: Final = b"lightning_pilot.snapshot"


def _check_columns(row: Mapping[str, Any], schema: pa.Schema, what: str) -> None:
    unknown = sorted(set(row) - set(schema.names))
    if unknown:
        raise ValueError(
            f"{what} has unknown column(s) {unknown}; valid columns are {schema.names}."
        )


def rows_to_table(rows: Sequence[Mapping[str, Any]], schema: pa.Schema) -> pa.Table:
    """Build a table of ``schema`` from row dicts, absent columns null; a column the schema
    lacks, or a value that does not fit its column's type, is a ``ValueError`` naming it."""
    for row in rows:
        _check_columns(row, schema, "a row")
    arrays = []
    for field in schema:
        values = [row.get(field.name) for row in rows]
        try:
            arrays.append(pa.array(values, type=field.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as err:
            raise ValueError(
                f"column {field.name!r} expects {field.type}, got values {values[:3]!r}: {err}"
            ) from err
    return pa.Table.from_arrays(arrays, schema=schema)


def write_snapshot(folder: PathLike, table: pa.Table, *, writer: str, seq: int) -> Location:
    """Publish one snapshot of a growing table (every row this ``writer`` has so far) and remove
    the writer's older ones. ``writer`` (a safe name) never runs in two processes at once; its
    ``seq`` strictly increases. A ``folder`` that is a link: :class:`UnsafePathError`."""
    safe_path_component(writer, "writer")
    validate.integer("write_snapshot", "seq", seq, minimum=0)
    target = location(folder)
    _refuse_link(target)
    meta = dict(table.schema.metadata or {})
    meta[SNAPSHOT_METADATA_KEY] = json.dumps({"writer": writer, "seq": seq}).encode()
    path = publish_table(
        table.replace_schema_metadata(meta), target / f"part-{writer}-{seq:08d}.parquet"
    )
    # Older snapshots go, so pandas.read_parquet(folder) sees each row once (after a crash here
    # the readers below still keep only the newest).
    pattern = re.compile(rf"part-{re.escape(writer)}-(\d{{8}})\.parquet")
    for old in target.iterdir():
        match = pattern.fullmatch(old.name)
        if match and int(match.group(1)) < seq:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
    return path


def _snapshot_identity(path: Location) -> tuple[str, int]:
    """The (writer, seq) a snapshot file records, or its own name when it records none."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            handle.seek(max(size - 8, 0))
            footer = _footer_bytes(handle.read(8), size)
            if footer is None or footer > DETAIL_FILE_LIMITS.max_footer_bytes:
                return path.name, 0  # the read that follows reports it
            handle.seek(0)
            meta = pq.read_schema(handle).metadata or {}
        info = json.loads(meta[SNAPSHOT_METADATA_KEY])
        return str(info["writer"]), int(info["seq"])
    except (OSError, pa.ArrowException, KeyError, ValueError, TypeError):
        return path.name, 0


def list_snapshot_files(folder: PathLike) -> list[Location]:
    """The newest snapshot file of each writer in a table folder (sorted by name); files that
    record no snapshot identity are all kept."""
    target = location(folder)
    if not target.is_dir():
        return []
    newest: dict[str, tuple[int, Location]] = {}
    for path in _visible_parquet_files(target):
        writer, seq = _snapshot_identity(path)
        if writer not in newest or seq > newest[writer][0]:
            newest[writer] = (seq, path)
    return sorted((path for _, path in newest.values()), key=str)


def read_snapshot_table(
    folder: PathLike,
    schema: pa.Schema | None = None,
    *,
    limits: ReadLimits = DETAIL_FILE_LIMITS,
    skipped: list[str] | None = None,
) -> pa.Table:
    """Read the newest snapshot of every writer in a table folder (:func:`read_parquet_files`)."""
    return read_parquet_files(list_snapshot_files(folder), schema, limits=limits, skipped=skipped)


@overload
def run_folders(path: RemotePath) -> list[RemotePath]: ...
@overload
def run_folders(path: Path) -> list[Path]: ...
@overload
def run_folders(path: Location) -> list[Location]: ...
def run_folders(path: Location) -> list[Any]:
    """Run folders under ``path``: a run folder itself, or an ``out_dir`` holding ``runs/``."""
    if (path / "phases.parquet").exists():
        return [path]
    runs = path / "runs"
    if runs.is_dir():
        found: Iterable[Location] = runs.iterdir()
        return sorted((p for p in found if p.is_dir() and not p.name.startswith(".")), key=str)
    return []


def _what_is(path: Location) -> str:
    if path.is_symlink() and not path.exists():
        return "a broken symbolic link"
    return "a plain file" if path.is_file() else "something that is not a folder"


def read_phase_table(path: PathLike) -> pd.DataFrame:
    """Read the phase table of a run folder, a ``phases.parquet`` folder or an ``<out_dir>``
    (all runs): one row per phase, attempt and rank, nullable dtypes (unmeasured is ``<NA>``);
    ``attrs["skipped"]`` lists what could not be read, each also warned about."""
    hint = "a run, phase-table or output folder"
    root = _location_argument("read_phase_table", "path", path, hint)
    if not root.exists():
        raise FileNotFoundError(f"path={str(root)!r} does not exist.")
    if root.name == "phases.parquet":
        tables = [root]
    else:
        tables = [run / "phases.parquet" for run in run_folders(root)]
        tables = [table for table in tables if table.exists() or table.is_symlink()]
    if not tables:
        raise ValueError(
            f"path={str(root)!r} holds no phase table: expected"
            " <out_dir>/runs/<run_id>/phases.parquet."
        )
    skipped: list[str] = []
    folders = [table for table in tables if table.is_dir()]
    for table in (table for table in tables if table not in folders):  # never read as empty
        message = (
            f"skipped {table}: expected a folder of snapshot parts"
            f" (phases.parquet/part-<writer>-<seq>.parquet), found {_what_is(table)};"
            " this run's phase rows are not read"
        )
        _skip(message, table, skipped, stacklevel=2)
    files = [file for folder in folders for file in list_snapshot_files(folder)]
    frame = _to_pandas(
        read_parquet_files(files, PHASE_SCHEMA, limits=PHASE_FILE_LIMITS, skipped=skipped)
    )
    if len(frame):  # phases in campaign order, each phase's first occurrence first
        keys = frame["phase"].map(PHASE_RANK).fillna(len(PHASE_RANK))
        frame = (
            frame.assign(_order=keys, _later=~frame["first"].fillna(False).astype(bool))
            .sort_values(["run_id", "attempt", "rank", "_order", "_later"], kind="stable")
            .drop(columns=["_order", "_later"])
            .reset_index(drop=True)
        )
    frame.attrs["skipped"] = skipped
    return frame


def validate_phase_row(row: Mapping[str, Any]) -> None:
    """Check a phase row's columns and its ``phase``/``verdict``/``counter`` vocabulary."""
    _check_columns(row, PHASE_SCHEMA, "phase row")
    for column, vocabulary in (("phase", PHASES), ("verdict", VERDICTS), ("counter", COUNTERS)):
        value = row.get(column)
        if value is not None and value not in vocabulary:
            raise ValueError(f"row[{column!r}]={value!r} is invalid; expected one of {vocabulary}.")
    if row.get("phase") is None:
        raise ValueError(f"a phase row needs 'phase', one of {PHASES}.")


def _to_pandas(table: pa.Table) -> pd.DataFrame:
    """Nullable dtypes keep "not measured" distinct from 0 and False."""
    frame: pd.DataFrame = table.to_pandas(
        types_mapper={
            pa.int32(): pd.Int32Dtype(),
            pa.int64(): pd.Int64Dtype(),
            pa.bool_(): pd.BooleanDtype(),
            pa.float64(): pd.Float64Dtype(),
        }.get
    )
    return frame
