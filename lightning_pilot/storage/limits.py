"""What a reader agrees to decode from a file it did not write (:class:`ReadLimits`, checked on
the Parquet footer first) and the tolerant Parquet readers that skip what is over them or
unreadable (docs/ledger.md, "What the readers refuse")."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import pyarrow as pa
import pyarrow.compute
import pyarrow.parquet as pq

from lightning_pilot.storage.paths import Location, PathLike, RemotePath, location


class SkippedFileWarning(RuntimeWarning):
    """A reader skipped a file: unreadable, over its limits, or not where the layout expects it
    (the result lists those paths too: ``attrs["skipped"]``, ``skipped=``, ``Ledger.skipped``)."""


@dataclass(frozen=True)
class ReadLimits:
    """What a reader agrees to decode from one Parquet file, checked on the footer first.

    A file over any limit is skipped with a :class:`SkippedFileWarning` quoting ``name``.
    ``max_values`` counts one leaf column (list elements and nulls included); the byte limits
    count the columns read, as pages and in Arrow memory.

    Example:
        >>> PHASE_FILE_LIMITS.max_rows, LEDGER_RECORD_LIMITS.max_rows
        (100000, 1000)
    """

    name: str
    max_file_bytes: int
    max_footer_bytes: int
    max_rows: int
    max_columns: int
    max_row_groups: int
    max_values: int
    max_uncompressed_bytes: int
    max_decoded_bytes: int


_MIB: Final = 1 << 20

#: One phase-table snapshot: a writer's rows are a few dozen, a long multi-stage run's hundreds.
PHASE_FILE_LIMITS: Final = ReadLimits(
    name="PHASE_FILE_LIMITS",
    max_file_bytes=64 * _MIB,
    max_footer_bytes=4 * _MIB,
    max_rows=100_000,
    max_columns=256,
    max_row_groups=64,
    max_values=2_000_000,
    max_uncompressed_bytes=256 * _MIB,
    max_decoded_bytes=256 * _MIB,
)
#: One ledger record file: one row; an end record carries whole curves (2 values per point),
#: so ``max_values`` admits curves of 2 million updates.
LEDGER_RECORD_LIMITS: Final = replace(
    PHASE_FILE_LIMITS, name="LEDGER_RECORD_LIMITS", max_rows=1_000, max_row_groups=16
)
#: One ledger index segment: :func:`index_ledger` cuts them at half these limits.
LEDGER_SEGMENT_LIMITS: Final = replace(
    PHASE_FILE_LIMITS,
    name="LEDGER_SEGMENT_LIMITS",
    max_file_bytes=256 * _MIB,
    max_rows=50_000,
    max_values=4_000_000,
    max_uncompressed_bytes=512 * _MIB,
    max_decoded_bytes=512 * _MIB,
)
#: Every other table (detail tables such as ``updates`` with one row per update, validation
#: predictions), the default of :func:`read_parquet_files` and :func:`read_snapshot_table`.
DETAIL_FILE_LIMITS: Final = ReadLimits(
    name="DETAIL_FILE_LIMITS",
    max_file_bytes=1024 * _MIB,
    max_footer_bytes=16 * _MIB,
    max_rows=5_000_000,
    max_columns=1_024,
    max_row_groups=1_024,
    max_values=50_000_000,
    max_uncompressed_bytes=2048 * _MIB,
    max_decoded_bytes=2048 * _MIB,
)
_FIXED_WIDTH: Final = {"BOOLEAN": 1, "INT32": 4, "INT64": 8, "INT96": 12, "FLOAT": 4, "DOUBLE": 8}
#: Text encodings whose decoded bytes are at most the page bytes.
_TEXT_ENCODINGS: Final = frozenset({"PLAIN", "RLE", "BIT_PACKED", "DELTA_LENGTH_BYTE_ARRAY"})
_DICTIONARY_ENCODINGS: Final = frozenset({"PLAIN_DICTIONARY", "RLE_DICTIONARY"})
_OVERHEAD: Final = 8  # per value: offsets, validity and levels, generously


class _OverLimitError(ValueError):
    """A file declares more than its :class:`ReadLimits` allow (found before decoding)."""


class _VanishedError(Exception):
    """A file listed a moment ago is gone (a compactor removed it): list again."""


def _over(limits: ReadLimits, field: str, value: int, what: str) -> _OverLimitError:
    return _OverLimitError(f"{value:,} {what} > {limits.name}.{field}={getattr(limits, field):,}")


def _within(limits: ReadLimits, field: str, value: int, what: str) -> None:
    if value > getattr(limits, field):
        raise _over(limits, field, value, what)


def _footer_bytes(tail: bytes, size: int) -> int | None:
    """The footer length a Parquet file of ``size`` bytes ending with ``tail`` (the footer,
    its length in 4 bytes little-endian, ``PAR1``) declares."""
    if size < 12 or len(tail) < 8 or tail[-4:] != b"PAR1":
        return None  # not Parquet: pyarrow says so when it opens it
    length = int.from_bytes(tail[-8:-4], "little")
    return length if length <= size - 12 else None  # longer than the file: corrupt, not big


def _cast(array: Any, name: str, want: pa.DataType) -> Any:
    try:
        return array.cast(want)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as err:
        raise ValueError(f"column {name!r} of type {array.type} cannot be read as {want}") from err


def _check_types(arrow: pa.Schema, schema: pa.Schema, names: Sequence[str]) -> None:
    for name in names:
        index = arrow.get_field_index(name)
        if index < 0:
            raise ValueError(f"column {name!r} appears more than once")
        have, want = arrow.field(index).type, schema.field(name).type
        if have != want:
            _cast(pa.array([], type=have), name, want)


def _check_footer(
    parquet: pq.ParquetFile, data: bytes, limits: ReadLimits, schema: pa.Schema | None
) -> list[str] | None:
    """Compare a file's footer with ``limits``; return the columns to read (None: all). Only
    text columns whose worst case is over the limit are decoded (their dictionaries)."""
    meta = parquet.metadata
    _within(limits, "max_rows", meta.num_rows, "rows")
    _within(limits, "max_columns", meta.num_columns, "columns")
    _within(limits, "max_row_groups", meta.num_row_groups, "row groups")
    arrow = parquet.schema_arrow
    columns: list[str] | None = None
    if schema is not None:  # columns the schema does not know are never decoded
        present = set(arrow.names)
        columns = [name for name in schema.names if name in present]
        if not arrow.equals(schema, check_metadata=False):
            _check_types(arrow, schema, columns)
        if len(columns) == len(arrow.names):
            columns = None  # every column of the file is read
    leaves = parquet.schema
    read = _leaf_indices(arrow, meta.num_columns, columns, leaves)
    rows = uncompressed = decoded = worst = 0
    values = dict.fromkeys(read, 0)
    texts: list[tuple[int, int, int, int]] = []  # (row group, leaf, values, page bytes)
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        rows += group.num_rows
        for i in read:
            chunk = group.column(i)
            count, size, kind = chunk.num_values, chunk.total_uncompressed_size, chunk.physical_type
            values[i] += count
            uncompressed += size
            if kind in _FIXED_WIDTH:
                decoded += count * (_FIXED_WIDTH[kind] + _OVERHEAD)
            elif kind == "FIXED_LEN_BYTE_ARRAY":
                decoded += count * (max(leaves.column(i).length, 0) + _OVERHEAD)
            else:  # BYTE_ARRAY: text and binary
                decoded += count * _OVERHEAD + size
                if count > 1:  # with a dictionary, each value as long as the chunk at worst
                    worst += count * size
                    texts.append((g, i, count, size))
    _within(limits, "max_rows", rows, "rows in its row groups")
    _within(limits, "max_values", max(values.values(), default=0), "values in one column")
    _within(limits, "max_uncompressed_bytes", uncompressed, "bytes of pages")
    _within(limits, "max_decoded_bytes", decoded, "bytes once decoded")
    if decoded + worst <= limits.max_decoded_bytes:
        return columns
    # Only now read the encodings (slow to fetch): which text chunks can repeat values?
    worst, amplified, unmeasurable = 0, set(), False
    for g, i, count, size in texts:
        encodings = set(meta.row_group(g).column(i).encodings)
        if encodings <= _TEXT_ENCODINGS:
            continue  # every value is on a page: decoded at most the page bytes
        worst += count * size
        amplified.add(i)
        unmeasurable = unmeasurable or not encodings <= _TEXT_ENCODINGS | _DICTIONARY_ENCODINGS
    if decoded + worst <= limits.max_decoded_bytes:
        return columns
    if unmeasurable:
        what = "bytes once decoded at worst (an encoding whose size cannot be measured first)"
        raise _over(limits, "max_decoded_bytes", decoded + worst, what)
    paths = [leaves.column(i).path for i in sorted(amplified)]
    total = decoded + _dictionary_bytes(data, paths)
    _within(limits, "max_decoded_bytes", total, "bytes once decoded")
    return columns


@functools.lru_cache(maxsize=1024)
def _leaf_count(kind: pa.DataType) -> int:
    """How many Parquet leaf columns a column of this Arrow type is stored as."""
    if pa.types.is_dictionary(kind) or kind.num_fields == 0:
        return 1
    return sum(_leaf_count(kind.field(i).type) for i in range(kind.num_fields))


def _leaf_indices(
    arrow: pa.Schema, count: int, columns: Sequence[str] | None, leaves: pq.ParquetSchema
) -> list[int]:
    """The Parquet leaf columns that store the top-level ``columns`` (None: all)."""
    if columns is None or len(columns) == len(arrow.names):
        return list(range(count))
    wanted = set(columns)
    sizes = [_leaf_count(field.type) for field in arrow]
    if sum(sizes) != count:  # an unusual mapping: ask each leaf its path
        return [i for i in range(count) if leaves.column(i).path.split(".")[0] in wanted]
    read: list[int] = []
    start = 0
    for field, size in zip(arrow, sizes, strict=True):
        if field.name in wanted:
            read.extend(range(start, start + size))
        start += size
    return read


def _dictionary_bytes(data: bytes, paths: Sequence[str]) -> int:
    """The bytes the text columns at ``paths`` take decoded, from their dictionaries."""
    parquet = pq.ParquetFile(pa.BufferReader(data), read_dictionary=list(paths))
    top = sorted({path.split(".")[0] for path in paths})
    table = parquet.read(columns=top, use_threads=False)
    return sum(_value_bytes(chunk) for column in table.columns for chunk in column.chunks)


def _value_bytes(array: pa.Array) -> int:
    kind = array.type
    if pa.types.is_dictionary(kind):
        lengths = pa.compute.binary_length(array.dictionary)
        total = pa.compute.sum(pa.compute.take(lengths, array.indices)).as_py()
        return int(total or 0) + _OVERHEAD * len(array)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _value_bytes(array.flatten()) + _OVERHEAD * len(array)
    if pa.types.is_struct(kind):
        return sum(_value_bytes(field) for field in array.flatten())
    return int(array.nbytes)


def _leaf_values(array: pa.Array) -> int:
    """The most values one leaf column of ``array`` holds, as Parquet will count them."""
    kind = array.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return len(array) + _leaf_values(array.flatten())
    if pa.types.is_struct(kind):
        return max([len(array), *(_leaf_values(field) for field in array.flatten())])
    return len(array)


def _check_writable(table: pa.Table, limits: ReadLimits, what: str) -> None:
    """Refuse to write what a reader would skip (``ValueError`` naming the limit)."""
    most_values = max(
        (sum(_leaf_values(chunk) for chunk in column.chunks) for column in table.columns),
        default=0,
    )
    measures = (
        ("max_rows", table.num_rows, "rows"),
        ("max_values", most_values, "values in one column"),
        ("max_decoded_bytes", table.nbytes, "bytes"),
    )
    problems = [
        str(_over(limits, field, value, what))
        for field, value, what in measures
        if value > getattr(limits, field)
    ]
    if problems:
        raise ValueError(
            f"{what} of {'; '.join(problems)} would be skipped by every reader; it is not"
            " written (shorten its curves or lists)."
        )


def _read_limited(file: Location, limits: ReadLimits, schema: pa.Schema | None) -> pa.Table:
    """Read one Parquet file, checking its size and footer against ``limits`` first, then
    conform it to ``schema`` (or, without one, decode its dictionary columns)."""
    _within(limits, "max_file_bytes", file.stat().st_size, "bytes on disk")
    # The bytes first (one request), decoded without threads: twice as fast as pq.read_table.
    data = file.read_bytes()
    footer = _footer_bytes(data[-8:], len(data))
    if footer is not None and footer > limits.max_footer_bytes:
        raise _over(limits, "max_footer_bytes", footer, "bytes of footer")
    parquet = pq.ParquetFile(pa.BufferReader(data))
    table = parquet.read(columns=_check_footer(parquet, data, limits, schema), use_threads=False)
    return conform(table, schema) if schema is not None else _decode_dictionaries(table)


def _read_or_skip(
    path: Location,
    limits: ReadLimits,
    schema: pa.Schema | None,
    skipped: list[str] | None,
    *,
    stacklevel: int,
    vanish: bool = False,
) -> pa.Table | None:
    """:func:`_read_limited`, or ``None`` with the file skipped (``vanish``: a file gone since
    it was listed raises ``_VanishedError``)."""
    try:
        return _read_limited(path, limits, schema)
    except _OverLimitError as err:
        message = f"skipped oversized file {path}: {err} (not decoded)"
    except (OSError, pa.ArrowException, ValueError) as err:
        if vanish and isinstance(err, FileNotFoundError):
            raise _VanishedError(str(path)) from None
        message = f"skipped unreadable file {path}: {type(err).__name__}: {err}"
    _skip(message, path, skipped, stacklevel=stacklevel)
    return None


def _skip(message: str, path: Location, skipped: list[str] | None, *, stacklevel: int = 3) -> None:
    warnings.warn(f"lightning-pilot: {message}", SkippedFileWarning, stacklevel=stacklevel)
    if skipped is not None:
        skipped.append(str(path))


def _visible_parquet_files(folder: Location) -> list[Location]:
    """The Parquet files of a folder not hidden by a leading ``.`` or ``_``, by name; a local
    folder in one listing, with no stat per file."""

    def visible(name: str) -> bool:
        return name.endswith(".parquet") and not name.startswith((".", "_"))

    if isinstance(folder, RemotePath):
        return sorted(p for p in folder.iterdir() if p.is_file() and visible(p.name))
    with os.scandir(folder) as entries:
        names = [entry.name for entry in entries if visible(entry.name) and entry.is_file()]
    return [folder / name for name in sorted(names)]


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Give ``table`` exactly the columns of ``schema``: cast what is there, null what is not.

    Columns the schema does not know (a newer version's) are dropped; one that cannot be cast
    is a ``ValueError``.
    """
    if table.schema.equals(schema, check_metadata=False):
        return table.replace_schema_metadata(schema.metadata)  # already conforming: no copy
    arrays = []
    for field in schema:
        if field.name in table.column_names:
            arrays.append(_cast(table.column(field.name), field.name, field.type))
        else:
            arrays.append(pa.nulls(table.num_rows, type=field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _decode_dictionaries(table: pa.Table) -> pa.Table:
    """Plain columns: a dictionary column of one file would not concatenate with another's."""
    for index, field in enumerate(table.schema):
        if pa.types.is_dictionary(field.type):
            column = table.column(index).cast(field.type.value_type)
            table = table.set_column(index, field.name, column)
    return table


def read_parquet_files(
    files: Iterable[PathLike],
    schema: pa.Schema | None = None,
    *,
    limits: ReadLimits = DETAIL_FILE_LIMITS,
    skipped: list[str] | None = None,
) -> pa.Table:
    """Read Parquet files one by one and concatenate them into one table.

    A file over ``limits`` or unreadable is skipped with a :class:`SkippedFileWarning` and its
    path appended to ``skipped``. Every file is conformed to ``schema``, if given.
    """
    tables: list[tuple[Location, pa.Table]] = []
    for file in files:
        path = location(file)
        table = _read_or_skip(path, limits, schema, skipped, stacklevel=4)
        if table is not None:
            tables.append((path, table))
    if not tables:
        return schema.empty_table() if schema is not None else pa.table({})
    # One chunk per column: pandas on thousands of one-row chunks is tens of times slower.
    if schema is not None:
        return pa.concat_tables([table for _, table in tables]).combine_chunks()
    try:
        together = pa.concat_tables([t for _, t in tables], promote_options="permissive")
    except pa.ArrowException:
        together = tables[0][1]
        for path, table in tables[1:]:
            try:
                together = pa.concat_tables([together, table], promote_options="permissive")
            except pa.ArrowException as err:
                _skip(f"skipped {path}: its columns do not match the others: {err}", path, skipped)
    return together.combine_chunks()
