"""DivergenceLedger: stop diverging runs and keep every run's row in the run ledger."""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Final, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Timer
from typing_extensions import override

from lightning_pilot import schemas, storage
from lightning_pilot.core import validate
from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.config import (
    canonical_params_json,
    config_hash,
    environment,
    variant_key,
)
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
from lightning_pilot.ledger import (
    EVENTS_SCHEMA,
    PREDICTIONS_SCHEMA,
    file_sha256,
    find_failed_runs,
    prediction_rows,
)
from lightning_pilot.run import PilotCallback, PilotRefusalError
from lightning_pilot.schemas import EVENTS_TABLE

__all__ = ["DivergenceLedger", "RepeatedVariantError", "RepeatedVariantWarning"]

PredictionsFn = Callable[[pl.LightningModule, Any, Any], Any]

# Columns the ledger callback owns; facts other callbacks hand over never replace them.
_OWN_FIELDS: Final = frozenset(
    {"run_id", "attempt", "attempt_id", "experiment", "variant", "seed", "derived_from_run_id",
     "params_json", "config_hash", "variant_key", "event", "status", "stop_cause", "stop_step",
     "stop_detail", "exception_type", "exception_message", "curves_delta", "train_loss", "lr_curve",
     "val_points", "predictions_uri", "predictions_sha256"}
)  # fmt: skip
_MESSAGE_CHARS: Final = 2000


class RepeatedVariantWarning(UserWarning):
    """A run starts with the ``variant_key`` of a run that diverged or failed."""


class RepeatedVariantError(PilotRefusalError):
    """Raised instead of the warning with ``on_repeat="error"`` (before anything is written)."""


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

    Records (``<out_dir>/ledger/``, one immutable Parquet file each, global rank 0 only; columns
    of :data:`lightning_pilot.storage.LEDGER_SCHEMA`, read them with
    :class:`lightning_pilot.Ledger`):

    * ``start`` at ``on_train_start`` (after a resume restored the step): identity, canonical
      ``params_json``, ``config_hash`` (with seed), ``variant_key`` (without), typed setup
      (``lr``, ``micro_batch_size``, ``accumulate_grad_batches``, ``dp_replicas``,
      ``effective_batch_size``, ``planned_updates``, ``precision``, ``strategy``, ``devices``)
      and environment, merged with the facts other pilot callbacks put in
      ``run.ledger_fields`` (theirs win for the setup and counters).
    * ``heartbeat`` every ``heartbeat_seconds`` (and every ``heartbeat_every`` updates when
      given), at a rule evaluation: ``status="running"`` and the curve points added since the
      previous record (``curves_delta=True``: the ledger grows linearly with a long run;
      :class:`~lightning_pilot.Ledger` joins them back into whole curves). ``start`` and
      ``end`` carry the whole curves: ``train_loss`` (float, the loss of the update
      un-divided by accumulation: the mean of its micro-batch losses, each multiplied back by
      ``K``; rank 0's batches), ``lr_curve`` (float, the first param group's LR used by the
      update) and ``val_points`` (``{step, name, value}`` of metrics named ``val*``, or
      ``val_metrics``, at each validation end). Steps are ``trainer.global_step`` after the
      update (1 = first).
    * ``end`` on every exit: ``status`` / ``stop_cause`` (completed/max_steps|max_epochs,
      stopped/early_stopping|time_limit|step_shortfall, diverged/<rule>,
      oom/cuda_oom, failed/exception:<Type>, interrupted/keyboard_interrupt|sigterm),
      ``stop_step``, ``stop_detail``, ``exception_type``, ``exception_message``. The user's
      exception propagates unchanged; a failed write on that path is a warning.

    Detail tables (``<out_dir>/runs/<run_id>/``): ``divergence.parquet`` (every rank; one row
    per event: ``step`` int64, ``event`` str (``spike``, ``spike_end``, ``grad_overflow`` or a
    fatal rule), ``loss``/``grad_norm``/``reference``/``threshold`` float64, ``detail``,
    ``action``); with ``save_predictions=True``, ``predictions.parquet`` (one file per attempt,
    rank 0's validation batches: ``step``, ``example_id`` str, ``prediction`` and ``target``
    flattened float64 lists, ``prediction_shape``), referenced by ``predictions_uri`` and
    ``predictions_sha256`` in the end record.

    Divergence: the rules of :class:`~lightning_pilot.core.divergence.DivergenceRules` see the
    loss of every optimizer update (not per micro-batch). The losses stay on the device and
    are read together every ``check_every`` updates (one host sync, and under several
    processes one collective, per evaluation: no per-update synchronisation). The total
    gradient norm (one norm over all gradients, in ``on_before_optimizer_step``) is taken at
    the first update and then one in ``grad_norm_every`` (every update under float16 AMP); a
    non-finite gradient at another update makes the weights, and so the next loss, non-finite:
    caught as ``nonfinite_loss`` one update later. Every
    rank applies the rules to its own values; the stop is decided with
    ``trainer.strategy.reduce_boolean_decision`` so every rank stops after the same update, at
    most ``check_every - 1`` updates after the rule fired (``stop_step`` is the update where it
    fired, ``updates_done`` where training stopped). ``action="record"`` records the rule and
    the run's status (``diverged``) without stopping. EarlyStopping's reason and message go to
    ``stop_detail``.

    Args:
        experiment: the experiment's name (a record field, not a path).
        variant: the variant's name.
        seed: the run's seed (part of ``config_hash``, not of ``variant_key``).
        params: the variant's parameters, JSON values (``lr`` here is the typed ``lr``).
        derived_from: the run id this run relaunches with a change (``derived_from_run_id``);
            a match of that run is acknowledged and does not warn.
        rules: divergence thresholds (defaults of :class:`DivergenceRules`).
        action: ``"stop"`` the fit on a fatal rule, or only ``"record"`` it.
        check_every: updates between rule evaluations (1: after every update, at the cost of
            a host sync per update on an accelerator).
        grad_norm_every: updates between gradient-norm reads for the ``nonfinite_grad`` rule
            (one pass over all gradients each; the first update always; 1: every update).
            Under float16 AMP every update, to record each step the scaler skips.
        heartbeat_seconds: seconds between heartbeats (checked at rule evaluations); keep it
            well below the ``stale_after`` of :class:`~lightning_pilot.Ledger` (30 minutes).
        heartbeat_every: also write a heartbeat every this many updates (``None``: by time
            only).
        on_repeat: what a ``variant_key`` already diverged or failed in this ledger does:
            ``"warn"`` (:class:`RepeatedVariantWarning`), ``"error"``
            (:class:`RepeatedVariantError` at train start, nothing written) or ``"ignore"``.
        save_predictions: keep validation predictions (rank 0's batches under several
            processes).
        predictions_fn: ``fn(pl_module, batch, outputs) -> tensor [B, ...]``; default: the
            ``predictions_key`` entry of the dict ``validation_step`` returns.
        predictions_key: see ``predictions_fn``.
        batch_adapter: reads example ids and targets of validation batches.
        val_metrics: names of the validation metrics to keep (default: those starting "val").
        out_dir: the output folder (see :class:`~lightning_pilot.PilotCallback`).

    Raises:
        TypeError, ValueError: an invalid argument (the message names it).

    Example:
        >>> import tempfile
        >>> import lightning.pytorch as pl
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> from lightning_pilot.ledger import Ledger
        >>> from lightning_pilot.callbacks import DivergenceLedger
        >>> folder = tempfile.mkdtemp()
        >>> ledger = DivergenceLedger(experiment="demo", variant="ctl", seed=0, params={"lr": 0.1})
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
        heartbeat_seconds: float = 60.0,
        heartbeat_every: int | None = None,
        on_repeat: Literal["warn", "error", "ignore"] = "warn",
        save_predictions: bool = False,
        predictions_fn: PredictionsFn | None = None,
        predictions_key: str = "preds",
        batch_adapter: BatchAdapter | None = None,
        val_metrics: Sequence[str] | None = None,
        out_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        owner = "DivergenceLedger"
        validate.path(owner, "out_dir", out_dir)
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
        self.heartbeat_seconds = validate.number(
            owner, "heartbeat_seconds", heartbeat_seconds, minimum=0, hint="seconds"
        )
        self.heartbeat_every = validate.integer(
            owner, "heartbeat_every", heartbeat_every, minimum=1, optional=True, hint="updates"
        )
        self.save_predictions = validate.boolean(owner, "save_predictions", save_predictions)
        self.predictions_fn = validate.callable_or_none(
            owner,
            "predictions_fn",
            predictions_fn,
            "a callable (pl_module, batch, outputs) -> tensor",
        )
        self.predictions_key = validate.text(owner, "predictions_key", predictions_key)
        validate.instance(owner, "batch_adapter", batch_adapter, BatchAdapter)
        self.batch_adapter = batch_adapter or BatchAdapter()
        self.val_metrics = validate.strings(
            owner, "val_metrics", val_metrics, hint="None: the metrics starting with 'val'"
        )
        self.curves = Curves()
        self._reset()

    def _reset(self) -> None:
        self._active = False
        self._refused = False
        self._ended = False
        self._facts: dict[str, Any] | None = None
        self._last_step = 0
        self._last_heartbeat = 0
        self._last_eval = 0
        self._last_norm = -(10**9)  # the first update's norm is always taken
        self._last_record_at = time.monotonic()
        self._mark: tuple[int, int, int] | None = None
        # Updates not yet evaluated: (step, micro-batch losses, K factor, lr, gradient norms).
        self._updates: list[tuple[int, list[torch.Tensor], int, float | None, list[Any]]] = []
        self._micro: list[torch.Tensor] = []
        self._factor = 1
        self._grad_norms: list[torch.Tensor] = []
        self._lr: float | None = None
        self._overflow = False
        self._stop: tuple[str, int, str] | None = None
        self._predictions: list[dict[str, Any]] = []
        self._predictions_error: str | None = None

    @override
    def _state_key_fields(self) -> dict[str, Any]:
        return {
            "out_dir": str(self.out_dir),
            "experiment": self.experiment,
            "variant": self.variant,
        }

    # ---------------------------------------------------------------------------------------
    # Hooks
    # ---------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        # A fresh fit starts fresh; a resume restores both in load_state_dict, after setup.
        self.detector = DivergenceDetector(self.detector.rules)
        self.curves = Curves()
        self._reset()
        self._active = stage == "fit"
        if (
            self._active
            and self.save_predictions
            and trainer.world_size > 1
            and self.run.is_global_zero
        ):
            warnings.warn(
                "DivergenceLedger(save_predictions=True) under several processes keeps rank 0's"
                " validation batches only (its shard of the validation set).",
                RuntimeWarning,
                stacklevel=2,
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        self._last_step = self._last_heartbeat = self._last_eval = trainer.global_step
        self._overflow = str(trainer.precision) in ("16-mixed", "16")
        self.curves.truncate(trainer.global_step)
        self._facts = self._read_facts(trainer, full=True)
        self._check_repeat(trainer)
        self.run.register_table(EVENTS_TABLE, EVENTS_SCHEMA)
        if self.run.is_global_zero:
            self.run.reserve_space()  # held until the end record (a disk may fill meanwhile)
            storage.write_ledger_record(
                self.run.ledger_dir, self._record(trainer, "start", status="running")
            )
            self._mark, self._last_record_at = self.curves.mark(), time.monotonic()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self._active:
            return
        if self._lr is None and optimizer.param_groups:
            self._lr = float(optimizer.param_groups[0]["lr"])
        # One update in grad_norm_every (the first one included); under a gradient scaler
        # every update: each overflow is a skipped step worth recording.
        step = trainer.global_step + 1
        if self.detector.rules.check_grad_norm and (
            self._overflow or step - self._last_norm >= self.grad_norm_every
        ):
            self._last_norm = step
            grads = [
                p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None
            ]
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
        self._add_micro_batch_loss(trainer, pl_module, outputs)
        step = trainer.global_step
        if step != self._last_step:
            self._last_step = step
            self._after_update(trainer)

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if (
            self._active
            and self.save_predictions
            and self.run.is_global_zero
            and self._predictions_error is None
        ):
            try:
                self._collect_predictions(
                    trainer, pl_module, outputs, batch, batch_idx, dataloader_idx
                )
            except Exception as err:  # the user's outputs or predictions_fn: a verdict
                self._predictions_failed(err)

    def _predictions_failed(self, err: Exception) -> None:
        """Stop keeping predictions for this fit and say why on the validation row."""
        detail = str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
        self._predictions_error = detail
        self.run.put_phase_row(
            {
                "phase": "validation",
                "first": True,
                "counter": "none",
                "verdict": "not_checked",
                "checks": [{"name": "predictions", "verdict": "not_checked", "detail": detail}],
                "reason": f"predictions not kept: {detail}",
            },
            source="DivergenceLedger",
        )
        warnings.warn(
            f"lightning-pilot: predictions not kept: {detail}", RuntimeWarning, stacklevel=3
        )

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active or trainer.sanity_checking:
            return
        for name, value in sorted(trainer.callback_metrics.items()):
            wanted = (
                name in self.val_metrics if self.val_metrics is not None else name.startswith("val")
            )
            if wanted and isinstance(value, torch.Tensor) and value.numel() == 1:
                self.curves.add_val(trainer.global_step, name, float(value))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active or self._ended:
            return

        def write_end(error: OSError | None) -> None:
            # After the run's tables were flushed: a run whose files could not be written is
            # not recorded as a clean one. Registered before the last evaluation, so an error
            # there cannot cost the end record.
            if self._ended:  # the exception path recorded the end already
                return
            status, cause, detail = self._normal_outcome(trainer)
            stop_step = self._stop[1] if self._stop is not None else trainer.global_step
            if error is None:
                self._write_end(
                    trainer,
                    status=status,
                    stop_cause=cause,
                    stop_step=stop_step,
                    stop_detail=detail,
                )
                return
            failed, failed_cause = exception_outcome(error)
            self._write_end(
                trainer,
                failing=True,
                status=failed,
                stop_cause=failed_cause,
                stop_step=trainer.global_step,
                stop_detail=f"training ended ({status}: {cause}) after {trainer.global_step}"
                f" update(s); then the run's tables could not be written: {error}",
                exception_type=type(error).__name__,
                exception_message=str(error)[:_MESSAGE_CHARS],
            )

        self.run.on_close(write_end)
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
            if self._active and not self._refused and not self._ended:
                unread = self._evaluate_if_possible()  # no collective: other ranks may be gone
                status, cause = exception_outcome(exception)
                message = str(exception)[:_MESSAGE_CHARS] or None
                self._write_end(
                    trainer,
                    failing=True,
                    status=status,
                    stop_cause=cause,
                    stop_step=trainer.global_step,
                    stop_detail=unread,
                    exception_type=type(exception).__name__,
                    exception_message=message,
                )
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

    # ---------------------------------------------------------------------------------------
    # Divergence
    # ---------------------------------------------------------------------------------------

    def _add_micro_batch_loss(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any
    ) -> None:
        # type() first: Lightning hands a plain dict, and an ABC isinstance check is slower.
        is_map = type(outputs) is dict or isinstance(outputs, Mapping)
        loss = outputs.get("loss") if is_map else outputs
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return
        # Lightning divides the loss by K (automatic optimisation) before outputs reach us;
        # the multiplication back waits for the evaluation, like the read.
        self._factor = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        self._micro.append(loss.detach() if loss.requires_grad else loss)

    def _evaluates(self, step: int) -> bool:
        # By distance, not step % check_every: several optimizers step global_step by more
        # than one per batch. Every rank sees the same steps, so they agree.
        return step - self._last_eval >= self.check_every

    def _after_update(self, trainer: pl.Trainer) -> None:
        step = trainer.global_step
        self._updates.append((step, self._micro, self._factor, self._lr, self._grad_norms))
        self._micro, self._grad_norms, self._lr = [], [], None
        if not self._evaluates(step):
            return
        self._last_eval = step
        self._evaluate()
        if self.action == "stop" and self._agree(trainer, step):
            trainer.should_stop = True
        if self.run.is_global_zero and self._heartbeat_due(step):
            self._last_heartbeat = step
            self._write(trainer, "heartbeat", failing=True, status="running")

    def _heartbeat_due(self, step: int) -> bool:
        if self.heartbeat_every is not None and step - self._last_heartbeat >= self.heartbeat_every:
            return True
        return time.monotonic() - self._last_record_at >= self.heartbeat_seconds

    def _evaluate_if_possible(self) -> str | None:
        """Evaluate the pending updates; if the device cannot be read any more, say so."""
        pending = len(self._updates)
        try:
            self._evaluate()
        except Exception as err:  # e.g. a device-side assert: its tensors are unreadable
            self._updates = []
            return f"the losses of the last {pending} update(s) could not be read: {err}"
        return None

    def _evaluate(self) -> None:
        """Read the pending updates' losses and norms (one host sync) and apply the rules."""
        updates, self._updates = self._updates, []
        if not updates:
            return
        values = iter(read_scalars([t for u in updates for t in (*u[1], *u[4])]))
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
            if decision.fatal and self._stop is None:
                found = (e.detail for e in decision.events if e.event == decision.cause)
                self._stop = (str(decision.cause), step, next(found, str(decision.cause)))

    def _agree(self, trainer: pl.Trainer, step: int) -> bool:
        """Whether a fatal rule fired on any rank (a collective: every rank calls it at once).

        A rank that did not see it takes the highest-priority rule (max of codes) and the
        earliest update it fired at (min over ranks).
        """
        mine = self._stop
        if not trainer.strategy.reduce_boolean_decision(mine is not None, all=False):
            return False
        if trainer.world_size > 1:
            device = trainer.strategy.root_device
            code = len(FATAL_CAUSES) - FATAL_CAUSES.index(mine[0]) if mine else 0
            agreed = trainer.strategy.reduce(torch.tensor(code, device=device), reduce_op="max")
            fired = trainer.strategy.reduce(
                torch.tensor(mine[1] if mine else step, device=device), reduce_op="min"
            )
            if mine is None:
                other, at = FATAL_CAUSES[len(FATAL_CAUSES) - int(agreed)], int(fired)
                self._stop = (other, at, f"{other} fired on another rank at step {at}")
        return True

    def _normal_outcome(self, trainer: pl.Trainer) -> tuple[str, str, str | None]:
        early = trainer.early_stopping_callbacks
        stopped_early = [c for c in early if c.stopping_reason.name != "NOT_STOPPED"]
        timers = [c for c in getattr(trainer, "callbacks", []) if isinstance(c, Timer)]
        timed_out = any(_expired(c.time_remaining()) for c in timers)
        facts = self._facts or {}
        if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
            limit: str | None = "max_steps"
        elif trainer.max_epochs not in (None, -1) and trainer.current_epoch >= trainer.max_epochs:
            limit = "max_epochs"
        else:
            limit = None
        status, cause = normal_outcome(
            divergence=self._stop[0] if self._stop else None,
            early_stopping=bool(stopped_early),
            time_limit=timed_out,
            limit_reached=limit,
            updates_done=trainer.global_step,
            planned_updates=facts.get("planned_updates"),
        )
        detail = None
        if status == "diverged" and self._stop is not None:
            detail = self._stop[2] + (
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

    # ---------------------------------------------------------------------------------------
    # Records
    # ---------------------------------------------------------------------------------------

    def _check_repeat(self, trainer: pl.Trainer) -> None:
        if self.on_repeat == "ignore" or self._facts is None:
            return
        matches: list[str] = []
        if self.run.is_global_zero:
            found = find_failed_runs(self.run.ledger_dir, self._facts["variant_key"])
            for row in found.itertuples(index=False):
                if row.run_id not in (self.run.run_id, self.derived_from):
                    matches.append(
                        f"{row.run_id} ({row.status}: {row.stop_cause} at step {row.stop_step})"
                    )
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
        planned = None
        if full:
            estimate = trainer.estimated_stepping_batches
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
        name = str(device)
        if device.type == "cuda":
            name += f" {torch.cuda.get_device_name(device)}"
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
            "device_name": name,
        }

    def _record(self, trainer: pl.Trainer, event: str, **outcome: Any) -> dict[str, Any]:
        run = self.run
        record: dict[str, Any] = dict(self._facts or {})
        record.update(
            {k: v for k, v in run.ledger_fields.items() if k not in _OWN_FIELDS and v is not None}
        )
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
        return record

    def _write(self, trainer: pl.Trainer, event: str, *, failing: bool, **outcome: Any) -> None:
        self._last_record_at = time.monotonic()
        try:
            record = self._record(trainer, event, **outcome)
            storage.write_ledger_record(self.run.ledger_dir, record)
            self._mark = self.curves.mark()
        except (OSError, ValueError) as err:
            if not failing:
                raise
            warnings.warn(
                f"lightning-pilot: could not write the {event} record of run {self.run.run_id}"
                f" to {self.run.ledger_dir}: {err}",
                RuntimeWarning,
                stacklevel=2,
            )

    def _write_end(self, trainer: pl.Trainer, *, failing: bool = False, **outcome: Any) -> None:
        self._ended = True
        if not self.run.is_global_zero:
            return
        self.run.release_space()  # room for the end record on a disk that filled up
        if self._facts is None:
            # The fit failed before training started: record what can be read safely.
            self._facts = self._read_facts(trainer, full=False)
        if self.save_predictions:
            outcome.update(self._publish_predictions(failing=failing))
        self._write(trainer, "end", failing=failing, **outcome)

    # ---------------------------------------------------------------------------------------
    # Predictions
    # ---------------------------------------------------------------------------------------

    def _collect_predictions(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, *idx: int
    ) -> None:
        if self.predictions_fn is not None:
            preds = self.predictions_fn(module, batch, outputs)
        elif isinstance(outputs, Mapping) and self.predictions_key in outputs:
            preds = outputs[self.predictions_key]
        else:
            got = (
                f"a dict without it (keys: {sorted(map(str, outputs))})"
                if isinstance(outputs, Mapping)
                else f"{type(outputs).__name__}"
            )
            raise ValueError(
                "DivergenceLedger(save_predictions=True) found no predictions: validation_step"
                f" must return a dict with the key {self.predictions_key!r}, it returned {got}."
                f" Return {{{self.predictions_key!r}: tensor[B, ...]}}"
                " from validation_step, or pass predictions_fn=(pl_module, batch, outputs)"
                " -> tensor[B, ...]."
            )
        view = self.batch_adapter.view(batch)
        rows = prediction_rows(
            preds,
            ids=view.ids_list(),
            targets=view.targets,
            step=trainer.global_step,
            rank=self.run.rank,
            batch_idx=idx[0],
            dataloader_idx=idx[1],
        )
        if not trainer.sanity_checking:  # checked during the sanity check, kept after it
            self._predictions.extend(rows)

    def _publish_predictions(self, *, failing: bool) -> dict[str, Any]:
        if not self._predictions:
            return {}
        run = self.run
        identity = {
            "schema_version": schemas.schema_version(PREDICTIONS_SCHEMA),
            "written_at": datetime.now(timezone.utc),
            "run_id": run.run_id,
            "attempt": run.attempt,
            "attempt_id": run.attempt_id,
            "world_size": run.world_size,
        }
        rows = [r | identity for r in self._predictions]
        table = storage.rows_to_table(rows, PREDICTIONS_SCHEMA)
        try:
            try:
                path = storage.publish_table(table, run.run_dir / "predictions.parquet")
            except FileExistsError:  # an earlier attempt of this run published its own
                path = storage.publish_table(
                    table, run.run_dir / f"predictions-{run.attempt_id}.parquet"
                )
        except OSError as err:
            if not failing:
                raise
            warnings.warn(
                f"lightning-pilot: could not write predictions: {err}", RuntimeWarning, stacklevel=2
            )
            return {}
        return {"predictions_uri": str(path), "predictions_sha256": file_sha256(path)}


def _expired(remaining: float | None) -> bool:
    return remaining is not None and remaining <= 0
