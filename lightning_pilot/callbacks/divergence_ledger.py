"""DivergenceLedger: stop diverging runs and keep every run's row in the run ledger."""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Timer
from typing_extensions import override

from lightning_pilot import storage
from lightning_pilot.core import validate
from lightning_pilot.core.config import canonical_params_json, config_hash, environment, variant_key
from lightning_pilot.core.divergence import (
    FATAL_CAUSES,
    Curves,
    DivergenceDetector,
    DivergenceRules,
    exception_outcome,
    normal_outcome,
)
from lightning_pilot.core.ids import validate_run_id
from lightning_pilot.core.scalars import read_scalars
from lightning_pilot.ledger import find_failed_runs
from lightning_pilot.run import PilotCallback, PilotRefusalError
from lightning_pilot.schemas import EVENTS_SCHEMA, EVENTS_TABLE

__all__ = ["DivergenceLedger", "Heartbeat", "RepeatedVariantError", "RepeatedVariantWarning"]

# Columns the ledger callback owns; facts other callbacks hand over never replace them.
_OWN_FIELDS: Final = frozenset(
    {"run_id", "attempt", "attempt_id", "experiment", "variant", "seed", "derived_from_run_id",
     "params_json", "config_hash", "variant_key", "event", "status", "stop_cause", "stop_step",
     "stop_detail", "exception_type", "exception_message", "curves_delta", "train_loss", "lr_curve",
     "val_points"}
)  # fmt: skip
_MESSAGE_CHARS: Final = 2000


class RepeatedVariantWarning(UserWarning):
    """A run starts with the ``variant_key`` of a run that diverged or failed.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("error", RepeatedVariantWarning)  # make repeats fatal
        ...     DivergenceLedger(experiment="e", variant="v").on_repeat
        'warn'
    """


class RepeatedVariantError(PilotRefusalError):
    """Raised instead of the warning with ``on_repeat="error"`` (before anything is written).

    Example:
        >>> DivergenceLedger(experiment="e", variant="v", on_repeat="error").on_repeat
        'error'
    """


@dataclass(frozen=True)
class Heartbeat:
    """How often :class:`DivergenceLedger` writes a ``heartbeat`` record (at rule evaluations).

    Example:
        >>> Heartbeat(updates=50)
        Heartbeat(seconds=60.0, updates=50)
        >>> Heartbeat(seconds=-1)
        Traceback (most recent call last):
        ...
        ValueError: Heartbeat(seconds=-1) is invalid: expected a finite number >= 0 (seconds).
    """

    # Keep seconds well below the ``stale_after`` of :class:`~lightning_pilot.Ledger` (30 min).
    seconds: float = 60.0  # seconds between heartbeats
    updates: int | None = None  # also a heartbeat every this many updates (None: by time only)

    def __post_init__(self) -> None:
        seconds = validate.number("Heartbeat", "seconds", self.seconds, minimum=0, hint="seconds")
        updates = validate.integer(
            "Heartbeat", "updates", self.updates, minimum=1, optional=True, hint="updates"
        )
        object.__setattr__(self, "seconds", seconds)
        object.__setattr__(self, "updates", updates)


class _Update(NamedTuple):
    """One optimizer update not evaluated yet (its tensors still on the device)."""

    step: int
    losses: list[torch.Tensor]  # the micro-batch losses, divided by the factor
    factor: int  # K: Lightning divided each micro-batch loss by it
    lr: float | None
    norms: list[torch.Tensor]


class _Stop(NamedTuple):
    """The fatal rule that stops (or, with ``action="record"``, marks) the run."""

    cause: str
    step: int
    detail: str


def _run_id(value: object) -> str | None:
    """``derived_from``: ``None`` or a run id (:func:`~lightning_pilot.core.ids.new_run_id`)."""
    owner, expected = "DivergenceLedger", "a run id such as '20261130T092309763Z-a1fe91cb433ec8b4'"
    run_id = validate.text(owner, "derived_from", value, optional=True, hint=expected)
    if run_id is None:
        return None
    try:
        return validate_run_id(run_id, "derived_from")
    except ValueError:
        raise ValueError(validate.invalid(owner, "derived_from", value, expected)) from None


class DivergenceLedger(PilotCallback):
    """Stop a run that diverges and write every run's row to the append-only run ledger.

    Global rank 0 writes ``start``, ``heartbeat`` and ``end`` records to ``<out_dir>/ledger/``
    (the ``end`` record on every exit); the rule events go to ``divergence.parquet``
    (docs/ledger.md).

    Args:
        experiment, variant: the names of the experiment and the variant (not paths).
        seed: the run's seed (part of ``config_hash``, not of ``variant_key``).
        params: the variant's parameters, JSON values (``lr`` here is the typed ``lr``).
        derived_from: the run id this run relaunches with a change (``derived_from_run_id``);
            a match of that run is acknowledged and does not warn.
        rules: divergence thresholds (defaults of :class:`DivergenceRules`).
        action: ``"stop"`` the fit on a fatal rule, or only ``"record"`` it.
        check_every: updates between rule evaluations (1: a host sync per update).
        grad_norm_every: updates between gradient-norm reads (every update under float16 AMP,
            to record each step the scaler skips).
        heartbeat: when heartbeats are written (default :class:`Heartbeat`: every 60 s).
        on_repeat: what a ``variant_key`` already diverged or failed in this ledger does:
            ``"warn"`` (:class:`RepeatedVariantWarning`), ``"error"``
            (:class:`RepeatedVariantError` at train start, nothing written) or ``"ignore"``.
        val_metrics: names of the validation metrics to keep (default: those starting "val").
        out_dir: the output folder (see :class:`~lightning_pilot.PilotCallback`).

    Example:
        >>> import tempfile
        >>> import lightning.pytorch as pl
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> from lightning_pilot.ledger import Ledger
        >>> from lightning_pilot.callbacks import DivergenceLedger
        >>> folder = tempfile.mkdtemp()
        >>> ledger = DivergenceLedger(experiment="demo", variant="ctl", seed=0, params={"lr": 0.1},
        ...                           heartbeat=Heartbeat(updates=2))
        >>> trainer = pl.Trainer(max_steps=3, callbacks=[ledger], logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, default_root_dir=folder)
        >>> trainer.fit(BoringModel())
        >>> Ledger(f"{folder}/pilot").runs()[["variant", "status", "stop_cause", "stop_step"]]
          variant     status stop_cause  stop_step
        0     ctl  completed  max_steps          3
    """

    LEDGER_STATE_VERSION: Final = 1

    def __init__(
        self,
        *,
        experiment: str,
        variant: str,
        seed: int | None = None,
        params: Mapping[str, Any] | None = None,
        derived_from: str | None = None,
        rules: DivergenceRules | None = None,
        action: Literal["stop", "record"] = "stop",
        check_every: int = 10,
        grad_norm_every: int = 100,
        heartbeat: Heartbeat | None = None,
        on_repeat: Literal["warn", "error", "ignore"] = "warn",
        val_metrics: Sequence[str] | None = None,
        out_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        owner = "DivergenceLedger"
        super().__init__(out_dir=out_dir)
        self.experiment = validate.run_name(owner, "experiment", experiment)
        self.variant = validate.run_name(owner, "variant", variant)
        self.seed = validate.integer(owner, "seed", seed, minimum=0, optional=True)
        self.params = validate.mapping_of_scalars(owner, "params", params)
        self.params_json = canonical_params_json(self.params)
        self.derived_from = _run_id(derived_from)
        validate.instance(owner, "rules", rules, DivergenceRules)
        self.detector = DivergenceDetector(rules)
        self.action: Literal["stop", "record"] = validate.choice(
            owner, "action", action, ("stop", "record")
        )
        self.on_repeat: Literal["warn", "error", "ignore"] = validate.choice(
            owner, "on_repeat", on_repeat, ("warn", "error", "ignore")
        )
        self.check_every = validate.integer(
            owner, "check_every", check_every, minimum=1, hint="updates"
        )
        self.grad_norm_every = validate.integer(
            owner, "grad_norm_every", grad_norm_every, minimum=1, hint="updates"
        )
        validate.instance(owner, "heartbeat", heartbeat, Heartbeat)
        self.heartbeat = heartbeat or Heartbeat()
        self.val_metrics = validate.strings(
            owner, "val_metrics", val_metrics, hint="None: the metrics starting with 'val'"
        )
        self._reset()

    def _reset(self) -> None:
        # A fresh fit starts fresh; a resume restores both in load_state_dict, after setup.
        self.detector = DivergenceDetector(self.detector.rules)
        self.curves = Curves()
        self._active = False
        self._refused = False
        self._ended = False
        self._closing = False  # the end record's closer is registered with the run
        self._failure: dict[str, Any] | None = None  # the end record of an exception
        self._facts: dict[str, Any] | None = None
        self._last_step = 0
        self._last_heartbeat = 0
        self._last_eval = 0
        self._norm_at: float = 0  # the update whose gradient norm is read next (the first)
        self._norm_every = 1
        self._last_record_at = time.monotonic()
        self._mark: tuple[int, int, int] | None = None
        self._updates: list[_Update] = []
        self._micro: list[torch.Tensor] = []
        self._factor = 1
        self._grad_norms: list[torch.Tensor] = []
        self._lr: float | None = None
        self._overflow = False
        self._stop: _Stop | None = None

    @override
    def _state_key_fields(self) -> dict[str, Any]:
        return {
            "out_dir": str(self.out_dir),
            "experiment": self.experiment,
            "variant": self.variant,
        }

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._reset()
        self._active = stage == "fit"

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        self._last_step = self._last_heartbeat = self._last_eval = trainer.global_step
        self._overflow = str(trainer.precision) in ("16-mixed", "16")
        # Under a gradient scaler every update: each overflow is a skipped step worth recording.
        self._norm_every = 1 if self._overflow else self.grad_norm_every
        self._norm_at = 0 if self.detector.rules.check_grad_norm else math.inf
        self.curves.truncate(trainer.global_step)
        self._facts = self._read_facts(trainer, full=True)
        self._check_repeat(trainer)
        self.run.register_table(EVENTS_TABLE, EVENTS_SCHEMA)
        if self.run.is_global_zero:
            self.run.reserve_space()  # held until the run closes (a disk may fill meanwhile)
            self._write(trainer, "start", failing=False, status="running")

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self._active:
            return
        if self._lr is None and optimizer.param_groups:
            self._lr = float(optimizer.param_groups[0]["lr"])
        step = trainer.global_step + 1
        if step >= self._norm_at:
            self._norm_at = step + self._norm_every
            params = (p for group in optimizer.param_groups for p in group["params"])
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                self._grad_norms.append(torch.nn.utils.get_total_norm(grads).detach())

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self._active:
            return
        # type() first: Lightning hands a plain dict, and an ABC isinstance check is slower.
        is_map = type(outputs) is dict or isinstance(outputs, Mapping)
        loss = outputs.get("loss") if is_map else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            # Lightning divides the loss by K (automatic optimisation) before outputs reach us;
            # the multiplication back waits for the evaluation, like the read.
            automatic = pl_module.automatic_optimization
            self._factor = trainer.accumulate_grad_batches if automatic else 1
            self._micro.append(loss.detach() if loss.requires_grad else loss)
        step = trainer.global_step
        if step != self._last_step:
            self._last_step = step
            self._after_update(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active or trainer.sanity_checking:
            return
        names = self.val_metrics
        for name, value in sorted(trainer.callback_metrics.items()):
            wanted = name in names if names is not None else name.startswith("val")
            if wanted and isinstance(value, torch.Tensor) and value.numel() == 1:
                self.curves.add_val(trainer.global_step, name, float(value))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active or self._ended:
            return
        self._end_at_close(trainer)  # before the last evaluation: its error cannot cost it
        self._evaluate()  # the updates since the last evaluation
        if trainer.world_size > 1:
            # Every rank ends here on a normal exit: a rule that fired on another rank after
            # the last evaluation (or with action="record") reaches rank 0's end record.
            self._agree(trainer, trainer.global_step)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        try:
            if not self._active or self._refused or self._ended or self._failure is not None:
                return
            pending, unread = len(self._updates), None
            try:
                self._evaluate()  # no collective: other ranks may be gone
            except Exception as err:  # e.g. a device-side assert: its tensors are unreadable
                unread = f"the losses of the last {pending} update(s) could not be read: {err}"
            status, cause = exception_outcome(exception)
            self._failure = {
                "status": status,
                "stop_cause": cause,
                "stop_step": trainer.global_step,
                "stop_detail": unread,
                "exception_type": type(exception).__name__,
                "exception_message": str(exception)[:_MESSAGE_CHARS] or None,
            }
            self._end_at_close(trainer)
        except Exception as err:  # ours must never replace the user's exception
            warnings.warn(
                f"lightning-pilot: DivergenceLedger could not record how the fit ended: {err!r}",
                RuntimeWarning,
                stacklevel=2,
            )
        finally:
            super().on_exception(trainer, pl_module, exception)

    @override
    def state_dict(self) -> dict[str, Any]:
        self._evaluate()  # a checkpoint holds every update's loss so far
        state = super().state_dict()
        state.update(
            ledger_version=self.LEDGER_STATE_VERSION,
            detector=self.detector.state_dict(),
            curves=self.curves.state_dict(),
        )
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.detector.load_state_dict(state_dict.get("detector", {}))
        self.curves.load_state_dict(state_dict.get("curves", {}))

    def _after_update(self, trainer: pl.Trainer) -> None:
        step = trainer.global_step
        self._updates.append(_Update(step, self._micro, self._factor, self._lr, self._grad_norms))
        self._micro, self._grad_norms, self._lr = [], [], None
        # By distance, not step % check_every: several optimizers step global_step by more
        # than one per batch. Every rank sees the same steps, so they agree.
        if step - self._last_eval < self.check_every:
            return
        self._last_eval = step
        self._evaluate()
        if self.action == "stop" and self._agree(trainer, step):
            trainer.should_stop = True
        if self.run.is_global_zero and self._heartbeat_due(step):
            self._last_heartbeat = step
            self._write(trainer, "heartbeat", failing=True, status="running")

    def _heartbeat_due(self, step: int) -> bool:
        every = self.heartbeat.updates
        if every is not None and step - self._last_heartbeat >= every:
            return True
        return time.monotonic() - self._last_record_at >= self.heartbeat.seconds

    def _evaluate(self) -> None:
        """Read the pending updates' losses and norms (one host sync) and apply the rules."""
        updates, self._updates = self._updates, []
        if not updates:
            return
        values = iter(read_scalars([t for u in updates for t in (*u.losses, *u.norms)]))
        overflow = self._overflow
        for step, micro, factor, lr, norms in updates:
            losses = [next(values) for _ in micro]
            squares = [next(values) ** 2 for _ in norms]
            loss = factor * math.fsum(losses) / len(losses) if losses else None
            grad = math.sqrt(math.fsum(squares)) if squares else None
            self.curves.add_train(step, loss, lr=lr)
            decision = self.detector.update(step, loss, grad, grad_may_overflow=overflow)
            if decision.events:
                self.run.append_rows(
                    EVENTS_TABLE, [e.as_row() | {"action": self.action} for e in decision.events]
                )
            cause = decision.cause
            if cause is not None and self._stop is None:
                found = (e.detail for e in decision.events if e.event == cause)
                self._stop = _Stop(cause, step, next(found, cause))

    def _agree(self, trainer: pl.Trainer, step: int) -> bool:
        """Whether a fatal rule fired on any rank (a collective); a rank that did not see it takes
        the highest-priority rule and the earliest update it fired at."""
        mine = self._stop
        if not trainer.strategy.reduce_boolean_decision(mine is not None, all=False):
            return False
        if trainer.world_size > 1:
            device = trainer.strategy.root_device
            code = len(FATAL_CAUSES) - FATAL_CAUSES.index(mine.cause) if mine else 0
            agreed = trainer.strategy.reduce(torch.tensor(code, device=device), reduce_op="max")
            fired = trainer.strategy.reduce(
                torch.tensor(mine.step if mine else step, device=device), reduce_op="min"
            )
            if mine is None:
                other, at = FATAL_CAUSES[len(FATAL_CAUSES) - int(agreed)], int(fired)
                self._stop = _Stop(other, at, f"{other} fired on another rank at step {at}")
        return True

    def _normal_outcome(self, trainer: pl.Trainer) -> tuple[str, str, str | None]:
        early = trainer.early_stopping_callbacks
        stopped_early = [c for c in early if c.stopping_reason.name != "NOT_STOPPED"]
        timers = [c for c in getattr(trainer, "callbacks", []) if isinstance(c, Timer)]
        remaining = [c.time_remaining() for c in timers]
        timed_out = any(r is not None and r <= 0 for r in remaining)
        facts = self._facts or {}
        limit: str | None = None
        if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
            limit = "max_steps"
        elif trainer.max_epochs not in (None, -1) and trainer.current_epoch >= trainer.max_epochs:
            limit = "max_epochs"
        status, cause = normal_outcome(
            divergence=self._stop.cause if self._stop else None,
            early_stopping=bool(stopped_early),
            time_limit=timed_out,
            limit_reached=limit,
            updates_done=trainer.global_step,
            planned_updates=facts.get("planned_updates"),
        )
        detail = None
        if status == "diverged" and self._stop is not None:
            detail = self._stop.detail + (
                " (action='record': training went on)" if self.action == "record" else ""
            )
        elif cause == "early_stopping":
            detail = "; ".join(
                f"{c.stopping_reason.name.lower()}: {c.stopping_reason_message}"
                for c in stopped_early
            )
        elif cause == "step_shortfall":
            detail = f"{trainer.global_step} of {facts.get('planned_updates')} planned updates done"
        return status, cause, detail

    def _check_repeat(self, trainer: pl.Trainer) -> None:
        if self.on_repeat == "ignore" or self._facts is None:
            return
        matches: list[str] = []
        if self.run.is_global_zero:
            found = find_failed_runs(self.run.ledger_dir, self._facts["variant_key"])
            matches = [
                f"{row.run_id} ({row.status}: {row.stop_cause} at step {row.stop_step})"
                for row in found.itertuples(index=False)
                if row.run_id not in (self.run.run_id, self.derived_from)
            ]
        if trainer.world_size > 1:
            matches = trainer.strategy.broadcast(matches, src=0)
        if not matches:
            return
        message = (
            f"{self.experiment}/{self.variant} (variant_key {self._facts['variant_key']}) repeats"
            f" a configuration that already ended badly in this ledger: {', '.join(matches)}."
            " Change the configuration, or pass derived_from=<run id> to relaunch it knowingly."
        )
        if self.on_repeat == "error":
            self._refused = True
            raise RepeatedVariantError(message)
        if self.run.is_global_zero:
            warnings.warn(message, RepeatedVariantWarning, stacklevel=2)

    def _read_facts(self, trainer: pl.Trainer, *, full: bool) -> dict[str, Any]:
        fields = self.run.ledger_fields
        strategy = type(trainer.strategy).__name__
        loader_size = getattr(trainer.train_dataloader, "batch_size", None) if full else None
        micro = fields.get(
            "micro_batch_size", loader_size if isinstance(loader_size, int) else None
        )
        accumulate = fields.get("accumulate_grad_batches", trainer.accumulate_grad_batches)
        # Model-parallel ranks do not multiply the batch; every other strategy is data parallel.
        dp = fields.get("dp_replicas", None if "ModelParallel" in strategy else trainer.world_size)
        effective = micro * accumulate * dp if micro and dp else None
        estimate = trainer.estimated_stepping_batches if full else math.nan
        planned = int(estimate) if math.isfinite(estimate) and estimate >= 0 else None
        setup = {
            "micro_batch_size": micro,
            "accumulate_grad_batches": accumulate,
            "dp_replicas": dp,
            "precision": str(trainer.precision),
        }
        lr = self.params.get("lr")
        if not isinstance(lr, int | float) or isinstance(lr, bool):
            groups = trainer.optimizers[0].param_groups if trainer.optimizers else []
            lr = float(groups[0].get("initial_lr", groups[0]["lr"])) if groups else None
        device = trainer.strategy.root_device
        model = f" {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
        return {
            **setup,
            **environment(),
            "variant_key": variant_key(self.experiment, self.params, setup),
            "config_hash": config_hash(self.experiment, self.params, self.seed, setup),
            "lr": float(lr) if lr is not None else None,
            "effective_batch_size": fields.get("effective_batch_size", effective),
            "planned_updates": fields.get("planned_updates", planned),
            "strategy": strategy,
            "devices": trainer.world_size,
            "device_name": f"{device}{model}",
        }

    def _write(self, trainer: pl.Trainer, event: str, *, failing: bool, **outcome: Any) -> None:
        if event == "end":  # for the Trainer's loggers, when the run closes
            self.run.summary.add(
                **{f"ledger/{k}": outcome.get(k) for k in ("status", "stop_cause", "stop_step")}
            )
        self._last_record_at = time.monotonic()
        run = self.run
        try:
            fields = run.ledger_fields.items()
            record: dict[str, Any] = dict(self._facts or {})
            record.update((k, v) for k, v in fields if k not in _OWN_FIELDS and v is not None)
            phases = run.run_dir / "phases.parquet"
            record.update(
                run_id=run.run_id,
                attempt=run.attempt,
                attempt_id=run.attempt_id,
                experiment=self.experiment,
                variant=self.variant,
                seed=self.seed,
                derived_from_run_id=self.derived_from,
                params_json=self.params_json,
                event=event,
                updates_done=trainer.global_step,
                phase_table_uri=str(phases) if phases.exists() else None,
                # Heartbeats carry the points since the attempt's previous record; start and end
                # the whole curves.
                curves_delta=event == "heartbeat" and self._mark is not None,
                **self.curves.as_record(since=self._mark if event == "heartbeat" else None),
            )
            record.update(outcome)
            storage.write_ledger_record(run.ledger_dir, record)
            self._mark = self.curves.mark()
        except (OSError, ValueError) as err:
            if not failing:
                raise
            warnings.warn(
                f"lightning-pilot: could not write the {event} record of run {run.run_id}"
                f" to {run.ledger_dir}: {err}",
                RuntimeWarning,
                stacklevel=2,
            )

    def _end_at_close(self, trainer: pl.Trainer) -> None:
        """Write the end record when the run closes: after every pilot callback handed over
        its facts (the predictions file, the counters) and the run's tables were flushed."""
        if self._closing:
            return
        self._closing = True
        if self.run.closed:  # the fit failed after its run closed: nothing is left to wait for
            self._end(trainer, None)
        else:
            self.run.on_close(lambda error: self._end(trainer, error))

    def _end(self, trainer: pl.Trainer, error: OSError | None) -> None:
        if self._ended:
            return
        self._ended = True
        if not self.run.is_global_zero:
            return
        if self._facts is None:
            # The fit failed before training started: record what can be read safely.
            self._facts = self._read_facts(trainer, full=False)
        if self._failure is not None:
            self._write(trainer, "end", failing=True, **self._failure)
            return
        status, cause, detail = self._normal_outcome(trainer)
        if error is None:
            stop_step = self._stop.step if self._stop is not None else trainer.global_step
            self._write(
                trainer, "end", failing=False, status=status, stop_cause=cause,
                stop_step=stop_step, stop_detail=detail,
            )  # fmt: skip
            return
        # A run whose files could not be written is not recorded as a clean one.
        failed, failed_cause = exception_outcome(error)
        self._write(
            trainer,
            "end",
            failing=True,
            status=failed,
            stop_cause=failed_cause,
            stop_step=trainer.global_step,
            stop_detail=f"training ended ({status}: {cause}) after {trainer.global_step}"
            f" update(s); then the run's tables could not be written: {error}",
            exception_type=type(error).__name__,
            exception_message=str(error)[:_MESSAGE_CHARS],
        )
