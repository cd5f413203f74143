"""Which updates of a fit are measured (docs/phase-table.md), and the others counted in bulk."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_pilot.core.phases import PhaseAggregator


class MeasureSchedule:
    """The measured updates of one fit: the first ``pilot_updates`` from the step the fit starts
    or resumes at, then one in ``sample_every`` (0: none); the first ``memory_updates`` run the
    CPU tensor tracker (later ones give clean durations). Several optimizers may move
    ``global_step`` by more than one per batch: an update is measured when it starts at or past
    :attr:`due`."""

    def __init__(self, pilot_updates: int, sample_every: int, memory_updates: int) -> None:
        self.pilot_updates = pilot_updates
        self.sample_every = sample_every
        self.memory_updates = memory_updates
        self.start_step = 0
        #: The first step whose update is measured.
        self.due: float = 0
        #: Below this step a batch end only counts (-1: look at every batch end).
        self.quiet_until: float = -1
        self.window_done = False
        self.measuring = False
        self.tracking = False

    def start(self, step: int) -> None:
        """The fit's first update starts at ``step`` (restored by then when resuming)."""
        self.start_step = self.due = step

    def next_measured(self, step: int) -> float:
        """The first step at or after ``step`` whose update is measured (``inf``: none)."""
        done = step - self.start_step
        if done < self.pilot_updates:
            return step
        if self.sample_every == 0:
            return math.inf
        return step + (-(done - self.pilot_updates + 1)) % self.sample_every

    def restart(self, step: int, *, fitting: bool) -> bool:
        """An update starts at ``step``: whether it is measured (only while ``fitting``), and
        :attr:`tracking` whether the CPU tensor tracker runs in it."""
        self.tracking = step - self.start_step < self.memory_updates
        self.measuring = fitting and step >= self.due
        self.quiet_until = self.due if self.window_done and not self.measuring else -1
        return self.measuring

    def update_ended(self, step: int) -> bool:
        """An update ended with ``global_step`` at ``step``; ``True`` when it closes the pilot
        window."""
        if self.measuring:
            self.due = self.next_measured(step)
        if self.window_done or step - self.start_step < self.pilot_updates:
            return False
        self.window_done = True
        return True

    def measures_eval(self, phase: str, first: bool) -> bool:
        """Whether an evaluation loop is measured: the first of each phase, every test and
        predict loop, and a validation loop that comes before a measured update."""
        return first or phase != "validation" or self.measuring


@dataclass
class QuietCounts:
    """The phases of the training steps between measured updates, counted in bulk and folded
    into the phase rows with :meth:`fold_into`."""

    micro_batches: int = 0
    backward: int = 0
    optimizer_steps: int = 0
    step_first: int | None = None
    step_last: int | None = None
    #: ``global_step`` when the current batch started.
    step_now: int = 0
    #: The module's ``automatic_optimization`` (if not, backward passes are counted as they run).
    automatic: bool = True

    def micro_batch(self, step: int) -> None:
        """One micro-batch (a data fetch and a forward) at ``step``."""
        self.micro_batches += 1
        if self.step_first is None:
            self.step_first = step
        self.step_last = step

    def batch_end(self, outputs: Any, step: int) -> None:
        """Count an unmeasured micro-batch at its end, ``global_step`` now at ``step``;
        ``outputs`` (as the batch end gets them): ``None`` for a skipped batch, empty without a
        backward."""
        automatic = self.automatic
        if outputs is not None or not automatic:
            self.micro_batch(self.step_now)
            if automatic and outputs:
                self.backward += 1
        self.optimizer_steps += step - self.step_now
        self.step_now = step

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
