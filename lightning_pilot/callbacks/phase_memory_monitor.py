"""PhaseMemoryMonitor: one row per phase with inputs, memory, duration and verdict."""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_pilot.core import checks, validate
from lightning_pilot.core.batches import BatchAdapter, BatchView
from lightning_pilot.core.memory import (
    AcceleratorCounter,
    CudaCounter,
    MemoryCounter,
    MemoryReading,
    NoCounter,
    TensorTracker,
    TrackerCounter,
    compiled_code,
    host_memory,
    state_bytes,
    state_tensors,
)
from lightning_pilot.core.phases import Occurrence, PhaseAggregator, judge, worst_verdict
from lightning_pilot.run import ExportFn, PilotCallback, PilotRefusalError
from lightning_pilot.schemas import MODEL_SCHEMA

__all__ = ["MODEL_SCHEMA", "PhaseCheckError", "PhaseMemoryMonitor"]


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


class _Open(NamedTuple):
    """The phase being measured: since when, and whether its memory is counted."""

    phase: str
    started: float
    tracked: bool


@dataclass
class _Eval:
    """One validation, test or predict loop: what its batches showed."""

    phase: str
    measured: bool
    samples: int = 0
    seq_len: int | None = None
    batch_size: int | None = None
    training: dict[str, torch.nn.Module] = field(default_factory=dict)
    grad: bool = False


@dataclass
class _Update:
    """The optimizer step being measured: the arguments of ``check_update`` known before it."""

    step_before: int
    before: dict[str, tuple[float, float]]
    trainable: set[str]
    zero_grad: set[str]
    zero_lr: set[str]
    without_grad: set[str]
    first: bool  # the fit's first measured update: on the phase's first row


@dataclass
class _QuietCounts:
    """Training-step phases between measured updates, counted in bulk (one add per hook)."""

    micro_batches: int = 0
    backward: int = 0
    optimizer_steps: int = 0
    step_first: int | None = None
    step_last: int | None = None

    def micro_batch(self, step: int) -> None:
        self.micro_batches += 1
        if self.step_first is None:
            self.step_first = step
        self.step_last = step

    def fold_into(self, aggregator: PhaseAggregator) -> None:
        """Add the counts to the aggregator and start again from zero."""
        counts = {
            "data": self.micro_batches,
            "forward": self.micro_batches,
            "backward": self.backward,
            "optimizer_step": self.optimizer_steps,
        }
        for phase, times in counts.items():
            aggregator.count(phase, self.step_last, times=times, step_first=self.step_first)
        self.micro_batches = self.backward = self.optimizer_steps = 0
        self.step_first = self.step_last = None


#: Per-update hooks with nothing to do between measured updates (see ``_count_quiet``).
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
        self.pilot_updates = validate.integer(
            owner,
            "pilot_updates",
            pilot_updates,
            minimum=2,
            hint="the first update allocates the optimizer state; the peak comes later",
        )
        self.sample_every = validate.integer(
            owner,
            "sample_every",
            sample_every,
            minimum=0,
            hint="0 stops measuring after the pilot window",
        )
        self.memory_updates = validate.integer(
            owner,
            "memory_updates",
            memory_updates,
            minimum=1,
            maximum=self.pilot_updates,
            hint="at most pilot_updates",
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
        self.aggregator = PhaseAggregator()
        self._quiet = _QuietCounts()
        self._step_now = 0
        self._counter: MemoryCounter | None = None
        self._tracker: TensorTracker | None = None
        self._module: pl.LightningModule | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []
        self._io: _MeasuredCheckpointIO | None = None
        self._open: _Open | None = None
        self._pending: Occurrence | None = None
        self._measuring = False
        self._automatic = True  # the module's automatic_optimization, read when going quiet
        # Below this step every update is unmeasured and the pilot window is over: a batch
        # end then only notes the step (-1: look at every batch end).
        self._quiet_until: float = -1
        # The first step whose update is measured: a batch starting at or past it is. Manual
        # optimisation may move global_step by several per batch, past the exact step.
        self._due: float = 0
        self._tracking = False
        self._start_step = 0
        self._setup_started: float | None = None
        self._update: _Update | None = None
        self._eval: _Eval | None = None
        self._exported: Occurrence | None = None
        self._window_done = False
        self._device = "unknown"
        self._precision: str | None = None
        self._root_device = torch.device("cpu")
        self._synchronized = True
        self._view: BatchView | None = None
        self._intended: set[int] = set()
        # ids of the parameters meant to train at the fit's first backward: one frozen later
        # while still optimized stopped learning mid-fit (docs/phase-table.md).
        self._trainable_at_start: set[int] | None = None
        self._placed = False
        self._backward_first = True
        # Missing gradients are judged over the measured updates (docs/phase-table.md, "Missing
        # gradients"): the names that received a gradient in a measured backward, the names
        # without one per row and check, and whether the evidence is complete (settled).
        self._reached: set[str] = set()
        self._never: set[str] = set()  # judged as never reached: stays so
        self._evidence = {"backward": 0, "optimizer_step": 0}
        self._deferred: dict[tuple[str, bool, str], dict[str, None]] = {}
        self._settled = False

    @override
    def _state_key_fields(self) -> dict[str, Any]:
        return {"out_dir": str(self.out_dir), "pilot_updates": self.pilot_updates}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        previous = self._run
        super().setup(trainer, pl_module, stage)
        if self.run is not previous:
            self._reset()
        self._module = pl_module
        # The device the strategy will place the model on (a checkpoint may load before that).
        self._root_device = trainer.strategy.root_device
        self._precision = str(trainer.precision)
        self._setup_started = time.perf_counter()
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

    def _stop_tracker(self) -> None:
        if self._tracker is not None:
            self._tracker.stop()

    def __getstate__(self) -> dict[str, Any]:
        # The memory counter (and the CPU tracker's weak references) is rebuilt on next use.
        state = dict(self.__dict__)
        state.update(_counter=None, _tracker=None, _io=None)
        return state

    def _release(self, trainer: pl.Trainer) -> None:
        """Take back everything installed for the fit: tracker, optimizer hooks, checkpoint IO."""
        self._stop_tracker()
        self._detach_update_hooks()
        self._settle(may_raise=False)
        io, self._io = self._io, None
        if io is not None and trainer.strategy.checkpoint_io is io:
            trainer.strategy.checkpoint_io = io.inner
        if self._run is not None:
            if self._run.measure_export == self._measure_export:
                self._run.measure_export = None
            if not self._run.closed:
                self._publish()

    def _ensure_counter(self) -> MemoryCounter:
        if self._counter is not None:
            return self._counter
        device = self._root_device
        self._device = str(device)
        counter: MemoryCounter
        if device.type == "cuda":
            counter = CudaCounter(device)
            self._device = f"{device} {torch.cuda.get_device_name(device)}"
        elif device.type == "cpu" and self.track_cpu and (compiled := self._compiled()):
            counter = _compiled_counter(compiled)
        elif device.type == "cpu" and self.track_cpu:
            self._tracker = TensorTracker()
            counter = TrackerCounter(self._tracker)
            self._device = "cpu"
        elif device.type != "cpu" and AcceleratorCounter.available(device):
            counter = AcceleratorCounter(device)
        else:
            reason = "track_cpu=False" if device.type == "cpu" else f"no counter for {device}"
            counter = NoCounter(f"memory not measured: {reason}")
        self._counter = counter
        # CPU work is synchronous; a device without counters was not synchronised either.
        self._synchronized = device.type == "cpu" or not isinstance(counter, NoCounter)
        return counter

    def _compiled(self) -> list[str]:
        """The compiled code in the module (see :func:`compiled_code`)."""
        return compiled_code(self._require_module())

    def _begin(self, phase: str, *, track: bool = True) -> None:
        """Start measuring ``phase``; the CPU tracker (a dispatch mode, left in the context it was
        entered in) runs within one hook span, and not for ``track=False`` phases."""
        counter = self._ensure_counter()
        self._open = None  # a phase interrupted by another (e.g. a save mid-step) is dropped
        tracked = track or not isinstance(counter, TrackerCounter)
        if tracked and self._tracker is not None and not self._tracker.active:
            compiled = self._compiled()  # compiled since the counter was made (on_train_start)
            if compiled:
                self._tracker = None
                self._counter = counter = _compiled_counter(compiled)
        if tracked and self._tracker is not None and not self._tracker.active:
            self._tracker.start()
            # Tensors that exist already (weights, gradients, optimizer state) count from now.
            self._tracker.adopt(state_tensors(self._require_module(), self._optimizers))
        counter.synchronize()
        if tracked:
            counter.begin()
        self._open = _Open(phase, time.perf_counter(), tracked)

    def _end(
        self, phase: str, step: int | None, view: BatchView | None = None
    ) -> Occurrence | None:
        opened = self._open
        if opened is None or opened.phase != phase:
            return None
        self._open = None
        counter = self._ensure_counter()
        counter.synchronize()
        duration = time.perf_counter() - opened.started
        tracked = opened.tracked
        reading = counter.end() if tracked else MemoryReading()
        values: dict[str, Any] = {k: getattr(reading, k) for k in reading.__dataclass_fields__}
        if not tracked:
            values["notes"] = (
                "allocated bytes not measured here: the CPU tensor tracker runs in the first"
                " updates and evaluations only, not during data fetching or checkpoint"
                " (de)serialisation; see host_rss_bytes"
            )
        values.update(self._state_values())
        if view is not None:
            values.update(
                batch_size=view.batch_size, seq_len=view.seq_len, input_shapes=_shapes(view)
            )
        clean = not (tracked and isinstance(counter, TrackerCounter))  # the tracker slows it
        return Occurrence(phase, step, duration, self._synchronized, values, clean_timing=clean)

    def _state_values(self) -> dict[str, Any]:
        state = state_bytes(self._require_module(), self._optimizers)
        host = host_memory()
        return state.totals() | {
            "host_rss_bytes": host.rss_bytes,
            "host_swap_used_bytes": host.swap_used_bytes,
        }

    def _add(
        self, occurrence: Occurrence | None, results: Iterable[checks.CheckResult] = ()
    ) -> None:
        if occurrence is None:
            return
        results = list(results)
        occurrence.checks.extend(results)
        self.aggregator.add(occurrence)
        failed = [r for r in results if r.verdict == "fail"]
        if failed and self.on_fail == "raise":
            self._publish()
            raise PhaseCheckError(
                f"{occurrence.phase} failed at step {occurrence.step}: "
                + "; ".join(f"{r.name}: {r.detail}" for r in failed)
            )

    def _require_module(self) -> pl.LightningModule:
        if self._module is None:
            raise RuntimeError("PhaseMemoryMonitor used before setup().")
        return self._module

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._optimizers = list(trainer.optimizers)
        self._trainable_at_start = None
        self._attach_update_hooks()
        self._record_setup(trainer, pl_module)
        self._record_model(pl_module)

    def _record_model(self, pl_module: pl.LightningModule) -> None:
        params = list(pl_module.parameters())
        optimizers = [
            f"{type(o).__name__}(lr={o.param_groups[0].get('lr')})" if o.param_groups else
            type(o).__name__
            for o in self._optimizers
        ]  # fmt: skip
        row = {
            "model_class": f"{type(pl_module).__module__}.{type(pl_module).__qualname__}",
            "parameters": sum(p.numel() for p in params),
            "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
            "param_bytes": state_bytes(pl_module).param_bytes,
            "optimizers": ", ".join(optimizers) or None,
            "precision": self._precision,
            "device": self._device,
        }
        self.run.register_table("model", MODEL_SCHEMA)
        self.run.append_rows("model", [row])

    def _record_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._setup_started is None:
            return
        counter = self._ensure_counter()
        counter.synchronize()
        duration = time.perf_counter() - self._setup_started
        self._setup_started = None
        values = self._state_values()
        if isinstance(counter, AcceleratorCounter):
            values["end_allocated_bytes"] = counter.end().end_allocated_bytes
        elif self._tracker is not None:
            # The weights baseline: every state tensor, counted once, by the tracker.
            self._tracker.adopt(state_tensors(pl_module, self._optimizers))
            values["end_allocated_bytes"] = self._tracker.current_bytes
            values["device_capacity_bytes"] = host_memory().total_bytes
        misplaced = [n for n, p in pl_module.named_parameters() if p.device != pl_module.device]
        result = checks.CheckResult("params_on_device", "pass", str(pl_module.device))
        if misplaced:
            detail = f"{len(misplaced)} parameter(s) not on {pl_module.device}: {misplaced[:8]}"
            result = checks.CheckResult("params_on_device", "warn", detail)
        self.aggregator.count("setup", trainer.global_step)
        occurrence = Occurrence("setup", trainer.global_step, duration, self._synchronized, values)
        self._add(occurrence, [result])

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_step = self._due = trainer.global_step  # restored by now when resuming
        # The phase table exists from the first update on: a kill before the pilot window
        # ends still leaves the setup row (and the other callbacks' rows) readable.
        self._flush_during_fit("at train start")
        self._restart_data_clock(trainer)

    def _flush_during_fit(self, when: str) -> None:
        """Publish and flush the rows; a failed write warns and training goes on."""
        try:
            self._publish(flush=True)
        except OSError as err:
            # The rows stay buffered: the flush at the end of the fit tries them again.
            warnings.warn(
                f"lightning-pilot: could not write the phase table of run {self.run.run_id} to"
                f" {self.run.out_dir} {when}: {err}; the rows stay buffered",
                RuntimeWarning,
                stacklevel=2,
            )

    def _next_measured(self, step: int) -> float:
        """The first step at or after ``step`` whose update is measured (inf: none)."""
        done = step - self._start_step
        if done < self.pilot_updates:
            return step
        if self.sample_every == 0:
            return math.inf
        return step + (-(done - self.pilot_updates + 1)) % self.sample_every

    def _restart_data_clock(self, trainer: pl.Trainer, step: int | None = None) -> None:
        step = trainer.global_step if step is None else step
        self._step_now = step  # global_step does not move until the next update ends
        # The CPU tracker's per-operator cost inflates durations: it runs in the first
        # ``memory_updates`` updates only; later measured updates are timed without it.
        self._tracking = step - self._start_step < self.memory_updates
        self._measuring = trainer.state.fn == TrainerFn.FITTING and step >= self._due
        if self._measuring:
            self._quiet.fold_into(self.aggregator)  # keep the counts in occurrence order
            self._unmute(*_QUIET_HOOKS)
            self._attach_update_hooks()
            self._quiet_until = -1
            self._begin("data", track=False)
        else:
            # Between measured updates the batch end alone counts (see _count_quiet): Lightning
            # skips the muted hooks and the optimizers run without our post-hook. Manual
            # optimisation keeps on_before_backward, the only way to count its backward passes.
            automatic = self._automatic = self._require_module().automatic_optimization
            self._mute(*(_QUIET_HOOKS if automatic else _QUIET_HOOKS[1:]))
            self._detach_update_hooks()
            self._quiet_until = self._due if self._window_done else -1

    def _attach_update_hooks(self) -> None:
        if not self._hooks:
            self._hooks = [o.register_step_post_hook(self._after_update) for o in self._optimizers]

    def _detach_update_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _count_quiet(self, outputs: Any, step: int) -> None:
        """Count an unmeasured micro-batch at its end (``outputs``: ``None`` without a forward,
        ``{}`` without a backward); optimizer steps are the moves of ``global_step``."""
        quiet, automatic = self._quiet, self._automatic
        if outputs is not None or not automatic:
            quiet.micro_batch(self._step_now)
            if automatic and outputs:
                quiet.backward += 1
        quiet.optimizer_steps += step - self._step_now
        self._step_now = step

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._pending is not None:
            self._flush_pending()
        if not self._measuring:
            return
        step = trainer.global_step
        # Read before the training step can switch parameters off (see _intended_trainable).
        self._intended = _intended_trainable(pl_module)
        self.aggregator.count("data", step)
        self.aggregator.count("forward", step)
        view = self.adapter.view(batch, count_tokens=False)
        self._add(self._end("data", step, view), _batch_checks(view))
        self._view = view
        self._begin("forward", track=self._tracking)

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if not self._measuring:
            self._quiet.backward += 1  # manual optimisation only: muted under automatic
            return
        step = trainer.global_step
        self._backward_first = not self.aggregator.has("backward")
        self.aggregator.count("backward", step)
        occurrence = self._end("forward", step, self._view)
        # The modes the forward ran in: the training step is over (automatic optimisation) or
        # has computed this loss (manual), so what it switched to eval mode is seen.
        intended = self._intended | _intended_trainable(pl_module)
        mode = checks.check_train_mode(pl_module.named_modules(), intended)
        self._add(occurrence, [*checks.check_loss(loss), mode])
        self._begin("backward", track=self._tracking)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._measuring:
            return
        occurrence = self._end("backward", trainer.global_step, self._view)
        per_optimizer = [
            {id(p) for g in o.param_groups for p in g["params"]} for o in self._optimizers
        ]
        now = _intended_trainable(pl_module)
        if self._trainable_at_start is None:  # the fit's first backward
            self._trainable_at_start = now
        optimized: set[int] = set().union(*per_optimizer)
        results = checks.check_gradients(
            pl_module.named_parameters(),
            optimized,
            self._intended | now,
            trainable_at_start=self._trainable_at_start,
            optimizers=per_optimizer,
        )
        # grads_reach_params is judged over the measured backwards (see _deferred_results).
        reached, missing = checks.gradient_reach(pl_module.named_parameters(), optimized)
        self._reached.update(reached)
        self._evidence["backward"] += 1
        self._add(occurrence, [r for r in results if r.name != "grads_reach_params"])
        self._defer(("backward", self._backward_first, "grads_reach_params"), missing)

    def _flush_pending(self, results: Iterable[checks.CheckResult] = ()) -> None:
        pending, self._pending = self._pending, None
        self._add(pending, results)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self._measuring:
            return
        step = trainer.global_step
        # Manual optimisation may step several optimizers in one batch (a GAN's discriminator,
        # then its generator): the previous step is judged now, before this one moves anything.
        before = self._check_pending_update(trainer, pl_module)
        first = not self.aggregator.has("optimizer_step")
        self.aggregator.count("optimizer_step", step)
        optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
        # Meant to move: in this optimizer and intended to train (see _intended_trainable).
        moving = optimized & (self._intended | _intended_trainable(pl_module))
        trainable = [(n, p) for n, p in pl_module.named_parameters() if id(p) in moving]
        resting = {
            id(p)
            for group in optimizer.param_groups
            if isinstance(group.get("lr"), int | float) and group["lr"] == 0
            for p in group["params"]
        }
        self._update = _Update(
            step,
            before or checks.fingerprint(pl_module.named_parameters()),
            trainable={n for n, _ in trainable},
            zero_grad=checks.zero_gradients(trainable),
            zero_lr={n for n, p in trainable if id(p) in resting},
            without_grad={n for n, p in trainable if p.grad is None},
            first=first,
        )
        self._begin("optimizer_step", track=self._tracking)

    def _check_pending_update(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> dict[str, tuple[float, float]] | None:
        """Judge the pending optimizer step; returns the fingerprint taken after it, if any."""
        update = self._update
        pending = self._pending
        if not (self._measuring and update and pending and pending.phase == "optimizer_step"):
            return None
        after = checks.fingerprint(pl_module.named_parameters())
        results = checks.check_update(
            update.before,
            after,
            trainable=update.trainable,
            step_before=update.step_before,
            step_after=trainer.global_step,
            zero_grad=update.zero_grad,
            zero_lr=update.zero_lr,
            without_grad=update.without_grad,
            reached=None,  # judged over the measured updates (see _deferred_results)
        )
        before = update.before
        skipped = [n for n in before if n in update.without_grad and before[n] == after.get(n)]
        self._evidence["optimizer_step"] += 1
        self._flush_pending(results)
        self._defer(("optimizer_step", update.first, "trainable_params_changed"), skipped)
        return after

    def _defer(self, key: tuple[str, bool, str], names: Iterable[str]) -> None:
        """Note ``names`` for the check ``key`` (phase, first row, check) of a measured
        occurrence; once settled, one never reached fails now (and raises under ``raise``)."""
        held = self._deferred.setdefault(key, {})
        held.update(dict.fromkeys(names))
        if self._settled and self.on_fail == "raise":
            self._raise_deferred()

    def _settle(self, *, may_raise: bool) -> None:
        """The evidence is complete (the pilot window is over, or the fit ended): the deferred
        checks join the rows from now on."""
        if self._settled:
            return
        self._settled = True
        if may_raise and self.on_fail == "raise":
            self._raise_deferred()

    def _raise_deferred(self) -> None:
        failed = [
            (key, result)
            for key, result in self._deferred_results().items()
            if result.verdict == "fail"
        ]
        if failed:
            self._publish()
            named = dict.fromkeys(f"{phase} {r.name}: {r.detail}" for (phase, _, _), r in failed)
            raise PhaseCheckError("failed over the measured updates: " + "; ".join(named))

    def _deferred_results(self) -> dict[tuple[str, bool, str], checks.CheckResult]:
        """The checks judged over the measured updates, one per (phase, first row, check): a
        name missing in a measured occurrence passes when it received a gradient in another
        measured backward; one judged as never reached keeps failing."""
        reached = self._reached - self._never
        results: dict[tuple[str, bool, str], checks.CheckResult] = {}
        for key, held in self._deferred.items():
            names = list(held)
            if key[2] == "grads_reach_params":
                result = checks.check_reached(names, reached, self._evidence["backward"])
            else:
                updates = self._evidence["optimizer_step"]
                result = checks.check_changed_without_gradient(names, reached, updates)
            self._never.update(n for n in names if n not in reached)
            results[key] = result
        return results

    def _with_deferred(
        self, row: dict[str, Any], deferred: Mapping[tuple[str, bool, str], checks.CheckResult]
    ) -> dict[str, Any]:
        """``row`` with its deferred checks merged into the checks of the same name (the worst
        verdict, both details) and its verdict and reason judged again."""
        phase, first = row["phase"], bool(row["first"])
        extra = {k[2]: r for k, r in deferred.items() if k[:2] == (phase, first)}
        if not extra:
            return row
        found = {c["name"]: c for c in row["checks"]}
        for name, result in extra.items():
            own = found.get(name)
            if own is not None:
                verdict = worst_verdict([own["verdict"], result.verdict])
                detail = "; ".join(d for d in (own["detail"], result.detail) if d)
                result = checks.CheckResult(name, verdict, detail)
            found[name] = result.as_row()
        merged = list(found.values())
        verdict, reason = judge(phase, ((c["name"], c["verdict"], c["detail"]) for c in merged))
        return row | {"checks": merged, "verdict": verdict, "reason": reason or row["reason"]}

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
        if self._open is not None and self._open.phase == "optimizer_step":
            self._pending = self._end(
                "optimizer_step", None if self._update is None else self._update.step_before
            )
        if not self._placed:
            # Right after the first update, weights, gradients and optimizer state all exist.
            self._placed = True
            self._record_placement("after_first_update")

    def _record_placement(self, moment: str) -> None:
        module = self._require_module()
        swap = host_memory().swap_used_bytes
        rows = state_bytes(module, self._optimizers).placement_rows()
        self.run.register_table("placement")
        self.run.append_rows(
            "placement", [row | {"moment": moment, "host_swap_used_bytes": swap} for row in rows]
        )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any
    ) -> None:
        step = trainer.global_step
        if not self._measuring:
            if self._pending is not None:
                self._flush_pending()
            self._count_quiet(outputs, step)
            if step < self._quiet_until:  # an unmeasured update follows: nothing to start
                return
        self._check_pending_update(trainer, pl_module)
        if self._measuring:
            self._due = self._next_measured(step)
        if not self._window_done and step - self._start_step >= self.pilot_updates:
            self._window_done = True
            self._settle(may_raise=True)
            self._flush_during_fit("after the pilot window")  # it survives a later crash
        self._stop_tracker()
        self._restart_data_clock(trainer, step)

    def _eval_start(self, trainer: pl.Trainer, phase: str) -> None:
        if trainer.sanity_checking:
            return
        self._flush_pending()
        self._record_setup(trainer, self._require_module())
        first = not self.aggregator.has(phase)
        self.aggregator.count(phase, trainer.global_step)
        measured = first or (phase != "validation") or self._measuring
        self._eval = _Eval(phase, measured)
        if measured:
            self._begin(phase, track=first)

    def _eval_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        state = self._eval
        if trainer.sanity_checking or state is None or not state.measured:
            return
        view = self.adapter.view(batch, count_tokens=False)
        state.samples += view.batch_size or 0
        if view.seq_len is not None:
            state.seq_len = max(view.seq_len, state.seq_len or view.seq_len)
        if view.batch_size is not None:
            state.batch_size = max(view.batch_size, state.batch_size or view.batch_size)
        for name, module in pl_module.named_modules():
            if module.training:  # kept with its module: the check tells dropout from containers
                state.training.setdefault(name or "<root>", module)
        state.grad = state.grad or torch.is_grad_enabled()

    def _eval_end(self, trainer: pl.Trainer, phase: str, loaders: Any) -> None:
        state, self._eval = self._eval, None
        if trainer.sanity_checking or state is None or not state.measured:
            return
        occurrence = self._end(phase, trainer.global_step)
        if occurrence is not None:
            occurrence.values.update(seq_len=state.seq_len, batch_size=state.batch_size)
        expected, why = _expected_samples(trainer, phase, loaders)
        results = (
            checks.check_eval_mode(list(state.training.items()), state.grad, phase)
            if phase != "predict"
            else []
        )
        results.append(checks.check_sample_count(state.samples, expected, why))
        self._add(occurrence, results)
        self._publish()
        self._stop_tracker()
        if phase == "validation" and trainer.state.fn == TrainerFn.FITTING:
            self._restart_data_clock(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start(trainer, "validation")

    @override
    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, *_: Any
    ) -> None:
        self._eval_batch(trainer, pl_module, batch)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_end(trainer, "validation", trainer.val_dataloaders)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start(trainer, "test")

    @override
    def on_test_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, *_: Any
    ) -> None:
        self._eval_batch(trainer, pl_module, batch)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_end(trainer, "test", trainer.test_dataloaders)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start(trainer, "predict")

    @override
    def on_predict_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, *_: Any
    ) -> None:
        self._eval_batch(trainer, pl_module, batch)

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_end(trainer, "predict", trainer.predict_dataloaders)

    def _checkpoint_begin(self, phase: str) -> None:
        self._flush_pending()
        self.aggregator.count(phase, self._require_module().global_step)
        self._begin(phase, track=False)

    def _checkpoint_end(self, phase: str, path: Any) -> None:
        occurrence = self._end(phase, self._require_module().global_step)
        if occurrence is None:
            return
        size = occurrence.values["file_bytes"] = _size(path)
        verdict, detail = (
            ("pass", f"{size} bytes") if size else ("fail", f"no file with bytes at {path}")
        )
        self._add(occurrence, [checks.CheckResult("checkpoint_file", verdict, detail)])
        if self._measuring:
            self._begin("data", track=False)  # the next fetch starts after the save

    @contextlib.contextmanager
    def _measure_export(self) -> Iterator[None]:
        """The ``export`` phase, for :attr:`PilotRun.measure_export` (the run calls the user's
        function inside it, whichever callback asks first)."""
        self._begin("export")
        try:
            yield
        finally:
            self._exported = self._end("export", self._require_module().global_step)
            self._stop_tracker()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush_pending()
        self._settle(may_raise=False)
        self._stop_tracker()
        if self.export is not None:
            path, error = self.run.export(self.export, trainer, pl_module)
            if self.run.measure_export == self._measure_export:
                self.run.measure_export = None  # later exports (other functions) are not ours
            occurrence, self._exported = self._exported, None
            if occurrence is not None:
                occurrence.values["file_bytes"] = None if path is None else _size(path)
                self.aggregator.count("export", occurrence.step)
                failed = [checks.CheckResult("export_written", "fail", error)] if error else []
                self._add(occurrence, failed)
        self._record_placement("fit_end")
        self._publish()

    def _publish(self, flush: bool = False) -> None:
        if self._run is None:
            return
        self._quiet.fold_into(self.aggregator)
        deferred = self._deferred_results() if self._settled else {}
        for row in self.aggregator.rows():
            row = self._with_deferred(row, deferred)
            row.update(
                device=self._device,
                precision=self._precision,
                counter=(self._counter.name if self._counter else "none"),
            )
            if self._counter is not None and self._counter.note and not row.get("notes"):
                row["notes"] = self._counter.note
            self._run.put_phase_row(row, source="PhaseMemoryMonitor")
        if flush:
            self._run.flush()


def _compiled_counter(compiled: list[str]) -> NoCounter:
    """No memory counter for a CPU fit with compiled code: the tensor tracker, a dispatch mode,
    would keep dynamo from compiling the user's training step."""
    return NoCounter(
        "not measured: the CPU tensor tracker would stop torch.compile from compiling; measured"
        f" on CUDA by the allocator (compiled: {checks.shown_names(compiled)})"
    )


def _intended_trainable(pl_module: pl.LightningModule) -> set[int]:
    """``id`` of the parameters the module means to train: ``requires_grad``, or what Lightning
    saved before an open ``toggle_optimizer`` (private: read defensively)."""
    state = getattr(pl_module, "_param_requires_grad_state", None)
    saved: Mapping[Any, Any] = state if isinstance(state, Mapping) else {}
    return {id(p) for p in pl_module.parameters() if p.requires_grad or saved.get(p, False)}


def _shapes(view: BatchView) -> str | None:
    shapes = {
        name: tuple(value.shape)
        for name in ("inputs", "targets", "attention_mask")
        if isinstance(value := getattr(view, name), torch.Tensor)
    }
    return ", ".join(f"{k}={list(v)}" for k, v in shapes.items()) or None


def _batch_checks(view: BatchView) -> list[checks.CheckResult]:
    sizes = {
        name: int(value.shape[0])
        for name in ("inputs", "targets", "attention_mask", "ids")
        if isinstance(value := getattr(view, name), torch.Tensor) and value.ndim >= 1
    }
    if not sizes:
        detail = f"no tensors found in the batch ({', '.join(view.missing)} missing)"
        return [checks.CheckResult("batch_sizes_agree", "not_checked", detail)]
    if len(set(sizes.values())) == 1:
        return [checks.CheckResult("batch_sizes_agree", "pass", "")]
    return [checks.CheckResult("batch_sizes_agree", "fail", f"leading dimensions differ: {sizes}")]


def _size(path: Any) -> int | None:
    try:
        target = Path(os.fspath(path))
    except TypeError:
        return None
    if target.is_file():
        return target.stat().st_size
    if target.is_dir():
        return sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    return None


def _loaders(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, Mapping):
        return list(value.values())
    if isinstance(value, list | tuple):
        return list(value)
    return [value]


def _expected_samples(trainer: pl.Trainer, phase: str, loaders: Any) -> tuple[int | None, str]:
    name = "limit_val_batches" if phase == "validation" else f"limit_{phase}_batches"
    limit = getattr(trainer, name)
    total = 0
    for loader in _loaders(loaders):
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
        if not (isinstance(loader, DataLoader) and isinstance(sampler, Sized)):
            return None, f"the {phase} loader has no sized sampler"
        # Lightning reads an int limit as a number of batches and a float as a fraction:
        # ``1`` is one batch, ``1.0`` is everything.
        partial = (isinstance(limit, float) and limit < 1.0) or (
            isinstance(limit, int) and limit < len(loader)
        )
        if partial:
            return None, f"{name}={limit} evaluates part of the data by design"
        total += len(sampler)  # per rank under a DistributedSampler
    return total, ""
