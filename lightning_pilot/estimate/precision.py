"""The precisions of Lightning's ``Trainer(precision=...)`` the estimate models: the dtypes of
the parameters and of the matrix products, and what the precision plugin wraps around a step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Final

import torch

#: The precisions of Lightning's ``Trainer(precision=...)`` the estimate models.
PRECISIONS: Final = ("32-true", "16-mixed", "bf16-mixed", "bf16-true")


def param_dtype(precision: str) -> torch.dtype:
    """The dtype of the parameters under ``precision`` (``bf16-true``: bfloat16)."""
    return torch.bfloat16 if precision == "bf16-true" else torch.float32


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype matrix products run in under ``precision``."""
    return {"32-true": torch.float32, "16-mixed": torch.float16}.get(precision, torch.bfloat16)


@contextlib.contextmanager
def precision_context(precision: str) -> Iterator[None]:
    """What Lightning's precision plugin wraps around a step, on CPU: autocast for the mixed
    precisions (``torch.autocast("cpu", ...)``; inside :func:`cuda_autocast`, with CUDA
    autocast's lists), the default dtype for ``bf16-true``."""
    if precision in ("16-mixed", "bf16-mixed"):
        with torch.autocast("cpu", dtype=compute_dtype(precision)):
            yield
    elif precision == "bf16-true":
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)
    else:
        yield
