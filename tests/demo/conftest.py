"""Fixtures of the demo-task tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run each test with one intra-op thread, then restore the setting.

    These models are tiny: on a 2-core machine shared with other processes, two threads spent
    10-20x longer per step synchronising than computing (measured 330-590 ms vs 16-27 ms).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
