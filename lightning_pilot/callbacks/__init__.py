"""The pilot callbacks and their registry, :data:`REGISTRY` (docs/contributing.md); the names
here and on ``lightning_pilot`` are imported on first use.

Example:
    >>> from lightning_pilot.callbacks import REGISTRY
    >>> [entry.option for entry in REGISTRY if entry.default]
    ['phase_memory', 'batch_inspector', 'effective_batch', 'resume', 'ledger']
    >>> REGISTRY[0].load().__name__
    'PhaseMemoryMonitor'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from lightning_pilot.callbacks.batch_inspector import BatchInspector
    from lightning_pilot.callbacks.divergence_ledger import (
        DivergenceLedger,
        RepeatedVariantError,
        RepeatedVariantWarning,
    )
    from lightning_pilot.callbacks.effective_batch_accountant import EffectiveBatchAccountant
    from lightning_pilot.callbacks.overfit_tiny_subset import OverfitTinySubset
    from lightning_pilot.callbacks.phase_memory_monitor import PhaseCheckError, PhaseMemoryMonitor
    from lightning_pilot.callbacks.prediction_writer import ValidationPredictionWriter
    from lightning_pilot.callbacks.target_estimator import TargetEstimator
    from lightning_pilot.core.ledger_records import Heartbeat
    from lightning_pilot.resume import ResumeVerifier
    from lightning_pilot.run import PilotCallback


@dataclass(frozen=True)
class Registered:
    """One pilot callback in the registry.

    Attributes:
        name: the class name, exported by ``lightning_pilot`` and ``lightning_pilot.callbacks``.
        module: the module that defines it.
        option: its key in ``pilot_callbacks(...)``; ``None`` when it must run in a fit of its
            own (it changes training) and is never part of the set.
        default: whether ``pilot_callbacks()`` includes it when its key is not given.
        example: constructor arguments for the lifecycle conformance test (besides ``out_dir``).
    """

    name: str
    module: str
    option: str | None
    default: bool = True
    example: Mapping[str, Any] = field(default_factory=dict)

    def load(self) -> type[PilotCallback]:
        """The callback class (imports its module)."""
        cls: type[PilotCallback] = getattr(importlib.import_module(self.module), self.name)
        return cls


_HERE: Final = "lightning_pilot.callbacks"

#: Every pilot callback, in the order ``pilot_callbacks()`` returns them.
REGISTRY: Final = (
    Registered("PhaseMemoryMonitor", f"{_HERE}.phase_memory_monitor", "phase_memory"),
    Registered("BatchInspector", f"{_HERE}.batch_inspector", "batch_inspector"),
    Registered(
        "EffectiveBatchAccountant", f"{_HERE}.effective_batch_accountant", "effective_batch"
    ),
    Registered(
        "ResumeVerifier",
        "lightning_pilot.resume",
        "resume",
        example={"at_step": 1, "compare_steps": 1},
    ),
    # Opt-in: it needs a validation_step that returns predictions.
    Registered("ValidationPredictionWriter", f"{_HERE}.prediction_writer", "predictions", False),
    Registered(
        "DivergenceLedger",
        f"{_HERE}.divergence_ledger",
        "ledger",
        example={"experiment": "lifecycle", "variant": "control", "seed": 0},
    ),
    # Opt-in: it runs the module on fake tensors over a grid of configurations at fit end.
    Registered(
        "TargetEstimator",
        f"{_HERE}.target_estimator",
        "estimate",
        False,
        example={"targets": ["L4-24GB"], "precisions": ["32-true"], "largest": False},
    ),
    Registered(
        "OverfitTinySubset",
        f"{_HERE}.overfit_tiny_subset",
        None,
        False,
        example={"num_examples": 2, "max_steps": 3},
    ),
)

#: Other public names of the callback modules.
_OTHERS: Final = {
    "Heartbeat": "lightning_pilot.core.ledger_records",
    "PhaseCheckError": f"{_HERE}.phase_memory_monitor",
    "RepeatedVariantError": f"{_HERE}.divergence_ledger",
    "RepeatedVariantWarning": f"{_HERE}.divergence_ledger",
}

#: Name -> module of every public name of this package (the lazy names of ``lightning_pilot``).
LAZY: Final = {entry.name: entry.module for entry in REGISTRY} | _OTHERS

__all__ = [
    "BatchInspector",
    "DivergenceLedger",
    "EffectiveBatchAccountant",
    "Heartbeat",
    "OverfitTinySubset",
    "PhaseCheckError",
    "PhaseMemoryMonitor",
    "RepeatedVariantError",
    "RepeatedVariantWarning",
    "ResumeVerifier",
    "TargetEstimator",
    "ValidationPredictionWriter",
]


def lazy_names(
    namespace: dict[str, Any], names: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` importing ``names`` (name -> module) on first
    use into ``namespace`` (the package's ``globals()``)."""

    def getattr_(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(module), name)
        return value  # stored: later lookups skip this function

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(namespace["__all__"]))

    return getattr_, dir_


__getattr__, __dir__ = lazy_names(globals(), LAZY)
