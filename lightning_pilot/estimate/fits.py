"""Whether a phase fits a target: the memory it needs there (:func:`need`: the live blocks,
never the allocator's cache), the ``tight`` note of a row whose reserved estimate exceeds the
GPU while its live blocks fit (:func:`tight_note`), and the need of the phases without
activations (:func:`fixed_phases_need`).

Example:
    >>> from lightning_pilot.estimate.targets import TARGETS
    >>> l4 = TARGETS["L4-24GB"]
    >>> need(10 << 30, 11 << 30, l4) == (11 << 30) + l4.workspace_bytes + l4.overhead_bytes
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from lightning_pilot.estimate.targets import Target

if TYPE_CHECKING:
    from lightning_pilot.estimate.precision_traces import PrecisionTraces

__all__ = ["FRAGMENTATION", "fixed_phases_need", "need", "tight_note"]

#: The share of reserved memory above the allocator's segments the estimate allows for
#: fragmentation (freed blocks too small for the next request). Training loops with fixed
#: shapes settle at a few percent; varying sequence lengths fragment more. It sizes
#: ``peak_reserved_bytes`` only: the allocator frees cached blocks before it raises
#: out-of-memory, so ``fits`` rests on the live blocks (:func:`need`).
FRAGMENTATION: Final = 0.05


def need(peak: int, segments: int, tgt: Target) -> int:
    """The bytes a phase needs so as not to run out of memory: its live blocks as CUDA's caching
    allocator holds them (``segments``: each block rounded to 512 bytes and packed into its
    segment, :func:`~lightning_pilot.estimate.recorder.segment_bytes`; plus the workspace), never
    less than ``peak`` allocated, plus the target's overhead outside the allocator.

    Cached blocks nobody uses are not counted: when ``cudaMalloc`` fails, the allocator frees
    its cached unsplit blocks and retries before it raises out-of-memory (PyTorch,
    ``c10/cuda/CUDACachingAllocator.cpp``), so reserved memory above the live segments (the
    ``fragmentation`` allowance of ``peak_reserved_bytes``) costs time, not a failure.
    """
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
