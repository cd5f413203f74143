"""Block extrapolation: a module's repeated block list (:func:`repeated_blocks`), the list cut
to a few blocks (:func:`cut_blocks`), and the full trace synthesized from traces at
:data:`CUTS` blocks when every operator's values are affine in the block count
(:func:`extrapolate_blocks`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Final

import numpy as np
import torch

from lightning_pilot.estimate.recorder import PhaseTrace, operator_signature, segment_bytes
from lightning_pilot.vocabulary import CATEGORIES

#: The block counts a block list is cut to: the first and last block of each trace may differ
#: from the others (the first layer's input is the embedding's output, its backward the last
#: before the embedding's), so three counts of 3 and more leave the middle blocks to fit.
CUTS: Final = (3, 4, 5)
#: A block list shorter than this is traced in full (the cuts cost 12 blocks).
MIN_BLOCKS: Final = 16
_NONE: Final = np.zeros(0, dtype=np.int64)


def _structure(module: torch.nn.Module) -> tuple[Any, ...]:
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return (
        tuple((name, tuple(t.shape), t.dtype) for name, t in tensors),
        tuple(type(sub).__name__ for sub in module.modules()),
    )


def repeated_blocks(module: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """``(name, container)`` of the module's repeated block list: the longest
    ``nn.ModuleList`` or ``nn.Sequential`` whose children are all of one class with the same
    parameters and buffers (names, shapes, dtypes) and the same submodules (Llama's
    ``model.layers``, GPT-2's ``transformer.h``), of at least :data:`MIN_BLOCKS` children;
    ``None`` when there is none."""
    best: tuple[str, torch.nn.Module] | None = None
    for name, sub in module.named_modules():
        if not isinstance(sub, torch.nn.ModuleList | torch.nn.Sequential):
            continue
        children = list(sub._modules.values())
        if len(children) < MIN_BLOCKS or (
            best is not None and len(children) <= len(best[1]._modules)
        ):
            continue
        first = children[0]
        if first is None or any(type(c) is not type(first) for c in children):
            continue
        shape = _structure(first)
        if all(_structure(c) == shape for c in children[1:] if c is not None):
            best = (name, sub)
    return best


@contextlib.contextmanager
def cut_blocks(container: torch.nn.Module, count: int) -> Iterator[list[torch.nn.Module]]:
    """``container`` (a block list) holding only its first ``count`` blocks for the duration;
    the very same dictionary of blocks is put back after. Yields the blocks left out."""
    original = container.__dict__["_modules"]
    items = list(original.items())
    container.__dict__["_modules"] = type(original)(items[:count])
    try:
        yield [block for _, block in items[count:] if block is not None]
    finally:
        container.__dict__["_modules"] = original


def _alignment(names: Sequence[tuple[str, ...]]) -> tuple[int, list[int]] | None:
    """``(block length, candidate prefix lengths)`` when the operator names of the traces at
    :data:`CUTS` blocks may be ``prefix + block * k + suffix`` (checked by the caller)."""
    first, second = names[0], names[1]
    lengths = [len(n) for n in names]
    size = lengths[1] - lengths[0]
    if size <= 0 or lengths[2] - lengths[1] != size:
        return None
    n1, n2, k1 = lengths[0], lengths[1], CUTS[0]
    common = 0
    while common < n1 and first[common] == second[common]:
        common += 1
    tail = 0
    while tail < n1 and first[n1 - 1 - tail] == second[n2 - 1 - tail]:
        tail += 1
    low, high = max(n1 - tail, 0), min(common - k1 * size, n1 - k1 * size)
    candidates = list(range(low, high + 1))
    return (size, candidates) if candidates else None


def _affine_in_count(values: Sequence[Any], count: int) -> Any:
    """The value at ``count`` blocks from the values at :data:`CUTS` (``None`` unless the
    three are affine in the block count; arrays compared element by element)."""
    a, b, c = values
    step = CUTS[1] - CUTS[0]
    if not np.array_equal(np.asarray(c) - b, np.asarray(b) - a):
        return None
    return b + (count - CUTS[1]) // step * (b - a)


def _synthesize(
    arrays: Sequence[np.ndarray], prefix: int, size: int, count: int
) -> np.ndarray | None:
    """Per operator, the value at ``count`` blocks from the values at :data:`CUTS` blocks.
    The prefix with the first block, and the last block with the suffix, are affine in the
    block count ``k``; a middle block ``m`` (0 for the second block) is ``a + b m + c k``,
    with ``a``, ``b``, ``c`` from three of the six middle blocks traced, checked on the other
    three. ``None`` when a value breaks the pattern."""
    k2 = CUTS[1]
    heads = [a[: prefix + size] for a in arrays]
    tails = [a[prefix + (k - 1) * size :] for a, k in zip(arrays, CUTS, strict=True)]
    middles = [
        a[prefix + size : prefix + (k - 1) * size].reshape(k - 2, size)
        for a, k in zip(arrays, CUTS, strict=True)
    ]
    head = _affine_in_count(heads, count)
    tail = _affine_in_count(tails, count)
    if head is None or tail is None:
        return None
    two, three = middles[1], middles[2]
    step_m = two[1] - two[0]
    step_k = two[0] - middles[0][0]
    if not (
        np.array_equal(three[0] - two[0], step_k)
        and np.array_equal(three[1] - three[0], step_m)
        and np.array_equal(three[2] - three[1], step_m)
    ):
        return None
    m = np.arange(count - 2, dtype=np.int64)[:, None]
    body = two[0][None, :] + m * step_m[None, :] + (count - k2) * step_k[None, :]
    return np.concatenate([head, body.reshape(-1).astype(arrays[0].dtype), tail])


def extrapolate_blocks(
    traces: Sequence[PhaseTrace], count: int
) -> tuple[PhaseTrace | None, str | None]:
    """The phase of the whole module (``count`` blocks) from its traces with the block list
    cut to :data:`CUTS` blocks: ``(trace, None)``, or ``(None, why)`` unless the three traces
    follow ``prefix + block x k + suffix`` with every operator's live bytes, FLOPs and bytes
    moved, and the peak's categories and allocator pools, affine in the block count (checked
    exactly on the three; see :func:`_synthesize`)."""
    names = [t.names for t in traces]
    aligned = _alignment(names)
    cuts = ", ".join(map(str, CUTS))
    if aligned is None:
        return None, f"the traces at {cuts} blocks do not repeat one block of operators"
    size, candidates = aligned
    if any(t.peak_bytes != max(t.start_bytes, int(t.curve.max(initial=0))) for t in traces):
        return None, "a traced peak falls between operators"
    if any(t.included != traces[0].included for t in traces):
        return None, f"the traces at {cuts} blocks hold different state"
    start = _affine_in_count([t.start_bytes for t in traces], count)
    categories = {
        name: _affine_in_count([t.categories[name] for t in traces], count) for name in CATEGORIES
    }
    parts = [_affine_in_count([t.segment_parts[i] for t in traces], count) for i in range(3)]
    if start is None or None in categories.values() or None in parts:
        return None, "the peak's categories are not affine in the block count"
    for prefix in candidates:
        head, block = names[0][:prefix], names[0][prefix : prefix + size]
        tail = names[0][prefix + CUTS[0] * size :]
        if any(n != head + block * k + tail for n, k in zip(names, CUTS, strict=True)):
            continue
        made = {
            name: _synthesize([getattr(t, name) for t in traces], prefix, size, count)
            for name in ("curve", "flops", "moved", "kinds")
        }
        if any(m is None for m in made.values()):
            continue
        curve, flops, moved, kinds = (m for m in made.values() if m is not None)
        peak = max(start, int(curve.max(initial=0)))
        if sum(v or 0 for v in categories.values()) != peak:
            continue
        order = head + block * count + tail
        synthesized = [
            _synthesize([getattr(t, name) for t in traces], prefix, size, count)
            for name in ("requests", "request_count", "grad_requests")
        ]
        requests = [r for r in synthesized if r is not None and len(r) == len(curve)]
        if len(requests) < 3:
            requests = [_NONE] * 3  # the allocations are then not replayed (estimate.cache)
        return PhaseTrace(
            phase=traces[0].phase,
            peak_bytes=peak,
            categories={k: int(v or 0) for k, v in categories.items()},
            curve=curve,
            flops=flops,
            moved=moved,
            kinds=kinds,
            peak_op=int(np.argmax(curve)) if len(curve) else 0,
            signature=operator_signature(order),
            start_bytes=start,
            segment_bytes=segment_bytes((parts[0] or 0, parts[1] or 0, parts[2] or 0)),
            included=dict(traces[0].included),
            notes=list(traces[0].notes),
            names=order,
            segment_parts=(parts[0] or 0, parts[1] or 0, parts[2] or 0),
            requests=requests[0],
            request_count=requests[1],
            grad_requests=requests[2],
        ), None
    return None, "an operator's live bytes, FLOPs or bytes moved are not affine in the block count"
