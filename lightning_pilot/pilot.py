"""``pilot_callbacks()``: every pilot callback for one Trainer, with consistent settings."""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

from lightning_pilot.callbacks import REGISTRY, Registered
from lightning_pilot.core import validate
from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.run import PilotCallback

#: Option key -> registry entry, in the order the callbacks are returned.
_CALLBACKS: dict[str, Registered] = {entry.option: entry for entry in REGISTRY if entry.option}
#: The keys ``pilot_callbacks(**options)`` accepts, in the order the callbacks are returned.
PILOT_OPTION_KEYS: tuple[str, ...] = tuple(_CALLBACKS)
#: Arguments pilot_callbacks sets itself, so every callback shares them.
_SHARED = {"out_dir", "adapter", "experiment", "variant", "seed"}

_OVERFIT_APART = (
    "OverfitTinySubset changes training (every batch of its fit is the same few examples), so"
    " the other callbacks would measure, resume and record that instead of your training; it"
    " must run in its own fit: Trainer(callbacks=[OverfitTinySubset(...)]).fit(model, ...), a"
    " separate Trainer (docs/data-and-overfit.md)"
)


def _parameters(cls: type[PilotCallback]) -> list[str]:
    return [name for name in inspect.signature(cls.__init__).parameters if name != "self"]


def _options_for(key: str, value: object) -> dict[str, Any] | None:
    """The keyword arguments for one callback, or ``None`` when it is left out."""
    entry = _CALLBACKS[key]
    if value is None or isinstance(value, bool):
        included = entry.default if value is None else value
        return {} if included else None
    if not isinstance(value, Mapping):
        raise TypeError(
            f"pilot_callbacks({key}={value!r}) is invalid: expected a dict of {entry.name}"
            " options, True (defaults) or False (leave it out)."
        )
    shared = sorted(str(name) for name in value if name in _SHARED)
    if shared:
        raise ValueError(
            f"pilot_callbacks({key}={dict(value)!r}) is invalid: {', '.join(shared)} are set"
            " for every callback at once; pass them to pilot_callbacks itself (out_dir=,"
            " adapter=, experiment=, variant=, seed=)."
        )
    accepted = sorted(set(_parameters(entry.load())) - _SHARED)
    unknown = sorted(str(name) for name in value if name not in accepted)
    if unknown:
        raise ValueError(
            f"pilot_callbacks({key}={dict(value)!r}) is invalid: {entry.name} has no option"
            f" {', '.join(repr(name) for name in unknown)}; valid: {', '.join(accepted)}."
        )
    return {str(name): option for name, option in value.items()}


def pilot_callbacks(
    out_dir: str | os.PathLike[str] | None = None,
    *,
    experiment: str = "pilot",
    variant: str = "control",
    seed: int | None = None,
    adapter: BatchAdapter | None = None,
    **options: Any,
) -> list[PilotCallback]:
    """Every pilot callback, configured to share one output folder, run and batch format.

    Each key of :data:`PILOT_OPTION_KEYS` takes a dict of options, ``True`` (defaults) or
    ``False`` (left out); a key not given means included, except ``predictions``. ``overfit=``
    (it changes training), unknown keys and options, and a shared argument given to one
    callback are refused.

    Example:
        >>> callbacks = pilot_callbacks(experiment="lr-sweep", variant="lr=1e-4", seed=0,
        ...                             resume={"at_step": 3})
        >>> [type(callback).__name__ for callback in callbacks]  # doctest: +NORMALIZE_WHITESPACE
        ['PhaseMemoryMonitor', 'BatchInspector', 'EffectiveBatchAccountant',
         'ResumeVerifier', 'DivergenceLedger']
        >>> pilot_callbacks(resum={"at_step": 3})
        Traceback (most recent call last):
        ...
        ValueError: pilot_callbacks(resum=...) is invalid: unknown option 'resum'; valid: ...
    """
    owner = "pilot_callbacks"
    overfit = options.pop("overfit", None)
    if overfit is not None and overfit is not False:
        expected = f"no overfit= option (or False); {_OVERFIT_APART}"
        raise ValueError(validate.invalid(owner, "overfit", overfit, expected))
    unknown = sorted(name for name in options if name not in _CALLBACKS)
    if unknown:
        raise ValueError(
            f"pilot_callbacks({unknown[0]}=...) is invalid: unknown option"
            f"{'s' if len(unknown) > 1 else ''} {', '.join(repr(name) for name in unknown)};"
            f" valid: {', '.join(PILOT_OPTION_KEYS)} (and out_dir, experiment, variant, seed,"
            " adapter)."
        )
    # Checked here too: they hold even when the ledger is left out.
    validate.path(owner, "out_dir", out_dir)
    validate.run_name(owner, "experiment", experiment)
    validate.run_name(owner, "variant", variant)
    validate.integer(owner, "seed", seed, minimum=0, optional=True)
    validate.instance(owner, "adapter", adapter, BatchAdapter)
    configured = {key: _options_for(key, options.get(key)) for key in PILOT_OPTION_KEYS}
    shared = {"experiment": experiment, "variant": variant, "seed": seed, "adapter": adapter}
    if adapter is None:
        del shared["adapter"]  # each callback keeps its own default
    callbacks: list[PilotCallback] = []
    for key, kwargs in configured.items():
        if kwargs is not None:
            cls = _CALLBACKS[key].load()
            accepted = {name: shared[name] for name in _parameters(cls) if name in shared}
            callbacks.append(cls(**kwargs, **accepted, out_dir=out_dir))
    return callbacks
