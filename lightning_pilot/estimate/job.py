"""One estimate's grid, checked once: the public entry points check their arguments with
:func:`check_arguments` and build a :class:`GridJob`; everything after reads it and checks
nothing again.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch

from lightning_pilot.core import validate
from lightning_pilot.estimate.batches import _sequence_length
from lightning_pilot.estimate.fits import FRAGMENTATION
from lightning_pilot.estimate.precision import PRECISIONS
from lightning_pilot.estimate.roofline import DEFAULT_EFFICIENCY, DEFAULT_MEMORY_EFFICIENCY
from lightning_pilot.estimate.strategies import FSDP_COMPUTE, Strategy
from lightning_pilot.estimate.targets import Target, target

#: Activation checkpointing: off, every block (``True``) or per operator (``"selective"``).
Ckpt = bool | str
#: One configuration of the grid: (checkpointing, sequence length, micro-batch).
Config = tuple[Ckpt, int | None, int]


@dataclass(frozen=True)
class GridJob:
    """What one estimate traces and how: the module (live, or ``factory`` building it), one
    real ``batch`` and the checked arguments of :func:`~lightning_pilot.estimate.estimate`;
    ``device`` is ``"cuda"`` or ``"cpu"`` (:func:`~.grid.trace_configuration`)."""

    module: Any = None
    factory: Callable[[], Any] | None = None
    batch: Any = None
    targets: tuple[Target, ...] = ()
    precisions: tuple[str, ...] = ("bf16-mixed",)
    micro_batches: tuple[int, ...] = (1,)
    seq_lens: tuple[int | None, ...] = (None,)
    checkpointing: tuple[Ckpt, ...] = (False,)
    strategies: tuple[Strategy, ...] = (Strategy(),)
    checkpoint_classes: tuple[type[torch.nn.Module], ...] = ()
    wrap_classes: tuple[type[torch.nn.Module] | str, ...] = ()
    efficiency: tuple[float, float] = DEFAULT_EFFICIENCY
    memory_efficiency: tuple[float, float] = DEFAULT_MEMORY_EFFICIENCY
    allow_tf32: bool = False
    fragmentation: float = FRAGMENTATION
    largest: bool = True
    verify_largest: bool = True
    max_micro_batch: int = 1024
    seq_step: int = 512
    max_seq_len: int = 131072
    blocks: bool = True
    workers: int | None = None
    timeout: float | None = 3600.0
    capacity_factor: float = 1.0
    device: str = "cuda"

    @functools.cached_property
    def fsdp_compute(self) -> dict[str, str]:
        """Precision -> the precision FSDP's mixed-precision policy computes in
        (:data:`~.strategies.FSDP_COMPUTE`), when a strategy is ``fsdp``."""
        if not any(s.kind == "fsdp" for s in self.strategies):
            return {}
        return {p: FSDP_COMPUTE[p] for p in self.precisions if p in FSDP_COMPUTE}

    @functools.cached_property
    def extra(self) -> tuple[str, ...]:
        """The precisions traced only for FSDP's compute (no rows of their own)."""
        return tuple(sorted(set(self.fsdp_compute.values()) - set(self.precisions)))

    @functools.cached_property
    def traced(self) -> tuple[str, ...]:
        """Every precision traced: the grid's, then :attr:`extra`."""
        return (*self.precisions, *self.extra)

    @functools.cached_property
    def grid(self) -> tuple[Config, ...]:
        """The configurations the rows cover."""
        return tuple(itertools.product(self.checkpointing, self.seq_lens, self.micro_batches))

    @functools.cached_property
    def longest(self) -> int | None:
        """The longest sequence length of the grid (``None``: the batch's own)."""
        return max(self.seq_lens, key=lambda s: s or 0)

    @functools.cached_property
    def search_base(self) -> tuple[int, ...]:
        """The two micro-batches the largest micro-batch is predicted from: the grid's two
        smallest from 2 up (a micro-batch of 1 often runs other operators: broadcasts,
        squeezes), else (2, 4)."""
        above = sorted({b for b in self.micro_batches if b >= 2})
        return tuple(above[:2]) if len(above) >= 2 else (2, 4)

    @functools.cached_property
    def configs(self) -> tuple[Config, ...]:
        """The configurations traced: :attr:`grid`, and with ``largest`` the search's base
        at the longest sequence."""
        configs = list(self.grid)
        if self.largest:
            for config in itertools.product(self.checkpointing, [self.longest], self.search_base):
                if config not in configs:
                    configs.append(config)
        return tuple(configs)

    @functools.cached_property
    def seq_micro_batch(self) -> int | None:
        """The micro-batch the largest sequence length is searched at (the grid's smallest),
        for a batch with a sequence dimension (token ids); ``None``: no sequence search."""
        with contextlib.suppress(Exception):
            if _sequence_length(self.batch) is not None:
                return min(self.micro_batches)
        return None

    def searches(self, precision: str) -> bool:
        """Whether the largest sizes are searched in ``precision`` (not in a precision traced
        only for FSDP's compute)."""
        return self.largest and precision not in self.extra


def checkpointing_choice(value: object, owner: str = "estimate") -> Ckpt:
    """``False``, ``True`` or ``"selective"``, else a clear error."""
    if isinstance(value, bool) or value == "selective":
        return value
    error = ValueError if isinstance(value, str) else TypeError
    raise error(validate.invalid(owner, "checkpointing", value, "False, True or 'selective'"))


def _listed(owner: str, name: str, value: object, *, empty: bool = False) -> list[Any]:
    """``value`` as a list: a sequence other than a string, non-empty unless ``empty``."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(validate.invalid(owner, name, value, "a list"))
    if not value and not empty:
        raise ValueError(validate.invalid(owner, name, value, "a non-empty list"))
    return list(value)


def _classes(owner: str, name: str, value: object) -> tuple[type[torch.nn.Module], ...]:
    classes = tuple(_listed(owner, name, value, empty=True))
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise TypeError(validate.invalid(owner, name, cls, "torch.nn.Module subclasses"))
    return classes


def _efficiency(owner: str, name: str, value: object) -> Any:
    expected = "a pair (low, high) with 0 < low <= high <= 1"
    if not isinstance(value, tuple) or len(value) != 2:
        raise TypeError(validate.invalid(owner, name, value, expected))
    low = validate.number(owner, name, value[0], minimum=0, maximum=1, allow_minimum=False)
    high = validate.number(owner, name, value[1], minimum=0, maximum=1, allow_minimum=False)
    if low > high:
        raise ValueError(validate.invalid(owner, name, value, expected))
    return value


def _each(check: Callable[[str, str, Any], Any]) -> Callable[[str, str, object], tuple[Any, ...]]:
    """The check of a non-empty list whose every item passes ``check``."""

    def checked(owner: str, name: str, value: object) -> tuple[Any, ...]:
        return tuple(check(owner, name, item) for item in _listed(owner, name, value))

    return checked


def _as_is(check: Callable[..., Any], **limits: Any) -> Callable[[str, str, object], Any]:
    """``check(owner, name, value, **limits)``, the value kept as it was given."""

    def checked(owner: str, name: str, value: object) -> Any:
        check(owner, name, value, **limits)
        return value

    return checked


def _timeout(owner: str, name: str, value: object) -> Any:
    if value is not None:
        validate.number(owner, name, value, minimum=0, allow_minimum=False)
    return value


#: Each argument of the grid and its check (run in this order): the value the job holds.
_CHECKS: Final[dict[str, Callable[[str, str, Any], Any]]] = {
    "targets": _each(lambda o, n, v: target(v)),
    "precisions": _each(lambda o, n, v: validate.choice(o, n, v, PRECISIONS)),
    "micro_batches": _each(lambda o, n, v: validate.integer(o, n, v, minimum=1)),
    "seq_lens": _each(lambda o, n, v: validate.integer(o, n, v, minimum=1, optional=True)),
    "checkpointing": _each(lambda o, n, v: checkpointing_choice(v, o)),
    "strategies": _each(lambda o, n, v: Strategy.parse(v, o)),
    "checkpoint_classes": _classes,
    "wrap_classes": lambda o, n, v: tuple(_listed(o, n, v, empty=True)),
    "efficiency": _efficiency,
    "memory_efficiency": _efficiency,
    "allow_tf32": validate.boolean,
    "fragmentation": _as_is(validate.number, minimum=0, maximum=1),
    "largest": validate.boolean,
    "verify_largest": validate.boolean,
    "workers": _as_is(validate.integer, minimum=1, optional=True),
    "timeout": _timeout,
    "max_micro_batch": _as_is(validate.integer, minimum=1),
    "seq_step": _as_is(validate.integer, minimum=1),
    "max_seq_len": _as_is(validate.integer, minimum=1),
    "blocks": validate.boolean,
    "capacity_factor": _as_is(validate.number, minimum=1.0),
}


def check_arguments(owner: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """``arguments`` (any of :class:`GridJob`'s but the module, the batch and the device)
    checked, each error naming ``owner``, the argument, its value and what is valid: the
    values a :class:`GridJob` takes (lists as tuples, names as :class:`Target` and
    :class:`Strategy`)."""
    unknown = sorted(set(arguments) - set(_CHECKS))
    if unknown:
        raise TypeError(f"check_arguments: not arguments of the grid: {', '.join(unknown)}")
    return {
        name: check(owner, name, arguments[name])
        for name, check in _CHECKS.items()
        if name in arguments
    }
