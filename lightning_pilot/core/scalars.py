"""Reading many 0-d tensors back to the host at once: callbacks queue per-update values on the
device and read them together, one device wait per flush instead of one per update."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def read_scalars(tensors: Sequence[torch.Tensor]) -> list[float]:
    """The values of 0-d (or one-element) tensors as floats, in order: one host sync for
    tensors on one device, one read each when they are spread over several."""
    if not tensors:
        return []
    dtype = tensors[0].dtype
    try:
        with torch.no_grad():
            if all(t.dtype is dtype and t.ndim == 0 for t in tensors):  # read in their dtype
                stacked = torch.stack(list(tensors))
            else:  # mixed dtypes would be promoted to the widest float: float64 for each
                stacked = torch.stack([t.detach().reshape(()).double() for t in tensors])
    except RuntimeError:  # on several devices: one read each
        return [float(t) for t in tensors]
    return [float(v) for v in stacked.tolist()]
