"""Batches for a trace: a real batch reshaped to the traced micro-batch and sequence length,
and its fake copy (integer and boolean tensors keep their real values).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_pilot.estimate.shadows import _SHADOW, _SHADOW_LIMIT


def _sequence_length(batch: Any) -> int | None:
    for value in tree_flatten(batch)[0]:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and not value.is_floating_point():
            return int(value.shape[1])
    return None


def _resize(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    have = tensor.shape[dim]
    if have == 0:
        raise ValueError(f"a batch tensor of shape {tuple(tensor.shape)} is empty along {dim}")
    if size > have:
        repeats = [1] * tensor.dim()
        repeats[dim] = -(-size // have)
        tensor = tensor.repeat(*repeats)
    if size == tensor.shape[dim]:
        return tensor.contiguous()
    # A copy of the rows (or positions) kept: a view would keep the whole storage it was cut
    # from, and the trace would count all of it as the batch.
    return tensor.narrow(dim, 0, size).clone(memory_format=torch.contiguous_format)


def reshape_batch(batch: Any, micro_batch: int, seq_len: int | None = None) -> Any:
    """``batch`` (tensors in dicts, lists, tuples) with ``micro_batch`` rows and, when
    ``seq_len`` is given, ``seq_len`` positions: rows and positions are repeated or cut. The
    sequence dimension is dimension 1 of every tensor whose dimension 1 has the length of the
    first integer tensor of 2 or more dimensions (the token ids).

    Example:
        >>> import torch
        >>> batch = {"input_ids": torch.arange(6).reshape(2, 3), "ids": torch.tensor([7, 8])}
        >>> out = reshape_batch(batch, 3, 5)
        >>> out["input_ids"].tolist(), out["ids"].tolist()
        ([[0, 1, 2, 0, 1], [3, 4, 5, 3, 4], [0, 1, 2, 0, 1]], [7, 8, 7])
    """
    length = _sequence_length(batch)
    if seq_len is not None and length is None:
        raise ValueError(
            f"reshape_batch(seq_len={seq_len!r}) is invalid: expected None for a batch without"
            " an integer tensor of 2 or more dimensions (token ids)."
        )

    def fit(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        value = _resize(value.detach(), 0, micro_batch)
        if seq_len is not None and value.dim() >= 2 and value.shape[1] == length:
            value = _resize(value, 1, seq_len)
        return value

    return tree_map(fit, batch)


def _fake_batch(batch: Any, mode: FakeTensorMode, precision: str) -> Any:
    """Fake copies of a real batch; integer and boolean tensors keep their real values."""

    def convert(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.is_floating_point() and precision == "bf16-true":
            value = value.to(torch.bfloat16)
        fake = mode.from_tensor(value)
        if not value.is_floating_point() and value.numel() <= _SHADOW_LIMIT:
            setattr(fake, _SHADOW, value)
        return fake

    return tree_map(convert, batch)
