"""Every Arrow schema lightning-pilot writes, with its version (pyarrow only, no torch).

Each file records its schema's name and version in its metadata; readers conform every file to
the current schema. The columns are documented in docs/phase-table.md and docs/ledger.md.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Final

import pyarrow as pa

from lightning_pilot.vocabulary import CATEGORIES, CATEGORY_COLUMNS, phase_of_label

#: Metadata key under which every file records its schema name and version.
SCHEMA_METADATA_KEY: Final = b"lightning_pilot.schema"

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
    """The schema of a per-callback detail table: the run identity columns, then ``fields``;
    :class:`~lightning_pilot.PilotRun` fills the identity columns when it writes the rows.

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
#: The phase table: one row per phase, attempt and rank. Bytes and seconds; a value that was not
#: measured is null, never 0. Allocated and reserved bytes are separate and never added.
PHASE_SCHEMA: Final = _schema(
    "phases",
    PHASE_SCHEMA_VERSION,
    [
        *RUN_IDENTITY_FIELDS,
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
        # the model's state (lightning_pilot.vocabulary.MEASURED_CATEGORIES)
        (CATEGORY_COLUMNS["param"], pa.int64()),
        (CATEGORY_COLUMNS["grad"], pa.int64()),
        (CATEGORY_COLUMNS["optimizer_state"], pa.int64()),
        (CATEGORY_COLUMNS["buffer"], pa.int64()),
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
#: One run-ledger record. ``curves_delta`` (version 2): true when the record's curves hold only
#: the points added since the attempt's previous record (heartbeats); else the whole curve.
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

# Detail tables (runs/<run_id>/<name>.parquet), one per callback.

EXAMPLES_TABLE: Final = "examples"
EXAMPLES_SCHEMA_VERSION: Final = 2
EXAMPLES_SCHEMA: Final = detail_schema(
    EXAMPLES_TABLE,
    EXAMPLES_SCHEMA_VERSION,
    [
        ("split", pa.string()),
        ("batch_index", pa.int64()),
        ("position", pa.int64()),
        ("example_id", pa.string()),
        ("input_text", pa.string()),
        ("input_tokens", pa.list_(pa.int64())),
        ("input_values", pa.list_(pa.float64())),
        ("target", pa.string()),
        ("target_tokens", pa.list_(pa.int64())),
        ("loss_positions", pa.list_(pa.int64())),
        ("loss_tokens", pa.int64()),
        ("length", pa.int64()),
        ("seq_len", pa.int64()),
        ("truncated", pa.bool_()),
        ("label_relation", pa.string()),
        ("notes", pa.string()),
    ],
)

OVERFIT_TABLE: Final = "overfit"
OVERFIT_SCHEMA_VERSION: Final = 1
OVERFIT_SCHEMA: Final = detail_schema(
    OVERFIT_TABLE,
    OVERFIT_SCHEMA_VERSION,
    [
        ("step", pa.int64()),
        ("loss", pa.float64()),
        ("micro_batches", pa.int64()),
        ("target_loss", pa.float64()),
        ("metric", pa.string()),
        ("score", pa.float64()),
        ("wrong_ids", pa.list_(pa.string())),
        ("subset_ids", pa.list_(pa.string())),
        ("notes", pa.string()),
    ],
)

UPDATES_TABLE: Final = "updates"
UPDATES_SCHEMA_VERSION: Final = 1
UPDATES_SCHEMA: Final = detail_schema(
    UPDATES_TABLE,
    UPDATES_SCHEMA_VERSION,
    [
        ("dp_replicas", pa.int32()),
        ("update", pa.int64()),
        ("epoch", pa.int64()),
        ("batch_idx_first", pa.int64()),
        ("batch_idx_last", pa.int64()),
        ("accumulate_grad_batches", pa.int64()),
        ("micro_batches", pa.int64()),
        ("examples", pa.int64()),
        ("tokens", pa.int64()),
        ("tokens_source", pa.string()),
        ("padding_duplicates", pa.int64()),
        ("micro_batches_all_ranks", pa.int64()),
        ("examples_all_ranks", pa.int64()),
        ("tokens_all_ranks", pa.int64()),
        ("padding_duplicates_all_ranks", pa.int64()),
        ("window_partial", pa.bool_()),
        ("weight", pa.float64()),
        ("optimizer_stepped", pa.bool_()),
        ("notes", pa.string()),
    ],
)

MODEL_SCHEMA = detail_schema(
    "model",
    1,
    [
        ("model_class", pa.string()),
        ("parameters", pa.int64()),
        ("trainable_parameters", pa.int64()),
        ("param_bytes", pa.int64()),
        ("optimizers", pa.string()),
        ("precision", pa.string()),
        ("device", pa.string()),
    ],
)

RESUME_SCHEMA = detail_schema(
    "resume",
    1,
    [
        ("checkpoint_step", pa.int64()),
        ("check", pa.string()),
        ("micro_batch", pa.int64()),
        ("step", pa.int64()),
        ("reference", pa.string()),
        ("resumed", pa.string()),
        ("equal", pa.bool_()),
    ],
)

EVENTS_TABLE: Final = "divergence"
EVENTS_SCHEMA: Final = detail_schema(
    EVENTS_TABLE,
    1,
    [
        ("step", pa.int64()),
        ("event", pa.string()),
        ("loss", pa.float64()),
        ("grad_norm", pa.float64()),
        ("reference", pa.float64()),
        ("threshold", pa.float64()),
        ("detail", pa.string()),
        ("action", pa.string()),
    ],
)

PREDICTIONS_SCHEMA: Final = detail_schema(
    "predictions",
    1,
    [
        ("step", pa.int64()),
        ("dataloader_idx", pa.int64()),
        ("batch_idx", pa.int64()),
        ("row", pa.int64()),
        ("example_id", pa.string()),
        ("prediction", pa.list_(pa.float64())),
        ("prediction_shape", pa.list_(pa.int64())),
        ("target", pa.list_(pa.float64())),
    ],
)

#: The names the estimate tables give activation checkpointing (``checkpointing`` column):
#: off, every block (``estimate(checkpointing=[True])``) or per operator (``"selective"``).
CHECKPOINTING_MODES: Final = ("off", "full", "selective")


def checkpointing_mode(value: object) -> str | None:
    """The name an estimate table gives ``value`` of activation checkpointing: ``"off"``,
    ``"full"`` or ``"selective"``. Takes what ``estimate(checkpointing=...)`` takes (``False``,
    ``True``, ``"selective"``), the names themselves, and the boolean column of files written
    before version 2 (``True``: full); ``None`` (a null) stays ``None``.

    Example:
        >>> [checkpointing_mode(v) for v in (False, True, "selective", "full", None)]
        ['off', 'full', 'selective', 'full', None]
    """
    if value is None or (isinstance(value, float) and value != value):  # None or NaN
        return None
    if isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy's too
        return "full" if value else "off"
    if isinstance(value, str) and value in CHECKPOINTING_MODES:
        return value
    raise ValueError(
        f"checkpointing={value!r} is not a checkpointing mode; valid: False, True,"
        f" {', '.join(repr(m) for m in CHECKPOINTING_MODES)}"
    )


ESTIMATE_SCHEMA_VERSION: Final = 3
#: The estimate of memory per GPU and step time on target GPUs (``lightning_pilot.estimate``):
#: one row per target x configuration x phase. ``docs/estimate.md`` documents the columns.
#: Version 2: ``checkpointing`` is a string (:data:`CHECKPOINTING_MODES`), not a boolean.
#: Version 3: the phase table's names for the same quantities (:mod:`lightning_pilot.vocabulary`),
#: so a measured and an estimated row join on ``("phase", "first")``: ``phase`` is
#: ``optimizer_step`` with ``first`` (not ``optimizer_step_first``), ``peak_reserved_bytes``
#: (was ``estimated_reserved_bytes``), ``param_bytes`` and ``buffer_bytes`` (were one
#: ``weights_bytes``), ``grad_bytes`` (was ``gradients_bytes``); :func:`upgrade_estimate`
#: reads a version 2 table with these names.
ESTIMATE_SCHEMA: Final = detail_schema(
    "estimate",
    ESTIMATE_SCHEMA_VERSION,
    [
        ("target", pa.string()),
        ("gpu_memory_bytes", pa.int64()),
        ("precision", pa.string()),
        ("micro_batch", pa.int64()),
        ("seq_len", pa.int64()),
        ("checkpointing", pa.string()),
        ("strategy", pa.string()),
        ("devices", pa.int64()),
        ("phase", pa.string()),
        ("first", pa.bool_()),
        ("status", pa.string()),
        ("reason", pa.string()),
        ("method", pa.string()),
        ("peak_allocated_bytes", pa.int64()),
        ("peak_reserved_bytes", pa.int64()),
        *((CATEGORY_COLUMNS[name], pa.int64()) for name in CATEGORIES),
        ("workspace_bytes", pa.int64()),
        ("overhead_bytes", pa.int64()),
        ("analytic_bytes", pa.int64()),
        ("fits", pa.bool_()),
        ("headroom_bytes", pa.int64()),
        ("flops_per_update", pa.int64()),
        ("bytes_per_update", pa.int64()),
        ("step_time_low_s", pa.float64()),
        ("step_time_high_s", pa.float64()),
        ("efficiency_low", pa.float64()),
        ("efficiency_high", pa.float64()),
        ("notes", pa.string()),
    ],
)

#: The columns version 3 of the estimate renamed: version 2's name -> version 3's.
ESTIMATE_V2_RENAMED: Final = {
    "estimated_reserved_bytes": "peak_reserved_bytes",
    "gradients_bytes": CATEGORY_COLUMNS["grad"],
}


def upgrade_estimate(table: pa.Table) -> pa.Table:
    """An estimate table of any version with the columns of :data:`ESTIMATE_SCHEMA` (version
    3), recognised by its columns: version 2's names renamed (:data:`ESTIMATE_V2_RENAMED`),
    ``optimizer_step_first`` read as ``phase="optimizer_step"`` with ``first`` true (every other
    phase: ``first`` false), and ``weights_bytes`` (parameters and buffers together, which
    version 3 splits) left out: ``param_bytes`` and ``buffer_bytes`` are null and the row's
    ``notes`` give the old value. ``checkpointing`` of version 1 (a boolean) is named. A
    column the schema does not have is dropped; one it has that the table lacks is null.

    Example:
        >>> old = pa.table({"phase": ["optimizer_step_first", "forward"],
        ...     "estimated_reserved_bytes": [3, 4], "weights_bytes": [2, 2], "notes": [None, "x"]})
        >>> new = upgrade_estimate(old)
        >>> new.column("phase").to_pylist(), new.column("first").to_pylist()
        (['optimizer_step', 'forward'], [True, False])
        >>> new.column("peak_reserved_bytes").to_pylist(), new.column("param_bytes").to_pylist()
        ([3, 4], [None, None])
        >>> new.column("notes").to_pylist()[1]
        'x; schema version 2: weights_bytes 2 (parameters and buffers, not split)'
        >>> new.schema.names == ESTIMATE_SCHEMA.names
        True
    """
    names = [ESTIMATE_V2_RENAMED.get(name, name) for name in table.column_names]
    if len(set(names)) == len(names):  # a table with both names keeps the new one
        table = table.rename_columns(names)
    if "first" not in table.column_names and "phase" in table.column_names:
        labels = table.column("phase").to_pylist()
        pairs = [(None, None) if p is None else _phase_pair(p) for p in labels]
        table = table.set_column(
            table.column_names.index("phase"), "phase", pa.array([p for p, _ in pairs], pa.string())
        )
        table = table.append_column("first", pa.array([f for _, f in pairs], pa.bool_()))
    if "weights_bytes" in table.column_names:
        weights = table.column("weights_bytes").to_pylist()
        notes = (
            table.column("notes").to_pylist()
            if "notes" in table.column_names
            else [None] * table.num_rows
        )
        merged = [
            note
            if value is None
            else "; ".join(
                [
                    *([note] if note else []),
                    f"schema version 2: weights_bytes {value} (parameters and buffers, not split)",
                ]
            )
            for value, note in zip(weights, notes, strict=True)
        ]
        table = table.drop_columns(["weights_bytes"])
        if "notes" in table.column_names:
            table = table.drop_columns(["notes"])
        table = table.append_column("notes", pa.array(merged, pa.string()))
    if "checkpointing" in table.column_names:
        modes = [_mode_name(v) for v in table.column("checkpointing").to_pylist()]
        index = table.column_names.index("checkpointing")
        table = table.set_column(index, "checkpointing", pa.array(modes, pa.string()))
    arrays = [
        table.column(field.name).cast(field.type)
        if field.name in table.column_names
        else pa.nulls(table.num_rows, field.type)
        for field in ESTIMATE_SCHEMA
    ]
    return pa.Table.from_arrays(arrays, schema=ESTIMATE_SCHEMA)


def _phase_pair(label: str) -> tuple[str, bool | None]:
    try:
        return phase_of_label(label)
    except ValueError:  # a phase of no known name: kept as it is
        return label, None


def _mode_name(value: object) -> str | None:
    try:
        return checkpointing_mode(value)
    except ValueError:
        return str(value)


#: The largest micro-batch (at the longest sequence) and the largest sequence length (at the
#: smallest micro-batch) that fit one target GPU (``lightning_pilot.estimate``).
#: Version 3: ``checkpointing`` is a string (:data:`CHECKPOINTING_MODES`), not a boolean.
LARGEST_SCHEMA: Final = detail_schema(
    "estimate_largest",
    3,
    [
        ("target", pa.string()),
        ("precision", pa.string()),
        ("checkpointing", pa.string()),
        ("strategy", pa.string()),
        ("devices", pa.int64()),
        ("seq_len", pa.int64()),
        ("largest_micro_batch", pa.int64()),
        ("method", pa.string()),
        ("checked", pa.bool_()),
        ("status", pa.string()),
        ("reason", pa.string()),
        # Version 2: the largest sequence length at micro-batch ``seq_len_micro_batch``.
        ("largest_seq_len", pa.int64()),
        ("seq_len_micro_batch", pa.int64()),
        ("max_seq_len", pa.int64()),
        ("seq_len_method", pa.string()),
        ("seq_len_checked", pa.bool_()),
        ("seq_len_reason", pa.string()),
    ],
)
