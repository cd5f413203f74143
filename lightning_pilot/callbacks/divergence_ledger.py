"""DivergenceLedger: stop diverging runs and keep every run's row in the run ledger."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Timer
from typing_extensions import override

from lightning_pilot import storage
from lightning_pilot.callbacks._shared import step_loss
from lightning_pilot.core import ledger_records as records
from lightning_pilot.core import validate
from lightning_pilot.core.config import canonical_params_json
from lightning_pilot.core.divergence import Curves, DivergenceDetector, DivergenceRules
from lightning_pilot.core.ledger_records import Heartbeat
from lightning_pilot.core.scalars import read_scalars
from lightning_pilot.ledger import find_failed_runs
from lightning_pilot.run import PilotCallback, PilotRefusalError
from lightning_pilot.schemas import EVENTS_SCHEMA, EVENTS_TABLE


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
        self.derived_from = records.derived_from_id(derived_from)
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
        self._active = self._refused = self._ended = False
        self._closing = False  # the end record's closer is registered with the run
        self._failure: dict[str, Any] | None = None  # the end record of an exception
        self._facts: dict[str, Any] | None = None
        self._schedule = records.RecordSchedule(self.check_every, self.heartbeat)
        self._pending = records.PendingUpdates()
        self._mark: tuple[int, int, int] | None = None
        self._stop: records.Stop | None = None

    @override
    def _state_key_fields(self) -> dict[str, Any]:
        return super()._state_key_fields() | {
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
        self._schedule.start(trainer.global_step)
        self._pending.start(
            trainer.global_step,
            overflow=str(trainer.precision) in ("16-mixed", "16"),
            grad_norm_every=self.grad_norm_every,
            check_grad_norm=self.detector.rules.check_grad_norm,
        )
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
        if optimizer.param_groups:
            self._pending.add_lr(float(optimizer.param_groups[0]["lr"]))
        if self._pending.norm_due(trainer.global_step + 1):
            params = (p for group in optimizer.param_groups for p in group["params"])
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                self._pending.add_grad_norm(torch.nn.utils.get_total_norm(grads).detach())

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any
    ) -> None:
        if not self._active:
            return
        loss = step_loss(outputs)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            # Lightning divides the loss by K (automatic optimisation) before outputs reach us;
            # the multiplication back waits for the evaluation, like the read.
            automatic = pl_module.automatic_optimization
            self._pending.add_loss(loss, factor=trainer.accumulate_grad_batches if automatic else 1)
        if self._pending.close(trainer.global_step):
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
            pending, unread = len(self._pending.updates), None
            try:
                self._evaluate()  # no collective: other ranks may be gone
            except Exception as err:  # e.g. a device-side assert: its tensors are unreadable
                unread = f"the losses of the last {pending} update(s) could not be read: {err}"
            self._failure = records.failure_outcome(exception, trainer.global_step, unread)
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
        return super().state_dict() | {
            "ledger_version": self.LEDGER_STATE_VERSION,
            "detector": self.detector.state_dict(),
            "curves": self.curves.state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.detector.load_state_dict(state_dict.get("detector", {}))
        self.curves.load_state_dict(state_dict.get("curves", {}))

    def _after_update(self, trainer: pl.Trainer) -> None:
        step = trainer.global_step
        if not self._schedule.evaluation_due(step):  # the same steps on every rank
            return
        self._evaluate()
        if self.action == "stop" and self._agree(trainer, step):
            trainer.should_stop = True
        if self.run.is_global_zero and self._schedule.take_heartbeat(step):
            self._write(trainer, "heartbeat", failing=True, status="running")

    def _evaluate(self) -> None:
        """Read the pending updates' losses and norms (one host sync) and apply the rules."""
        for decision in self._pending.evaluate(self.detector, self.curves, read=read_scalars):
            if decision.events:
                self.run.append_rows(
                    EVENTS_TABLE, [e.as_row() | {"action": self.action} for e in decision.events]
                )
            self._stop = self._stop or records.Stop.of(decision)

    def _agree(self, trainer: pl.Trainer, step: int) -> bool:
        """Whether a fatal rule fired on any rank (a collective); a rank that did not see it takes
        the highest-priority rule and the earliest update it fired at."""
        mine = self._stop
        if not trainer.strategy.reduce_boolean_decision(mine is not None, all=False):
            return False
        if trainer.world_size > 1:
            device = trainer.strategy.root_device
            code = mine.code if mine else 0
            agreed = trainer.strategy.reduce(torch.tensor(code, device=device), reduce_op="max")
            fired = trainer.strategy.reduce(
                torch.tensor(mine.step if mine else step, device=device), reduce_op="min"
            )
            if mine is None:
                self._stop = records.Stop.from_code(int(agreed), int(fired))
        return True

    def _normal_outcome(self, trainer: pl.Trainer) -> tuple[str, str, str | None]:
        timers = [c for c in getattr(trainer, "callbacks", []) if isinstance(c, Timer)]
        remaining = [c.time_remaining() for c in timers]
        return records.normal_end(
            stop=self._stop,
            action=self.action,
            stopped_early=[
                (c.stopping_reason.name, c.stopping_reason_message)
                for c in trainer.early_stopping_callbacks
                if c.stopping_reason.name != "NOT_STOPPED"
            ],
            time_limit=any(r is not None and r <= 0 for r in remaining),
            limit=records.limit_reached(
                max_steps=trainer.max_steps,
                global_step=trainer.global_step,
                max_epochs=trainer.max_epochs,
                current_epoch=trainer.current_epoch,
            ),
            updates_done=trainer.global_step,
            planned_updates=(self._facts or {}).get("planned_updates"),
        )

    def _check_repeat(self, trainer: pl.Trainer) -> None:
        if self.on_repeat == "ignore" or self._facts is None:
            return
        matches: list[str] = []
        if self.run.is_global_zero:
            found = find_failed_runs(self.run.ledger_dir, self._facts["variant_key"])
            exclude = (self.run.run_id, self.derived_from)
            matches = records.failed_matches(found.itertuples(index=False), exclude=exclude)
        if trainer.world_size > 1:
            matches = trainer.strategy.broadcast(matches, src=0)
        if not matches:
            return
        key = self._facts["variant_key"]
        message = records.repeat_message(self.experiment, self.variant, key, matches)
        if self.on_repeat == "error":
            self._refused = True
            raise RepeatedVariantError(message)
        if self.run.is_global_zero:
            warnings.warn(message, RepeatedVariantWarning, stacklevel=2)

    def _read_facts(self, trainer: pl.Trainer, *, full: bool) -> dict[str, Any]:
        def optimizer_lr() -> float | None:
            groups = trainer.optimizers[0].param_groups if trainer.optimizers else []
            return float(groups[0].get("initial_lr", groups[0]["lr"])) if groups else None

        device = trainer.strategy.root_device
        model = f" {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
        return records.run_facts(
            experiment=self.experiment,
            params=self.params,
            seed=self.seed,
            fields=self.run.ledger_fields,
            strategy=type(trainer.strategy).__name__,
            loader_size=getattr(trainer.train_dataloader, "batch_size", None) if full else None,
            accumulate=trainer.accumulate_grad_batches,
            world_size=trainer.world_size,
            estimate=trainer.estimated_stepping_batches if full else math.nan,
            precision=str(trainer.precision),
            optimizer_lr=optimizer_lr,
            device_name=f"{device}{model}",
        )

    def _write(self, trainer: pl.Trainer, event: str, *, failing: bool, **outcome: Any) -> None:
        if event == "end":  # for the Trainer's loggers, when the run closes
            self.run.summary.add(
                **{f"ledger/{k}": outcome.get(k) for k in ("status", "stop_cause", "stop_step")}
            )
        self._schedule.recorded()
        run = self.run
        try:
            phases = run.run_dir / "phases.parquet"
            identity = {
                "run_id": run.run_id,
                "attempt": run.attempt,
                "attempt_id": run.attempt_id,
                "experiment": self.experiment,
                "variant": self.variant,
                "seed": self.seed,
                "derived_from_run_id": self.derived_from,
                "params_json": self.params_json,
            }
            record = records.ledger_record(
                self._facts, run.ledger_fields, identity, event=event,
                updates_done=trainer.global_step,
                phase_table_uri=str(phases) if phases.exists() else None,
                curves=self.curves, mark=self._mark, outcome=outcome,
            )  # fmt: skip
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
        outcome = records.unwritten_outcome(status, cause, trainer.global_step, error)
        self._write(trainer, "end", failing=True, **outcome)
