"""Whether a phase fits a target: the memory it needs there (:func:`need`) and the ``tight``
note (:func:`tight_note`).
"""

from __future__ import annotations

from typing import Final

from lightning_pilot.estimate.targets import Target

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
