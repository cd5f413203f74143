"""The clock and memory counter of the phase being measured, one phase at a time; the columns:
docs/phase-table.md."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, NamedTuple

import torch

from lightning_pilot.core import checks
from lightning_pilot.core.batches import BatchView
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
from lightning_pilot.core.phases import Occurrence

#: The note of a phase timed without its memory counted.
UNTRACKED_NOTE = (
    "allocated bytes not measured here: the CPU tensor tracker runs in the first updates and"
    " evaluations only, not during data fetching or checkpoint (de)serialisation; see"
    " host_rss_bytes"
)


class _Open(NamedTuple):
    phase: str
    started: float
    tracked: bool


def compiled_counter(compiled: list[str]) -> NoCounter:
    """The counter of a CPU fit with compiled code: none (its note says why)."""
    return NoCounter(
        "not measured: the CPU tensor tracker would stop torch.compile from compiling; measured"
        f" on CUDA by the allocator (compiled: {checks.shown_names(compiled)})"
    )


def input_shapes(view: BatchView) -> str | None:
    """The shapes of a batch's inputs, targets and attention mask (``None``: no tensor)."""
    shapes = {
        name: tuple(value.shape)
        for name in ("inputs", "targets", "attention_mask")
        if isinstance(value := getattr(view, name), torch.Tensor)
    }
    return ", ".join(f"{k}={list(v)}" for k, v in shapes.items()) or None


class PhaseMeter:
    """Measures the phases of ``module`` (``None``: set :attr:`module` before measuring) and
    its optimizers on ``root_device``, one at a time, each into an
    :class:`~lightning_pilot.core.phases.Occurrence`.

    The memory counter is chosen on first use (:meth:`ensure_counter`); :attr:`device` then names
    the device and :attr:`synchronized` says whether durations waited for it. On CPU the tensor
    tracker counts memory (unless ``track_cpu=False``, or the module holds compiled code), from
    :meth:`begin` of a tracked phase until :meth:`stop_tracker`, called within the same span."""

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        root_device: torch.device | None = None,
        *,
        track_cpu: bool = True,
    ) -> None:
        self.module = module
        self.optimizers: list[torch.optim.Optimizer] = []
        self.root_device = root_device or torch.device("cpu")
        self.track_cpu = track_cpu
        self.device = "unknown"
        self.counter: MemoryCounter | None = None
        self.tracker: TensorTracker | None = None
        self.synchronized = True
        self._open: _Open | None = None
        self._setup_started: float | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The memory counter (the CPU tracker holds weak references) is rebuilt on next use.
        return self.__dict__ | {"counter": None, "tracker": None}

    def require_module(self) -> torch.nn.Module:
        """The module measured; a ``RuntimeError`` when none was given yet."""
        if self.module is None:
            raise RuntimeError("PhaseMeter has no module yet: set PhaseMeter.module first.")
        return self.module

    @property
    def open_phase(self) -> str | None:
        """The phase being measured, if any."""
        return None if self._open is None else self._open.phase

    def ensure_counter(self) -> MemoryCounter:
        """The memory counter of :attr:`root_device`, chosen on first use."""
        if self.counter is not None:
            return self.counter
        device = self.root_device
        self.device = str(device)
        counter: MemoryCounter
        if device.type == "cuda":
            counter = CudaCounter(device)
            self.device = f"{device} {torch.cuda.get_device_name(device)}"
        elif device.type == "cpu" and self.track_cpu and (compiled := self._compiled()):
            counter = compiled_counter(compiled)
        elif device.type == "cpu" and self.track_cpu:
            self.tracker = TensorTracker()
            counter = TrackerCounter(self.tracker)
            self.device = "cpu"
        elif device.type != "cpu" and AcceleratorCounter.available(device):
            counter = AcceleratorCounter(device)
        else:
            reason = "track_cpu=False" if device.type == "cpu" else f"no counter for {device}"
            counter = NoCounter(f"memory not measured: {reason}")
        self.counter = counter
        # CPU work is synchronous; a device without counters was not synchronised either.
        self.synchronized = device.type == "cpu" or not isinstance(counter, NoCounter)
        return counter

    def _compiled(self) -> list[str]:
        return compiled_code(self.require_module())

    def stop_tracker(self) -> None:
        """Stop the CPU tensor tracker, if it runs."""
        if self.tracker is not None:
            self.tracker.stop()

    def begin(self, phase: str, *, track: bool = True) -> None:
        """Start measuring ``phase`` (a phase still open is dropped: a save inside a step); the
        CPU tracker starts for it unless ``track=False``."""
        counter = self.ensure_counter()
        self._open = None
        tracked = track or not isinstance(counter, TrackerCounter)
        if tracked and self.tracker is not None and not self.tracker.active:
            if compiled := self._compiled():  # compiled since the counter was made
                self.tracker = None
                self.counter = counter = compiled_counter(compiled)
            else:
                self.tracker.start()
                # Tensors that exist already (weights, gradients, optimizer state) count from now.
                self.tracker.adopt(state_tensors(self.require_module(), self.optimizers))
        counter.synchronize()
        if tracked:
            counter.begin()
        self._open = _Open(phase, time.perf_counter(), tracked)

    def end(self, phase: str, step: int | None, view: BatchView | None = None) -> Occurrence | None:
        """The measurements of ``phase`` at ``step`` (``None`` when it is not the phase open),
        with the batch's sizes and shapes when ``view`` is given."""
        opened = self._open
        if opened is None or opened.phase != phase:
            return None
        self._open = None
        counter = self.ensure_counter()
        counter.synchronize()
        duration = time.perf_counter() - opened.started
        tracked = opened.tracked
        values = asdict(counter.end() if tracked else MemoryReading())
        if not tracked:
            values["notes"] = UNTRACKED_NOTE
        values.update(self.state_values())
        if view is not None:
            values.update(
                batch_size=view.batch_size, seq_len=view.seq_len, input_shapes=input_shapes(view)
            )
        clean = not (tracked and isinstance(counter, TrackerCounter))  # the tracker slows it
        return Occurrence(phase, step, duration, self.synchronized, values, clean_timing=clean)

    def state_values(self) -> dict[str, Any]:
        """The training state's bytes and the host's resident and swapped memory, now."""
        state = state_bytes(self.require_module(), self.optimizers)
        host = host_memory()
        return state.totals() | {
            "host_rss_bytes": host.rss_bytes,
            "host_swap_used_bytes": host.swap_used_bytes,
        }

    def start_setup(self) -> None:
        """The setup phase starts now (the Trainer's setup)."""
        self._setup_started = time.perf_counter()

    def end_setup(self, step: int) -> Occurrence | None:
        """The setup phase, once (``None`` when not started or already ended): its duration and
        the memory the placed state holds."""
        if self._setup_started is None:
            return None
        counter = self.ensure_counter()
        counter.synchronize()
        duration = time.perf_counter() - self._setup_started
        self._setup_started = None
        values = self.state_values()
        if isinstance(counter, AcceleratorCounter):
            values["end_allocated_bytes"] = counter.end().end_allocated_bytes
        elif self.tracker is not None:  # the weights baseline
            self.tracker.adopt(state_tensors(self.require_module(), self.optimizers))
            values["end_allocated_bytes"] = self.tracker.current_bytes
            values["device_capacity_bytes"] = host_memory().total_bytes
        return Occurrence("setup", step, duration, self.synchronized, values)
