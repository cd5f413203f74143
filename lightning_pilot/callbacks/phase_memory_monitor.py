"""PhaseMemoryMonitor: one row per phase with inputs, memory, duration and verdict; its hooks
call the Trainer-free logic of ``core/``."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_pilot.core import phase_rows, validate
from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.eval_phase import EvalLoop, expected_samples, limit_name
from lightning_pilot.core.measure_schedule import MeasureSchedule
from lightning_pilot.core.phase_meter import PhaseMeter
from lightning_pilot.core.phases import Occurrence, PhaseAggregator
from lightning_pilot.core.training_step import TrainingStep
from lightning_pilot.run import ExportFn, PilotCallback, PilotRefusalError
from lightning_pilot.schemas import MODEL_SCHEMA


class PhaseCheckError(PilotRefusalError):
    """A phase check failed and the monitor was asked to stop (``on_fail="raise"``)."""


class _MeasuredCheckpointIO(CheckpointIO):
    """Delegates to the strategy's checkpoint IO and times the file write and read."""

    def __init__(self, inner: CheckpointIO, monitor: PhaseMemoryMonitor) -> None:
        self.inner = inner
        self.monitor = monitor

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        self._measure("_checkpoint_begin", "checkpoint_save")
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
        self._measure("_checkpoint_end", "checkpoint_save", path)

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        self._measure("_checkpoint_begin", "checkpoint_load")
        loaded = self.inner.load_checkpoint(
            path, map_location=map_location, weights_only=weights_only
        )
        self._measure("_checkpoint_end", "checkpoint_load", path)
        return loaded

    def _measure(self, method: str, *args: Any) -> None:
        self.monitor._quietly(f"checkpoint_io.{method}", getattr(self.monitor, method), *args)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


#: Per-update hooks with nothing to do between measured updates (see ``QuietCounts``).
_QUIET_HOOKS = (
    "on_before_backward",
    "on_train_batch_start",
    "on_after_backward",
    "on_before_optimizer_step",
)


class PhaseMemoryMonitor(PilotCallback):
    """Measure every phase of the campaign: inputs, memory, duration and a verdict per phase.

    Writes ``phases.parquet``, ``placement.parquet`` and ``model.parquet``
    (:data:`MODEL_SCHEMA`) on every rank; the rows and checks: docs/phase-table.md.

    Args:
        pilot_updates: updates measured fully at the start of each fit (>= 2).
        sample_every: after the pilot window, measure one update in this many (0 = stop).
        memory_updates: on CPU, updates measured with the tensor tracker (1 to
            ``pilot_updates``); the other measured updates give the clean durations.
        export: ``fn(pl_module, directory) -> path`` run once per fit at fit end through
            :meth:`PilotRun.export` and measured as the ``export`` phase.
        on_fail: ``"record"`` (default) or ``"raise"`` a :class:`PhaseCheckError`.
        track_cpu: use the tensor tracker on CPU (``False``: CPU memory columns null).
        adapter: how to read batches (default :class:`BatchAdapter`).
        out_dir: the output folder (default ``<default_root_dir>/pilot``).

    Example:
        >>> import tempfile
        >>> import lightning.pytorch as pl
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> from lightning_pilot import PhaseMemoryMonitor, read_phase_table
        >>> folder = tempfile.mkdtemp()
        >>> monitor = PhaseMemoryMonitor()
        >>> trainer = pl.Trainer(max_steps=3, val_check_interval=2, limit_val_batches=2,
        ...                      callbacks=[monitor],
        ...                      logger=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, default_root_dir=folder)
        >>> trainer.fit(BoringModel())
        >>> table = read_phase_table(monitor.run.run_dir)
        >>> sorted(set(table["phase"]))  # doctest: +NORMALIZE_WHITESPACE
        ['backward', 'checkpoint_save', 'data', 'forward', 'optimizer_step', 'setup',
         'validation']
        >>> set(table["verdict"])
        {'pass'}
    """

    def __init__(
        self,
        *,
        pilot_updates: int = 3,
        sample_every: int = 100,
        memory_updates: int = 2,
        export: ExportFn | None = None,
        on_fail: Literal["record", "raise"] = "record",
        track_cpu: bool = True,
        adapter: BatchAdapter | None = None,
        out_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        owner = "PhaseMemoryMonitor"
        super().__init__(out_dir=out_dir)
        hint = "the first update allocates the optimizer state; the peak comes later"
        self.pilot_updates = validate.integer(
            owner, "pilot_updates", pilot_updates, minimum=2, hint=hint
        )
        hint = "0 stops measuring after the pilot window"
        self.sample_every = validate.integer(
            owner, "sample_every", sample_every, minimum=0, hint=hint
        )
        hint, most = "at most pilot_updates", self.pilot_updates
        self.memory_updates = validate.integer(
            owner, "memory_updates", memory_updates, minimum=1, maximum=most, hint=hint
        )
        self.export = validate.callable_or_none(
            owner, "export", export, "a callable fn(pl_module, directory) -> path | None"
        )
        self.on_fail: Literal["record", "raise"] = validate.choice(
            owner, "on_fail", on_fail, ("record", "raise")
        )
        self.track_cpu = validate.boolean(owner, "track_cpu", track_cpu)
        validate.instance(owner, "adapter", adapter, BatchAdapter)
        self.adapter = adapter or BatchAdapter()
        self._reset()

    def _reset(self) -> None:
        self._schedule = MeasureSchedule(self.pilot_updates, self.sample_every, self.memory_updates)
        self._meter = PhaseMeter(track_cpu=self.track_cpu)
        self._rows = phase_rows.PhaseRows()
        self._step = TrainingStep(self._rows, self._meter)
        self._hooks: list[Any] = []
        self._io: _MeasuredCheckpointIO | None = None
        self._eval: EvalLoop | None = None
        self._exported: Occurrence | None = None
        self._precision: str | None = None
        self._placed = False

    @property
    def aggregator(self) -> PhaseAggregator:
        """The occurrences of this fit's phases, folded into rows."""
        return self._rows.aggregator

    @override
    def _state_key_fields(self) -> dict[str, Any]:
        return {"out_dir": str(self.out_dir), "pilot_updates": self.pilot_updates}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        previous = self._run
        super().setup(trainer, pl_module, stage)
        if self.run is not previous:
            self._reset()
        self._meter.module = pl_module
        # The device the strategy will place the model on (a checkpoint may load before that).
        self._meter.root_device = trainer.strategy.root_device
        self._precision = str(trainer.precision)
        self._rows.stop_on_fail = self.on_fail == "raise"
        self._meter.start_setup()
        io = trainer.strategy.checkpoint_io
        if isinstance(io, _MeasuredCheckpointIO):  # another monitor's: it measures for us
            io.monitor = self
        else:
            self._io = trainer.strategy.checkpoint_io = _MeasuredCheckpointIO(io, self)
        if self.export is not None:
            self.run.measure_export = self._measure_export

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release(trainer)
        super().teardown(trainer, pl_module, stage)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._release(trainer)
        super().on_exception(trainer, pl_module, exception)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_io": None}  # the meter drops its counter (rebuilt on use)

    def _release(self, trainer: pl.Trainer) -> None:
        """Take back everything installed for the fit: tracker, optimizer hooks, checkpoint IO."""
        self._meter.stop_tracker()
        self._detach_update_hooks()
        self._rows.settle(may_fail=False)
        io, self._io = self._io, None
        if io is not None and trainer.strategy.checkpoint_io is io:
            trainer.strategy.checkpoint_io = io.inner
        if self._run is not None:
            if self._run.measure_export == self._measure_export:
                self._run.measure_export = None
            if not self._run.closed:
                self._publish()

    def _stop(self, failed: str | None) -> None:
        """Stop the fit on a failed check (``on_fail="raise"``), the rows published first."""
        if failed is not None:
            self._publish()
            raise PhaseCheckError(failed)

    def _module(self) -> pl.LightningModule:
        return cast(pl.LightningModule, self._meter.require_module())

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._meter.optimizers = list(trainer.optimizers)
        self._step.trainable_at_start = None
        self._attach_update_hooks()
        self._record_setup(trainer, pl_module)
        row = phase_rows.model_row(
            pl_module, self._meter.optimizers, precision=self._precision, device=self._meter.device
        )
        self.run.register_table("model", MODEL_SCHEMA)
        self.run.append_rows("model", [row])

    def _record_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        occurrence = self._meter.end_setup(trainer.global_step)
        if occurrence is not None:
            self._rows.count("setup", trainer.global_step)
            placed = phase_rows.params_on_device(pl_module.named_parameters(), pl_module.device)
            self._stop(self._rows.add(occurrence, [placed]))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._schedule.start(trainer.global_step)  # restored by now when resuming
        # The phase table exists from the first update on: a kill before the pilot window
        # ends still leaves the setup row (and the other callbacks' rows) readable.
        self._flush_during_fit("at train start")
        self._restart_data_clock(trainer)

    def _flush_during_fit(self, when: str) -> None:
        """Publish and flush the rows; a failed write warns, training goes on and the rows stay
        buffered (the flush at the end of the fit tries them again)."""
        try:
            self._publish(flush=True)
        except OSError as err:
            warnings.warn(
                f"lightning-pilot: could not write the phase table of run {self.run.run_id} to"
                f" {self.run.out_dir} {when}: {err}; the rows stay buffered",
                RuntimeWarning,
                stacklevel=2,
            )

    def _restart_data_clock(self, trainer: pl.Trainer) -> None:
        step = trainer.global_step
        quiet = self._rows.quiet
        quiet.step_now = step  # global_step does not move until the next update ends
        if self._schedule.restart(step, fitting=trainer.state.fn == TrainerFn.FITTING):
            self._rows.fold_quiet()  # keep the counts in occurrence order
            self._unmute(*_QUIET_HOOKS)
            self._attach_update_hooks()
            self._meter.begin("data", track=False)
        else:
            # Between measured updates the batch end alone counts (QuietCounts): Lightning skips
            # the muted hooks and the optimizers run without our post-hook. Manual optimisation
            # keeps on_before_backward, the only way to count its backward passes.
            automatic = quiet.automatic = self._module().automatic_optimization
            self._mute(*(_QUIET_HOOKS if automatic else _QUIET_HOOKS[1:]))
            self._detach_update_hooks()

    def _attach_update_hooks(self) -> None:
        if not self._hooks:
            self._hooks = [
                o.register_step_post_hook(self._after_update) for o in self._meter.optimizers
            ]

    def _detach_update_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._step.pending is not None:
            self._step.flush()
        if self._schedule.measuring:
            view = self.adapter.view(batch, count_tokens=False)
            track = self._schedule.tracking
            self._stop(self._step.batch_start(trainer.global_step, view, track=track))

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if not self._schedule.measuring:
            self._rows.quiet.backward += 1  # manual optimisation only: muted under automatic
            return
        track = self._schedule.tracking
        self._stop(self._step.before_backward(trainer.global_step, loss, track=track))

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._schedule.measuring:
            self._stop(self._step.after_backward(trainer.global_step))

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._schedule.measuring:
            step, track = trainer.global_step, self._schedule.tracking
            self._stop(self._step.before_optimizer_step(step, optimizer, track=track))

    def _quietly(self, hook: str, measure: Callable[..., None], *args: Any) -> None:
        """Run ``measure`` inside the user's own work (an optimizer step, a checkpoint save or
        load): a failure of ours is recorded (row "pilot") and never stops that work."""
        try:
            measure(*args)
        except OSError:
            raise
        except Exception as err:
            self._hook_failed(hook, err)

    def _after_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._quietly("optimizer_step_post_hook", self._measure_update)

    def _measure_update(self) -> None:
        self._step.optimizer_stepped()
        if not self._placed:  # after the first update: weights, gradients, optimizer state exist
            self._placed = True
            self._record_placement("after_first_update")

    def _record_placement(self, moment: str) -> None:
        rows = phase_rows.placement_rows(
            self._meter.require_module(), self._meter.optimizers, moment
        )
        self.run.register_table("placement")
        self.run.append_rows("placement", rows)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any
    ) -> None:
        step, schedule = trainer.global_step, self._schedule
        if not schedule.measuring:
            if self._step.pending is not None:
                self._step.flush()
            self._rows.quiet.batch_end(outputs, step)
            if step < schedule.quiet_until:  # an unmeasured update follows: nothing to start
                return
        self._stop(self._step.judge_update(step))
        if schedule.update_ended(step):
            self._stop(self._rows.settle(may_fail=True))
            self._flush_during_fit("after the pilot window")  # it survives a later crash
        self._meter.stop_tracker()
        self._restart_data_clock(trainer)

    def _eval_start(self, trainer: pl.Trainer, phase: str) -> None:
        if trainer.sanity_checking:
            return
        self._step.flush()
        self._record_setup(trainer, self._module())
        first = not self._rows.has(phase)
        self._rows.count(phase, trainer.global_step)
        self._eval = EvalLoop(phase, self._schedule.measures_eval(phase, first))
        if self._eval.measured:
            self._meter.begin(phase, track=first)

    def _eval_end(self, trainer: pl.Trainer, phase: str, loaders: Any) -> None:
        loop, self._eval = self._eval, None
        if trainer.sanity_checking or loop is None or not loop.measured:
            return
        occurrence = self._meter.end(phase, trainer.global_step)
        expected, why = expected_samples(phase, loaders, getattr(trainer, limit_name(phase)))
        self._stop(self._rows.add(occurrence, loop.finish(occurrence, expected, why)))
        self._publish()
        self._meter.stop_tracker()
        if phase == "validation" and trainer.state.fn == TrainerFn.FITTING:
            self._restart_data_clock(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start(trainer, "validation")

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
        loop = self._eval
        if not (trainer.sanity_checking or loop is None or not loop.measured):
            view = self.adapter.view(batch, count_tokens=False)
            loop.add_batch(view, pl_module.named_modules(), grad_enabled=torch.is_grad_enabled())

    # The test and predict loops add their batches alike.
    on_test_batch_end = on_predict_batch_end = on_validation_batch_end

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_end(trainer, "validation", trainer.val_dataloaders)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start(trainer, "test")

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_end(trainer, "test", trainer.test_dataloaders)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start(trainer, "predict")

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_end(trainer, "predict", trainer.predict_dataloaders)

    def _checkpoint_begin(self, phase: str) -> None:
        self._step.flush()
        self._rows.count(phase, self._module().global_step)
        self._meter.begin(phase, track=False)

    def _checkpoint_end(self, phase: str, path: Any) -> None:
        occurrence = self._meter.end(phase, self._module().global_step)
        if occurrence is not None:
            self._stop(self._rows.add(occurrence, phase_rows.checkpoint_file(occurrence, path)))
            if self._schedule.measuring:
                self._meter.begin("data", track=False)  # the next fetch starts after the save

    @contextlib.contextmanager
    def _measure_export(self) -> Iterator[None]:
        """The ``export`` phase, for :attr:`PilotRun.measure_export` (the run calls the user's
        function inside it, whichever callback asks first)."""
        self._meter.begin("export")
        try:
            yield
        finally:
            self._exported = self._meter.end("export", self._module().global_step)
            self._meter.stop_tracker()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step.flush()
        self._rows.settle(may_fail=False)
        self._meter.stop_tracker()
        if self.export is not None:
            path, error = self.run.export(self.export, trainer, pl_module)
            if self.run.measure_export == self._measure_export:
                self.run.measure_export = None  # later exports (other functions) are not ours
            occurrence, self._exported = self._exported, None
            if occurrence is not None:
                results = phase_rows.export_written(occurrence, path, error)
                self._rows.count("export", occurrence.step)
                self._stop(self._rows.add(occurrence, results))
        self._record_placement("fit_end")
        self._publish()

    def _publish(self, flush: bool = False) -> None:
        if self._run is None:
            return
        meter = self._meter
        rows = self._rows.rows(
            device=meter.device, precision=self._precision, counter=meter.counter
        )
        for row in rows:
            self._run.put_phase_row(row, source="PhaseMemoryMonitor")
        if flush:
            self._run.flush()
