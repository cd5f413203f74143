"""The previous update's gradients in CUDA's allocator cache.

Lightning's automatic optimization calls ``zero_grad`` (``set_to_none``) after
``training_step`` and before ``backward``: the previous update's gradients are freed, and their
blocks stay reserved in PyTorch's caching allocator, which reuses a free block only for a
request no larger than it, from the same pool (blocks of up to 1 MiB and larger ones apart;
``c10/cuda/CUDACachingAllocator.cpp``). :func:`cached_gradient_bytes` replays the backward
pass's requests up to its peak against those blocks, best fit first, a block split when what it
leaves is large enough to stay in its pool: what no request took is still reserved at the peak.
Each request is taken at the smallest block an operator asks for and may take a cached gradient
block before any block the backward pass itself freed, so the figure is a lower bound of what
the cache holds.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from lightning_pilot.estimate.recorder import _SMALL, PhaseTrace, _round_up


def _rounded(nbytes: int) -> int:
    return _round_up(nbytes, 512)


def cached_gradient_bytes(
    gradients: Sequence[int], trace: PhaseTrace, shards: int = 1
) -> int | None:
    """Bytes of the freed gradient blocks (``gradients``: each gradient's bytes, split over
    ``shards`` GPUs by FSDP) that no allocation of ``trace`` (the backward pass) up to its peak
    reuses; ``None`` when the trace does not carry its allocations."""
    if len(trace.requests) != len(trace.curve):
        return None
    pools: tuple[list[int], list[int]] = ([], [])
    for nbytes in gradients:
        block = _rounded(-(-nbytes // shards))
        pools[block > _SMALL].append(block)
    for pool in pools:
        pool.sort()
    end = min(trace.peak_op + 1, len(trace.curve))
    for index in range(end):
        asked = [int(trace.requests[index])] * int(trace.request_count[index])
        if trace.grad_requests[index]:
            asked.append(-(-int(trace.grad_requests[index]) // shards))
        for request in map(_rounded, asked):
            large = request > _SMALL
            pool = pools[large]
            at = bisect.bisect_left(pool, request)
            if at == len(pool):
                continue
            rest = pool.pop(at) - request
            if rest > (_SMALL if large else 0):  # the allocator splits the block
                bisect.insort(pool, rest)
    return sum(pools[0]) + sum(pools[1])
