"""Real copies ("shadows", attribute :data:`_SHADOW` of a fake tensor) of the integer and boolean
tensors derived only from the batch, and of small floating ones (step counters), so that
``int(mask.sum())`` or ``nonzero`` on labels compute real values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_flatten

# Integer and boolean tensors larger than this carry no real copy (a B x 1 x T x T mask at
# 70B sizes would cost real memory); reading their values is then untraceable.
_SHADOW_LIMIT: Final = 1 << 24
_FLOAT_SHADOW_LIMIT: Final = 4096
_SHADOW: Final = "_lightning_pilot_shadow"


def _tensors(values: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, list | tuple):
            found.extend(item for item in value if isinstance(item, torch.Tensor))
    return found


def _shadowable(tensor: torch.Tensor) -> bool:
    """Integer and boolean tensors up to :data:`_SHADOW_LIMIT` elements, small floating ones
    (optimizer step counters, scalars made from constants) up to :data:`_FLOAT_SHADOW_LIMIT`."""
    if tensor.dtype.is_complex:
        return False
    limit = _FLOAT_SHADOW_LIMIT if tensor.dtype.is_floating_point else _SHADOW_LIMIT
    return tensor.numel() <= limit


def _is_fake(value: Any) -> bool:
    return isinstance(value, FakeTensor)


def _fake_mode_of(args: Any, kwargs: Any) -> FakeTensorMode | None:
    for value in tree_flatten((args, kwargs))[0]:
        mode = getattr(value, "fake_mode", None)
        if isinstance(mode, FakeTensorMode):
            return mode
    return None


def _inputs(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """An operator's tensor inputs: in ``args`` (lists and tuples of them too) and ``kwargs``."""
    found = _tensors(args)
    if kwargs:
        found.extend(v for v in tree_flatten(dict(kwargs))[0] if isinstance(v, torch.Tensor))
    return found


def _all_shadowed(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether every tensor input carries a real copy (true for factory operators)."""
    return all(_shadow_of(tensor) is not None for tensor in _inputs(args, kwargs))


def _shadow_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The real values of ``tensor``: its shadow, or itself when it is a real tensor."""
    shadow = getattr(tensor, _SHADOW, None)
    if shadow is None and not _is_fake(tensor):
        return tensor
    return shadow


def _drop_written_shadows(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """An in-place operator with an input lacking a real copy: its outputs' copies are stale."""
    for index, argument in enumerate(func._schema.arguments):
        info = argument.alias_info
        if info is None or not info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        for tensor in _tensors((value,)):
            if hasattr(tensor, _SHADOW):
                delattr(tensor, _SHADOW)
