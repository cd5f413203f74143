"""read_scalars: many 0-d tensors read back as floats, in order, without a Trainer."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_pilot.core import scalars
from lightning_pilot.core.scalars import read_scalars


def test_values_come_back_as_floats_in_order() -> None:
    values = [torch.tensor(1.5), torch.tensor(2), torch.tensor([3], dtype=torch.int64)]
    assert read_scalars(values) == [1.5, 2.0, 3.0]
    assert all(type(v) is float for v in read_scalars(values))


def test_nothing_to_read() -> None:
    assert read_scalars([]) == []


def test_large_integer_counts_are_exact() -> None:
    # Token counts are int64 sums: read through float64, exact below 2**53.
    assert read_scalars([torch.tensor(2**52 + 1, dtype=torch.int64)]) == [float(2**52 + 1)]


def test_tensors_that_need_gradients_are_read_detached() -> None:
    value = torch.tensor(0.25, requires_grad=True) * 2
    assert read_scalars([value]) == [0.5]


def test_one_read_for_one_device(monkeypatch: pytest.MonkeyPatch) -> None:
    stacks: list[Any] = []
    real_stack = torch.stack

    def counting_stack(tensors: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        stacks.append(tensors)
        return real_stack(tensors, *args, **kwargs)

    monkeypatch.setattr(scalars.torch, "stack", counting_stack)
    assert read_scalars([torch.tensor(float(i)) for i in range(5)]) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert len(stacks) == 1


def test_tensors_on_several_devices_are_read_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("Expected all tensors to be on the same device")

    monkeypatch.setattr(scalars.torch, "stack", refuse)
    assert read_scalars([torch.tensor(1.0), torch.tensor(7)]) == [1.0, 7.0]


def test_a_tensor_of_several_values_is_refused() -> None:
    with pytest.raises(ValueError, match="only one element tensors"):
        read_scalars([torch.tensor([1.0, 2.0])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_each_dtype_reads_exactly_as_its_float64_value(dtype: torch.dtype) -> None:
    # Same-dtype values are stacked as they are (one kernel); the floats equal each value
    # converted to float64 one by one.
    values = [torch.tensor(v, dtype=dtype) for v in (0.1, 1 / 3, 1234.5678, -7.0)]
    assert read_scalars(values) == [float(v.double()) for v in values]


def test_mixed_dtypes_are_not_promoted_to_the_narrowest() -> None:
    # A float32 loss beside an int64 token count above 2**24: stacking them as they are would
    # promote the count to float32 and round it.
    count = 2**24 + 1
    values = [torch.tensor(0.5), torch.tensor(count, dtype=torch.int64)]
    assert read_scalars(values) == [0.5, float(count)]
