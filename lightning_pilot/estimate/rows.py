"""The estimate's rows (``ESTIMATE_SCHEMA`` and ``LARGEST_SCHEMA`` of
:mod:`lightning_pilot.schemas`) and the :class:`Estimate` that holds them: one per target x
configuration x phase (:func:`configuration_rows`; a failed configuration gets one row naming
the phase and why), and the ``largest`` table from what the searches found.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_pilot.estimate.cache import cached_gradient_bytes
from lightning_pilot.estimate.fits import need, tight_note
from lightning_pilot.estimate.job import Ckpt, Config, GridJob
from lightning_pilot.estimate.precision_traces import PrecisionTraces, phase_traces
from lightning_pilot.estimate.recorder import PhaseTrace
from lightning_pilot.estimate.roofline import split_seconds
from lightning_pilot.estimate.searches import BatchFound, SeqFound
from lightning_pilot.estimate.strategies import (
    Strategy,
    communication_seconds,
    fsdp_mixed,
    strategy_memory,
)
from lightning_pilot.estimate.targets import Target
from lightning_pilot.vocabulary import (
    CATEGORIES,
    CATEGORY_COLUMNS,
    ESTIMATE_PHASES,
    phase_label,
    phase_of_label,
)


@dataclass
class Estimate:
    """What :func:`~lightning_pilot.estimate.estimate` returns: ``rows`` (one per target x
    configuration x phase) and ``largest`` (per target x precision x checkpointing, one GPU:
    the largest micro-batch at the longest sequence and the largest sequence length at the
    smallest micro-batch)."""

    rows: list[dict[str, Any]]
    largest: list[dict[str, Any]]
    seconds: float
    paths: list[str] = field(default_factory=list)

    def frame(self) -> Any:
        """``rows`` as a pandas DataFrame with every column of :data:`ESTIMATE_SCHEMA` (a row
        of a step that failed carries only what names it: the rest is null)."""
        import pandas as pd

        from lightning_pilot.schemas import ESTIMATE_SCHEMA

        return pd.DataFrame(self.rows, columns=ESTIMATE_SCHEMA.names)

    def largest_frame(self) -> Any:
        """``largest`` as a pandas DataFrame with every column of :data:`LARGEST_SCHEMA`."""
        import pandas as pd

        from lightning_pilot.schemas import LARGEST_SCHEMA

        return pd.DataFrame(self.largest, columns=LARGEST_SCHEMA.names)


def _band_seconds(
    update: Sequence[PhaseTrace], tgt: Target, job: GridJob, shards: int
) -> tuple[float, float, float, float]:
    """(fast, slow, compute, memory) seconds of one update: the compute-bound operators' ideal
    (``compute``) divided by ``job.efficiency``, the memory-bound ones' by
    ``job.memory_efficiency``; the optimizer step's divided by ``shards`` (FSDP: each GPU steps
    its own shard)."""
    compute = memory = 0.0
    for trace in update:
        c, m = split_seconds(trace.flops, trace.moved, trace.kinds, tgt, allow_tf32=job.allow_tf32)
        share = 1 / shards if trace.phase.startswith("optimizer_step") else 1.0
        compute, memory = compute + c * share, memory + m * share
    fast = compute / job.efficiency[1] + memory / job.memory_efficiency[1]
    slow = compute / job.efficiency[0] + memory / job.memory_efficiency[0]
    return fast, slow, compute, memory


def configuration_rows(
    traces: PrecisionTraces,
    tgt: Target,
    strategy: Strategy,
    key: Config,
    job: GridJob,
    low: PrecisionTraces | None = None,
) -> list[dict[str, Any]]:
    """The rows of one target, strategy and configuration; ``low``: the low-precision traces
    FSDP's mixed-precision policy computes with (:data:`~.strategies.FSDP_COMPUTE`)."""
    checkpointing, seq_len, micro_batch = key
    efficiency, memory_efficiency = job.efficiency, job.memory_efficiency
    common = {
        "target": tgt.name,
        "gpu_memory_bytes": tgt.memory_bytes,
        "precision": traces.precision,
        "micro_batch": micro_batch,
        "seq_len": seq_len,
        "checkpointing": checkpointing,
        "strategy": strategy.kind,
        "devices": strategy.devices,
        "efficiency_low": efficiency[0],
        "efficiency_high": efficiency[1],
    }
    if strategy.kind != "fsdp":
        low = None
    failure = traces.error or traces.failed.get(checkpointing)
    if failure is None and low is not None:
        failure = low.error or low.failed.get(checkpointing)
        if failure is not None:
            failure = (failure[0], failure[1], f"{low.precision} (FSDP's compute): {failure[2]}")
    if failure is not None:
        status, label, reason = failure
        first: bool | None
        try:
            phase, first = phase_of_label(label)
        except ValueError:  # a phase outside the phase table (the user's code's ``setup``)
            phase, first = label, None
        return [{**common, "phase": phase, "first": first, "status": status, "reason": reason}]
    phases = phase_traces(traces, key)
    if low is not None:
        phases = fsdp_mixed(phases, phase_traces(low, key), traces, low)
    update = [phases[p][0] for p in ("forward", "backward", "optimizer_step")]
    flops = int(sum(int(t.flops.sum()) for t in update))
    moved = int(sum(int(t.moved.sum()) for t in update))
    # FSDP: each GPU steps the optimizer over its own shard only.
    shards = strategy.devices if strategy.kind == "fsdp" else 1
    fast, slow, compute, memory = _band_seconds(update, tgt, job, shards)
    comm = communication_seconds(strategy, traces, tgt)
    fast, slow = max(fast, comm), slow + comm
    roofline = (
        f"roofline: {compute:.4g} s compute-bound, {memory:.4g} s memory-bound, {comm:.4g} s"
        f" collectives at 100 %; efficiency {efficiency[0]:g} to {efficiency[1]:g} (compute),"
        f" {memory_efficiency[0]:g} to {memory_efficiency[1]:g} (memory)"
    )
    rows = []
    for phase, first in ESTIMATE_PHASES:
        trace, method = phases[phase_label(phase, first)]
        analytic, strategy_note = strategy_memory(trace, strategy, traces)
        allocated = trace.peak_bytes + tgt.workspace_bytes + analytic
        live = trace.segment_bytes + tgt.workspace_bytes + analytic
        cached, cache_note = _gradient_cache(phase, trace, traces, shards)
        # The allowance covers free pieces of the live blocks' segments; the cached gradient
        # blocks hold no live block, so they come on top.
        reserved = max(math.ceil(live * (1 + job.fragmentation)) + cached, allocated)
        headroom = tgt.memory_bytes - need(allocated, live - tgt.workspace_bytes, tgt)
        notes = [*trace.notes, roofline, *cache_note]
        if headroom >= 0 and reserved + tgt.overhead_bytes > tgt.memory_bytes:
            notes.append(tight_note(reserved, tgt))
        if strategy_note:
            notes.append(strategy_note)
        notes.extend(traces.notes)
        rows.append(
            {
                **common,
                "phase": phase,
                "first": first,
                "status": "ok",
                "reason": None,
                "method": method,
                "peak_allocated_bytes": allocated,
                "peak_reserved_bytes": reserved,
                **{CATEGORY_COLUMNS[name]: trace.categories[name] for name in CATEGORIES},
                "workspace_bytes": tgt.workspace_bytes,
                "overhead_bytes": tgt.overhead_bytes,
                "analytic_bytes": analytic,
                "fits": headroom >= 0,
                "headroom_bytes": headroom,
                "flops_per_update": flops,
                "bytes_per_update": moved,
                "step_time_low_s": fast,
                "step_time_high_s": slow,
                "notes": "; ".join(notes) or None,
            }
        )
    return rows


def _gradient_cache(
    phase: str, trace: PhaseTrace, traces: PrecisionTraces, shards: int
) -> tuple[int, list[str]]:
    """The previous update's gradient blocks still cached at the backward pass's peak
    (:func:`~lightning_pilot.estimate.cache.cached_gradient_bytes`), and its note."""
    if phase != "backward" or not traces.gradient_blocks:
        return 0, []
    cached = cached_gradient_bytes(traces.gradient_blocks, trace, shards)
    if cached is None:
        return 0, [
            "allocator cache: the previous update's gradients, freed by zero_grad, not"
            " replayed (the trace kept no allocations)"
        ]
    if not cached:
        return 0, [
            "allocator cache: the backward pass reuses the previous update's freed gradient"
            " blocks by its peak"
        ]
    return cached, [
        f"allocator cache: {cached} bytes of the previous update's gradients, freed by"
        " zero_grad before backward, stay reserved (no request up to the peak fits them; a"
        " lower bound)"
    ]


def largest_row(
    precision: str,
    tgt: Target,
    ckpt: Ckpt,
    seq_len: int | None,
    found: BatchFound,
    seq: SeqFound | None,
) -> dict[str, Any]:
    """The largest table's row of one target, precision and checkpointing (one GPU): what the
    micro-batch search ``found`` and the sequence length search (``seq``; ``None`` for a batch
    without a sequence dimension) found; a search that did not run leaves its sizes out."""
    row = {
        "target": tgt.name,
        "precision": precision,
        "checkpointing": ckpt,
        "strategy": "single",
        "devices": 1,
        "seq_len": seq_len,
        "status": found.status,
    }
    if found.largest is not None:
        row.update(largest_micro_batch=found.largest, method=found.method, checked=found.checked)
    row["reason"] = found.reason
    if seq is not None:
        row.update(seq_len_micro_batch=seq.micro_batch, max_seq_len=seq.bound)
        if seq.largest is not None:
            row.update(
                largest_seq_len=seq.largest, seq_len_method=seq.method, seq_len_checked=seq.checked
            )
        row["seq_len_reason"] = seq.reason
    return row


def publish(result: Estimate, out_dir: Any) -> list[str]:
    """Write ``estimate.parquet`` and ``estimate_largest.parquet`` into ``out_dir`` (through
    :mod:`lightning_pilot.storage`, never overwriting): their paths."""
    from lightning_pilot import storage
    from lightning_pilot.schemas import ESTIMATE_SCHEMA, LARGEST_SCHEMA

    folder = storage.make_folder(out_dir)
    paths = []
    for rows, schema, name in (
        (named_checkpointing(result.rows), ESTIMATE_SCHEMA, "estimate.parquet"),
        (named_checkpointing(result.largest), LARGEST_SCHEMA, "estimate_largest.parquet"),
    ):
        table = storage.rows_to_table(rows, schema)
        paths.append(str(storage.publish_table(table, folder / name)))
    return paths


def named_checkpointing(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows as the Parquet schema holds them: ``checkpointing`` by its name (``"off"``,
    ``"full"`` or ``"selective"``, :func:`~lightning_pilot.schemas.checkpointing_mode`)."""
    from lightning_pilot.schemas import checkpointing_mode

    return [{**row, "checkpointing": checkpointing_mode(row.get("checkpointing"))} for row in rows]
