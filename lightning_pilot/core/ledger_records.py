"""What :class:`~lightning_pilot.callbacks.DivergenceLedger` decides and builds without a
Trainer: when to evaluate the rules and write a heartbeat, the updates waiting to be read, how a
run ended, and the facts and records written (docs/ledger.md)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import torch

from lightning_pilot.core import validate
from lightning_pilot.core.config import config_hash, environment, variant_key
from lightning_pilot.core.divergence import (
    FATAL_CAUSES,
    Curves,
    DivergenceDecision,
    DivergenceDetector,
    exception_outcome,
    normal_outcome,
)
from lightning_pilot.core.ids import validate_run_id
from lightning_pilot.core.scalars import read_scalars

#: Columns the ledger callback owns; facts other callbacks hand over never replace them.
OWN_FIELDS: Final = frozenset(
    {"run_id", "attempt", "attempt_id", "experiment", "variant", "seed", "derived_from_run_id",
     "params_json", "config_hash", "variant_key", "event", "status", "stop_cause", "stop_step",
     "stop_detail", "exception_type", "exception_message", "curves_delta", "train_loss", "lr_curve",
     "val_points"}
)  # fmt: skip
#: The longest exception message kept in a record.
MESSAGE_CHARS: Final = 2000


@dataclass(frozen=True)
class Heartbeat:
    """How often :class:`~lightning_pilot.callbacks.DivergenceLedger` writes a ``heartbeat``
    record (at rule evaluations): every ``seconds``, and every ``updates`` when given. Keep
    ``seconds`` well below the ``stale_after`` of :class:`~lightning_pilot.Ledger` (30 min).

    Example:
        >>> Heartbeat(updates=50)
        Heartbeat(seconds=60.0, updates=50)
        >>> Heartbeat(seconds=-1)
        Traceback (most recent call last):
        ...
        ValueError: Heartbeat(seconds=-1) is invalid: expected a finite number >= 0 (seconds).
    """

    seconds: float = 60.0
    updates: int | None = None

    def __post_init__(self) -> None:
        seconds = validate.number("Heartbeat", "seconds", self.seconds, minimum=0, hint="seconds")
        updates = validate.integer(
            "Heartbeat", "updates", self.updates, minimum=1, optional=True, hint="updates"
        )
        object.__setattr__(self, "seconds", seconds)
        object.__setattr__(self, "updates", updates)


def derived_from_id(value: object) -> str | None:
    """``DivergenceLedger(derived_from=)``: ``None`` or a run id."""
    owner, expected = "DivergenceLedger", "a run id such as '20261130T092309763Z-a1fe91cb433ec8b4'"
    run_id = validate.text(owner, "derived_from", value, optional=True, hint=expected)
    if run_id is None:
        return None
    try:
        return validate_run_id(run_id, "derived_from")
    except ValueError:
        raise ValueError(validate.invalid(owner, "derived_from", value, expected)) from None


class RecordSchedule:
    """When the rules are evaluated (every ``check_every`` updates, by distance: several
    optimizers move ``global_step`` by more than one per batch) and when an evaluation writes a
    heartbeat (``heartbeat.updates`` since the last one, or ``heartbeat.seconds`` since the last
    record of any kind, on ``clock``)."""

    def __init__(
        self, check_every: int, heartbeat: Heartbeat, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.check_every, self.heartbeat, self.clock = check_every, heartbeat, clock
        self.last_eval = self.last_heartbeat = 0
        self.last_record_at = clock()

    def start(self, step: int) -> None:
        """Count from ``step`` (the fit's first, or the step it resumes at)."""
        self.last_eval = self.last_heartbeat = step

    def evaluation_due(self, step: int) -> bool:
        """Whether the update that finished at ``step`` is evaluated (then counted from it)."""
        if step - self.last_eval < self.check_every:
            return False
        self.last_eval = step
        return True

    def take_heartbeat(self, step: int) -> bool:
        """Whether a heartbeat is due at ``step`` (then counted from it)."""
        every = self.heartbeat.updates
        due = every is not None and step - self.last_heartbeat >= every
        if due or self.clock() - self.last_record_at >= self.heartbeat.seconds:
            self.last_heartbeat = step
            return True
        return False

    def recorded(self) -> None:
        """A record was written now: the time to the next heartbeat counts from here."""
        self.last_record_at = self.clock()


class _Update(NamedTuple):
    step: int
    losses: list[torch.Tensor]  # the micro-batch losses, divided by the factor
    factor: int
    lr: float | None
    norms: list[torch.Tensor]


class PendingUpdates:
    """The optimizer updates not evaluated yet: each one's micro-batch losses (divided by the
    accumulation factor), learning rate and gradient norms, kept on the device until
    :meth:`evaluate` reads them all in one host sync."""

    def __init__(self) -> None:
        self.updates: list[_Update] = []
        self.overflow = False  # a non-finite gradient norm is a scaler's overflow
        self._micro: list[torch.Tensor] = []
        self._factor = 1
        self._grad_norms: list[torch.Tensor] = []
        self._lr: float | None = None
        self._last_step = 0
        self._norm_at: float = 0  # the update whose gradient norm is read next
        self._norm_every = 1

    def start(
        self, step: int, *, overflow: bool, grad_norm_every: int, check_grad_norm: bool
    ) -> None:
        """Count updates from ``step``; ``overflow``: under a gradient scaler (the norm is then
        read at every update)."""
        self._last_step, self.overflow = step, overflow
        self._norm_every = 1 if overflow else grad_norm_every
        self._norm_at = 0 if check_grad_norm else math.inf

    def add_lr(self, lr: float) -> None:
        """The learning rate of the update being made (the first one given is kept)."""
        if self._lr is None:
            self._lr = lr

    def norm_due(self, step: int) -> bool:
        """Whether the gradient norm of the update that finishes at ``step`` is read."""
        if step < self._norm_at:
            return False
        self._norm_at = step + self._norm_every
        return True

    def add_grad_norm(self, norm: torch.Tensor) -> None:
        """The total gradient norm of the update being made."""
        self._grad_norms.append(norm)

    def add_loss(self, loss: torch.Tensor, *, factor: int) -> None:
        """One micro-batch's loss, divided by ``factor``."""
        self._factor = factor
        self._micro.append(loss.detach() if loss.requires_grad else loss)

    def close(self, step: int) -> bool:
        """Whether an update finished (``step`` moved): then it waits for :meth:`evaluate`."""
        if step == self._last_step:
            return False
        self._last_step = step
        self.updates.append(_Update(step, self._micro, self._factor, self._lr, self._grad_norms))
        self._micro, self._grad_norms, self._lr = [], [], None
        return True

    def evaluate(
        self,
        detector: DivergenceDetector,
        curves: Curves,
        *,
        read: Callable[[list[torch.Tensor]], list[float]] = read_scalars,
    ) -> Iterator[DivergenceDecision]:
        """Read the pending updates (one host sync, by ``read``), add each to ``curves`` and
        yield ``detector``'s decision per update, in order."""
        updates, self.updates = self.updates, []
        if not updates:
            return
        values = iter(read([t for u in updates for t in (*u.losses, *u.norms)]))
        for step, micro, factor, lr, norms in updates:
            losses = [next(values) for _ in micro]
            squares = [next(values) ** 2 for _ in norms]
            loss = factor * math.fsum(losses) / len(losses) if losses else None
            grad = math.sqrt(math.fsum(squares)) if squares else None
            curves.add_train(step, loss, lr=lr)
            yield detector.update(step, loss, grad, grad_may_overflow=self.overflow)


class Stop(NamedTuple):
    """The fatal rule that stops (or, with ``action="record"``, marks) the run."""

    cause: str
    step: int
    detail: str

    @classmethod
    def of(cls, decision: DivergenceDecision) -> Stop | None:
        """The stop a decision makes, with the detail of that rule's event."""
        if decision.cause is None:
            return None
        found = (e.detail for e in decision.events if e.event == decision.cause)
        return cls(decision.cause, decision.step, next(found, decision.cause))

    @property
    def code(self) -> int:
        """The cause as a number to reduce across ranks (higher: a higher priority)."""
        return len(FATAL_CAUSES) - FATAL_CAUSES.index(self.cause)

    @classmethod
    def from_code(cls, code: int, step: int) -> Stop:
        """The stop another rank agreed on: the cause of ``code``, first fired at ``step``."""
        cause = FATAL_CAUSES[len(FATAL_CAUSES) - code]
        return cls(cause, step, f"{cause} fired on another rank at step {step}")


def limit_reached(
    *, max_steps: int, global_step: int, max_epochs: int | None, current_epoch: int
) -> str | None:
    """The Trainer limit a fit reached (``max_steps`` first), or ``None``."""
    if max_steps != -1 and global_step >= max_steps:
        return "max_steps"
    if max_epochs is not None and max_epochs != -1 and current_epoch >= max_epochs:
        return "max_epochs"
    return None


def normal_end(
    *,
    stop: Stop | None,
    action: str,
    stopped_early: Sequence[tuple[str, str | None]],
    time_limit: bool,
    limit: str | None,
    updates_done: int,
    planned_updates: int | None,
) -> tuple[str, str, str | None]:
    """``(status, stop_cause, stop_detail)`` of a fit that returned normally; ``stopped_early``:
    each early-stopping callback's ``(reason, message)``."""
    status, cause = normal_outcome(
        divergence=stop.cause if stop else None,
        early_stopping=bool(stopped_early),
        time_limit=time_limit,
        limit_reached=limit,
        updates_done=updates_done,
        planned_updates=planned_updates,
    )
    detail = None
    if status == "diverged" and stop is not None:
        went_on = " (action='record': training went on)" if action == "record" else ""
        detail = stop.detail + went_on
    elif cause == "early_stopping":
        detail = "; ".join(f"{reason.lower()}: {message}" for reason, message in stopped_early)
    elif cause == "step_shortfall":
        detail = f"{updates_done} of {planned_updates} planned updates done"
    return status, cause, detail


def failure_outcome(exception: BaseException, step: int, unread: str | None) -> dict[str, Any]:
    """The outcome columns of a fit that raised ``exception`` at ``step`` (``unread``: why the
    last losses could not be read)."""
    status, cause = exception_outcome(exception)
    return {
        "status": status,
        "stop_cause": cause,
        "stop_step": step,
        "stop_detail": unread,
        "exception_type": type(exception).__name__,
        "exception_message": str(exception)[:MESSAGE_CHARS] or None,
    }


def unwritten_outcome(status: str, cause: str, step: int, error: OSError) -> dict[str, Any]:
    """The outcome columns of a fit that ended (``status``, ``cause``) at ``step`` but whose
    tables could not be written: not a clean run."""
    detail = (
        f"training ended ({status}: {cause}) after {step} update(s); then the run's tables"
        f" could not be written: {error}"
    )
    return failure_outcome(error, step, detail) | {"exception_message": str(error)[:MESSAGE_CHARS]}


def failed_matches(rows: Iterable[Any], *, exclude: Iterable[str | None]) -> list[str]:
    """Each failed or diverged run row not in ``exclude``, named for :func:`repeat_message`."""
    left_out = set(exclude)
    return [
        f"{row.run_id} ({row.status}: {row.stop_cause} at step {row.stop_step})"
        for row in rows
        if row.run_id not in left_out
    ]


def repeat_message(experiment: str, variant: str, key: str, matches: Sequence[str]) -> str:
    """What a run repeating a configuration that already ended badly is told."""
    return (
        f"{experiment}/{variant} (variant_key {key}) repeats a configuration that already"
        f" ended badly in this ledger: {', '.join(matches)}. Change the configuration, or pass"
        " derived_from=<run id> to relaunch it knowingly."
    )


def run_facts(
    *,
    experiment: str,
    params: Mapping[str, Any],
    seed: int | None,
    fields: Mapping[str, Any],
    strategy: str,
    loader_size: Any,
    accumulate: int,
    world_size: int,
    estimate: float,
    precision: str,
    optimizer_lr: Callable[[], float | None],
    device_name: str,
) -> dict[str, Any]:
    """The facts of a run's records: setup, environment, keys, learning rate and plan
    (``fields``: handed over by other callbacks, they win; ``estimate``: the Trainer's estimated
    stepping batches, NaN when unknown; ``optimizer_lr``: read when ``params`` has no ``lr``)."""
    micro = fields.get("micro_batch_size", loader_size if isinstance(loader_size, int) else None)
    accumulate = fields.get("accumulate_grad_batches", accumulate)
    # Model-parallel ranks do not multiply the batch; every other strategy is data parallel.
    dp = fields.get("dp_replicas", None if "ModelParallel" in strategy else world_size)
    effective = micro * accumulate * dp if micro and dp else None
    planned = int(estimate) if math.isfinite(estimate) and estimate >= 0 else None
    setup = {
        "micro_batch_size": micro,
        "accumulate_grad_batches": accumulate,
        "dp_replicas": dp,
        "precision": precision,
    }
    lr = params.get("lr")
    if not isinstance(lr, int | float) or isinstance(lr, bool):
        lr = optimizer_lr()
    return {
        **setup,
        **environment(),
        "variant_key": variant_key(experiment, params, setup),
        "config_hash": config_hash(experiment, params, seed, setup),
        "lr": float(lr) if lr is not None else None,
        "effective_batch_size": fields.get("effective_batch_size", effective),
        "planned_updates": fields.get("planned_updates", planned),
        "strategy": strategy,
        "devices": world_size,
        "device_name": device_name,
    }


def ledger_record(
    facts: Mapping[str, Any] | None,
    fields: Mapping[str, Any],
    identity: Mapping[str, Any],
    *,
    event: str,
    updates_done: int,
    phase_table_uri: str | None,
    curves: Curves,
    mark: tuple[int, int, int] | None,
    outcome: Mapping[str, Any],
) -> dict[str, Any]:
    """One ledger record: the run's facts, the fields other callbacks handed over (not in
    :data:`OWN_FIELDS`, not null), ``identity``, ``event``, the curves (a heartbeat after a
    ``mark``: only the points since) and the ``outcome`` columns."""
    record: dict[str, Any] = dict(facts or {})
    record.update((k, v) for k, v in fields.items() if k not in OWN_FIELDS and v is not None)
    heartbeat = event == "heartbeat"
    record.update(
        identity,
        event=event,
        updates_done=updates_done,
        phase_table_uri=phase_table_uri,
        curves_delta=heartbeat and mark is not None,
        **curves.as_record(since=mark if heartbeat else None),
    )
    record.update(outcome)
    return record
