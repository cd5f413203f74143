"""core/phase_meter.py without a Trainer: the counter chosen per device, a phase's memory and
duration, the setup phase, and what a copy keeps."""

from __future__ import annotations

import pickle
import time

import torch

from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.memory import host_memory
from lightning_pilot.core.phase_meter import UNTRACKED_NOTE, PhaseMeter, input_shapes

FLOAT = 4  # bytes of a float32


def test_cpu_tracker_counts_the_weights_and_the_tensors_of_the_phase() -> None:
    model = torch.nn.Linear(16, 16)
    weights = (16 * 16 + 16) * FLOAT
    inputs = torch.ones(4, 16)
    meter = PhaseMeter(model)
    meter.begin("forward")
    outputs = model(inputs)
    occurrence = meter.end("forward", step=2)
    meter.stop_tracker()
    assert occurrence is not None
    assert meter.tracker is not None
    assert not meter.tracker.active
    values = occurrence.values
    assert (meter.device, meter.counter and meter.counter.name) == ("cpu", "cpu_tensor_tracker")
    assert values["baseline_allocated_bytes"] == values["param_bytes"] == weights
    # The weights it adopted, the input it saw and the output it made: 4 x 16 floats each.
    assert values["peak_allocated_bytes"] == weights + 2 * inputs.numel() * FLOAT
    assert values["peak_allocated_bytes"] == weights + inputs.nbytes + outputs.nbytes
    assert values["peak_reserved_bytes"] is None  # no caching allocator on a CPU
    assert values["device_capacity_bytes"] == host_memory().total_bytes
    assert (occurrence.phase, occurrence.step, occurrence.synchronized) == ("forward", 2, True)
    assert occurrence.clean_timing is False  # the tracker slowed it down


def test_untracked_phase_is_timed_cleanly_without_memory() -> None:
    model = torch.nn.Linear(4, 4)
    meter = PhaseMeter(model)
    meter.begin("data", track=False)
    time.sleep(0.02)
    view = BatchAdapter().view({"input_ids": torch.ones(3, 7, dtype=torch.long)})
    occurrence = meter.end("data", step=0, view=view)
    assert occurrence is not None
    assert occurrence.duration_s is not None
    assert occurrence.duration_s >= 0.02
    assert occurrence.clean_timing is True
    assert occurrence.values["peak_allocated_bytes"] is None
    assert occurrence.values["notes"] == UNTRACKED_NOTE
    assert (occurrence.values["batch_size"], occurrence.values["seq_len"]) == (3, 7)
    assert occurrence.values["input_shapes"] == "inputs=[3, 7]"
    assert meter.tracker is not None
    assert not meter.tracker.active


def test_only_the_open_phase_ends_and_a_new_one_drops_it() -> None:
    meter = PhaseMeter(torch.nn.Linear(2, 2), track_cpu=False)
    assert meter.end("forward", 0) is None  # nothing open
    meter.begin("forward")
    assert meter.end("backward", 0) is None
    assert meter.open_phase == "forward"
    meter.begin("checkpoint_save", track=False)  # a save inside the step
    assert meter.end("forward", 0) is None
    assert meter.open_phase == "checkpoint_save"
    assert meter.end("checkpoint_save", 0) is not None
    assert meter.open_phase is None


def test_counters_per_device() -> None:
    model = torch.nn.Linear(2, 2)
    off = PhaseMeter(model, track_cpu=False)
    counter = off.ensure_counter()
    assert (counter.name, counter.note) == ("none", "memory not measured: track_cpu=False")
    assert (off.device, off.synchronized) == ("cpu", True)  # CPU work is synchronous
    meta = PhaseMeter(model, torch.device("meta"))
    counter = meta.ensure_counter()
    assert (counter.name, counter.note) == ("none", "memory not measured: no counter for meta")
    assert (meta.device, meta.synchronized) == ("meta", False)
    assert meta.ensure_counter() is counter  # chosen once


def test_compiled_code_keeps_the_tracker_off() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0] = torch.compile(model[0], backend="eager")
    meter = PhaseMeter(model)
    counter = meter.ensure_counter()
    assert meter.tracker is None
    assert counter.note is not None
    assert counter.note.endswith("(compiled: 0)")
    meter.begin("forward")
    occurrence = meter.end("forward", 0)
    assert occurrence is not None
    assert occurrence.values["peak_allocated_bytes"] is None


def test_code_compiled_after_the_counter_stops_the_tracker_at_the_next_phase() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    meter = PhaseMeter(model)
    assert meter.ensure_counter().name == "cpu_tensor_tracker"
    model[0] = torch.compile(model[0], backend="eager")
    meter.begin("forward")
    assert meter.tracker is None
    assert meter.counter is not None
    assert meter.counter.name == "none"


def test_setup_is_measured_once_with_the_placed_weights() -> None:
    model = torch.nn.Linear(8, 8)
    meter = PhaseMeter(model)
    assert meter.end_setup(0) is None  # not started
    meter.start_setup()
    setup = meter.end_setup(5)
    assert setup is not None
    assert (setup.phase, setup.step) == ("setup", 5)
    assert setup.values["end_allocated_bytes"] == (8 * 8 + 8) * FLOAT
    assert setup.values["device_capacity_bytes"] == host_memory().total_bytes
    assert meter.end_setup(5) is None  # once


def test_the_optimizer_state_counts_once_it_exists() -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    meter = PhaseMeter(model, track_cpu=False)
    assert meter.state_values()["optimizer_state_bytes"] == 0  # the meter was given none
    meter.optimizers = [optimizer]
    weights = (4 * 4 + 4) * FLOAT
    values = meter.state_values()
    # Two moments per parameter, and one step counter per parameter tensor (float32 scalar).
    assert values["optimizer_state_bytes"] == 2 * weights + 2 * FLOAT
    assert values["grad_bytes"] == weights


def test_a_copy_rebuilds_its_counter_and_keeps_what_it_measured() -> None:
    meter = PhaseMeter(torch.nn.Linear(2, 2))
    meter.ensure_counter()
    copy = pickle.loads(pickle.dumps(meter))
    assert (copy.counter, copy.tracker, copy.device) == (None, None, "cpu")
    assert meter.counter is not None  # the original keeps its own


def test_input_shapes_names_what_the_batch_holds() -> None:
    view = BatchAdapter().view((torch.ones(2, 3), torch.zeros(2, dtype=torch.long)))
    assert input_shapes(view) == "inputs=[2, 3], targets=[2]"
    assert input_shapes(BatchAdapter().view([1, 2, 3])) is None
