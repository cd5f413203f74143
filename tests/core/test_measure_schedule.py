"""core/measure_schedule.py without a Trainer: which updates are measured, and the counts of
the others."""

from __future__ import annotations

import math
from typing import Any

import pytest

from lightning_pilot.core.measure_schedule import MeasureSchedule, QuietCounts
from lightning_pilot.core.phases import PhaseAggregator


def _fit(schedule: MeasureSchedule, batches: int, steps_per_batch: int = 1) -> dict[str, Any]:
    """Drive the schedule as the monitor does over ``batches`` batches from step 0: an update
    starts at ``step``, ends with ``global_step`` at ``step + steps_per_batch``."""
    schedule.start(0)
    measured, tracked, closed = [], [], []
    for batch in range(batches):
        step = batch * steps_per_batch
        if schedule.restart(step, fitting=True):
            measured.append(step)
            if schedule.tracking:
                tracked.append(step)
        if schedule.update_ended(step + steps_per_batch):
            closed.append(step + steps_per_batch)
    return {"measured": measured, "tracked": tracked, "closed": closed}


def test_pilot_window_then_one_in_sample_every() -> None:
    schedule = MeasureSchedule(pilot_updates=3, sample_every=4, memory_updates=2)
    seen = _fit(schedule, batches=16)
    # The window (0, 1, 2), then every 4th update counted from the window's end: 6, 10, 14.
    assert seen == {"measured": [0, 1, 2, 6, 10, 14], "tracked": [0, 1], "closed": [3]}
    # Past the window an unmeasured update leaves the batch end nothing to start before 18.
    assert schedule.restart(15, fitting=True) is False
    assert schedule.quiet_until == 18


def test_sample_every_zero_stops_after_the_window() -> None:
    schedule = MeasureSchedule(pilot_updates=2, sample_every=0, memory_updates=1)
    assert _fit(schedule, batches=8)["measured"] == [0, 1]
    assert schedule.due == math.inf


def test_a_resumed_fit_counts_its_window_from_the_step_it_resumes_at() -> None:
    schedule = MeasureSchedule(pilot_updates=2, sample_every=3, memory_updates=1)
    schedule.start(40)
    assert [schedule.next_measured(s) for s in (40, 41, 42, 43, 44, 45)] == [40, 41, 44, 44, 44, 47]


def test_several_steps_per_batch_never_jump_over_a_measured_update() -> None:
    # Manual optimisation with two optimizers: global_step moves by two per batch, so the due
    # steps 5, 9, 13 and 17 are reached by the batches that start at 6, 10, 14 and 18.
    schedule = MeasureSchedule(pilot_updates=2, sample_every=4, memory_updates=2)
    seen = _fit(schedule, batches=10, steps_per_batch=2)
    assert seen["measured"] == [0, 6, 10, 14, 18]
    assert seen["closed"] == [2]


def test_nothing_is_measured_outside_fitting_and_evaluations_follow_the_updates() -> None:
    schedule = MeasureSchedule(pilot_updates=2, sample_every=5, memory_updates=1)
    schedule.start(0)
    assert schedule.restart(0, fitting=False) is False
    assert schedule.measures_eval("validation", first=True)  # the first of each phase
    assert not schedule.measures_eval("validation", first=False)
    assert schedule.measures_eval("test", first=False)
    assert schedule.measures_eval("predict", first=False)
    schedule.restart(0, fitting=True)
    assert schedule.measures_eval("validation", first=False)  # before a measured update


@pytest.mark.parametrize(
    ("outputs", "automatic", "micro_batches", "backward"),
    [
        ({"loss": 1.0}, True, 1, 1),
        ({}, True, 1, 0),  # a training step without a loss: no backward
        (None, True, 0, 0),  # a skipped batch: no forward
        (None, False, 1, 0),  # manual: backward passes are counted as they happen
        ({"loss": 1.0}, False, 1, 0),
    ],
)
def test_quiet_batch_end_counts(
    outputs: Any, automatic: bool, micro_batches: int, backward: int
) -> None:
    quiet = QuietCounts(step_now=7, automatic=automatic)
    quiet.batch_end(outputs, 9)  # two optimizer steps in this batch
    assert (quiet.micro_batches, quiet.backward, quiet.optimizer_steps) == (
        micro_batches,
        backward,
        2,
    )
    assert quiet.step_now == 9


def test_quiet_counts_fold_into_the_rows_and_start_again() -> None:
    aggregator, quiet = PhaseAggregator(), QuietCounts(step_now=3)
    for phase in ("data", "forward", "backward", "optimizer_step"):
        aggregator.count(phase, 0)  # the measured first update, on its own row
    for step in range(4, 9):  # five unmeasured updates, starting at 3 to 7
        quiet.batch_end({"loss": 0.1}, step)
    quiet.fold_into(aggregator)
    later = {r["phase"]: r for r in aggregator.rows() if not r["first"]}
    assert {p: r["occurrences"] for p, r in later.items()} == {
        "data": 5,
        "forward": 5,
        "backward": 5,
        "optimizer_step": 5,
    }
    assert (later["forward"]["step_first"], later["forward"]["step_last"]) == (3, 7)
    assert (quiet.micro_batches, quiet.step_first, quiet.step_last) == (0, None, None)
    quiet.fold_into(aggregator)  # nothing counted since: nothing added
    assert sum(r["occurrences"] for r in aggregator.rows()) == 24
