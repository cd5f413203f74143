"""Arrow schemas, atomic Parquet publishing and tolerant readers.

Everything lightning-pilot writes goes through this module, so that every file stays readable
whatever happens to the process that writes it:

* **Explicit, versioned schemas.** :data:`PHASE_SCHEMA` (the phase table) and
  :data:`LEDGER_SCHEMA` (one run-ledger record) name every column and its type. Readers apply
  the schema to each file, so a file written by an older version reads with nulls in the
  columns it did not have, instead of the first file's schema silently winning.
* **Atomic, never-overwriting publish.** :func:`publish_table` writes a hidden temporary file
  in the target folder, fsyncs it, publishes it under its final name with a hard link (which
  refuses an existing name, unlike ``os.replace``) and fsyncs the folder. Readers and
  ``pandas.read_parquet`` skip names starting with ``.``, so a half-written file is never seen.
* **Snapshots instead of rewrites.** A table that grows during a run (the phase table, the
  per-callback details) is a folder ``<name>.parquet/`` of snapshot files, one writer (attempt
  and rank) each; a newer snapshot of a writer supersedes its older ones, which the writer then
  removes. Readers keep the newest snapshot of each writer, so a crash between publish and
  clean-up never duplicates rows.
* **One file at a time.** Readers open files one by one and skip an unreadable or truncated
  file with a warning that names it, instead of failing the whole folder.
* **Safe names.** :func:`safe_path_component` and :func:`safe_join` keep every user-given name
  (experiment, variant, run id) inside the output folder.

Example:
    >>> import tempfile, pyarrow as pa
    >>> from lightning_pilot.storage import publish_table, read_parquet_files
    >>> folder = tempfile.mkdtemp()
    >>> path = publish_table(pa.table({"x": [1, 2]}), f"{folder}/a.parquet")
    >>> publish_table(pa.table({"x": [3]}), path)
    Traceback (most recent call last):
    ...
    FileExistsError: refusing to overwrite ...a.parquet: published files are immutable
    >>> read_parquet_files([path]).num_rows
    2
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO, Final

import pandas as pd
import pyarrow as pa
import pyarrow.compute
import pyarrow.parquet as pq

from lightning_pilot.core.ids import new_run_id, validate_run_id
from lightning_pilot.core.phases import COUNTERS, PHASES, VERDICTS

__all__ = [
    "LEDGER_SCHEMA",
    "LEDGER_SCHEMA_VERSION",
    "PHASE_SCHEMA",
    "PHASE_SCHEMA_VERSION",
    "STATUSES",
    "conform",
    "detail_schema",
    "index_ledger",
    "list_snapshot_files",
    "publish_bytes",
    "publish_file",
    "publish_table",
    "read_ledger_records",
    "read_parquet_files",
    "read_phase_table",
    "read_snapshot_table",
    "rows_to_table",
    "safe_join",
    "safe_path_component",
    "sanitize_name",
    "validate_phase_row",
    "write_ledger_record",
    "write_snapshot",
]

PathLike = str | os.PathLike[str]

#: Metadata key under which every file records its schema name and version.
SCHEMA_METADATA_KEY: Final = b"lightning_pilot.schema"
#: Metadata key under which a snapshot file records its writer and sequence number.
SNAPSHOT_METADATA_KEY: Final = b"lightning_pilot.snapshot"

_TIMESTAMP = pa.timestamp("us", tz="UTC")
_POINT = pa.struct([("step", pa.int64()), ("value", pa.float64())])
_NAMED_POINT = pa.struct([("step", pa.int64()), ("name", pa.string()), ("value", pa.float64())])
_CHECK = pa.struct([("name", pa.string()), ("verdict", pa.string()), ("detail", pa.string())])


def _schema(name: str, version: int, fields: Sequence[tuple[str, pa.DataType]]) -> pa.Schema:
    meta = json.dumps({"name": name, "version": version}).encode()
    return pa.schema(list(fields), metadata={SCHEMA_METADATA_KEY: meta})


#: The columns that say whose row it is: every run table starts with them.
RUN_IDENTITY_FIELDS: Final = (
    ("schema_version", pa.int32()),
    ("written_at", _TIMESTAMP),
    ("run_id", pa.string()),
    ("attempt", pa.int32()),
    ("attempt_id", pa.string()),
    ("rank", pa.int32()),
    ("world_size", pa.int32()),
)


def detail_schema(name: str, version: int, fields: Sequence[tuple[str, pa.DataType]]) -> pa.Schema:
    """The schema of a per-callback detail table: the run identity columns, then ``fields``.

    The name and version are stored in the schema metadata; :class:`~lightning_pilot.PilotRun`
    fills the identity columns and ``schema_version`` when it writes the rows.

    Example:
        >>> schema = detail_schema("updates", 1, [("update", pa.int64())])
        >>> schema.names[:3], schema.names[-1]
        (['schema_version', 'written_at', 'run_id'], 'update')
    """
    return _schema(name, version, [*RUN_IDENTITY_FIELDS, *fields])


def schema_version(schema: pa.Schema) -> int | None:
    """The version a schema made by this module records in its metadata."""
    raw = (schema.metadata or {}).get(SCHEMA_METADATA_KEY)
    if raw is None:
        return None
    version = json.loads(raw).get("version")
    return int(version) if isinstance(version, int) else None


PHASE_SCHEMA_VERSION: Final = 1
#: The phase table: one row per phase, per attempt, per rank. Memory columns are bytes,
#: durations seconds; a value that was not measured is null (with ``counter="none"`` or a
#: reason in ``notes``), never 0. Allocated and reserved bytes are separate and never added.
PHASE_SCHEMA: Final = _schema(
    "phases",
    PHASE_SCHEMA_VERSION,
    [
        ("schema_version", pa.int32()),
        ("written_at", _TIMESTAMP),
        # identity
        ("run_id", pa.string()),
        ("attempt", pa.int32()),
        ("attempt_id", pa.string()),
        ("rank", pa.int32()),
        ("world_size", pa.int32()),
        ("device", pa.string()),
        ("source", pa.string()),
        # the phase
        ("phase", pa.string()),
        ("first", pa.bool_()),
        ("occurrences", pa.int64()),
        ("measured_occurrences", pa.int64()),
        ("step_first", pa.int64()),
        ("step_last", pa.int64()),
        # inputs
        ("batch_size", pa.int64()),
        ("seq_len", pa.int64()),
        ("input_shapes", pa.string()),
        ("precision", pa.string()),
        # memory
        ("counter", pa.string()),
        ("baseline_allocated_bytes", pa.int64()),
        ("peak_allocated_bytes", pa.int64()),
        ("end_allocated_bytes", pa.int64()),
        ("peak_reserved_bytes", pa.int64()),
        ("device_capacity_bytes", pa.int64()),
        ("alloc_retries", pa.int64()),
        ("host_rss_bytes", pa.int64()),
        ("param_bytes", pa.int64()),
        ("grad_bytes", pa.int64()),
        ("optimizer_state_bytes", pa.int64()),
        ("buffer_bytes", pa.int64()),
        ("host_swap_used_bytes", pa.int64()),
        ("file_bytes", pa.int64()),
        # time
        ("duration_s", pa.float64()),
        ("duration_median_s", pa.float64()),
        ("duration_max_s", pa.float64()),
        ("synchronized", pa.bool_()),
        # verdict
        ("verdict", pa.string()),
        ("checks", pa.list_(_CHECK)),
        ("reason", pa.string()),
        ("notes", pa.string()),
    ],
)

LEDGER_SCHEMA_VERSION: Final = 2
#: One run-ledger record (events ``start``, ``heartbeat``, ``end``). Curves are lists of
#: ``{step, value}``; validation points lists of ``{step, name, value}``. The learning-rate
#: curve is ``lr_curve`` because ``lr`` is the typed learning rate of the configuration.
#: ``curves_delta`` (version 2): true when the record's curves hold only the points added
#: since the attempt's previous record (heartbeats); null or false: the whole curve so far.
LEDGER_SCHEMA: Final = _schema(
    "ledger",
    LEDGER_SCHEMA_VERSION,
    [
        ("schema_version", pa.int32()),
        ("record_id", pa.string()),
        ("event", pa.string()),
        ("written_at", _TIMESTAMP),
        # identity
        ("run_id", pa.string()),
        ("attempt", pa.int32()),
        ("attempt_id", pa.string()),
        ("experiment", pa.string()),
        ("variant", pa.string()),
        ("seed", pa.int64()),
        ("derived_from_run_id", pa.string()),
        # configuration
        ("params_json", pa.string()),
        ("config_hash", pa.string()),
        ("variant_key", pa.string()),
        ("lr", pa.float64()),
        ("micro_batch_size", pa.int64()),
        ("accumulate_grad_batches", pa.int64()),
        ("dp_replicas", pa.int64()),
        ("effective_batch_size", pa.int64()),
        ("planned_updates", pa.int64()),
        ("precision", pa.string()),
        ("strategy", pa.string()),
        ("devices", pa.int64()),
        # outcome
        ("status", pa.string()),
        ("stop_cause", pa.string()),
        ("stop_step", pa.int64()),
        # why it stopped, in words (the divergence rule, EarlyStopping's message, ...)
        ("stop_detail", pa.string()),
        ("updates_done", pa.int64()),
        ("examples_seen", pa.int64()),
        ("tokens_seen", pa.int64()),
        ("exception_type", pa.string()),
        ("exception_message", pa.string()),
        # curves
        ("curves_delta", pa.bool_()),
        ("train_loss", pa.list_(_POINT)),
        ("lr_curve", pa.list_(_POINT)),
        ("val_points", pa.list_(_NAMED_POINT)),
        # artifacts
        ("predictions_uri", pa.string()),
        ("predictions_sha256", pa.string()),
        ("checkpoint_uri", pa.string()),
        ("checkpoint_sha256", pa.string()),
        ("phase_table_uri", pa.string()),
        # environment
        ("torch_version", pa.string()),
        ("lightning_version", pa.string()),
        ("python_version", pa.string()),
        ("device_name", pa.string()),
        ("git_revision", pa.string()),
        ("hostname", pa.string()),
    ],
)

LEDGER_EVENTS: Final = ("start", "heartbeat", "end")
STATUSES: Final = ("running", "completed", "stopped", "diverged", "oom", "failed", "interrupted")

# --------------------------------------------------------------------------------------------
# Names that become paths
# --------------------------------------------------------------------------------------------

_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._+=@-]")
_MAX_COMPONENT = 128


def safe_path_component(value: object, argument: str) -> str:
    """Validate a name that becomes one component of a path.

    Accepts letters, digits and ``. _ + = @ -``; refuses anything that could leave the folder
    it is joined to (separators, ``..``, absolute paths, NUL, a leading dot that would hide
    the file from readers).

    Args:
        value: the name given by the user or read from a file.
        argument: the argument's name, used in the error message.

    Returns:
        The name, unchanged.

    Raises:
        TypeError: ``value`` is not a string.
        ValueError: ``value`` is not a safe path component.

    Example:
        >>> safe_path_component("lr-1e-4", "variant")
        'lr-1e-4'
        >>> safe_path_component("../x", "variant")
        Traceback (most recent call last):
        ...
        ValueError: variant='../x' is not a safe name: use 1 to 128 letters, digits or ._+=@- ...
    """
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a string, got {type(value).__name__} {value!r}.")
    if (
        not value
        or len(value) > _MAX_COMPONENT
        or value.startswith(".")
        or _UNSAFE_CHARS.search(value)
    ):
        raise ValueError(
            f"{argument}={value!r} is not a safe name: use 1 to {_MAX_COMPONENT} letters, digits"
            " or ._+=@- not starting with '.' (no separators, '..' or NUL)."
        )
    return value


def sanitize_name(value: str, *, fallback: str = "unnamed") -> str:
    """Turn free text into a safe path component by replacing every other character by ``_``.

    Use it where a readable name is wanted in a file name; the original text should be kept in
    the data as well, since the mapping is not reversible.

    Example:
        >>> sanitize_name("lr=1e-4 / warm up")
        'lr=1e-4___warm_up'
        >>> sanitize_name("../../etc/passwd")
        '__.._etc_passwd'
        >>> sanitize_name("")
        'unnamed'
    """
    cleaned = _UNSAFE_CHARS.sub("_", value)[:_MAX_COMPONENT]
    # A leading run of dots would hide the file or climb out of the folder.
    cleaned = re.sub(r"^\.+", "_", cleaned)
    return cleaned or fallback


def safe_join(root: PathLike, *components: str) -> Path:
    """Join validated components to ``root`` and check that the result stays inside it.

    Raises:
        ValueError: a component is unsafe, or the joined path resolves outside ``root``
            (for example through a symbolic link).

    Example:
        >>> safe_join("/tmp/pilot", "runs", "abc")
        PosixPath('/tmp/pilot/runs/abc')
        >>> safe_join("/tmp/pilot", "/etc")
        Traceback (most recent call last):
        ...
        ValueError: path component='/etc' is not a safe name: ...
    """
    base = Path(root)
    for component in components:
        safe_path_component(component, "path component")
    joined = base.joinpath(*components)
    resolved_root = base.resolve()
    resolved = joined.resolve()
    if resolved != resolved_root and resolved_root not in resolved.parents:
        raise ValueError(f"{joined} resolves to {resolved}, outside the output folder {base}.")
    return joined


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _fsync_dir(folder: Path) -> None:
    # Directory fsync makes the new name durable; some platforms cannot open folders.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _publish_no_overwrite(tmp: Path, final: Path) -> None:
    try:
        os.link(tmp, final)
    except FileExistsError:
        raise FileExistsError(
            f"refusing to overwrite {final}: published files are immutable"
        ) from None
    except OSError as err:
        # File systems without hard links: fall back to a checked rename. The window between
        # the check and the rename is the only place an overwrite could still happen.
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        if final.exists():
            raise FileExistsError(
                f"refusing to overwrite {final}: published files are immutable"
            ) from None
        os.rename(tmp, final)


def publish_file(path: PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Write a file atomically under ``path`` with ``write(handle)``, never overwriting.

    The content is written to a hidden temporary file in the same folder, flushed and fsynced,
    published under its final name (a hard link, which refuses an existing name) and the folder
    is fsynced. If anything fails (a full disk, say) the temporary file is removed, the error
    propagates and no file is visible under ``path``.

    Raises:
        FileExistsError: ``path`` already exists.
        ValueError: ``path`` names a hidden file (readers would never see it).
        OSError: the write failed (nothing is left behind).
    """
    final = Path(path)
    if final.name.startswith((".", "_")):
        raise ValueError(
            f"path={str(final)!r} names a hidden file; readers skip names starting with"
            " '.' or '_', so it would never be read."
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        raise FileExistsError(f"refusing to overwrite {final}: published files are immutable")
    tmp = final.parent / f".{final.name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        _publish_no_overwrite(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    _fsync_dir(final.parent)
    return final


def publish_table(table: pa.Table, path: PathLike) -> Path:
    """Write ``table`` as Parquet to ``path`` atomically, never overwriting (:func:`publish_file`).

    Raises:
        FileExistsError: ``path`` already exists.
        OSError: the write failed (nothing is left behind).
    """
    return publish_file(path, lambda handle: pq.write_table(table, handle))


def publish_bytes(data: bytes, path: PathLike) -> Path:
    """Write ``data`` to ``path`` atomically, never overwriting (:func:`publish_file`)."""
    return publish_file(path, lambda handle: handle.write(data))


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _check_columns(row: Mapping[str, Any], schema: pa.Schema, what: str) -> None:
    unknown = sorted(set(row) - set(schema.names))
    if unknown:
        raise ValueError(
            f"{what} has unknown column(s) {unknown}; valid columns are {schema.names}."
        )


def rows_to_table(rows: Sequence[Mapping[str, Any]], schema: pa.Schema) -> pa.Table:
    """Build a table of ``schema`` from row dicts; absent columns are null.

    Raises:
        ValueError: a row names a column the schema does not have, or a value does not fit
            its column's type (the message names the column).
    """
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


def write_snapshot(
    folder: PathLike,
    table: pa.Table,
    *,
    writer: str,
    seq: int,
) -> Path:
    """Publish one snapshot of a growing table and remove this writer's older snapshots.

    Args:
        folder: the table folder, e.g. ``runs/<run_id>/phases.parquet``.
        table: every row this writer has so far (a snapshot replaces, it does not append).
        writer: the writer's identity, a safe name (for example ``a0001-r00000-<attempt_id>``).
            One writer must never run in two processes at once.
        seq: this writer's snapshot number, strictly increasing.

    Returns:
        The published snapshot file.
    """
    safe_path_component(writer, "writer")
    if not isinstance(seq, int) or seq < 0:
        raise ValueError(f"seq={seq!r} is invalid: seq must be a non-negative integer.")
    target = Path(folder)
    meta = dict(table.schema.metadata or {})
    meta[SNAPSHOT_METADATA_KEY] = json.dumps({"writer": writer, "seq": seq}).encode()
    path = publish_table(
        table.replace_schema_metadata(meta), target / f"part-{writer}-{seq:08d}.parquet"
    )
    # The new snapshot holds every row of the older ones: remove those so a plain
    # ``pandas.read_parquet(folder)`` sees each row once. A crash before this point leaves
    # both, and the readers below still keep only the newest.
    pattern = re.compile(rf"part-{re.escape(writer)}-(\d{{8}})\.parquet")
    for old in target.iterdir():
        match = pattern.fullmatch(old.name)
        if match and int(match.group(1)) < seq:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
    return path


def write_ledger_record(ledger_dir: PathLike, record: Mapping[str, Any]) -> Path:
    """Publish one immutable run-ledger record as its own Parquet file.

    ``schema_version``, ``record_id`` and ``written_at`` are filled in when absent. The file
    name starts with the time, so a folder listing is in write order.

    Args:
        ledger_dir: the ledger folder (``<out_dir>/ledger``).
        record: column -> value; ``run_id``, ``event`` are required.

    Returns:
        The published file.

    Raises:
        ValueError: an unknown column, a bad event or status, or a value of the wrong type.

    Example:
        >>> import tempfile
        >>> from lightning_pilot.core.ids import new_run_id
        >>> folder = tempfile.mkdtemp()
        >>> path = write_ledger_record(folder, {"run_id": new_run_id(), "event": "start",
        ...                                      "status": "running"})
        >>> read_ledger_records(folder)["status"].tolist()
        ['running']
    """
    _check_columns(record, LEDGER_SCHEMA, "ledger record")
    run_id = validate_run_id(record.get("run_id"), "record['run_id']")
    event = record.get("event")
    if event not in LEDGER_EVENTS:
        raise ValueError(f"record['event']={event!r} is invalid; expected one of {LEDGER_EVENTS}.")
    status = record.get("status")
    if status is not None and status not in STATUSES:
        raise ValueError(
            f"record['status']={status!r} is invalid; expected one of {STATUSES} or None."
        )
    full = dict(record)
    full.setdefault("schema_version", LEDGER_SCHEMA_VERSION)
    full.setdefault("record_id", new_run_id())
    full.setdefault("written_at", _utcnow())
    record_id = safe_path_component(full["record_id"], "record['record_id']")
    stamp = full["written_at"].strftime("%Y%m%dT%H%M%S%fZ")
    name = f"{stamp}-{run_id}-{event}-{record_id}.parquet"
    return publish_table(rows_to_table([full], LEDGER_SCHEMA), Path(ledger_dir) / name)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _visible_parquet_files(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and p.suffix == ".parquet" and not p.name.startswith((".", "_"))
    )


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Give ``table`` exactly the columns of ``schema``: cast what is there, null what is not.

    Columns the schema does not know (written by a newer version) are dropped.

    Raises:
        ValueError: a column cannot be cast to its type in ``schema``.
    """
    if table.schema.equals(schema, check_metadata=False):
        return table.replace_schema_metadata(schema.metadata)  # already conforming: no copy
    arrays = []
    for field in schema:
        if field.name in table.column_names:
            column = table.column(field.name)
            try:
                arrays.append(column.cast(field.type))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as err:
                raise ValueError(
                    f"column {field.name!r} of type {column.type} cannot be read as {field.type}"
                ) from err
        else:
            arrays.append(pa.nulls(table.num_rows, type=field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def read_parquet_files(files: Iterable[PathLike], schema: pa.Schema | None = None) -> pa.Table:
    """Read Parquet files one by one and concatenate them.

    A file that cannot be read (truncated, corrupt, or with a column of an incompatible type)
    is skipped with a :class:`RuntimeWarning` naming it; the others are still read.

    Args:
        files: the files to read.
        schema: when given, every file is conformed to it (older files read with nulls in
            newer columns); when absent, the files must share one schema.

    Returns:
        One table (empty, with ``schema``'s columns, when nothing could be read).
    """
    tables = []
    for file in files:
        try:
            table = _read_one(Path(file))
            if schema is not None:
                table = conform(table, schema)
        except (OSError, pa.ArrowException, ValueError) as err:
            warnings.warn(
                f"lightning-pilot: skipped unreadable file {file}: {type(err).__name__}: {err}",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        tables.append(table)
    if not tables:
        return schema.empty_table() if schema is not None else pa.table({})
    # One chunk per column: pandas operations on a column of thousands of one-row chunks (one
    # per file) are tens of times slower.
    if schema is None:
        return pa.concat_tables(tables, promote_options="permissive").combine_chunks()
    return pa.concat_tables(tables).combine_chunks()


def _snapshot_identity(path: Path, *, default_seq: int) -> tuple[str, int]:
    """The (writer, seq) a snapshot file records, or its own name when it records none."""
    try:
        meta = pq.read_schema(path).metadata or {}
        info = json.loads(meta[SNAPSHOT_METADATA_KEY])
        return str(info["writer"]), int(info["seq"])
    except (OSError, pa.ArrowException, KeyError, ValueError, TypeError):
        return path.name, default_seq


def list_snapshot_files(folder: PathLike) -> list[Path]:
    """The newest snapshot file of each writer in a table folder (sorted by name).

    Files that record no snapshot identity (copied in by hand, say) are all kept.
    """
    target = Path(folder)
    if not target.is_dir():
        return []
    newest: dict[str, tuple[int, Path]] = {}
    for path in _visible_parquet_files(target):
        writer, seq = _snapshot_identity(path, default_seq=0)
        if writer not in newest or seq > newest[writer][0]:
            newest[writer] = (seq, path)
    return sorted(path for _, path in newest.values())


def read_snapshot_table(folder: PathLike, schema: pa.Schema | None = None) -> pa.Table:
    """Read a snapshot table folder: the newest snapshot of every writer, concatenated."""
    return read_parquet_files(list_snapshot_files(folder), schema)


def _run_folders(path: Path) -> list[Path]:
    """Run folders under ``path``: a run folder itself, or an ``out_dir`` holding ``runs/``."""
    if (path / "phases.parquet").exists():
        return [path]
    runs = path / "runs"
    if runs.is_dir():
        return sorted(p for p in runs.iterdir() if p.is_dir() and not p.name.startswith("."))
    return []


def read_phase_table(path: PathLike) -> pd.DataFrame:
    """Read the phase table of one run or of every run under an output folder.

    Args:
        path: a run folder (``<out_dir>/runs/<run_id>``), a phase-table folder
            (``.../phases.parquet``), or an output folder (``<out_dir>``, all runs).

    Returns:
        One row per phase, per attempt, per rank, with the columns of :data:`PHASE_SCHEMA`.
        Integer columns are pandas nullable integers, so an unmeasured value is ``<NA>``,
        never 0.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` holds no phase table.

    Example:
        >>> import tempfile
        >>> from lightning_pilot.storage import read_phase_table
        >>> read_phase_table(tempfile.mkdtemp())
        Traceback (most recent call last):
        ...
        ValueError: ... holds no phase table: expected <out_dir>/runs/<run_id>/phases.parquet.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"path={str(root)!r} does not exist.")
    if root.name == "phases.parquet" and root.is_dir():
        folders = [root]
    else:
        folders = [run / "phases.parquet" for run in _run_folders(root)]
        folders = [folder for folder in folders if folder.is_dir()]
    if not folders:
        raise ValueError(
            f"path={str(root)!r} holds no phase table: expected"
            " <out_dir>/runs/<run_id>/phases.parquet."
        )
    files = [file for folder in folders for file in list_snapshot_files(folder)]
    frame = _to_pandas(read_parquet_files(files, PHASE_SCHEMA))
    if len(frame):
        # Runs in time order, then attempts and ranks, then phases in campaign order with each
        # phase's first occurrence before the rest.
        order = {phase: index for index, phase in enumerate(PHASES)}
        keys = frame["phase"].map(order).fillna(len(order))
        frame = (
            frame.assign(_order=keys, _later=~frame["first"].fillna(False).astype(bool))
            .sort_values(["run_id", "attempt", "rank", "_order", "_later"], kind="stable")
            .drop(columns=["_order", "_later"])
            .reset_index(drop=True)
        )
    return frame


#: Ledger index segments live here, hidden from pandas and pyarrow dataset readers.
LEDGER_INDEX_DIR: Final = "_index"
_SOURCE_COLUMN: Final = "source_file"


def _ledger_folder(path: PathLike) -> Path:
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"path={str(root)!r} does not exist.")
    return root / "ledger" if (root / "ledger").is_dir() else root


def _read_index(folder: Path) -> tuple[list[pa.Table], set[str]]:
    """The index segments of a ledger and the record files they already hold."""
    index = folder / LEDGER_INDEX_DIR
    if not index.is_dir():
        return [], set()
    schema = LEDGER_SCHEMA.append(pa.field(_SOURCE_COLUMN, pa.string()))
    segments, covered = [], set()
    for segment in _visible_parquet_files(index):
        try:
            table = conform(pq.read_table(segment), schema)
        except (OSError, pa.ArrowException, ValueError) as err:
            # A damaged segment costs speed, never records: its files are read one by one.
            warnings.warn(
                f"lightning-pilot: skipped unreadable ledger index {segment}: {err}",
                RuntimeWarning,
                stacklevel=3,
            )
            continue
        covered.update(table.column(_SOURCE_COLUMN).to_pylist())
        segments.append(table.drop_columns([_SOURCE_COLUMN]))
    return segments, covered


def index_ledger(path: PathLike) -> Path | None:
    """Copy the ledger's not-yet-indexed records into one new index segment.

    Reading a ledger opens every record file (about 1 ms each); an index segment holds many
    records in one file, so :func:`read_ledger_records` reads it at once and opens only the
    files written since. The record files stay the source of truth: they are never changed or
    removed, a segment is a derived, immutable copy published like any other file, and a
    damaged segment is skipped with a warning (its files are then read one by one).

    Returns:
        The new segment, or ``None`` when every record was already indexed.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> _ = write_ledger_record(folder, {"run_id": new_run_id(), "event": "start"})
        >>> index_ledger(folder).parent.name
        '_index'
        >>> index_ledger(folder) is None
        True
        >>> len(read_ledger_records(folder))
        1
    """
    folder = _ledger_folder(path)
    _, covered = _read_index(folder)
    pending = [f for f in _visible_parquet_files(folder) if f.name not in covered]
    tables = []
    for file in pending:
        try:
            table = conform(_read_one(file), LEDGER_SCHEMA)
        except (OSError, pa.ArrowException, ValueError):
            continue  # unreadable files stay out of the index; readers report them
        tables.append(table.append_column(_SOURCE_COLUMN, pa.array([file.name] * len(table))))
    if not tables:
        return None
    segment = pa.concat_tables(tables).combine_chunks()
    name = f"segment-{_utcnow().strftime('%Y%m%dT%H%M%S%fZ')}-{uuid.uuid4().hex[:12]}.parquet"
    return publish_table(segment, folder / LEDGER_INDEX_DIR / name)


def _read_one(file: Path) -> pa.Table:
    # Reading the bytes first and decoding without threads is about twice as fast as
    # pq.read_table for the small one-record files of a ledger.
    with open(file, "rb") as handle:
        return pq.ParquetFile(pa.BufferReader(handle.read())).read(use_threads=False)


def read_ledger_records(path: PathLike, *, events: Sequence[str] | None = None) -> pd.DataFrame:
    """Read every record of a run ledger, oldest first.

    Records already copied into an index segment (:func:`index_ledger`) are read from it; the
    others file by file.

    Args:
        path: the ledger folder, or an output folder holding ``ledger/``.
        events: read only these events (``start``, ``heartbeat``, ``end``); the other files
            are not even opened, since their names say their event.

    Returns:
        One row per record with the columns of :data:`LEDGER_SCHEMA`; unreadable files are
        skipped with a warning naming them.
    """
    if events is not None and not set(events) <= set(LEDGER_EVENTS):
        raise ValueError(f"events={events!r} is invalid; expected a subset of {LEDGER_EVENTS}.")
    folder = _ledger_folder(path)
    segments, covered = _read_index(folder)
    pending = [f for f in _visible_parquet_files(folder) if f.name not in covered]
    if events is not None:
        # Names read <time>-<run_id>-<event>-<record_id>.parquet; ids are hex, so the event
        # word cannot occur inside them.
        pending = [f for f in pending if any(f"-{event}-" in f.name for event in events)]
        wanted = pa.array(list(events))
        segments = [
            t.filter(pa.compute.is_in(t.column("event"), value_set=wanted)) for t in segments
        ]
    table = pa.concat_tables([*segments, read_parquet_files(pending, LEDGER_SCHEMA)])
    frame = _to_pandas(table.combine_chunks())
    if len(frame):
        frame = frame.sort_values(["written_at", "record_id"], kind="stable")
        frame = frame.reset_index(drop=True)
    return frame


def _to_pandas(table: pa.Table) -> pd.DataFrame:
    # Nullable dtypes keep "not measured" distinct from 0 and False.
    frame: pd.DataFrame = table.to_pandas(
        types_mapper={
            pa.int32(): pd.Int32Dtype(),
            pa.int64(): pd.Int64Dtype(),
            pa.bool_(): pd.BooleanDtype(),
            pa.float64(): pd.Float64Dtype(),
        }.get
    )
    return frame


def validate_phase_row(row: Mapping[str, Any]) -> None:
    """Check a phase row's vocabulary columns and names before it is buffered.

    Raises:
        ValueError: an unknown column, or ``phase``/``verdict``/``counter`` outside its
            vocabulary.
    """
    _check_columns(row, PHASE_SCHEMA, "phase row")
    for column, vocabulary in (("phase", PHASES), ("verdict", VERDICTS), ("counter", COUNTERS)):
        value = row.get(column)
        if value is not None and value not in vocabulary:
            raise ValueError(f"row[{column!r}]={value!r} is invalid; expected one of {vocabulary}.")
    if row.get("phase") is None:
        raise ValueError(f"a phase row needs 'phase', one of {PHASES}.")
