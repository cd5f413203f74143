"""Step time on a target from the traced operators: a roofline with a stated efficiency range.

Each traced operator did ``flops`` arithmetic (``torch.utils.flop_counter``'s formulas, the
ones ``FlopCounterMode`` uses: matrix products, convolutions, attention) and moved ``bytes``
(its tensor inputs and outputs; views move nothing). On a target it takes at least::

    max(flops / peak_flops(dtype), bytes / memory_bandwidth, KERNEL_FLOOR_S)

and the ideal update time is the sum over the update's operators (forward, backward, the
optimizer step; under FSDP each GPU steps only its shard, so the optimizer step's share is
divided by the number of GPUs). Operators whose arithmetic takes longer than their memory
traffic are compute-bound, the others memory-bound; real kernels reach a fraction of the
roofline, and the band divides each part by its own efficiency range:
:data:`DEFAULT_EFFICIENCY` (compute-bound) and :data:`DEFAULT_MEMORY_EFFICIENCY`
(memory-bound), both 0.40 to 0.85.

Where the range comes from (``docs/estimate-validation.md``): three published step times of
FSDP training on A100 80GB (torchtitan's Llama 2 13B without checkpointing, Llama 2 70B and
Llama 3 70B with full checkpointing) ran at 0.67 to 0.69 of this roofline's ideal; the high
end, 0.85, leaves room above them for better-tuned runs (``torch.compile``, fused kernels); the
low end, 0.40, keeps eager training without fused kernels inside. The published runs cannot
separate the two efficiencies (the memory-bound operators are 10 to 16 % of each calibration
run's ideal), so both ranges are the same until measurements that separate them exist; pass
your own (``estimate(efficiency=..., memory_efficiency=...)``). Small layers are slower than
any roofline (launch-bound): :data:`KERNEL_FLOOR_S` is a floor per operator for that, and the
band says nothing finer.

Collectives (DDP's gradient all-reduce, FSDP's all-gathers and reduce-scatters) cost
``2 (N - 1) / N * bytes / link`` (a ring); the band's low end assumes they overlap compute
completely, the high end not at all.

Example:
    >>> import numpy as np
    >>> from lightning_pilot.estimate.targets import TARGETS
    >>> seconds = ideal_seconds(np.array([10**12]), np.array([10**6]), np.array([2]),
    ...                         TARGETS["H100-SXM-80GB"])
    >>> round(seconds * 1000, 3)  # 1 TFLOP of bf16 at 989.5 TFLOP/s
    1.011
"""

from __future__ import annotations

from typing import Final

import numpy as np

from lightning_pilot.core import validate
from lightning_pilot.estimate.targets import Target

__all__ = [
    "DEFAULT_EFFICIENCY",
    "DEFAULT_MEMORY_EFFICIENCY",
    "KERNEL_FLOOR_S",
    "band",
    "collective_seconds",
    "ideal_seconds",
    "split_seconds",
]

#: The fraction of the roofline compute-bound operators reach, low to high (see the module
#: docstring).
DEFAULT_EFFICIENCY: Final = (0.40, 0.85)
#: The fraction of the memory bandwidth memory-bound operators reach, low to high.
DEFAULT_MEMORY_EFFICIENCY: Final = (0.40, 0.85)
#: The least time one operator takes on a GPU (a kernel launch and its gap), seconds.
KERNEL_FLOOR_S: Final = 2e-6


def ideal_seconds(
    flops: np.ndarray,
    moved: np.ndarray,
    kinds: np.ndarray,
    target: Target,
    *,
    allow_tf32: bool = False,
) -> float:
    """Sum over operators of ``max(flops / peak, bytes / bandwidth, floor)``; views (no bytes
    moved, no FLOPs) cost nothing. ``kinds``: 0 memory-bound, 1 fp32, 2 bf16, 3 fp16."""
    peaks = np.array([np.inf, target.tf32 if allow_tf32 else target.fp32, target.bf16, target.fp16])
    compute = flops / peaks[kinds.astype(np.int64)]
    memory = moved / target.bandwidth
    work = (flops > 0) | (moved > 0)
    per_op = np.maximum(np.maximum(compute, memory), KERNEL_FLOOR_S) * work
    return float(per_op.sum())


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
    takes longer than its memory traffic, else into the second (views cost nothing)."""
    peaks = np.array([np.inf, target.tf32 if allow_tf32 else target.fp32, target.bf16, target.fp16])
    compute = flops / peaks[kinds.astype(np.int64)]
    memory = moved / target.bandwidth
    work = (flops > 0) | (moved > 0)
    per_op = np.maximum(np.maximum(compute, memory), KERNEL_FLOOR_S) * work
    bound = compute >= memory
    return float(per_op[bound].sum()), float(per_op[~bound].sum())


def band(ideal: float, efficiency: tuple[float, float] = DEFAULT_EFFICIENCY) -> tuple[float, float]:
    """``(low, high)`` seconds: the ideal divided by the high and the low efficiency."""
    low_eff, high_eff = efficiency
    return ideal / high_eff, ideal / low_eff


def collective_seconds(nbytes: float, devices: int, target: Target) -> float:
    """A ring all-reduce (or all-gather plus reduce-scatter) of ``nbytes`` over ``devices``."""
    validate.integer("collective_seconds", "devices", devices, minimum=1)
    if devices == 1:
        return 0.0
    return 2 * (devices - 1) / devices * nbytes / target.link
