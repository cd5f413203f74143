"""Memory probes without a Trainer: the tensor tracker, the state breakdown, host memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pilot.core.memory import (
    AcceleratorCounter,
    NoCounter,
    TensorTracker,
    TrackerCounter,
    host_memory,
    state_bytes,
    state_tensors,
)


def test_tracker_counts_live_storages_once_and_frees_them() -> None:
    tracker = TensorTracker()
    with tracker:
        x = torch.ones(1000)  # 4,000 bytes
        view = x[10:20]  # a view shares the storage: no new bytes
        y = x * 2 + view.sum()  # y (4,000) and small temporaries
        assert tracker.current_bytes >= 8000
        peak = tracker.peak_bytes
        del y
        assert tracker.current_bytes == 4000  # only x is alive (temporaries were freed)
    assert peak >= 8000
    del x, view
    assert tracker.current_bytes == 0
    tracker.reset_peak()
    assert tracker.peak_bytes == 0


def test_tracker_adopts_existing_tensors_without_double_counting() -> None:
    layer = nn.Linear(10, 10)  # 440 bytes of parameters, created before tracking
    tracker = TensorTracker()
    tracker.adopt(state_tensors(layer))
    assert tracker.current_bytes == 440
    with tracker:
        out = layer(torch.ones(4, 10))  # touches the parameters again: still 440 for them
    assert tracker.current_bytes == 440 + 4 * 10 * 4 + 4 * 10 * 4  # input and output
    del out


def test_tracker_sees_backward_and_optimizer_state() -> None:
    layer = nn.Linear(100, 100)
    optimizer = torch.optim.AdamW(layer.parameters())
    tracker = TensorTracker()
    tracker.adopt(state_tensors(layer, [optimizer]))
    counter = TrackerCounter(tracker)
    with tracker:
        counter.begin()
        layer(torch.ones(8, 100)).sum().backward()
        optimizer.step()
        reading = counter.end()
    params = state_bytes(layer).param_bytes
    assert reading.peak_allocated_bytes is not None
    assert reading.peak_allocated_bytes >= 4 * params  # weights, grads, two moments
    assert reading.peak_reserved_bytes is None  # no caching allocator on CPU
    assert reading.alloc_retries is None


def test_state_bytes_counts_shared_storage_once_and_by_kind() -> None:
    embed = nn.Embedding(50, 8)
    head = nn.Linear(8, 50, bias=False)
    head.weight = embed.weight  # tied weights: one storage
    model = nn.Sequential(embed, head, nn.BatchNorm1d(50))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    state = state_bytes(model, [optimizer])
    trainable = 50 * 8 * 4 + 2 * 50 * 4  # tied embedding once, batch-norm weight and bias
    assert state.param_bytes == trainable
    assert state.grad_bytes == trainable
    n_tensors = len(list(model.parameters()))
    assert state.optimizer_state_bytes == 2 * trainable + 4 * n_tensors
    assert state.buffer_bytes == 2 * 50 * 4 + 8  # running mean, var, num_batches_tracked
    kinds = {row["kind"] for row in state.placement_rows()}
    assert kinds == {"param", "grad", "optimizer_state", "buffer"}


def test_host_memory_reads_real_values_on_linux() -> None:
    host = host_memory()
    assert host.rss_bytes is not None
    assert host.rss_bytes > 10_000_000
    assert host.total_bytes is not None
    assert host.total_bytes > host.rss_bytes


def test_counters_without_a_device_report_nulls() -> None:
    counter = NoCounter("memory not measured: no counter for meta")
    counter.begin()
    reading = counter.end()
    assert counter.name == "none"
    assert all(getattr(reading, f) is None for f in reading.__dataclass_fields__)
    assert AcceleratorCounter.available(torch.device("cpu")) is False


class FakeAllocator:
    """The allocator functions ``torch.cuda`` and ``torch.accelerator`` share, in plain numbers."""

    def __init__(self) -> None:
        self.allocated, self.peak, self.retries = 100, 0, 1

    def synchronize(self, device: torch.device) -> None:
        return None

    def memory_allocated(self, device: torch.device) -> int:
        return self.allocated

    def memory_stats(self, device: torch.device) -> dict[str, int]:
        return {"num_alloc_retries": self.retries}

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        self.peak = self.allocated

    def max_memory_allocated(self, device: torch.device) -> int:
        return self.peak

    def max_memory_reserved(self, device: torch.device) -> int:
        return 4096

    def get_memory_info(self, device: torch.device) -> tuple[int, int]:
        return 0, 1 << 30


def test_allocator_counter_reads_baseline_peak_end_retries_and_capacity() -> None:
    fake = FakeAllocator()
    counter = AcceleratorCounter(torch.device("cpu"), api=fake)
    counter.begin()
    fake.allocated, fake.peak, fake.retries = 300, 900, 3
    reading = counter.end()
    assert counter.name == "accelerator_allocator"
    assert (reading.baseline_allocated_bytes, reading.peak_allocated_bytes) == (100, 900)
    assert (reading.end_allocated_bytes, reading.peak_reserved_bytes) == (300, 4096)
    assert (reading.alloc_retries, reading.device_capacity_bytes) == (2, 1 << 30)


def test_state_bytes_totals_name_the_phase_table_columns() -> None:
    totals = state_bytes(nn.Linear(10, 10)).totals()
    assert totals == {
        "param_bytes": 440,
        "grad_bytes": 0,
        "optimizer_state_bytes": 0,
        "buffer_bytes": 0,
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_counter_reports_allocated_and_reserved_apart() -> None:
    from lightning_pilot.core.memory import CudaCounter

    device = torch.device("cuda", 0)
    counter = CudaCounter(device)
    counter.begin()
    block = torch.empty(10_000_000, device=device)
    del block
    reading = counter.end()
    assert reading.peak_allocated_bytes is not None
    assert reading.peak_allocated_bytes >= 40_000_000
    assert reading.peak_reserved_bytes is not None
    assert reading.peak_reserved_bytes >= reading.peak_allocated_bytes
    assert reading.device_capacity_bytes is not None
