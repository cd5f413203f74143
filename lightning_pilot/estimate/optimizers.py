"""The optimizer ``configure_optimizers`` returns, PyTorch's CUDA default for its
implementation, and how its ``step()`` runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def optimizer_of(configured: Any) -> torch.optim.Optimizer:
    """The optimizer in what ``configure_optimizers`` returned (every form Lightning takes);
    ``ValueError`` when there is none or more than one (manual optimization)."""
    found: list[torch.optim.Optimizer] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.optim.Optimizer):
            found.append(value)
        elif isinstance(value, Mapping):
            walk(value.get("optimizer"))
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)

    walk(configured)
    if len(found) != 1:
        raise ValueError(
            f"configure_optimizers() returned {len(found)} optimizers: the estimate models"
            " automatic optimization with exactly one optimizer"
        )
    return found[0]


def cuda_optimizer_defaults(optimizer: torch.optim.Optimizer) -> None:
    """PyTorch's CUDA default applied to ``optimizer`` where the user left it unset: the
    ``foreach`` implementation (``torch.optim``'s ``_default_to_fused_or_foreach`` picks it for
    CUDA tensors; on CPU it picks the for-loop)."""
    for group in optimizer.param_groups:
        if group.get("foreach") is None and not group.get("fused"):
            group["foreach"] = True


def optimizer_implementation(optimizer: torch.optim.Optimizer) -> str:
    """``"fused"``, ``"foreach"`` or ``"for-loop"``: how ``optimizer.step()`` runs as its
    groups are set now (an unset ``foreach`` is the for-loop on CPU tensors; see
    :func:`cuda_optimizer_defaults` for CUDA's default); ``"single"`` for an optimizer with
    neither option; groups that differ are joined with ``"+"``."""
    found: list[str] = []
    for group in optimizer.param_groups:
        if group.get("fused"):
            kind = "fused"
        elif group.get("foreach"):
            kind = "foreach"
        elif "foreach" in group or "foreach" in optimizer.defaults:
            kind = "for-loop"
        else:
            kind = "single"
        if kind not in found:
            found.append(kind)
    return "+".join(found) or "single"
