"""Mixture-of-experts routing under the estimate's assumption: fake scores have no values, so
every ``topk`` over them routes tokens evenly (:func:`balanced_routes`); :class:`BalancedRouting`
applies the same routing to real tensors, for a real run to compare with. Also torch's
``aten._grouped_mm`` on fake tensors of any floating dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

_GROUPED_MM: Final = torch.ops.aten._grouped_mm.default
_TOPK: Final = torch.ops.aten.topk.default


def _fake_grouped_mm(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """``aten._grouped_mm`` on fake tensors of any floating dtype (torch's fake kernel accepts
    bfloat16 only, the real kernels float32 too): the bfloat16 output's shape, in ``out_dtype``
    or the inputs' dtype."""
    call = dict(zip(("self", "mat2", "offs", "bias", "out_dtype"), args, strict=False))
    call.update(kwargs)
    a, b = call["self"], call["mat2"]
    if a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        return func(*args, **kwargs)
    bias = call.get("bias")
    shaped = func(
        a.to(torch.bfloat16),
        b.to(torch.bfloat16),
        call.get("offs"),
        bias.to(torch.bfloat16) if bias is not None else None,
    )
    return torch.empty(shaped.shape, dtype=call.get("out_dtype") or a.dtype, device=a.device)


def balanced_routes(
    shape: Sequence[int], k: int, dim: int = -1, capacity_factor: float = 1.0
) -> torch.Tensor:
    """The expert indices of ``topk(scores, k, dim)`` for ``scores`` of ``shape`` under the
    routing assumption. Balanced (``capacity_factor=1``): row ``r`` (each token) picks the
    ``k`` distinct experts ``(r k + j) mod E`` (``E = shape[dim]``), so every expert gets
    ``tokens x k / E`` of the tokens (exactly when that divides). With ``capacity_factor``
    ``c > 1``, the first expert gets ``c`` times that share (at most every token) and the
    others share the rest evenly: the imbalance an expert capacity of ``c`` allows."""
    dims = len(shape)
    dim = dim % dims
    experts = int(shape[dim])
    rest = [int(n) for i, n in enumerate(shape) if i != dim]
    rows = int(np.prod(rest)) if rest else 1
    j = torch.arange(k)[None, :]
    if capacity_factor <= 1.0 or k >= experts:
        picks = (torch.arange(rows)[:, None] * k + j) % experts
    else:
        busiest = min(rows, int(np.ceil(capacity_factor * rows * k / experts)))
        first = (torch.arange(rows) < busiest).long()[:, None]
        count = k - first
        start = torch.cumsum(count, 0) - count
        other = 1 + (start + j - first) % (experts - 1)
        picks = torch.where((first == 1) & (j == 0), 0, other)
    return picks.reshape(*rest, k).movedim(-1, dim).contiguous()


class BalancedRouting(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """On real tensors, every ``topk`` over floating scores returns the indices of
    :func:`balanced_routes` (its values unchanged): the routing the estimate assumes, for a
    real run to compare with."""

    def __init__(self, capacity_factor: float = 1.0) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.capacity_factor = capacity_factor

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _TOPK and args[0].is_floating_point():
            dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
            k = int(out[1].shape[dim])
            routes = balanced_routes(args[0].shape, k, dim, self.capacity_factor)
            out = (out[0], routes.to(out[1].device))
        return out
