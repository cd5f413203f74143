"""What several pilot callbacks and the resume check read from a fit, or do to it, alike."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def step_loss(outputs: Any) -> Any:
    """The loss in what a training step returned: its ``"loss"`` entry, or the value itself."""
    # type() first: Lightning hands a plain dict, and an ABC isinstance check is slower.
    is_map = type(outputs) is dict or isinstance(outputs, Mapping)
    return outputs.get("loss") if is_map else outputs


@contextlib.contextmanager
def evaluating(module: torch.nn.Module) -> Iterator[None]:
    """``module`` in eval mode, its training mode put back after."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)
