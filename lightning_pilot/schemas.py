"""Every Arrow schema lightning-pilot writes, with its version (pyarrow only, no torch).

Each file records its schema's name and version in its metadata; readers conform every file to
the current schema. The columns are documented in docs/phase-table.md and docs/ledger.md.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Final

import pyarrow as pa

from lightning_pilot.vocabulary import CATEGORY_COLUMNS, phase_of_label

#: Metadata key under which every file records its schema name and version.
SCHEMA_METADATA_KEY: Final = b"lightning_pilot.schema"

_NAMED_POINT = pa.struct([("step", pa.int64()), ("name", pa.string()), ("value", pa.float64())])
_CHECK = pa.struct([("name", pa.string()), ("verdict", pa.string()), ("detail", pa.string())])
#: The column types the field lists below name.
_TYPES: Final = {
    "str": pa.string(),
    "i32": pa.int32(),
    "i64": pa.int64(),
    "f64": pa.float64(),
    "bool": pa.bool_(),
    "time": pa.timestamp("us", tz="UTC"),
    "strs": pa.list_(pa.string()),
    "i64s": pa.list_(pa.int64()),
    "f64s": pa.list_(pa.float64()),
    "points": pa.list_(pa.struct([("step", pa.int64()), ("value", pa.float64())])),
    "named_points": pa.list_(_NAMED_POINT),
    "checks": pa.list_(_CHECK),
}


def _fields(spec: str) -> tuple[tuple[str, pa.DataType], ...]:
    """The columns ``name:type ...`` (white-space separated, each type a key of ``_TYPES``)."""
    return tuple(
        (name, _TYPES[kind]) for name, _, kind in (item.partition(":") for item in spec.split())
    )


def _schema(name: str, version: int, fields: Sequence[tuple[str, pa.DataType]]) -> pa.Schema:
    meta = json.dumps({"name": name, "version": version}).encode()
    return pa.schema(list(fields), metadata={SCHEMA_METADATA_KEY: meta})


#: The columns that say whose row it is: every run table starts with them.
RUN_IDENTITY_FIELDS: Final = _fields(
    "schema_version:i32 written_at:time run_id:str attempt:i32 attempt_id:str rank:i32"
    " world_size:i32"
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


def _detail(name: str, version: int, spec: str) -> pa.Schema:
    return detail_schema(name, version, _fields(spec))


def schema_version(schema: pa.Schema) -> int | None:
    """The version a schema made by this module records in its metadata."""
    raw = (schema.metadata or {}).get(SCHEMA_METADATA_KEY)
    if raw is None:
        return None
    version = json.loads(raw).get("version")
    return int(version) if isinstance(version, int) else None


PHASE_SCHEMA_VERSION: Final = 1
#: The phase table: one row per phase, attempt and rank. Bytes and seconds; a value that was not
#: measured is null, never 0. Allocated and reserved bytes are separate and never added. The
#: model's state columns are those of :data:`~lightning_pilot.vocabulary.MEASURED_CATEGORIES`.
PHASE_SCHEMA: Final = _detail(
    "phases",
    PHASE_SCHEMA_VERSION,
    """
    device:str source:str
    phase:str first:bool occurrences:i64 measured_occurrences:i64 step_first:i64 step_last:i64
    batch_size:i64 seq_len:i64 input_shapes:str precision:str
    counter:str baseline_allocated_bytes:i64 peak_allocated_bytes:i64 end_allocated_bytes:i64
    peak_reserved_bytes:i64 device_capacity_bytes:i64 alloc_retries:i64 host_rss_bytes:i64
    param_bytes:i64 grad_bytes:i64 optimizer_state_bytes:i64 buffer_bytes:i64
    host_swap_used_bytes:i64 file_bytes:i64
    duration_s:f64 duration_median_s:f64 duration_max_s:f64 synchronized:bool
    verdict:str checks:checks reason:str notes:str
    """,
)

LEDGER_SCHEMA_VERSION: Final = 2
#: One run-ledger record. ``curves_delta`` (version 2): true when the record's curves hold only
#: the points added since the attempt's previous record (heartbeats); else the whole curve.
#: ``stop_detail`` says why it stopped, in words (the divergence rule, EarlyStopping's message).
LEDGER_SCHEMA: Final = _schema(
    "ledger",
    LEDGER_SCHEMA_VERSION,
    _fields(
        """
        schema_version:i32 record_id:str event:str written_at:time
        run_id:str attempt:i32 attempt_id:str experiment:str variant:str seed:i64
        derived_from_run_id:str
        params_json:str config_hash:str variant_key:str lr:f64 micro_batch_size:i64
        accumulate_grad_batches:i64 dp_replicas:i64 effective_batch_size:i64 planned_updates:i64
        precision:str strategy:str devices:i64
        status:str stop_cause:str stop_step:i64 stop_detail:str updates_done:i64
        examples_seen:i64 tokens_seen:i64 exception_type:str exception_message:str
        curves_delta:bool train_loss:points lr_curve:points val_points:named_points
        predictions_uri:str predictions_sha256:str checkpoint_uri:str checkpoint_sha256:str
        phase_table_uri:str
        torch_version:str lightning_version:str python_version:str device_name:str
        git_revision:str hostname:str
        """
    ),
)

LEDGER_EVENTS: Final = ("start", "heartbeat", "end")
STATUSES: Final = ("running", "completed", "stopped", "diverged", "oom", "failed", "interrupted")

# Detail tables (runs/<run_id>/<name>.parquet), one per callback.

EXAMPLES_TABLE: Final = "examples"
EXAMPLES_SCHEMA_VERSION: Final = 2
EXAMPLES_SCHEMA: Final = _detail(
    EXAMPLES_TABLE,
    EXAMPLES_SCHEMA_VERSION,
    """
    split:str batch_index:i64 position:i64 example_id:str input_text:str input_tokens:i64s
    input_values:f64s target:str target_tokens:i64s loss_positions:i64s loss_tokens:i64
    length:i64 seq_len:i64 truncated:bool label_relation:str notes:str
    """,
)

OVERFIT_TABLE: Final = "overfit"
OVERFIT_SCHEMA_VERSION: Final = 1
OVERFIT_SCHEMA: Final = _detail(
    OVERFIT_TABLE,
    OVERFIT_SCHEMA_VERSION,
    """
    step:i64 loss:f64 micro_batches:i64 target_loss:f64 metric:str score:f64 wrong_ids:strs
    subset_ids:strs notes:str
    """,
)

UPDATES_TABLE: Final = "updates"
UPDATES_SCHEMA_VERSION: Final = 1
UPDATES_SCHEMA: Final = _detail(
    UPDATES_TABLE,
    UPDATES_SCHEMA_VERSION,
    """
    dp_replicas:i32 update:i64 epoch:i64 batch_idx_first:i64 batch_idx_last:i64
    accumulate_grad_batches:i64 micro_batches:i64 examples:i64 tokens:i64 tokens_source:str
    padding_duplicates:i64 micro_batches_all_ranks:i64 examples_all_ranks:i64
    tokens_all_ranks:i64 padding_duplicates_all_ranks:i64 window_partial:bool weight:f64
    optimizer_stepped:bool notes:str
    """,
)

MODEL_SCHEMA = _detail(
    "model",
    1,
    "model_class:str parameters:i64 trainable_parameters:i64 param_bytes:i64 optimizers:str"
    " precision:str device:str",
)

RESUME_SCHEMA = _detail(
    "resume",
    1,
    "checkpoint_step:i64 check:str micro_batch:i64 step:i64 reference:str resumed:str equal:bool",
)

EVENTS_TABLE: Final = "divergence"
EVENTS_SCHEMA: Final = _detail(
    EVENTS_TABLE,
    1,
    "step:i64 event:str loss:f64 grad_norm:f64 reference:f64 threshold:f64 detail:str action:str",
)

PREDICTIONS_SCHEMA: Final = _detail(
    "predictions",
    1,
    "step:i64 dataloader_idx:i64 batch_idx:i64 row:i64 example_id:str prediction:f64s"
    " prediction_shape:i64s target:f64s",
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
#: one row per target x configuration x phase, in the phase table's names (a measured and an
#: estimated row join on ``("phase", "first")``). docs/estimate.md documents the columns and
#: what each version changed; :func:`upgrade_estimate` reads the older versions.
ESTIMATE_SCHEMA: Final = _detail(
    "estimate",
    ESTIMATE_SCHEMA_VERSION,
    f"""
    target:str gpu_memory_bytes:i64 precision:str micro_batch:i64 seq_len:i64
    checkpointing:str strategy:str devices:i64 phase:str first:bool status:str reason:str
    method:str peak_allocated_bytes:i64 peak_reserved_bytes:i64
    {" ".join(f"{column}:i64" for column in CATEGORY_COLUMNS.values())}
    workspace_bytes:i64 overhead_bytes:i64 analytic_bytes:i64 fits:bool headroom_bytes:i64
    flops_per_update:i64 bytes_per_update:i64 step_time_low_s:f64 step_time_high_s:f64
    efficiency_low:f64 efficiency_high:f64 notes:str
    """,
)

#: The columns version 3 of the estimate renamed: version 2's name -> version 3's.
ESTIMATE_V2_RENAMED: Final = {
    "estimated_reserved_bytes": "peak_reserved_bytes",
    "gradients_bytes": CATEGORY_COLUMNS["grad"],
}


def upgrade_estimate(table: pa.Table) -> pa.Table:
    """An estimate table of any version (told by its columns) as :data:`ESTIMATE_SCHEMA`:
    version 2's names renamed, ``optimizer_step_first`` read as ``optimizer_step`` with
    ``first``, ``weights_bytes`` (not split into ``param_bytes`` and ``buffer_bytes``, left
    null) kept in ``notes``, a boolean ``checkpointing`` named; unknown columns dropped, missing
    ones null."""
    names = [ESTIMATE_V2_RENAMED.get(name, name) for name in table.column_names]
    if len(set(names)) == len(names):  # a table with both names keeps the new one
        table = table.rename_columns(names)
    columns = {name: table.column(name) for name in table.column_names}
    if "first" not in columns and "phase" in columns:
        labels = columns["phase"].to_pylist()
        pairs = [(None, None) if p is None else _phase_pair(p) for p in labels]
        columns["phase"] = pa.array([p for p, _ in pairs], pa.string())
        columns["first"] = pa.array([f for _, f in pairs], pa.bool_())
    if "weights_bytes" in columns:
        notes = columns["notes"].to_pylist() if "notes" in columns else [None] * table.num_rows
        for row, value in enumerate(columns["weights_bytes"].to_pylist()):
            if value is not None:
                old = f"schema version 2: weights_bytes {value} (parameters and buffers, not split)"
                notes[row] = f"{notes[row]}; {old}" if notes[row] else old
        columns["notes"] = pa.array(notes, pa.string())
    if "checkpointing" in columns:
        modes = [_mode_name(v) for v in columns["checkpointing"].to_pylist()]
        columns["checkpointing"] = pa.array(modes, pa.string())
    arrays = [
        columns[field.name].cast(field.type)
        if field.name in columns
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
#: smallest micro-batch) that fit one target GPU (``lightning_pilot.estimate``; docs/estimate.md).
LARGEST_SCHEMA: Final = _detail(
    "estimate_largest",
    3,
    """
    target:str precision:str checkpointing:str strategy:str devices:i64 seq_len:i64
    largest_micro_batch:i64 method:str checked:bool status:str reason:str
    largest_seq_len:i64 seq_len_micro_batch:i64 max_seq_len:i64 seq_len_method:str
    seq_len_checked:bool seq_len_reason:str
    """,
)
