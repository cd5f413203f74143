"""The previous update's gradients in CUDA's allocator cache (``estimate.cache``): Lightning
frees them with ``zero_grad`` between ``training_step`` and ``backward``, and the caching
allocator reuses a freed block only for a request no larger than it, from its own pool (blocks
of up to 1 MiB apart from larger ones). What the backward pass cannot reuse by its peak stays
in ``peak_reserved_bytes`` of the backward row."""

from __future__ import annotations

import re
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lightning_pilot.estimate import PhaseTrace, estimate
from lightning_pilot.estimate import rows as estimate_rows
from lightning_pilot.estimate.cache import cached_gradient_bytes
from lightning_pilot.vocabulary import CATEGORIES

MIB = 1 << 20
LAYERS = 4


class Stack(pl.LightningModule):
    """Four 1024 x 1024 matrices: each gradient is a 4 MiB block."""

    def __init__(self) -> None:
        super().__init__()
        linears = [torch.nn.Linear(1024, 1024, bias=False) for _ in range(LAYERS)]
        self.layers = torch.nn.Sequential(*linears)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layers(batch).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def backward_row(micro_batch: int, strategy: str = "single") -> dict[str, Any]:
    result = estimate(
        Stack(),
        torch.zeros(2, 1024),
        precisions=["32-true"],
        micro_batches=[micro_batch],
        strategies=[strategy],
        largest=False,
        workers=1,
    )
    (row,) = [row for row in result.rows if row["phase"] == "backward"]
    return row


def cached(row: dict[str, Any]) -> int:
    found = re.search(r"allocator cache: (\d+) bytes", row["notes"])
    if found is None:
        assert "reuses the previous update's freed gradient blocks" in row["notes"], row["notes"]
        return 0
    return int(found.group(1))


def test_requests_split_the_best_fitting_block_per_shard() -> None:
    ops = np.array([64 * MIB, 4 * MIB, 0])  # 64 MiB, then 4 MiB, then nothing
    trace = PhaseTrace(
        "backward",
        1,
        dict.fromkeys(CATEGORIES, 0),
        ops,
        ops,
        ops,
        ops,
        2,
        0,
        0,
        requests=ops,
        request_count=np.array([1, 1, 0]),
        grad_requests=np.zeros(3, np.int64),
    )
    # 4 MiB split from the 8 MiB block; over 8 shards the 1 and 2 MiB blocks stay.
    assert cached_gradient_bytes([8 * MIB, 16 * MIB], trace) // MIB == 20
    assert cached_gradient_bytes([8 * MIB, 16 * MIB], trace, shards=8) // MIB == 3


def test_gradient_blocks_smaller_than_every_request_stay_reserved() -> None:
    # 8,192 rows: every activation and its gradient is 32 MiB; the peak comes before the
    # backward pass allocates a gradient, so none of the four 4 MiB blocks is reused.
    assert cached(backward_row(8192)) == LAYERS * 4 * MIB


def test_the_backward_pass_reuses_blocks_its_requests_fit() -> None:
    # 256 rows: the activations' gradients are 1 MiB (the small pool, which cannot take a
    # 4 MiB block) and the peak comes at the end, after the new gradients (4 MiB each) took
    # the old blocks.
    assert cached(backward_row(256)) == 0


def test_fsdp_shards_are_the_blocks() -> None:
    # Over four GPUs each gradient shard is 1 MiB, a small-pool block: the 32 MiB requests
    # cannot use them; the loss's scalar gradients (512-byte blocks) split one of them.
    row = backward_row(8192, "fsdp:4")
    assert LAYERS * MIB - 8 * 512 <= cached(row) < LAYERS * MIB


def test_the_cache_adds_to_the_reserved_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    with_cache = backward_row(8192)
    monkeypatch.setattr(estimate_rows, "cached_gradient_bytes", lambda *args: 0)
    without = backward_row(8192)
    assert with_cache["peak_allocated_bytes"] == without["peak_allocated_bytes"]
    assert with_cache["fits"] == without["fits"]  # the allocator frees its cache before OOM
    gained = with_cache["peak_reserved_bytes"] - without["peak_reserved_bytes"]
    assert gained == LAYERS * 4 * MIB
