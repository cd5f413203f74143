"""Whether a phase fits a target: the memory it needs there (:func:`need`), the ``tight`` note
(:func:`tight_note`) and the need of the phases without activations (:func:`fixed_phases_need`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from lightning_pilot.estimate.targets import Target

if TYPE_CHECKING:
    from lightning_pilot.estimate.precision_traces import PrecisionTraces

#: The share of reserved memory above the allocator's segments allowed for fragmentation
#: (fixed shapes settle at a few percent), in ``peak_reserved_bytes`` only: ``fits`` rests on
#: the live blocks (:func:`need`).
FRAGMENTATION: Final = 0.05


def need(peak: int, segments: int, tgt: Target) -> int:
    """The bytes a phase needs so as not to run out of memory: its live blocks as the caching
    allocator packs them (``segments``, plus the workspace), never less than ``peak``
    allocated, plus the target's overhead. Cached blocks nobody uses do not count: the
    allocator frees them and retries before it raises out-of-memory (PyTorch,
    ``c10/cuda/CUDACachingAllocator.cpp``)."""
    return max(segments + tgt.workspace_bytes, peak) + tgt.overhead_bytes


def tight_note(reserved: int, tgt: Target) -> str:
    """The note of a row whose live blocks fit but whose estimated reserved memory does not."""
    gib = 2**30
    return (
        f"tight: the estimated reserved {reserved / gib:.2f} GiB plus"
        f" {tgt.overhead_bytes / gib:.2f} GiB overhead exceed the"
        f" {tgt.memory_bytes / gib:.2f} GiB of {tgt.name}; the live"
        " blocks fit, so the allocator will free its cache and retry cudaMalloc (slower steps;"
        " an allocation larger than any free piece of a segment still in use can still fail)"
    )


def fixed_phases_need(traces: PrecisionTraces, tgt: Target, batch_bytes: int) -> int:
    """The most memory the phases without activations need: the optimizer steps (with the
    training batch of ``batch_bytes`` held) and the save."""
    worst = 0
    for trace in traces.optimizer.values():
        peak = trace.peak_bytes + batch_bytes + tgt.workspace_bytes
        worst = max(worst, need(peak, trace.segment_bytes + batch_bytes, tgt))
    if traces.save is not None:
        peak = traces.save.peak_bytes + tgt.workspace_bytes
        worst = max(worst, need(peak, traces.save.segment_bytes, tgt))
    return worst
