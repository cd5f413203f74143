"""The run ledger's files: one immutable Parquet file per record, index segments under
``_index/`` holding records whole, compaction, and readers that take each record once while
writers and compactors run (docs/ledger.md)."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute

from lightning_pilot.core import validate
from lightning_pilot.core.ids import new_run_id, validate_run_id
from lightning_pilot.schemas import LEDGER_EVENTS, LEDGER_SCHEMA, LEDGER_SCHEMA_VERSION, STATUSES
from lightning_pilot.storage.limits import (
    _MIB,
    LEDGER_RECORD_LIMITS,
    LEDGER_SEGMENT_LIMITS,
    _check_writable,
    _OverLimitError,
    _read_limited,
    _read_or_skip,
    _skip,
    _VanishedError,
    _visible_parquet_files,
)
from lightning_pilot.storage.paths import (
    Location,
    PathLike,
    RemotePath,
    _location_argument,
    _refuse_link,
    safe_path_component,
)
from lightning_pilot.storage.publish import publish_table
from lightning_pilot.storage.tables import _check_columns, _to_pandas, rows_to_table

#: Ledger index segments live here, hidden from pandas and pyarrow dataset readers.
LEDGER_INDEX_DIR: Final = "_index"
#: How long a compacted record file (or a merged segment) stays after the segment holding it
#: was published, by default (docs/ledger.md, "Compaction").
LEDGER_GRACE_SECONDS: Final = 3600.0
#: ``<written_at>-<run_id>-<event>-<record_id>.parquet`` (run ids are hex).
_RECORD_NAME: Final = re.compile(
    r"\d{8}T\d+Z-\d{8}T\d{9}Z-[0-9a-f]{16}-(?:start|heartbeat|end)-(?P<record_id>.+)\.parquet"
)
_SEGMENT_STAMP: Final = re.compile(r"segment-(\d{8}T\d{12}Z)-")
_STAMP_FORMAT: Final = "%Y%m%dT%H%M%S%fZ"
_READ_TRIES: Final = 3
#: Compaction merges small segments (under half a segment's records) once there are this many
#: (the new records counting as one): each record is rewritten a few times, not at every run.
_MERGE_AT: Final = 4
#: Index segments are cut well inside :data:`LEDGER_SEGMENT_LIMITS`: rows, values, bytes.
_SEGMENT_CUT: Final = (10_000, 2_000_000, 128 * _MIB)
#: A hidden temporary file of :func:`publish_file`: ``.<name>.<uuid hex>.tmp``.
_TEMPORARY_NAME: Final = re.compile(r"\..+\.[0-9a-f]{32}\.tmp")
#: A hidden temporary file younger than this is never removed by a compaction, whatever its
#: ``grace``: a live writer may still publish it (one takes milliseconds; docs/ledger.md).
TEMPORARY_GRACE_SECONDS: Final = 600.0


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def write_ledger_record(ledger_dir: PathLike, record: Mapping[str, Any]) -> Location:
    """Publish one immutable run-ledger record as its own Parquet file, named after its time.

    ``run_id`` and ``event`` are required; ``schema_version``, ``record_id`` and ``written_at``
    are filled in when absent. A record over :data:`LEDGER_RECORD_LIMITS` is refused.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> path = write_ledger_record(folder, {"run_id": new_run_id(), "event": "start",
        ...                                      "status": "running"})
        >>> read_ledger_records(folder)["status"].tolist()
        ['running']
    """
    folder = _location_argument("write_ledger_record", "ledger_dir", ledger_dir, "a folder")
    _check_columns(record, LEDGER_SCHEMA, "ledger record")
    run_id = validate_run_id(record.get("run_id"), "record['run_id']")
    owner = "write_ledger_record"
    event = validate.choice(owner, "record['event']", record.get("event"), LEDGER_EVENTS)
    validate.choice(owner, "record['status']", record.get("status"), STATUSES, optional=True)
    full = dict(record)
    full.setdefault("schema_version", LEDGER_SCHEMA_VERSION)
    full.setdefault("record_id", new_run_id())
    full.setdefault("written_at", _utcnow())
    record_id = safe_path_component(full["record_id"], "record['record_id']")
    name = f"{full['written_at'].strftime(_STAMP_FORMAT)}-{run_id}-{event}-{record_id}.parquet"
    table = rows_to_table([full], LEDGER_SCHEMA)
    _check_writable(table, LEDGER_RECORD_LIMITS, "a ledger record")
    _refuse_link(folder)
    return publish_table(table, folder / name)


def _ledger_folder(path: PathLike, owner: str) -> Location:
    root = _location_argument(owner, "path", path, "the ledger folder")
    if not root.exists():
        raise FileNotFoundError(f"path={str(root)!r} does not exist.")
    return root / "ledger" if (root / "ledger").is_dir() else root


def _ledger_files(folder: Location) -> list[Location]:
    """The visible Parquet files of a ledger folder, by name; none when it is no folder."""
    if isinstance(folder, RemotePath) and not folder.is_dir():
        return []
    try:
        return _visible_parquet_files(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _record_id_of(name: str) -> str | None:
    match = _RECORD_NAME.fullmatch(name)
    return match.group("record_id") if match else None


@dataclass
class _Segment:
    path: Location
    table: pa.Table

    @functools.cached_property
    def ids(self) -> frozenset[str]:
        return frozenset(i for i in self.table.column("record_id").to_pylist() if i is not None)


def _read_segments(
    folder: Location,
    schema: pa.Schema,
    *,
    vanish: bool = True,
    skipped: list[str] | None = None,
) -> list[_Segment]:
    """The readable index segments of a ledger, conformed to ``schema``; a bad one is skipped
    with a warning and listed in ``skipped``. One gone since the listing: ``_VanishedError``."""
    segments = []
    for segment in _ledger_files(folder / LEDGER_INDEX_DIR):
        try:
            table = _read_limited(segment, LEDGER_SEGMENT_LIMITS, schema)
        except FileNotFoundError:
            if vanish:
                raise _VanishedError(str(segment)) from None
            if skipped is not None:  # a reader's last try: its records may be missing
                _skip(f"skipped ledger index {segment}: removed while read", segment, skipped)
        except _OverLimitError as err:
            _skip(
                f"skipped oversized ledger index {segment}: {err} (not decoded)", segment, skipped
            )
        except (OSError, pa.ArrowException, ValueError) as err:
            _skip(f"skipped unreadable ledger index {segment}: {err}", segment, skipped)
        else:
            segments.append(_Segment(segment, table))
    return segments


def _cut_table(table: pa.Table) -> list[pa.Table]:
    """Cut ``table`` into consecutive slices, each within :data:`_SEGMENT_CUT`."""
    rows = table.num_rows
    if rows == 0:
        return []
    values = np.ones(rows, dtype=np.int64)  # a list cell counts itself and its elements
    for column in table.columns:
        if pa.types.is_list(column.type):
            lengths = pa.compute.list_value_length(column).fill_null(0)
            values = np.maximum(values, 1 + lengths.to_numpy(zero_copy_only=False))
    per_row = max(1, table.nbytes // rows)
    slices, start, total_values = [], 0, 0
    for end in range(rows):
        total_values += int(values[end])
        count = end - start + 1
        if count > 1 and (
            count > _SEGMENT_CUT[0]
            or total_values > _SEGMENT_CUT[1]
            or count * per_row > _SEGMENT_CUT[2]
        ):
            slices.append(table.slice(start, end - start))
            start, total_values = end, int(values[end])
    slices.append(table.slice(start))
    return slices


def _sorted_records(table: pa.Table) -> pa.Table:
    return table.sort_by([("written_at", "ascending"), ("record_id", "ascending")])


def _publish_segments(folder: Location, table: pa.Table) -> list[_Segment]:
    written = []
    for part in _cut_table(_sorted_records(_unique_records(table))):
        part = part.combine_chunks()
        name = f"segment-{_utcnow().strftime(_STAMP_FORMAT)}-{uuid.uuid4().hex[:12]}.parquet"
        path = publish_table(part, folder / LEDGER_INDEX_DIR / name)
        written.append(_Segment(path, part))
    return written


#: Record files read for compaction are joined into one table this many at a time: a table
#: read from a file carries about 75 KB of Arrow objects, so 290,000 of them held apart took
#: 22 GB; joined, the records take what their values take.
_PENDING_JOIN: Final = 2_000


def _read_pending(files: Sequence[Location]) -> list[pa.Table]:
    """Read record files for compaction, :data:`_PENDING_JOIN` to a table; the ones that cannot
    be read stay out (the readers report them; a vanished one is in a segment already)."""
    tables: list[pa.Table] = []
    batch: list[pa.Table] = []
    for position, file in enumerate(files, 1):
        with contextlib.suppress(OSError, pa.ArrowException, ValueError):
            batch.append(_read_limited(file, LEDGER_RECORD_LIMITS, LEDGER_SCHEMA))
        if batch and (position % _PENDING_JOIN == 0 or position == len(files)):
            tables.append(pa.concat_tables(batch).combine_chunks())
            batch = []
    return tables


def compact_ledger(path: PathLike, *, grace: float | None = LEDGER_GRACE_SECONDS) -> list[Location]:
    """Compact a ledger: copy the records no segment holds into new index segments, merge
    small segments, and remove what a segment has held for ``grace`` seconds.

    Safe with any number of writers, readers and compactors at once, on any machine: nothing
    is renamed or locked. A record file is removed only once a segment published at least
    ``grace`` seconds earlier holds its record; a segment only once larger segments at least
    that old hold all its records. Hidden temporary files of killed publications are removed
    once older than ``grace`` and :data:`TEMPORARY_GRACE_SECONDS`. ``grace=None`` removes and
    merges nothing (:func:`index_ledger`). Returns the new segments.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> _ = write_ledger_record(folder, {"run_id": new_run_id(), "event": "start"})
        >>> [p.parent.name for p in compact_ledger(folder, grace=0)]
        ['_index']
        >>> len(list(Path(folder).glob("*.parquet"))), len(read_ledger_records(folder))
        (0, 1)
    """
    if grace is not None:
        grace = validate.number("compact_ledger", "grace", grace, minimum=0, hint="seconds")
    folder = _ledger_folder(path, "compact_ledger")
    _refuse_link(folder)
    _refuse_link(folder / LEDGER_INDEX_DIR, folder)
    files = _ledger_files(folder)  # records first, then segments: see read_ledger_records
    segments = _read_segments(folder, LEDGER_SCHEMA, vanish=False)
    covered = set().union(*(s.ids for s in segments))
    pending = [f for f in files if _record_id_of(f.name) not in covered]
    tables = _read_pending(pending)
    # A segment whose records a larger one holds is waiting to be removed: never merged again.
    held: set[str] = set()
    superseded = set()
    for segment in _largest_first(segments):
        if segment.ids <= held:
            superseded.add(segment.path.name)
        held |= segment.ids
    if grace is not None:
        small = [
            s
            for s in segments
            if s.table.num_rows < _SEGMENT_CUT[0] // 2 and s.path.name not in superseded
        ]
        if len(small) + bool(tables) >= _MERGE_AT:
            tables.extend(s.table for s in small)
    written = _publish_segments(folder, pa.concat_tables(tables)) if tables else []
    if grace is None:
        return [s.path for s in written]
    segments += written
    cutoff = _utcnow().timestamp() - grace
    for where in (folder, folder / LEDGER_INDEX_DIR):
        _remove_stale_temporaries(where, cutoff - max(0.0, TEMPORARY_GRACE_SECONDS - grace))

    def settled(segment: _Segment) -> bool:
        stamp = _SEGMENT_STAMP.match(segment.path.name)
        if stamp is None:
            return False
        made = datetime.strptime(stamp.group(1), _STAMP_FORMAT).replace(tzinfo=timezone.utc)
        return made.timestamp() <= cutoff

    kept: set[str] = set()  # records held by settled segments kept so far, largest first
    for segment in _largest_first(segments):
        if segment.ids and segment.ids <= kept:
            with contextlib.suppress(FileNotFoundError):
                segment.path.unlink()
        elif settled(segment):
            kept |= segment.ids
    for file in files:
        if _record_id_of(file.name) in kept:
            with contextlib.suppress(FileNotFoundError):
                file.unlink()
    return [s.path for s in written]


def _largest_first(segments: list[_Segment]) -> list[_Segment]:
    return sorted(segments, key=lambda s: (s.table.num_rows, s.path.name), reverse=True)


def _remove_stale_temporaries(folder: Location, cutoff: float) -> None:
    """Remove the hidden temporary files (``.<name>.<uuid hex>.tmp``) a killed
    :func:`publish_file` left in a local ``folder``, last modified before ``cutoff`` (an
    object store has none: a remote publication is one write)."""
    if not isinstance(folder, Path):
        return
    try:
        with os.scandir(folder) as entries:
            stale = [entry for entry in entries if _TEMPORARY_NAME.fullmatch(entry.name)]
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in stale:
        with contextlib.suppress(FileNotFoundError):  # its writer (or a compactor) removed it
            stat = entry.stat(follow_symlinks=False)
            if entry.is_file(follow_symlinks=False) and stat.st_mtime < cutoff:
                os.unlink(entry.path)


def index_ledger(path: PathLike) -> Location | None:
    """Copy the ledger's not-yet-indexed records into new index segments, so readers open only
    the files written since; nothing is removed. Returns the last new segment, or ``None``."""
    folder = _ledger_folder(path, "index_ledger")
    written = compact_ledger(folder, grace=None)
    return written[-1] if written else None


def _unique_records(table: pa.Table) -> pa.Table:
    """Keep the first copy of every ``record_id`` (records without one are all kept)."""
    ids = table.column("record_id")
    if ids.null_count == 0 and len(pa.compute.unique(ids)) == len(ids):
        return table
    series = ids.to_pandas()
    duplicate = series.duplicated(keep="first") & series.notna()
    return table.filter(pa.array(~duplicate.to_numpy(dtype=bool)))


def read_ledger_table(
    path: PathLike,
    *,
    events: Sequence[str] | None = None,
    columns: Sequence[str] | None = None,
    skipped: list[str] | None = None,
) -> pa.Table:
    """:func:`read_ledger_records` as an Arrow table; ``columns`` reads only those (and
    ``record_id``, ``written_at`` and ``run_id``)."""
    if events is not None and not set(events) <= set(LEDGER_EVENTS):
        raise ValueError(f"events={events!r} is invalid; expected a subset of {LEDGER_EVENTS}.")
    schema = LEDGER_SCHEMA
    if columns is not None:
        unknown = sorted(set(columns) - set(LEDGER_SCHEMA.names))
        if unknown:
            raise ValueError(f"columns={unknown!r} are not ledger columns; valid: {schema.names}.")
        wanted = {"record_id", "written_at", "run_id", *columns, *(["event"] if events else [])}
        schema = pa.schema([f for f in LEDGER_SCHEMA if f.name in wanted])
    folder = _ledger_folder(path, "read_ledger_records")
    for tries_left in reversed(range(_READ_TRIES)):
        found: list[str] = []
        try:
            table = _read_ledger_once(folder, schema, events, found, vanish=tries_left > 0)
        except _VanishedError:
            continue  # a compactor moved records into a segment meanwhile: list again
        if skipped is not None:
            skipped.extend(found)
        return table
    raise AssertionError("unreachable")  # pragma: no cover - the last try never raises


def _read_ledger_once(
    folder: Location,
    schema: pa.Schema,
    events: Sequence[str] | None,
    skipped: list[str],
    *,
    vanish: bool,
) -> pa.Table:
    # Records first, then segments: a record compacted in between is found in its segment.
    files = _ledger_files(folder)
    segments = _read_segments(folder, schema, vanish=vanish, skipped=skipped)
    tables = [s.table for s in segments]
    pending = files
    if files and segments:
        named = pa.array([_record_id_of(f.name) for f in files], type=pa.string())
        held = pa.chunked_array([t.column("record_id") for t in tables], type=pa.string())
        covered = pa.compute.is_in(
            named, value_set=held.combine_chunks(), skip_nulls=True
        ).to_pylist()
        pending = [f for f, hit in zip(files, covered, strict=True) if not hit]
    if events is not None:  # the file names say the event (ids are hex)
        pending = [f for f in pending if any(f"-{event}-" in f.name for event in events)]
        wanted = pa.array(list(events))
        tables = [t.filter(pa.compute.is_in(t.column("event"), value_set=wanted)) for t in tables]
    for path in pending:
        table = _read_or_skip(
            path, LEDGER_RECORD_LIMITS, schema, skipped, stacklevel=4, vanish=vanish
        )
        if table is not None:
            tables.append(table)
    if not tables:
        return schema.empty_table()
    return _sorted_records(_unique_records(pa.concat_tables(tables).combine_chunks()))


def read_ledger_records(path: PathLike, *, events: Sequence[str] | None = None) -> pd.DataFrame:
    """Read every record of a run ledger, oldest first, each record once.

    ``path`` is the ledger folder or an output folder holding ``ledger/``; ``events`` reads
    only those events. Skipped files are warned about and listed in ``attrs["skipped"]``. A
    compaction running meanwhile is tolerated (docs/ledger.md).
    """
    skipped: list[str] = []
    frame = _to_pandas(read_ledger_table(path, events=events, skipped=skipped))
    frame.attrs["skipped"] = skipped
    return frame
