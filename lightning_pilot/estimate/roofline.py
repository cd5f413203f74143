"""Step time on a target from the traced operators: a roofline with a stated efficiency range.

Each operator takes at least ``max(flops / peak_flops(dtype), bytes / bandwidth,
KERNEL_FLOOR_S)``; the band divides the compute-bound and the memory-bound parts by their
efficiency ranges; a collective of ``bytes`` over N GPUs costs ``2 (N - 1) / N * bytes / link``
(a ring). ``docs/estimate.md`` ("Step time") says where the ranges come from.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from lightning_pilot.estimate.targets import Target

#: The fraction of the roofline compute-bound operators reach, low to high.
DEFAULT_EFFICIENCY: Final = (0.40, 0.85)
#: The fraction of the memory bandwidth memory-bound operators reach, low to high.
DEFAULT_MEMORY_EFFICIENCY: Final = (0.40, 0.85)
#: The least time one operator takes on a GPU (a kernel launch and its gap), seconds.
KERNEL_FLOOR_S: Final = 2e-6


def split_seconds(
    flops: np.ndarray,
    moved: np.ndarray,
    kinds: np.ndarray,
    target: Target,
    *,
    allow_tf32: bool = False,
) -> tuple[float, float]:
    """``(compute-bound, memory-bound)`` ideal seconds: each operator's
    ``max(flops / peak, bytes / bandwidth, floor)`` summed into the first when its arithmetic
    takes longer than its memory traffic, else into the second (views cost nothing).
    ``kinds``: 0 memory-bound, 1 fp32, 2 bf16, 3 fp16."""
    peaks = np.array([np.inf, target.tf32 if allow_tf32 else target.fp32, target.bf16, target.fp16])
    compute = flops / peaks[kinds.astype(np.int64)]
    memory = moved / target.bandwidth
    work = (flops > 0) | (moved > 0)
    per_op = np.maximum(np.maximum(compute, memory), KERNEL_FLOOR_S) * work
    bound = compute >= memory
    return float(per_op[bound].sum()), float(per_op[~bound].sum())


def collective_seconds(nbytes: float, devices: int, target: Target) -> float:
    """A ring all-reduce (or all-gather plus reduce-scatter) of ``nbytes`` over ``devices``."""
    return 2 * (devices - 1) / devices * nbytes / target.link
