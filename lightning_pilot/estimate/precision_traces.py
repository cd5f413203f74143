"""The traces of one precision in one :class:`Session`: :func:`trace_grid` traces the grid's
training phases and validation (other micro-batches **extrapolated** where two traced ones ran
the same operators, :func:`extrapolate`), the optimizer steps and the save once;
:func:`phase_traces` derives a later update's passes by adding the previous gradients and the
optimizer state (live throughout). A failure of the user's code becomes the precision's
``error``, never a crash (:func:`failures_recorded`). ``configure_optimizers`` on a module
without a Trainer sees :class:`StandInTrainer`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from lightning_pilot.estimate.job import Ckpt, Config, GridJob
from lightning_pilot.estimate.precision import compute_dtype
from lightning_pilot.estimate.recorder import PhaseTrace, UntraceableError
from lightning_pilot.estimate.session import Session
from lightning_pilot.estimate.strategies import unit_bytes
from lightning_pilot.vocabulary import CATEGORIES, phase_label

_FIRST_STEP: Final = phase_label("optimizer_step", True)
_CKPT_ORDER: Final[dict[Ckpt, int]] = {False: 0, True: 1, "selective": 2}
_TRAIN: Final = ("forward", "backward")


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
        ...         "param": 10, "activations": 2 * scale}, np.array([10, 10 + 2 * scale]),
        ...         np.zeros(2, np.int64), np.zeros(2, np.int64), np.zeros(2, np.int8), 1, 7, 10)
        >>> extrapolate(trace(1), trace(2), 1, 2, 8).peak_bytes
        26
    """
    if low.signature != high.signature or low.curve.shape != high.curve.shape:
        return None
    if not len(low.curve) or any(t.peak_bytes != int(t.curve.max()) for t in (low, high)):
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
    with_requests = low.requests.shape == high.requests.shape == low.curve.shape  # else none
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
        requests=line(low.requests, high.requests) if with_requests else low.requests[:0],
        request_count=low.request_count if with_requests else low.request_count[:0],
        grad_requests=(
            line(low.grad_requests, high.grad_requests) if with_requests else low.grad_requests[:0]
        ),
    )


@dataclass
class PrecisionTraces:
    """Everything traced for one precision."""

    precision: str
    train: dict[Config, dict[str, PhaseTrace]] = field(default_factory=dict)
    validation: dict[tuple[int | None, int], PhaseTrace] = field(default_factory=dict)
    optimizer: dict[str, PhaseTrace] = field(default_factory=dict)
    save: PhaseTrace | None = None
    state: dict[str, int] = field(default_factory=dict)
    units: tuple[int, int] = (0, 0)
    #: The bytes of each gradient (one per storage) after a backward pass.
    gradient_blocks: tuple[int, ...] = ()
    error: tuple[str, str, str] | None = None  # (status, phase, reason)
    #: checkpointing -> (status, phase, reason): what failed only with activation
    #: checkpointing on; the configurations without it are estimated.
    failed: dict[Ckpt, tuple[str, str, str]] = field(default_factory=dict)
    #: (checkpointing, sequence length, micro-batch) -> the phases the searches traced.
    searched: dict[Config, tuple[dict[str, PhaseTrace], PhaseTrace]] = field(default_factory=dict)
    exception: BaseException | None = None
    resolved_train: dict[Config, tuple[dict[str, PhaseTrace], str]] = field(default_factory=dict)
    resolved_validation: dict[tuple[int | None, int], tuple[PhaseTrace, str]] = field(
        default_factory=dict
    )
    #: What every row of this precision says in ``notes`` (a stand-in Trainer).
    notes: list[str] = field(default_factory=list)
    #: The phase under way, named by a failure outside the recorder's phases.
    phase: str = "setup"


def matching_pair(traced: Mapping[int, Sequence[PhaseTrace]], below: int) -> tuple[int, int] | None:
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
    session: Session, batch: Any, traces: PrecisionTraces, key: Config
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
    pair = matching_pair(traced, micro_batch)
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
    session: Session, batch: Any, traces: PrecisionTraces, key: tuple[int | None, int]
) -> tuple[PhaseTrace, str]:
    """Validation at ``key``, as :func:`_train_at`."""
    if key in traces.validation:
        return traces.validation[key], "traced"
    seq_len, micro_batch = key
    traced = {k[1]: [v] for k, v in traces.validation.items() if k[0] == seq_len}
    pair = matching_pair(traced, micro_batch)
    if pair is not None:
        low, high = (traces.validation[(seq_len, b)] for b in pair)
        made = extrapolate(low, high, pair[0], pair[1], micro_batch)
        if made is not None:
            return made, "extrapolated"
    result = session.validation_phase(batch, micro_batch=micro_batch, seq_len=seq_len)
    traces.validation[key] = result
    return result, "traced"


def trace_grid(session: Session, traces: PrecisionTraces, job: GridJob) -> None:
    """Trace ``job``'s configurations into ``traces`` in the open ``session``: the training
    phases (traced or extrapolated), the optimizer steps, validation and the save."""
    itemsize = compute_dtype(traces.precision).itemsize
    traces.units = unit_bytes(session.module, job.wrap_classes, itemsize)
    traces.phase = "forward"
    configs = job.configs
    ordered = sorted(configs, key=lambda c: (_CKPT_ORDER[c[0]], c[1] or 0, c[2]))
    for key in ordered:
        if key[0] in traces.failed:
            continue
        try:
            traces.resolved_train[key] = _train_at(session, job.batch, traces, key)
        except Exception as err:
            if not key[0] or not any(not c[0] for c in configs):
                raise
            # Only checkpointing failed (the same step without it traced): its rows
            # say why, the others are estimated.
            status = "untraceable" if isinstance(err, UntraceableError) else "error"
            reason = f"activation checkpointing: {type(err).__name__}: {err}"
            traces.failed[key[0]] = (status, "forward", reason)
    traces.phase = _FIRST_STEP
    try:
        with stand_in_trainer(session.module, traces.notes):
            session.build_optimizer()
    except Exception as err:
        raise ConfigureError(err) from err
    traces.optimizer = session.optimizer_phases()
    traces.state = session.measure_state()
    traces.gradient_blocks = tuple(session.gradient_blocks())
    traces.phase = "validation"
    val_keys = sorted({(c[1], c[2]) for c in configs}, key=lambda k: (k[0] or 0, k[1]))
    for val_key in val_keys:
        traces.resolved_validation[val_key] = _validation_at(session, job.batch, traces, val_key)
    traces.phase = "checkpoint_save"
    traces.save = session.save_phase()


@contextlib.contextmanager
def failures_recorded(traces: PrecisionTraces, session: Session) -> Iterator[None]:
    """Every failure inside (the user's code, run in ``session``) becomes ``traces.error``
    (status, phase, reason) and ``traces.exception``, never a crash: the phase is the
    recorder's, else :attr:`PrecisionTraces.phase`."""
    try:
        yield
    except ConfigureError as err:
        cause = err.__cause__
        traces.error = ("error", _FIRST_STEP, str(err))
        traces.exception = cause if isinstance(cause, Exception) else err
    except Exception as err:  # the user's code: every failure becomes a row, never a crash
        where = session.recorder._phase or traces.phase
        if isinstance(err, UntraceableError):
            traces.error = ("untraceable", where, str(err))
        else:
            traces.error = ("error", where, f"{type(err).__name__}: {err}")
        traces.exception = err


def later_extra(trace: PhaseTrace, traces: PrecisionTraces) -> dict[str, int]:
    """What a later update holds during ``trace``'s phase that the trace did not: the previous
    gradients (forward pass only) and the optimizer state."""
    extra = {"optimizer_state": traces.state["optimizer_state"]}
    if trace.phase == "forward":
        extra["grad"] = traces.state["grad"]
    return {name: value - trace.included.get(name, 0) for name, value in extra.items()}


def phase_traces(traces: PrecisionTraces, key: Config) -> dict[str, tuple[PhaseTrace, str]]:
    """The six phases of one configuration with how each was obtained (later-update passes
    derived), keyed by :func:`~lightning_pilot.vocabulary.phase_label`."""
    train, how = traces.resolved_train[key]
    forward = train["forward"].shifted(
        later_extra(train["forward"], traces),
        "later update: the previous gradients and the optimizer state added (live throughout)",
    )
    backward = train["backward"].shifted(
        later_extra(train["backward"], traces),
        "later update: the optimizer state added (live throughout)",
    )
    validation, val_how = traces.resolved_validation[(key[1], key[2])]
    assert traces.save is not None
    held = {"batch": train["forward"].categories["batch"]}
    note = "the training batch added (Lightning holds it through the optimizer step)"
    return {
        "forward": (forward, "derived" if how == "traced" else how),
        "backward": (backward, "derived" if how == "traced" else how),
        _FIRST_STEP: (traces.optimizer[_FIRST_STEP].shifted(held, note), "derived"),
        "optimizer_step": (traces.optimizer["optimizer_step"].shifted(held, note), "derived"),
        "validation": (validation, val_how),
        "checkpoint_save": (traces.save, "traced"),
    }


#: The stand-in Trainer's ``estimated_stepping_batches`` (a schedule's length changes neither
#: memory nor step time).
STAND_IN_STEPS: Final = 1000


class StandInTrainer:
    """What ``configure_optimizers`` may read of ``self.trainer`` when the estimate runs
    without a Trainer: a stated number of steps on one device, epoch and step 0."""

    estimated_stepping_batches = STAND_IN_STEPS
    max_steps = STAND_IN_STEPS
    num_training_batches = STAND_IN_STEPS
    max_epochs = 1
    current_epoch = 0
    global_step = 0
    accumulate_grad_batches = 1
    num_devices = 1
    num_nodes = 1
    world_size = 1
    global_rank = 0
    local_rank = 0
    is_global_zero = True

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"trainer.{name}: estimate() runs without a Trainer, and its stand-in has only"
            " estimated_stepping_batches, max_steps, num_training_batches (all"
            f" {STAND_IN_STEPS}), max_epochs (1), current_epoch, global_step, world_size,"
            " num_devices, num_nodes, global_rank, local_rank, accumulate_grad_batches,"
            " is_global_zero"
        )


class ConfigureError(Exception):
    """``configure_optimizers`` failed: the row names the phase and the remedy."""

    def __init__(self, err: Exception) -> None:
        super().__init__(
            f"configure_optimizers() failed: {type(err).__name__}: {err}. The estimate needs"
            " the optimizer it returns: make configure_optimizers work without a Trainer"
            " (estimate() stands one in with the attributes above), or estimate at the end"
            " of a fit with TargetEstimator, where the fit's Trainer is attached"
        )


@contextlib.contextmanager
def stand_in_trainer(module: Any, notes: list[str]) -> Iterator[None]:
    """A LightningModule with no Trainer (nor Fabric) attached gets :class:`StandInTrainer`
    while its ``configure_optimizers`` runs, and ``notes`` (the rows') say so."""
    if (
        not hasattr(type(module), "trainer")
        or getattr(module, "_trainer", True) is not None
        or getattr(module, "_fabric", None) is not None
    ):
        yield
        return
    module._trainer = StandInTrainer()
    try:
        yield
    finally:
        module._trainer = None
    notes.append(
        f"configure_optimizers ran without a Trainer: a stand-in gave"
        f" estimated_stepping_batches={STAND_IN_STEPS} (a schedule's length changes neither"
        " memory nor step time)"
    )
