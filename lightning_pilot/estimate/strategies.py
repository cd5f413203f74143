"""What a strategy adds per GPU to the trace of one device: memory (**analytic**, named so in
``notes``) and the collectives' time. ``ddp`` adds DDP's gradient buckets; ``fsdp`` (full
shard over N) divides the state by N and adds the gathered units; under a mixed precision FSDP
computes in the low dtype (:data:`FSDP_COMPUTE`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import torch

from lightning_pilot.core import validate
from lightning_pilot.estimate.recorder import PhaseTrace
from lightning_pilot.estimate.roofline import collective_seconds
from lightning_pilot.estimate.targets import Target

if TYPE_CHECKING:
    from lightning_pilot.estimate.precision_traces import PrecisionTraces

#: The precision FSDP computes in, per mixed precision: Lightning's ``FSDPStrategy`` gives FSDP
#: ``MixedPrecision(param_dtype=...)`` of the low dtype, so the gathered parameters and the
#: activations are in it (no autocast copies of the weights) while the sharded state stays
#: float32; traced in ``bf16-true`` for both (float16 has bfloat16's size and speed).
FSDP_COMPUTE: Final = {"bf16-mixed": "bf16-true", "16-mixed": "bf16-true"}
_STATE: Final = ("param", "buffer", "grad", "optimizer_state")


@dataclass(frozen=True)
class Strategy:
    """How the campaign spreads over GPUs: ``single``, ``ddp`` or ``fsdp`` (full shard) over
    ``devices``; ``bucket_view`` is DDP's ``gradient_as_bucket_view``.

    Example:
        >>> Strategy.parse("fsdp:8")
        Strategy(kind='fsdp', devices=8, bucket_view=False)
    """

    kind: str = "single"
    devices: int = 1
    bucket_view: bool = False

    def __post_init__(self) -> None:
        validate.choice("Strategy", "kind", self.kind, ("single", "ddp", "fsdp"))
        validate.integer("Strategy", "devices", self.devices, minimum=1)
        if self.kind == "single" and self.devices != 1:
            raise ValueError(validate.invalid("Strategy", "devices", self.devices, "1 for single"))

    @classmethod
    def parse(cls, value: object, owner: str = "estimate") -> Strategy:
        """A :class:`Strategy` from itself or ``"single"``, ``"ddp:N"``, ``"fsdp:N"``; an error
        names ``owner``'s ``strategies`` argument."""
        if isinstance(value, Strategy):
            return value
        expected = "a Strategy or 'single', 'ddp:N' or 'fsdp:N' (N >= 1)"
        if not isinstance(value, str):
            raise TypeError(validate.invalid(owner, "strategies", value, expected))
        kind, _, count = value.partition(":")
        if kind == "single" and not count:
            return cls()
        if kind in ("ddp", "fsdp") and count.isdigit() and int(count) >= 1:
            return cls(kind, int(count))
        raise ValueError(validate.invalid(owner, "strategies", value, expected))


def unit_bytes(module: torch.nn.Module, wrap: tuple[Any, ...], itemsize: int) -> tuple[int, int]:
    """(largest FSDP unit, parameters outside every unit) in bytes of ``itemsize``: the units
    are the ``wrap`` classes (or class names) and the Hugging Face ``_no_split_modules``. Units
    are wrapped bottom-up, so a unit holds its parameters less those of the units inside it."""
    names = {n for sub in module.modules() for n in getattr(sub, "_no_split_modules", None) or []}
    classes = tuple(c for c in wrap if isinstance(c, type))
    names.update(c for c in wrap if isinstance(c, str))
    inside: set[int] = set()
    largest = 0
    for sub in reversed(list(module.modules())):  # a unit's descendants before the unit
        if sub is module or not (isinstance(sub, classes) or type(sub).__name__ in names):
            continue
        params = [p for p in sub.parameters() if id(p) not in inside]
        inside.update(id(p) for p in params)
        largest = max(largest, sum(p.numel() for p in params) * itemsize)
    root = sum(p.numel() for p in module.parameters() if id(p) not in inside) * itemsize
    if largest == 0:  # no unit: the whole module is one
        return root, 0
    return largest, root


def strategy_memory(
    trace: PhaseTrace, strategy: Strategy, traces: PrecisionTraces
) -> tuple[int, str | None]:
    """(bytes ``strategy`` adds per GPU, allocated and in the allocator's segments alike; its
    note)."""
    if strategy.kind == "single":
        return 0, None
    devices = strategy.devices
    if strategy.kind == "ddp":
        if strategy.bucket_view or devices == 1:
            return 0, "ddp: gradient_as_bucket_view, no bucket copy" if devices > 1 else None
        return traces.state["grad"], "analytic: DDP gradient buckets, one copy of the gradients"
    cats = trace.categories
    stepping = trace.phase.startswith("optimizer_step")
    sharded = sum(cats[name] for name in _STATE)
    if stepping:  # each GPU steps its own shard: the optimizer's temporaries shrink with it
        sharded += cats["temporaries"]
    saved = sharded - -(-sharded // devices)
    largest, root = traces.units
    gathered = {
        "forward": 2 * largest + root,
        "validation": 2 * largest + root,
        "backward": 3 * largest + root,
        "checkpoint_save": largest,
    }.get(trace.phase, 0)
    stepped = " (and the optimizer's temporaries)" if stepping else ""
    note = (
        f"analytic: FSDP full shard over {devices}: weights, gradients and optimizer state"
        f"{stepped} / {devices}, plus {gathered} bytes of gathered units (largest unit"
        f" {largest}, outside units {root})"
    )
    return gathered - saved, note


def communication_seconds(strategy: Strategy, traces: PrecisionTraces, tgt: Target) -> float:
    """The ideal seconds of one update's collectives on ``tgt``: DDP all-reduces the
    gradients; FSDP all-gathers the parameters twice and reduce-scatters the gradients."""
    if strategy.kind == "single" or strategy.devices == 1:
        return 0.0
    grads = traces.state["grad"]
    if strategy.kind == "ddp":
        return collective_seconds(grads, strategy.devices, tgt)
    params = sum(traces.units) if traces.units[0] else 0
    # all-gather twice (forward, backward) and reduce-scatter once: 1.5 all-reduces.
    return 0.75 * collective_seconds(2 * params + grads, strategy.devices, tgt)


def fsdp_mixed(
    phases: Mapping[str, tuple[PhaseTrace, str]],
    lowered: Mapping[str, tuple[PhaseTrace, str]],
    traces: PrecisionTraces,
    low: PrecisionTraces,
) -> dict[str, tuple[PhaseTrace, str]]:
    """The phases of FSDP's mixed-precision policy: ``forward``, ``backward`` and
    ``validation`` from ``lowered`` (the phases of ``low``, the low-precision trace:
    activations in that dtype, no autocast weight copies) with its weights, gradients and
    optimizer state counted at ``traces``' (float32) size; the optimizer steps and the save
    from ``phases``."""
    scale = {
        name: traces.state[name] / low.state[name] if low.state.get(name) else 1.0
        for name in _STATE
    }
    note = (
        f"FSDP mixed precision (param_dtype={low.precision.split('-')[0]}): the batch's phases"
        f" traced in {low.precision} (no autocast copies of the weights), the sharded weights,"
        " gradients and optimizer state in float32"
    )
    made = dict(phases)
    for phase in ("forward", "backward", "validation"):
        trace, method = lowered[phase]
        extra = {name: round(trace.categories[name] * (scale[name] - 1)) for name in _STATE}
        made[phase] = (trace.shifted(extra, note), method)
    return made
