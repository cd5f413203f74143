"""Every file lightning-pilot writes and reads: atomic publish, snapshots, tolerant readers
(docs/architecture.md, "Storage rules"). One module per concern, each importing only those
before it: ``paths``, ``publish``, ``limits``, ``tables``, ``ledger_store``. A test patches a
name where it is looked up (``storage.publish.publish_file``).

Example:
    >>> from lightning_pilot import storage
    >>> storage.publish_json is storage.publish.publish_json
    True
"""

from __future__ import annotations

from lightning_pilot.schemas import (
    LEDGER_SCHEMA,
    LEDGER_SCHEMA_VERSION,
    PHASE_SCHEMA,
    PHASE_SCHEMA_VERSION,
    STATUSES,
)
from lightning_pilot.storage.ledger_store import LEDGER_INDEX_DIR as LEDGER_INDEX_DIR
from lightning_pilot.storage.ledger_store import TEMPORARY_GRACE_SECONDS as TEMPORARY_GRACE_SECONDS
from lightning_pilot.storage.ledger_store import (
    compact_ledger,
    index_ledger,
    read_ledger_records,
    read_ledger_table,
    write_ledger_record,
)
from lightning_pilot.storage.limits import (
    DETAIL_FILE_LIMITS,
    LEDGER_RECORD_LIMITS,
    LEDGER_SEGMENT_LIMITS,
    PHASE_FILE_LIMITS,
    ReadLimits,
    SkippedFileWarning,
    conform,
    read_parquet_files,
)
from lightning_pilot.storage.paths import (
    Location,
    RemotePath,
    UnsafePathError,
    is_remote,
    location,
    make_folder,
    remove_work_folder,
    safe_join,
    safe_path_component,
    sanitize_name,
    work_folder,
)
from lightning_pilot.storage.paths import PathLike as PathLike
from lightning_pilot.storage.publish import (
    publish_bytes,
    publish_file,
    publish_json,
    publish_table,
    read_json,
)
from lightning_pilot.storage.tables import (
    list_snapshot_files,
    read_phase_table,
    read_snapshot_table,
    rows_to_table,
    run_folders,
    validate_phase_row,
    write_snapshot,
)

__all__ = [
    "DETAIL_FILE_LIMITS",
    "LEDGER_RECORD_LIMITS",
    "LEDGER_SCHEMA",
    "LEDGER_SCHEMA_VERSION",
    "LEDGER_SEGMENT_LIMITS",
    "PHASE_FILE_LIMITS",
    "PHASE_SCHEMA",
    "PHASE_SCHEMA_VERSION",
    "STATUSES",
    "Location",
    "ReadLimits",
    "RemotePath",
    "SkippedFileWarning",
    "UnsafePathError",
    "compact_ledger",
    "conform",
    "index_ledger",
    "is_remote",
    "list_snapshot_files",
    "location",
    "make_folder",
    "publish_bytes",
    "publish_file",
    "publish_json",
    "publish_table",
    "read_json",
    "read_ledger_records",
    "read_ledger_table",
    "read_parquet_files",
    "read_phase_table",
    "read_snapshot_table",
    "remove_work_folder",
    "rows_to_table",
    "run_folders",
    "safe_join",
    "safe_path_component",
    "sanitize_name",
    "validate_phase_row",
    "work_folder",
    "write_ledger_record",
    "write_snapshot",
]

# The public classes keep the name they are known by (in tracebacks, pickles and reprs).
for _public in (RemotePath, UnsafePathError, ReadLimits, SkippedFileWarning):
    _public.__module__ = __name__
del _public
