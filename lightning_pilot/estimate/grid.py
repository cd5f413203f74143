"""The grid: targets x precision x micro-batch x sequence length x checkpointing x strategy.

:func:`estimate` traces each precision once per session (the module built or converted once),
and within it:

- ``forward`` and ``backward`` per checkpointing x sequence length at the two smallest
  micro-batches; every other micro-batch is **extrapolated** from those two when both ran the
  same operators in the same order (every storage of such a step is either fixed or
  proportional to the micro-batch, so the live bytes after each operator are affine in it) and
  the extrapolated peak falls on the operator where both traced peaks fell; otherwise it is
  traced. ``method`` says which.
- the optimizer steps (first and later) and the checkpoint save once: they do not depend on
  the batch;
- ``validation`` per sequence length, the same way as the training phases;
- with a repeated block list (Llama's ``model.layers``), each of those traces runs the list cut
  to 3, 4 and 5 blocks and extrapolates every operator to all of them (exact where the
  pattern holds, checked; else traced in full, said in ``notes``).

Per target, precision and checkpointing, the ``largest`` table holds the largest micro-batch
(at the longest sequence; affine in the micro-batch) and the largest sequence length (at the
smallest micro-batch; quadratic in the length, from three traced lengths), both confirmed by
tracing the answer and the next step.

A later update's forward pass holds the previous update's gradients (Lightning zeroes them
after ``training_step``, before ``backward``) and both passes hold the optimizer state; the
trace of the first update is **derived** by adding them (live throughout, so every point of
the phase moves by the same bytes).

Per GPU, from the single-device trace: ``ddp`` adds DDP's gradient buckets (one copy of the
gradients, unless ``gradient_as_bucket_view``); ``fsdp`` (full shard over N) divides weights,
gradients and optimizer state by N and adds the units gathered at once (two of the largest
unit, the one computing and the one prefetched, and in the backward pass that unit's
gradients) plus the parameters outside every unit. Those parts are **analytic**
(``analytic_bytes``), named so in ``notes``.

Example:
    >>> from lightning_pilot.demo import TinyCausalLM, InstructionDataModule
    >>> data = InstructionDataModule(batch_size=4, max_length=32)
    >>> data.setup("fit")
    >>> batch = next(iter(data.train_dataloader()))
    >>> result = estimate(TinyCausalLM(max_length=32), batch, targets=["L4-24GB"],
    ...                   micro_batches=[2, 4, 8], seq_lens=[32], largest=False)
    >>> frame = result.frame()
    >>> sorted(set(frame["method"]))
    ['derived', 'extrapolated', 'traced']
    >>> bool(frame["fits"].all())
    True
"""

from __future__ import annotations

import contextlib
import itertools
import math
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import torch

from lightning_pilot.core import validate
from lightning_pilot.core.progress import Reporter
from lightning_pilot.estimate.fits import FRAGMENTATION, fixed_phases_need
from lightning_pilot.estimate.fits import need as _need
from lightning_pilot.estimate.fits import tight_note as _tight_note
from lightning_pilot.estimate.reference import PHASE_ORDER
from lightning_pilot.estimate.roofline import (
    DEFAULT_EFFICIENCY,
    DEFAULT_MEMORY_EFFICIENCY,
    split_seconds,
)
from lightning_pilot.estimate.stand_in import ConfigureError, stand_in_trainer
from lightning_pilot.estimate.strategies import (
    FSDP_COMPUTE,
    Strategy,
    communication_seconds,
    fsdp_mixed,
)
from lightning_pilot.estimate.strategies import strategy_memory as _strategy_memory
from lightning_pilot.estimate.strategies import unit_bytes as _unit_bytes
from lightning_pilot.estimate.targets import Target, target
from lightning_pilot.estimate.trace import (
    CATEGORIES,
    PRECISIONS,
    PhaseTrace,
    Session,
    UntraceableError,
    compute_dtype,
)

__all__ = ["Estimate", "Strategy", "estimate", "extrapolate"]

_OWNER: Final = "estimate"
#: Activation checkpointing: off, every block (``True``) or per operator (``"selective"``).
Ckpt = bool | str
_CKPT_ORDER: Final[dict[Ckpt, int]] = {False: 0, True: 1, "selective": 2}
_TRAIN: Final = ("forward", "backward")


@dataclass
class Estimate:
    """What :func:`estimate` returns: ``rows`` (one per target x configuration x phase) and
    ``largest`` (per target x precision x checkpointing, one GPU: the largest micro-batch at
    the longest sequence and the largest sequence length at the smallest micro-batch)."""

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


def extrapolate(
    low: PhaseTrace, high: PhaseTrace, low_x: int, high_x: int, x: int
) -> PhaseTrace | None:
    """The phase at micro-batch ``x`` from traces at ``low_x`` and ``high_x``: every
    operator's live bytes, FLOPs, bytes moved and the peak's categories move linearly.
    ``None`` when the two traces ran different operators or the peak moves to another
    operator (then trace it).

    Example:
        >>> import numpy as np
        >>> def trace(scale):
        ...     return PhaseTrace("forward", 10 + 2 * scale, {**dict.fromkeys(CATEGORIES, 0),
        ...         "weights": 10, "activations": 2 * scale}, np.array([10, 10 + 2 * scale]),
        ...         np.zeros(2, np.int64), np.zeros(2, np.int64), np.zeros(2, np.int8), 1, 7, 10)
        >>> extrapolate(trace(1), trace(2), 1, 2, 8).peak_bytes
        26
    """
    if low.signature != high.signature or low.curve.shape != high.curve.shape:
        return None
    if not len(low.curve) or low.peak_bytes != int(low.curve.max()):
        return None
    if high.peak_bytes != int(high.curve.max()):
        return None
    span = high_x - low_x

    def line(a: Any, b: Any) -> Any:
        return a + (b - a) * (x - low_x) // span

    curve = line(low.curve, high.curve)
    index = int(np.argmax(curve))
    if index != int(np.argmax(low.curve)) or index != int(np.argmax(high.curve)):
        return None
    categories = {
        name: int(line(low.categories[name], high.categories[name])) for name in CATEGORIES
    }
    peak = int(curve[index])
    categories["temporaries"] += peak - sum(categories.values())
    return PhaseTrace(
        phase=low.phase,
        peak_bytes=peak,
        categories=categories,
        curve=curve,
        flops=line(low.flops, high.flops),
        moved=line(low.moved, high.moved),
        kinds=low.kinds,
        peak_op=index,
        signature=low.signature,
        start_bytes=int(line(low.start_bytes, high.start_bytes)),
        segment_bytes=int(line(low.segment_bytes, high.segment_bytes)),
        included=dict(low.included),
        notes=[
            *low.notes,
            f"extrapolated from micro-batches {low_x} and {high_x} (same operators, peak at"
            " the same operator)",
        ],
    )


@dataclass
class _Traces:
    """Everything traced for one precision."""

    precision: str
    train: dict[tuple[Ckpt, int | None, int], dict[str, PhaseTrace]] = field(default_factory=dict)
    validation: dict[tuple[int | None, int], PhaseTrace] = field(default_factory=dict)
    optimizer: dict[str, PhaseTrace] = field(default_factory=dict)
    save: PhaseTrace | None = None
    state: dict[str, int] = field(default_factory=dict)
    units: tuple[int, int] = (0, 0)
    error: tuple[str, str, str] | None = None  # (status, phase, reason)
    #: checkpointing -> (status, phase, reason): what failed only with activation
    #: checkpointing on; the configurations without it are estimated.
    failed: dict[Ckpt, tuple[str, str, str]] = field(default_factory=dict)
    #: (checkpointing, sequence length, micro-batch) -> the phases the searches traced.
    searched: dict[tuple[Ckpt, int | None, int], tuple[dict[str, PhaseTrace], PhaseTrace]] = field(
        default_factory=dict
    )
    exception: BaseException | None = None
    resolved_train: dict[tuple[Ckpt, int | None, int], tuple[dict[str, PhaseTrace], str]] = field(
        default_factory=dict
    )
    resolved_validation: dict[tuple[int | None, int], tuple[PhaseTrace, str]] = field(
        default_factory=dict
    )
    #: What every row of this precision says in ``notes`` (a stand-in Trainer).
    notes: list[str] = field(default_factory=list)


def _base(micro_batches: Sequence[int]) -> list[int]:
    """The two micro-batches traced for extrapolation: the two smallest from 2 up (a
    micro-batch of 1 often runs other operators: broadcasts, squeezes), else the smallest."""
    ordered = sorted(set(micro_batches))
    above = [b for b in ordered if b >= 2]
    return above[:2] if len(above) >= 2 else ordered[:2]


def _pair(traced: Mapping[int, Sequence[PhaseTrace]], below: int) -> tuple[int, int] | None:
    """The two largest traced micro-batches under ``below`` whose every phase ran the same
    operators (extrapolation needs them), or ``None``."""
    sizes = sorted((b for b in traced if b < below), reverse=True)
    for high_index, high in enumerate(sizes):
        for low in sizes[high_index + 1 :]:
            same = all(
                a.signature == b.signature and a.curve.shape == b.curve.shape
                for a, b in zip(traced[low], traced[high], strict=True)
            )
            if same:
                return low, high
    return None


def _train_at(
    session: Session,
    batch: Any,
    traces: _Traces,
    key: tuple[Ckpt, int | None, int],
) -> tuple[dict[str, PhaseTrace], str]:
    """The training phases at ``key``: extrapolated from two smaller traced micro-batches
    that ran the same operators, or traced."""
    if key in traces.train:
        return traces.train[key], "traced"
    checkpointing, seq_len, micro_batch = key
    traced = {
        k[2]: [v[p] for p in _TRAIN]
        for k, v in traces.train.items()
        if k[:2] == (checkpointing, seq_len)
    }
    pair = _pair(traced, micro_batch)
    if pair is not None:
        low, high = (traces.train[(checkpointing, seq_len, b)] for b in pair)
        made = {p: extrapolate(low[p], high[p], pair[0], pair[1], micro_batch) for p in _TRAIN}
        if all(value is not None for value in made.values()):
            return {k: v for k, v in made.items() if v is not None}, "extrapolated"
    result = session.train_phases(
        batch, micro_batch=micro_batch, seq_len=seq_len, checkpointing=checkpointing
    )
    traces.train[key] = result
    return result, "traced"


def _validation_at(
    session: Session,
    batch: Any,
    traces: _Traces,
    key: tuple[int | None, int],
) -> tuple[PhaseTrace, str]:
    """Validation at ``key``, as :func:`_train_at`."""
    if key in traces.validation:
        return traces.validation[key], "traced"
    seq_len, micro_batch = key
    traced = {k[1]: [v] for k, v in traces.validation.items() if k[0] == seq_len}
    pair = _pair(traced, micro_batch)
    if pair is not None:
        low, high = (traces.validation[(seq_len, b)] for b in pair)
        made = extrapolate(low, high, pair[0], pair[1], micro_batch)
        if made is not None:
            return made, "extrapolated"
    result = session.validation_phase(batch, micro_batch=micro_batch, seq_len=seq_len)
    traces.validation[key] = result
    return result, "traced"


def _trace_precision(
    precision: str,
    module: Any,
    factory: Callable[[], Any] | None,
    batch: Any,
    configs: Sequence[tuple[Ckpt, int | None, int]],
    base: Sequence[int],
    checkpoint_classes: tuple[type[torch.nn.Module], ...],
    wrap: tuple[Any, ...],
    largest_at: Callable[[Session, _Traces], None] | None,
    *,
    device: str = "cuda",
    blocks: bool = True,
    capacity_factor: float = 1.0,
) -> _Traces:
    traces = _Traces(precision)
    session = Session(
        module,
        factory=factory,
        precision=precision,
        round_to=512 if device == "cuda" else 1,
        cuda=device == "cuda",
        checkpoint_classes=checkpoint_classes,
        blocks=blocks,
        capacity_factor=capacity_factor,
    )
    phase = "setup"
    try:
        with session:
            itemsize = torch.empty((), dtype=compute_dtype(precision)).element_size()
            traces.units = _unit_bytes(session.module, wrap, itemsize)
            phase = "forward"
            ordered = sorted(configs, key=lambda c: (_CKPT_ORDER[c[0]], c[1] or 0, c[2]))
            for key in ordered:
                if key[0] in traces.failed:
                    continue
                try:
                    traces.resolved_train[key] = _train_at(session, batch, traces, key)
                except Exception as err:
                    if not key[0] or not any(not c[0] for c in configs):
                        raise
                    # Only checkpointing failed (the same step without it traced): its rows
                    # say why, the others are estimated.
                    status = "untraceable" if isinstance(err, UntraceableError) else "error"
                    reason = f"activation checkpointing: {type(err).__name__}: {err}"
                    traces.failed[key[0]] = (status, "forward", reason)
            phase = "optimizer_step_first"
            try:
                with stand_in_trainer(session.module, traces.notes):
                    session.build_optimizer()
            except Exception as err:
                raise ConfigureError(err) from err
            traces.optimizer = session.optimizer_phases()
            traces.state = session.measure_state()
            phase = "validation"
            val_keys = sorted({(c[1], c[2]) for c in configs}, key=lambda k: (k[0] or 0, k[1]))
            for val_key in val_keys:
                traces.resolved_validation[val_key] = _validation_at(
                    session, batch, traces, val_key
                )
            phase = "checkpoint_save"
            traces.save = session.save_phase()
            if largest_at is not None:
                phase = "forward"
                largest_at(session, traces)
    except ConfigureError as err:
        cause = err.__cause__
        traces.error = ("error", "optimizer_step_first", str(err))
        traces.exception = cause if isinstance(cause, Exception) else err
    except UntraceableError as err:
        traces.error = ("untraceable", session.recorder._phase or phase, str(err))
        traces.exception = err
    except Exception as err:  # the user's code: every failure becomes a row, never a crash
        where = session.recorder._phase or phase
        traces.error = ("error", where, f"{type(err).__name__}: {err}")
        traces.exception = err
    return traces


def _later_extra(trace: PhaseTrace, traces: _Traces) -> dict[str, int]:
    """What a later update holds during ``trace``'s phase that the trace did not: the previous
    gradients (forward pass only) and the optimizer state."""
    extra = {"optimizer_state": traces.state["optimizer_state"]}
    if trace.phase == "forward":
        extra["gradients"] = traces.state["gradients"]
    return {name: value - trace.included.get(name, 0) for name, value in extra.items()}


def _phase_traces(
    traces: _Traces, key: tuple[Ckpt, int | None, int], base: Sequence[int]
) -> dict[str, tuple[PhaseTrace, str]]:
    """The six phases of one configuration (later-update passes derived)."""
    train, how = traces.resolved_train[key]
    forward = train["forward"].shifted(
        _later_extra(train["forward"], traces),
        "later update: the previous gradients and the optimizer state added (live throughout)",
    )
    backward = train["backward"].shifted(
        _later_extra(train["backward"], traces),
        "later update: the optimizer state added (live throughout)",
    )
    validation, val_how = traces.resolved_validation[(key[1], key[2])]
    assert traces.save is not None
    held = {"batch": train["forward"].categories["batch"]}
    note = "the training batch added (Lightning holds it through the optimizer step)"
    return {
        "forward": (forward, "derived" if how == "traced" else how),
        "backward": (backward, "derived" if how == "traced" else how),
        "optimizer_step_first": (
            traces.optimizer["optimizer_step_first"].shifted(held, note),
            "derived",
        ),
        "optimizer_step": (traces.optimizer["optimizer_step"].shifted(held, note), "derived"),
        "validation": (validation, val_how),
        "checkpoint_save": (traces.save, "traced"),
    }


def _band_seconds(
    update: Sequence[PhaseTrace],
    tgt: Target,
    efficiency: tuple[float, float],
    memory_efficiency: tuple[float, float],
    allow_tf32: bool,
    shards: int,
) -> tuple[float, float, float, float]:
    """(fast, slow, compute, memory) seconds of one update: the compute-bound operators' ideal
    (``compute``) divided by
    ``efficiency``, the memory-bound ones' by ``memory_efficiency``; the optimizer step's
    divided by ``shards`` (FSDP: each GPU steps its own shard)."""
    compute = memory = 0.0
    for trace in update:
        c, m = split_seconds(trace.flops, trace.moved, trace.kinds, tgt, allow_tf32=allow_tf32)
        share = 1 / shards if trace.phase.startswith("optimizer_step") else 1.0
        compute, memory = compute + c * share, memory + m * share
    fast = compute / efficiency[1] + memory / memory_efficiency[1]
    slow = compute / efficiency[0] + memory / memory_efficiency[0]
    return fast, slow, compute, memory


def _rows_for(
    traces: _Traces,
    tgt: Target,
    strategy: Strategy,
    key: tuple[Ckpt, int | None, int],
    base: Sequence[int],
    efficiency: tuple[float, float],
    allow_tf32: bool,
    fragmentation: float,
    low: _Traces | None = None,
    memory_efficiency: tuple[float, float] = DEFAULT_MEMORY_EFFICIENCY,
) -> list[dict[str, Any]]:
    """The rows of one target, strategy and configuration; ``low``: the low-precision traces
    FSDP's mixed-precision policy computes with (:data:`FSDP_COMPUTE`)."""
    checkpointing, seq_len, micro_batch = key
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
    mixed = low is not None and strategy.kind == "fsdp"
    failure = traces.error or traces.failed.get(checkpointing)
    if failure is None and mixed:
        assert low is not None
        failure = low.error or low.failed.get(checkpointing)
        if failure is not None:
            failure = (failure[0], failure[1], f"{low.precision} (FSDP's compute): {failure[2]}")
    if failure is not None:
        status, phase, reason = failure
        return [{**common, "phase": phase, "status": status, "reason": reason}]
    phases = _phase_traces(traces, key, base)
    if mixed:
        assert low is not None
        phases = fsdp_mixed(phases, _phase_traces(low, key, base), traces, low)
    update = [phases[p][0] for p in ("forward", "backward", "optimizer_step")]
    flops = int(sum(int(t.flops.sum()) for t in update))
    moved = int(sum(int(t.moved.sum()) for t in update))
    # FSDP: each GPU steps the optimizer over its own shard only.
    shards = strategy.devices if strategy.kind == "fsdp" else 1
    fast, slow, compute, memory = _band_seconds(
        update, tgt, efficiency, memory_efficiency, allow_tf32, shards
    )
    comm = communication_seconds(strategy, traces, tgt)
    fast, slow = max(fast, comm), slow + comm
    roofline = (
        f"roofline: {compute:.4g} s compute-bound, {memory:.4g} s memory-bound, {comm:.4g} s"
        f" collectives at 100 %; efficiency {efficiency[0]:g} to {efficiency[1]:g} (compute),"
        f" {memory_efficiency[0]:g} to {memory_efficiency[1]:g} (memory)"
    )
    rows = []
    for phase in PHASE_ORDER:
        trace, method = phases[phase]
        analytic, segments, strategy_note = _strategy_memory(trace, strategy, traces)
        allocated = trace.peak_bytes + tgt.workspace_bytes + analytic
        live = trace.segment_bytes + tgt.workspace_bytes + segments
        reserved = max(math.ceil(live * (1 + fragmentation)), allocated)
        headroom = tgt.memory_bytes - _need(allocated, live - tgt.workspace_bytes, tgt)
        notes = [*trace.notes, roofline]
        if headroom >= 0 and reserved + tgt.overhead_bytes > tgt.memory_bytes:
            notes.append(_tight_note(reserved, tgt))
        if strategy_note:
            notes.append(strategy_note)
        notes.extend(traces.notes)
        rows.append(
            {
                **common,
                "phase": phase,
                "status": "ok",
                "reason": None,
                "method": method,
                "peak_allocated_bytes": allocated,
                "estimated_reserved_bytes": reserved,
                **{f"{name}_bytes": trace.categories[name] for name in CATEGORIES},
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


def _affine(low: int, high: int, low_x: int, high_x: int, x: int) -> int:
    return low + (high - low) * (x - low_x) // (high_x - low_x)


def _predicted_need(
    traces: _Traces,
    tgt: Target,
    checkpointing: Ckpt,
    seq_len: int | None,
    base: Sequence[int],
    micro_batch: int,
    fragmentation: float,
) -> int | None:
    """The most memory any phase needs at ``micro_batch``: every operator's live bytes moved
    linearly from the two base traces (``None`` when they ran different operators)."""
    low_x, high_x = base
    train_low = traces.resolved_train[(checkpointing, seq_len, low_x)][0]
    train_high = traces.resolved_train[(checkpointing, seq_len, high_x)][0]
    pairs = [
        (
            train_low["forward"],
            train_high["forward"],
            sum(_later_extra(train_low["forward"], traces).values()),
        ),
        (
            train_low["backward"],
            train_high["backward"],
            sum(_later_extra(train_low["backward"], traces).values()),
        ),
        (
            traces.resolved_validation[(seq_len, low_x)][0],
            traces.resolved_validation[(seq_len, high_x)][0],
            0,
        ),
    ]
    worst = 0
    for low, high, extra in pairs:
        if low.signature != high.signature or low.curve.shape != high.curve.shape:
            return None
        curve = low.curve + (high.curve - low.curve) * (micro_batch - low_x) // (high_x - low_x)
        start = _affine(low.start_bytes, high.start_bytes, low_x, high_x, micro_batch)
        peak = max(int(curve.max()), start) + extra + tgt.workspace_bytes
        segments = _affine(low.segment_bytes, high.segment_bytes, low_x, high_x, micro_batch)
        worst = max(worst, _need(peak, segments + extra, tgt))
    batch_bytes = _affine(
        train_low["forward"].categories["batch"],
        train_high["forward"].categories["batch"],
        low_x,
        high_x,
        micro_batch,
    )
    return max(worst, fixed_phases_need(traces, tgt, batch_bytes))


def _largest_search(
    targets: Sequence[Target],
    checkpointing: Sequence[Ckpt],
    seq_len: int | None,
    base: Sequence[int],
    batch: Any,
    fragmentation: float,
    rows: list[dict[str, Any]],
    verify: bool,
    cap: int,
    seq: tuple[int, int, int] | None = None,
) -> Callable[[Session, _Traces], None]:
    """A step run inside the session: the largest micro-batch per target and checkpointing,
    predicted from the base traces and checked by tracing it and the next one; with ``seq``
    (micro-batch, step, limit), the largest sequence length too (:func:`_seq_search`)."""

    def run(session: Session, traces: _Traces) -> None:
        by_seq: dict[Ckpt, dict[str, dict[str, Any]]] = {}
        for tgt, ckpt in itertools.product(targets, checkpointing):
            if seq is not None and ckpt not in by_seq and ckpt not in traces.failed:
                by_seq[ckpt] = _seq_search(
                    session, batch, traces, targets, ckpt, *seq, fragmentation, verify
                )
            start = len(rows)
            _largest_row(session, traces, tgt, ckpt)
            for row in rows[start:]:
                row.update(by_seq.get(ckpt, {}).get(tgt.name, {}))

    def _largest_row(session: Session, traces: _Traces, tgt: Target, ckpt: Ckpt) -> None:
        row: dict[str, Any] = {
            "target": tgt.name,
            "precision": traces.precision,
            "checkpointing": ckpt,
            "strategy": "single",
            "devices": 1,
            "seq_len": seq_len,
        }
        if ckpt in traces.failed:
            status, _, failure = traces.failed[ckpt]
            rows.append({**row, "status": status, "reason": failure})
            return
        traced = {
            b: [t["forward"], t["backward"], traces.validation[(seq_len, b)]]
            for (c, q, b), t in traces.train.items()
            if (c, q) == (ckpt, seq_len) and (seq_len, b) in traces.validation
        }
        pair = _pair(traced, 1 << 62)
        if pair is None:
            why = "no two traced micro-batches ran the same operators"
            rows.append({**row, "status": "not_estimated", "reason": why})
            return
        base = list(pair)

        def need(
            b: int, tgt: Target = tgt, ckpt: Ckpt = ckpt, base: list[int] = base
        ) -> int | None:
            return _predicted_need(traces, tgt, ckpt, seq_len, base, b, fragmentation)

        first = need(1)
        if first is None:
            rows.append(
                {
                    **row,
                    "status": "not_estimated",
                    "reason": "the two traced micro-batches ran different operators",
                }
            )
            return
        if first > tgt.memory_bytes:
            checked = verify and (
                _traced_need(session, batch, traces, tgt, ckpt, seq_len, 1, fragmentation)
                > tgt.memory_bytes
            )
            rows.append(
                {
                    **row,
                    "status": "ok",
                    "largest_micro_batch": 0,
                    "method": "predicted, traced" if verify else "predicted",
                    "checked": checked,
                    "reason": "micro-batch 1 does not fit"
                    if checked or not verify
                    else "micro-batch 1 does not fit as predicted, but fits as traced",
                }
            )
            return
        lo, hi = 1, 2
        while hi <= cap and (need(hi) or 0) <= tgt.memory_bytes:
            lo, hi = hi, hi * 2
        if hi > cap and (need(cap) or 0) <= tgt.memory_bytes:
            rows.append(
                {
                    **row,
                    "status": "ok",
                    "largest_micro_batch": cap,
                    "method": "predicted",
                    "checked": False,
                    "reason": f"fits at max_micro_batch={cap}, the end of the search",
                }
            )
            return
        hi = min(hi, cap + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if (need(mid) or 0) <= tgt.memory_bytes:
                lo = mid
            else:
                hi = mid
        checked = False
        method = "predicted"
        if verify:
            found, checked = _verify(
                session, batch, traces, tgt, ckpt, seq_len, lo, fragmentation, cap
            )
            method = "predicted, traced" if found == lo else "predicted, corrected by tracing"
            lo = found
        reason: str | None = None
        if verify and not checked:
            reason = f"traces near the prediction did not settle in {_VERIFY_TRACES} tries"
        rows.append(
            {
                **row,
                "status": "ok",
                "largest_micro_batch": lo,
                "method": method,
                "checked": checked,
                "reason": reason,
            }
        )

    return run


def _phases_at(
    session: Session,
    batch: Any,
    traces: _Traces,
    ckpt: Ckpt,
    seq_len: int | None,
    micro_batch: int,
) -> tuple[dict[str, PhaseTrace], PhaseTrace]:
    """The training phases and validation at one size: traced by the grid or an earlier
    search step, else traced now (and kept for the next step)."""
    key = (ckpt, seq_len, micro_batch)
    found = traces.searched.get(key)
    if found is not None:
        return found
    train = traces.train.get(key)
    if train is None:
        train = session.train_phases(
            batch, micro_batch=micro_batch, seq_len=seq_len, checkpointing=ckpt
        )
    val = traces.validation.get((seq_len, micro_batch))
    if val is None:
        val = session.validation_phase(batch, micro_batch=micro_batch, seq_len=seq_len)
    traces.searched[key] = (train, val)
    return train, val


def _traced_need(
    session: Session,
    batch: Any,
    traces: _Traces,
    tgt: Target,
    ckpt: Ckpt,
    seq_len: int | None,
    micro_batch: int,
    fragmentation: float,
) -> int:
    """The most memory any phase needs at ``micro_batch``, traced."""
    train, val = _phases_at(session, batch, traces, ckpt, seq_len, micro_batch)
    worst = 0
    for trace, extra in (
        (train["forward"], sum(_later_extra(train["forward"], traces).values())),
        (train["backward"], sum(_later_extra(train["backward"], traces).values())),
        (val, 0),
    ):
        peak = trace.peak_bytes + extra + tgt.workspace_bytes
        worst = max(worst, _need(peak, trace.segment_bytes + extra, tgt))
    batch_bytes = train["forward"].categories["batch"]
    return max(worst, fixed_phases_need(traces, tgt, batch_bytes))


_VERIFY_TRACES: Final = 12


def _settle(fits: Callable[[int], bool], start: int, cap: int) -> tuple[int, bool]:
    """The largest ``b`` up to ``cap`` with ``fits(b)`` (each call a trace), from the
    prediction ``start``: it must fit and ``start + 1`` must not; when one disagrees, the
    boundary is bracketed by doubling steps and bisected (at most :data:`_VERIFY_TRACES`
    calls). ``(largest, settled)``."""
    cache: dict[int, bool] = {}

    def check(b: int) -> bool:
        if b not in cache:
            cache[b] = fits(b)
        return cache[b]

    lo, hi = 0, None  # largest known to fit, smallest known not to
    step = 1
    b = min(max(start, 1), cap)
    while len(cache) < _VERIFY_TRACES:
        if hi is not None and hi - lo <= 1:
            return lo, True
        if lo >= cap:
            return cap, True
        if check(b):
            lo = max(lo, b)
            b = min(lo + step, cap) if hi is None else (lo + hi) // 2
        else:
            hi = b if hi is None else min(hi, b)
            if b == 1:
                return 0, True
            b = max(hi - step, 1) if lo == 0 and hi - step > 0 else (lo + hi) // 2
            b = max(b, lo + 1)
        step *= 2
    return lo, (hi is not None and hi - lo <= 1) or lo >= cap


def _verify(
    session: Session,
    batch: Any,
    traces: _Traces,
    tgt: Target,
    ckpt: Ckpt,
    seq_len: int | None,
    micro_batch: int,
    fragmentation: float,
    cap: int,
) -> tuple[int, bool]:
    """The largest micro-batch, settled by tracing from the prediction (:func:`_settle`)."""

    def fits(b: int) -> bool:
        need = _traced_need(session, batch, traces, tgt, ckpt, seq_len, b, fragmentation)
        return need <= tgt.memory_bytes

    return _settle(fits, micro_batch, cap)


#: The module attributes (and their ``config``'s) that bound the sequence length.
_POSITION_LIMITS: Final = ("max_position_embeddings", "n_positions", "max_seq_len", "max_length")


def sequence_bound(module: torch.nn.Module) -> int | None:
    """The longest sequence ``module`` declares it accepts: the smallest positive integer
    ``max_position_embeddings``, ``n_positions``, ``max_seq_len`` or ``max_length`` of any
    submodule or its ``config``; ``None`` when none declares one.

    Example:
        >>> from lightning_pilot.demo import TinyCausalLM
        >>> sequence_bound(TinyCausalLM(max_length=32))
        32
    """
    found: list[int] = []
    for sub in module.modules():
        for owner in (sub, getattr(sub, "config", None)):
            if owner is None:
                continue
            for name in _POSITION_LIMITS:
                value = getattr(owner, name, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    found.append(value)
    return min(found) if found else None


def _lagrange(xs: Sequence[int], values: Sequence[Any], x: int) -> Any:
    """The polynomial through ``(xs[i], values[i])`` (arrays element by element) at ``x``."""
    total: Any = 0
    for i, xi in enumerate(xs):
        weight = 1.0
        for j, xj in enumerate(xs):
            if j != i:
                weight *= (x - xj) / (xi - xj)
        total = total + weight * np.asarray(values[i], dtype=np.float64)
    return total


def _ceil(value: Any) -> int:
    return math.ceil(float(value) - 1e-6)


def _seq_need(
    points: Mapping[int, Sequence[PhaseTrace]],
    traces: _Traces,
    tgt: Target,
    seq_len: int,
    fragmentation: float,
) -> int | None:
    """The most memory any phase needs at ``seq_len``: every operator's live bytes (and the
    start, the allocator's segments and the batch) through the polynomial of the traced
    sequence lengths ``points`` (three: quadratic, as attention's T x T terms are);
    ``None`` when they ran different operators."""
    xs = sorted(points)
    worst = 0
    for index in range(3):  # forward, backward, validation
        phases = [points[x][index] for x in xs]
        if len({(p.signature, p.curve.shape) for p in phases}) != 1:
            return None
        curve = _lagrange(xs, [p.curve for p in phases], seq_len)
        start = _lagrange(xs, [p.start_bytes for p in phases], seq_len)
        extra = sum(_later_extra(phases[0], traces).values()) if index < 2 else 0
        peak = _ceil(max(float(curve.max(initial=0)), float(start))) + extra
        segments = _ceil(_lagrange(xs, [p.segment_bytes for p in phases], seq_len))
        worst = max(worst, _need(peak + tgt.workspace_bytes, segments + extra, tgt))
    batch_bytes = _ceil(_lagrange(xs, [points[x][0].categories["batch"] for x in xs], seq_len))
    return max(worst, fixed_phases_need(traces, tgt, batch_bytes))


def _seq_search(
    session: Session,
    batch: Any,
    traces: _Traces,
    targets: Sequence[Target],
    ckpt: Ckpt,
    micro_batch: int,
    step: int,
    limit: int,
    fragmentation: float,
    verify: bool,
) -> dict[str, dict[str, Any]]:
    """Per target: the largest sequence length (a multiple of the step) that fits at
    ``micro_batch``, up to the module's declared bound or ``limit``; predicted from three
    traced lengths, then settled by tracing it and the next step. The row's ``seq_len_*``
    fields, by target name."""
    bound = sequence_bound(session.module)
    cap = bound if bound is not None else limit
    while step > 1 and cap // step < 8:
        step //= 2
    top = cap // step
    common: dict[str, Any] = {"seq_len_micro_batch": micro_batch, "max_seq_len": cap}
    why_cap = (
        f"the module's declared maximum ({bound} positions)"
        if bound is not None
        else f"max_seq_len={limit}, the end of the search"
    )
    # Three lengths: the bound, and a third and two thirds of it, or a length the grid
    # traced already at this micro-batch in their place.
    units = [max(1, top // 3), max(2, 2 * top // 3), top]
    for known_ckpt, known_seq, known_b in traces.train:
        if (known_ckpt, known_b) == (ckpt, micro_batch) and known_seq and known_seq % step == 0:
            unit = known_seq // step
            if 0 < unit < top and unit not in units:
                nearest = min(range(2), key=lambda i: abs(units[i] - unit))
                units[nearest] = unit
    units = sorted(set(units))
    points: dict[int, list[PhaseTrace]] = {}
    try:
        if len(units) < 3:
            raise ValueError(f"the bound {cap} holds fewer than 3 steps of {step}")
        for unit in units:
            seq = unit * step
            train, val = _phases_at(session, batch, traces, ckpt, seq, micro_batch)
            points[seq] = [train["forward"], train["backward"], val]
    except Exception as err:  # the module refuses a length: the search cannot run
        failure = f"sequence lengths could not be traced: {type(err).__name__}: {err}"
        return {t.name: {**common, "seq_len_reason": failure} for t in targets}
    found: dict[str, dict[str, Any]] = {}
    for tgt in targets:

        def need(unit: int, tgt: Target = tgt) -> int | None:
            return _seq_need(points, traces, tgt, unit * step, fragmentation)

        if need(1) is None:
            different = "the traced sequence lengths ran different operators"
            found[tgt.name] = {**common, "seq_len_reason": different}
            continue
        lo, hi = 0, top + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if (need(mid) or 0) <= tgt.memory_bytes:
                lo = mid
            else:
                hi = mid
        method, checked = "predicted (quadratic in the sequence length)", False
        reason: str | None = None if lo else f"one step ({step}) does not fit"
        if verify:

            def fits(unit: int, tgt: Target = tgt) -> bool:
                need = _traced_need(
                    session, batch, traces, tgt, ckpt, unit * step, micro_batch, fragmentation
                )
                return need <= tgt.memory_bytes

            settled, checked = _settle(fits, max(lo, 1), top)
            method += ", traced" if settled == lo else ", corrected by tracing"
            lo = settled
            if not checked:
                reason = f"traces near the prediction did not settle in {_VERIFY_TRACES} tries"
        if lo == top and reason is None:
            reason = f"fits at {why_cap}"
        found[tgt.name] = {
            **common,
            "largest_seq_len": lo * step,
            "seq_len_method": method,
            "seq_len_checked": checked,
            "seq_len_reason": reason,
        }
    return found


def trace_configuration(
    module: Any = None,
    batch: Any = None,
    *,
    factory: Callable[[], Any] | None = None,
    precision: str = "32-true",
    micro_batch: int = 1,
    seq_len: int | None = None,
    checkpointing: Ckpt = False,
    checkpoint_classes: Sequence[type[torch.nn.Module]] = (),
    device: str = "cpu",
    blocks: bool = True,
) -> dict[str, PhaseTrace]:
    """The six phases of one configuration, as :func:`estimate` traces them, on ``device``
    ``"cpu"`` (storages as they are, the optimizer as on CPU: comparable with
    :func:`~lightning_pilot.estimate.measure_cpu`) or ``"cuda"`` (512-byte blocks, the CUDA
    optimizer default). ``UntraceableError`` or the user's error when a phase fails.

    Example:
        >>> from lightning_pilot.demo import TinyCausalLM, InstructionDataModule
        >>> data = InstructionDataModule(batch_size=4, max_length=32)
        >>> data.setup("fit")
        >>> batch = next(iter(data.train_dataloader()))
        >>> phases = trace_configuration(TinyCausalLM(max_length=32), batch, micro_batch=4)
        >>> phases["optimizer_step"].categories["optimizer_state"] > 0
        True
    """
    owner = "trace_configuration"
    validate.choice(owner, "precision", precision, PRECISIONS)
    validate.integer(owner, "micro_batch", micro_batch, minimum=1)
    validate.integer(owner, "seq_len", seq_len, minimum=1, optional=True)
    _checkpointing(checkpointing, owner)
    validate.choice(owner, "device", device, ("cpu", "cuda"))
    key = (checkpointing, seq_len, micro_batch)
    traces = _trace_precision(
        precision,
        module,
        factory,
        batch,
        [key],
        [micro_batch],
        tuple(checkpoint_classes),
        (),
        None,
        device=device,
        blocks=validate.boolean(owner, "blocks", blocks),
    )
    if traces.exception is not None:
        raise traces.exception
    return {name: trace for name, (trace, _) in _phase_traces(traces, key, [micro_batch]).items()}


_JOB: dict[str, Any] | None = None


def _precision_job(
    precision: str, keep_exception: bool = False
) -> tuple[_Traces, list[dict[str, Any]]]:
    """Trace one precision of the grid in :data:`_JOB` (in a forked worker, or here)."""
    job = _JOB
    assert job is not None
    found: list[dict[str, Any]] = []
    search = (
        _largest_search(
            job["targets"],
            job["checkpointing"],
            job["longest"],
            job["search_base"],
            job["batch"],
            job["fragmentation"],
            found,
            job["verify"],
            job["cap"],
            job["seq"],
        )
        if job["largest"] and precision not in job["extra"]
        else None
    )
    traces = _trace_precision(
        precision,
        job["module"],
        job["factory"],
        job["batch"],
        job["configs"],
        job["base"],
        job["classes"],
        job["wrap"],
        search,
        blocks=job["blocks"],
        capacity_factor=job["capacity_factor"],
    )
    if traces.error is not None and job["largest"] and precision not in job["extra"]:
        status, _, reason = traces.error
        for tgt, ckpt in itertools.product(job["targets"], job["checkpointing"]):
            found.append(
                {
                    "target": tgt.name,
                    "precision": precision,
                    "checkpointing": ckpt,
                    "strategy": "single",
                    "devices": 1,
                    "seq_len": job["longest"],
                    "status": status,
                    "reason": reason,
                }
            )
    if not keep_exception:
        traces.exception = None  # not every exception survives the trip between processes
    return traces, found


def estimate(
    module: Any = None,
    batch: Any = None,
    *,
    factory: Callable[[], Any] | None = None,
    targets: Sequence[str | Target] = ("H100-SXM-80GB",),
    precisions: Sequence[str] = ("bf16-mixed",),
    micro_batches: Sequence[int] = (1,),
    seq_lens: Sequence[int | None] = (None,),
    checkpointing: Sequence[Ckpt] = (False,),
    strategies: Sequence[str | Strategy] = ("single",),
    checkpoint_classes: Sequence[type[torch.nn.Module]] = (),
    wrap_classes: Sequence[type[torch.nn.Module] | str] = (),
    efficiency: tuple[float, float] = DEFAULT_EFFICIENCY,
    memory_efficiency: tuple[float, float] = DEFAULT_MEMORY_EFFICIENCY,
    allow_tf32: bool = False,
    fragmentation: float = FRAGMENTATION,
    largest: bool = True,
    verify_largest: bool = True,
    max_micro_batch: int = 1024,
    seq_step: int = 512,
    max_seq_len: int = 131072,
    blocks: bool = True,
    workers: int | None = None,
    timeout: float | None = 3600.0,
    capacity_factor: float = 1.0,
    out_dir: str | Any = None,
    progress: Any = None,
) -> Estimate:
    """Estimate memory per GPU and step time of ``module`` (or ``factory()``) on ``targets``.

    ``batch`` is one real batch of the pilot's data (dicts, lists, tuples of tensors); it is
    reshaped to each micro-batch and sequence length (``None``: as it is). Precisions are
    traced in parallel, one forked process each, up to ``workers`` (default: the CPU count;
    ``1``, or CUDA already initialised in this process, traces here). Returns an
    :class:`Estimate`; with ``out_dir``, also writes ``estimate.parquet`` and
    ``estimate_largest.parquet`` there (through :mod:`lightning_pilot.storage`, never
    overwriting).

    ``checkpoint_classes``: the module classes activation checkpointing wraps (default: the
    Hugging Face models inside switch it on themselves). ``wrap_classes``: FSDP's units (classes
    or class names; default: the Hugging Face ``_no_split_modules``). ``efficiency``: the
    fraction of the roofline compute-bound operators reach, low and high; ``memory_efficiency``:
    the fraction of the bandwidth memory-bound ones reach. ``allow_tf32``: fp32 matrix products
    on TF32 tensor cores. ``fragmentation``: reserved bytes allowed above the allocator's
    segments, in ``estimated_reserved_bytes`` only: ``fits`` rests on the live blocks (a
    ``tight`` note says when the reserved estimate exceeds the GPU). ``largest``: search the
    largest micro-batch per target, precision and
    checkpointing at the longest sequence, up to ``max_micro_batch`` (``verify_largest``:
    confirmed by tracing), and the largest sequence length at the smallest micro-batch, a
    multiple of ``seq_step`` (halved until the bound holds 8 steps) up to the module's declared
    maximum (:func:`sequence_bound`) or ``max_seq_len``. ``blocks``: trace the batch's phases
    with the repeated block list cut and extrapolated (see
    :class:`~lightning_pilot.estimate.Session`). ``progress``: a
    :class:`lightning_pilot.core.progress.Reporter` told as each precision's traces start and
    finish (default: none). ``timeout``: seconds the worker processes may take together
    (``None``: no limit); past it they are stopped and a ``TimeoutError`` says so (each worker
    computes on one thread, so a parent's OpenMP threads cannot leave them waiting).
    ``capacity_factor``: a mixture of experts' routing, traced balanced (``1``: every expert
    gets its share of the tokens) or with the busiest expert given that many times its share
    (:class:`~lightning_pilot.estimate.Session`'s, at least 1).
    """
    started = time.perf_counter()
    if (module is None) == (factory is None):
        raise ValueError(
            validate.invalid(_OWNER, "module", module, "a LightningModule, or None with factory")
        )
    if module is not None:
        validate.instance(_OWNER, "module", module, torch.nn.Module, optional=False)
    validate.callable_or_none(_OWNER, "factory", factory, "factory() -> LightningModule")
    if batch is None:
        raise ValueError(validate.invalid(_OWNER, "batch", batch, "one real batch of the data"))
    tgts = [target(value) for value in sequence_argument(targets, "targets")]
    precs = [
        validate.choice(_OWNER, "precisions", p, PRECISIONS)
        for p in sequence_argument(precisions, "precisions")
    ]
    mbs = [
        validate.integer(_OWNER, "micro_batches", b, minimum=1)
        for b in sequence_argument(micro_batches, "micro_batches")
    ]
    seqs = [
        validate.integer(_OWNER, "seq_lens", s, minimum=1, optional=True)
        for s in sequence_argument(seq_lens, "seq_lens")
    ]
    ckpts = [_checkpointing(c) for c in sequence_argument(checkpointing, "checkpointing")]
    strats = [Strategy.parse(s) for s in sequence_argument(strategies, "strategies")]
    classes = tuple(sequence_argument(checkpoint_classes, "checkpoint_classes", empty=True))
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise TypeError(
                validate.invalid(_OWNER, "checkpoint_classes", cls, "torch.nn.Module subclasses")
            )
    wrap = tuple(sequence_argument(wrap_classes, "wrap_classes", empty=True))
    _efficiency(efficiency)
    _efficiency(memory_efficiency, "memory_efficiency")
    validate.boolean(_OWNER, "allow_tf32", allow_tf32)
    validate.number(_OWNER, "fragmentation", fragmentation, minimum=0, maximum=1)
    validate.boolean(_OWNER, "largest", largest)
    validate.boolean(_OWNER, "verify_largest", verify_largest)
    validate.path(_OWNER, "out_dir", out_dir)
    validate.integer(_OWNER, "workers", workers, minimum=1, optional=True)
    if timeout is not None:
        validate.number(_OWNER, "timeout", timeout, minimum=0, allow_minimum=False)
    validate.integer(_OWNER, "max_micro_batch", max_micro_batch, minimum=1)
    validate.integer(_OWNER, "seq_step", seq_step, minimum=1)
    validate.integer(_OWNER, "max_seq_len", max_seq_len, minimum=1)
    validate.boolean(_OWNER, "blocks", blocks)
    validate.number(_OWNER, "capacity_factor", capacity_factor, minimum=1.0)

    base = _base(mbs)
    # FSDP's mixed-precision policy computes in the low precision: traced too (no rows).
    lows = (
        {p: FSDP_COMPUTE[p] for p in precs if p in FSDP_COMPUTE}
        if any(s.kind == "fsdp" for s in strats)
        else {}
    )
    extra = sorted(set(lows.values()) - set(precs))
    traced = [*precs, *extra]
    configs = [(c, s, b) for c in ckpts for s in seqs for b in mbs]
    longest = max(seqs, key=lambda s: s or 0)
    # The largest micro-batch is predicted from two traced micro-batches from 2 up.
    search_base = base if len(base) == 2 and base[0] >= 2 else [2, 4]
    if largest:
        for c in ckpts:
            for b in search_base:
                if (c, longest, b) not in configs:
                    configs.append((c, longest, b))
    rows: list[dict[str, Any]] = []
    largest_rows: list[dict[str, Any]] = []
    global _JOB
    stack = contextlib.ExitStack()
    done: list[tuple[_Traces, list[dict[str, Any]]]] = []
    _JOB = {
        "targets": tgts,
        "checkpointing": ckpts,
        "longest": longest,
        "search_base": search_base,
        "batch": batch,
        "fragmentation": fragmentation,
        "verify": verify_largest,
        "cap": max_micro_batch,
        # The largest sequence length is searched at the grid's smallest micro-batch, for a
        # batch with a sequence dimension (token ids).
        "seq": (min(mbs), seq_step, max_seq_len) if _has_sequence(batch) else None,
        "blocks": blocks,
        "capacity_factor": capacity_factor,
        "largest": largest,
        "module": module,
        "factory": factory,
        "configs": configs,
        "base": base,
        "classes": classes,
        "wrap": wrap,
        "extra": extra,
    }
    try:
        stack.enter_context(_not_logging(module))
        count = min(len(traced), workers or os.cpu_count() or 1)
        # A forked child must not touch CUDA once the parent has initialised it (a live
        # module on a GPU: its buffers' values are read): trace in this process then.
        forkable = "fork" in multiprocessing.get_all_start_methods()
        shown = progress if progress is not None else Reporter()
        total = f"{len(configs)} configuration(s) x {len(tgts)} target(s)"
        if count > 1 and forkable and not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            shown.update(f"tracing {', '.join(traced)} in {count} processes: {total}", done=0)
            with multiprocessing.get_context("fork").Pool(count, _worker_start) as pool:
                deadline = time.monotonic() + (timeout if timeout is not None else math.inf)
                results = pool.imap(_precision_job, traced, chunksize=1)
                for _ in traced:
                    left = deadline - time.monotonic()
                    try:
                        finished = results.next(timeout=None if math.isinf(left) else left)
                    except multiprocessing.TimeoutError:
                        raise TimeoutError(
                            _timeout_message(timeout, count, len(done), traced)
                        ) from None
                    done.append(finished)
                    shown.update(
                        f"{len(done)} of {len(traced)} precision(s) traced", done=len(done)
                    )
        else:
            for index, precision in enumerate(traced):
                shown.update(f"tracing {precision}: {total}", done=index)
                done.append(_precision_job(precision, keep_exception=True))
    finally:
        _JOB = None
        stack.close()
    by_precision = {traces.precision: traces for traces, _ in done}
    for traces, found in done:
        if traces.precision in extra:
            continue
        largest_rows.extend(found)
        low = by_precision.get(lows.get(traces.precision, ""))
        for tgt, strategy, key in itertools.product(
            tgts, strats, [(c, s, b) for c in ckpts for s in seqs for b in mbs]
        ):
            rows.extend(
                _rows_for(
                    traces,
                    tgt,
                    strategy,
                    key,
                    base,
                    efficiency,
                    allow_tf32,
                    fragmentation,
                    low,
                    memory_efficiency,
                )
            )
    result = Estimate(rows, largest_rows, time.perf_counter() - started)
    shown.close(f"{len(rows)} row(s) in {result.seconds:.1f} s", done=len(traced))
    if out_dir is not None:
        result.paths = _publish(result, out_dir)
    return result


def _worker_start() -> None:
    """Each forked worker computes on one thread. A parent that already ran an
    OpenMP-parallel operator leaves libgomp's thread pool behind in a forked child, and the
    child's first parallel region waits on threads that do not exist there: one thread per
    worker never enters one (the precisions run side by side instead)."""
    torch.set_num_threads(1)


def _timeout_message(timeout: float | None, count: int, finished: int, precs: Sequence[str]) -> str:
    return (
        f"estimate(timeout={timeout}): {count} worker processes traced {finished} of"
        f" {len(precs)} precision(s) ({', '.join(precs)}) in {timeout} s and were stopped;"
        " pass workers=1 to trace in this process, or a larger timeout"
    )


def _checkpointing(value: object, owner: str = _OWNER) -> Ckpt:
    """``False``, ``True`` or ``"selective"``, else a clear error."""
    if isinstance(value, bool) or value == "selective":
        return value
    error = ValueError if isinstance(value, str) else TypeError
    raise error(validate.invalid(owner, "checkpointing", value, "False, True or 'selective'"))


def _has_sequence(batch: Any) -> bool:
    from lightning_pilot.estimate.trace import _sequence_length

    with contextlib.suppress(Exception):
        return _sequence_length(batch) is not None
    return False


def sequence_argument(
    value: object, name: str, *, empty: bool = False, owner: str = _OWNER
) -> list[Any]:
    """``value`` as a list: a sequence other than a string, non-empty unless ``empty``."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(validate.invalid(owner, name, value, "a list"))
    if not value and not empty:
        raise ValueError(validate.invalid(owner, name, value, "a non-empty list"))
    return list(value)


def _efficiency(value: object, name: str = "efficiency") -> None:
    expected = "a pair (low, high) with 0 < low <= high <= 1"
    if not isinstance(value, tuple) or len(value) != 2:
        raise TypeError(validate.invalid(_OWNER, name, value, expected))
    low = validate.number(_OWNER, name, value[0], minimum=0, maximum=1, allow_minimum=False)
    high = validate.number(_OWNER, name, value[1], minimum=0, maximum=1, allow_minimum=False)
    if low > high:
        raise ValueError(validate.invalid(_OWNER, name, value, expected))


def _publish(result: Estimate, out_dir: Any) -> list[str]:
    from lightning_pilot import storage
    from lightning_pilot.schemas import ESTIMATE_SCHEMA, LARGEST_SCHEMA

    folder = storage.make_folder(out_dir)
    paths = []
    for rows, schema, name in (
        (_named_checkpointing(result.rows), ESTIMATE_SCHEMA, "estimate.parquet"),
        (_named_checkpointing(result.largest), LARGEST_SCHEMA, "estimate_largest.parquet"),
    ):
        table = storage.rows_to_table(rows, schema)
        paths.append(str(storage.publish_table(table, folder / name)))
    return paths


def _named_checkpointing(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows as the Parquet schema holds them: ``checkpointing`` by its name (``"off"``,
    ``"full"`` or ``"selective"``, :func:`~lightning_pilot.schemas.checkpointing_mode`)."""
    from lightning_pilot.schemas import checkpointing_mode

    return [{**row, "checkpointing": checkpointing_mode(row.get("checkpointing"))} for row in rows]


@contextlib.contextmanager
def _not_logging(module: Any) -> Iterator[None]:
    """A live LightningModule's ``self.log``/``self.log_dict`` do nothing while its steps run on
    fake values (nothing may reach a Trainer's loggers); put back after. Nothing to do
    for ``None`` (a factory builds the module) or a plain ``nn.Module``."""
    names = ("log", "log_dict")
    if not callable(getattr(type(module), "log_dict", None)):  # no LightningModule: no logging
        yield
        return
    held = {name: module.__dict__[name] for name in names if name in module.__dict__}
    for name in names:
        module.__dict__[name] = _ignore
    try:
        yield
    finally:
        for name in names:
            if name in held:
                module.__dict__[name] = held[name]
            else:
                module.__dict__.pop(name, None)


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None
