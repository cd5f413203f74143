"""The storage counter shared by the CPU tensor tracker and the estimate's recorder."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_pilot.core.memory import TensorTracker
from lightning_pilot.core.storage_count import StorageCounter
from lightning_pilot.estimate.recorder import Recorder


def test_a_storage_counts_once_until_freed_with_serials_in_order() -> None:
    counter = StorageCounter()
    x = torch.ones(100)  # 400 bytes
    assert counter.count(x) == 1
    assert counter.count(x[10:20]) == 1  # a view: the same storage
    assert counter.count(x.view(10, 10)) == 1
    y = torch.zeros(5, dtype=torch.float64)  # 40 bytes
    assert counter.count(y) == 2
    assert counter.current_bytes == 440
    assert counter.live_serials() == {1, 2}
    del x
    gc.collect()
    assert counter.current_bytes == 40  # the views went with x: its storage is freed
    assert counter.live_serials() == {2}
    assert counter.peak_bytes == 440
    z = torch.ones(1)
    assert counter.count(z) == 3  # a new storage gets a new serial, never a reused one
    assert counter.count(y) == 2


@pytest.mark.parametrize(
    ("nbytes", "round_to", "counted"),
    [
        (0, 512, 0),
        (1, 512, 512),
        (512, 512, 512),
        (513, 512, 1024),
        (4000, 512, 4096),
        (4000, 1, 4000),
        (3, 2, 4),
    ],
)
def test_round_to_counts_whole_blocks(nbytes: int, round_to: int, counted: int) -> None:
    counter = StorageCounter(round_to=round_to)
    tensor = torch.empty(nbytes, dtype=torch.uint8)
    counter.count(tensor)
    assert counter.current_bytes == counted
    assert counter.live[id(tensor.untyped_storage())] == (1, counted)


def test_peak_storages_are_those_live_at_the_peak_not_at_the_end() -> None:
    counter = StorageCounter(snapshots=True)
    a = torch.ones(10)
    b = torch.ones(20)
    counter.count(a)
    counter.count(b)  # the peak: 120 bytes, serials 1 and 2
    del b
    c = torch.ones(5)
    counter.count(c)  # 60 bytes live: below the peak
    assert counter.peak_bytes == 120
    assert sorted(counter.peak_storages().values()) == [(1, 40), (2, 80)]
    counter.reset_peak()  # the peak restarts at the current level, with what is live now
    assert counter.peak_bytes == counter.current_bytes == 60
    assert sorted(counter.peak_storages().values()) == [(1, 40), (3, 20)]
    del a, c


def test_peak_storages_need_snapshots() -> None:
    counter = StorageCounter()
    counter.count(torch.ones(3))
    with pytest.raises(ValueError, match=r"StorageCounter.peak_storages\(\).*snapshots=True"):
        counter.peak_storages()


def test_each_new_peak_calls_the_hook() -> None:
    peaks: list[int] = []

    class Marking(StorageCounter):
        def _peaked(self) -> None:
            peaks.append(self.peak_bytes)

    counter = Marking()
    a = torch.ones(1)
    counter.count(a)
    b = torch.ones(2)
    counter.count(b)
    del b
    c = torch.ones(1)
    counter.count(c)  # 8 bytes live again: not above the 12-byte peak
    counter.count(a)  # counted before: no change
    assert peaks == [4, 12]
    del a, c


def test_arguments_are_checked_with_their_names() -> None:
    with pytest.raises(ValueError, match=r"StorageCounter\(round_to=0\) is invalid"):
        StorageCounter(round_to=0)
    with pytest.raises(TypeError, match=r"round_to=True"):
        StorageCounter(round_to=True)
    with pytest.raises(TypeError, match=r"StorageCounter\(snapshots='yes'\) is invalid"):
        StorageCounter(snapshots="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Recorder\(round_to=-512\) is invalid"):
        Recorder(-512)


def test_a_tensor_without_a_plain_storage_is_not_counted() -> None:
    counter = StorageCounter()
    sparse = torch.eye(3).to_sparse()
    assert counter.count(sparse) is None
    assert counter.current_bytes == 0


def test_storages_keep_no_counter_alive_and_outlive_it_quietly() -> None:
    counter = StorageCounter(snapshots=True)
    kept = torch.ones(10)
    counter.count(kept)
    gone = weakref.ref(counter)
    gc.disable()  # as the estimate traces: freed by reference counts alone
    try:
        del counter
        assert gone() is None  # the storage's weak-reference callback holds no counter
    finally:
        gc.enable()
    del kept  # its callback finds no counter: nothing to take off, no error
    gc.collect()


def test_tracker_and_recorder_count_the_same_bytes_on_real_tensors() -> None:
    """Both are this counter: the same operators give the same live and peak bytes."""
    layer = torch.nn.Linear(16, 8)
    tracker = TensorTracker()
    recorder = Recorder()
    assert isinstance(tracker, StorageCounter)
    assert isinstance(recorder, StorageCounter)
    tracker.adopt(layer.parameters())
    for param in layer.parameters():
        recorder.record(param)
    peaks = []
    for mode in (tracker, recorder):
        with mode:
            out = layer(torch.ones(4, 16)).relu().sum()
            out.backward()
        peaks.append((mode.peak_bytes, mode.current_bytes))
        del out
        layer.zero_grad(set_to_none=True)
    assert peaks[0] == peaks[1]
    assert peaks[0][0] > 4 * (16 * 8 + 8)  # the weights, their gradients and activations


def test_recorder_counts_fake_storages_with_fake_only() -> None:
    recorder = Recorder(512, fake_only=True)
    real = torch.ones(1000)
    assert recorder.record(real) is None  # a real tensor: not counted with fake_only
    with FakeTensorMode():
        fake = torch.ones(1000)  # 4,000 bytes on no device
        assert recorder.record(fake) == 1
    assert recorder.current_bytes == 4096
    del fake
    gc.collect()
    assert recorder.current_bytes == 0
