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

__all__ = ["PILOT_OPTION_KEYS", "pilot_callbacks"]

#: Option key -> registry entry, in the order the callbacks are returned.
_CALLBACKS: dict[str, Registered] = {entry.option: entry for entry in REGISTRY if entry.option}

#: The keys ``pilot_callbacks(**options)`` accepts, in the order the callbacks are returned.
PILOT_OPTION_KEYS: tuple[str, ...] = tuple(_CALLBACKS)

# Arguments pilot_callbacks sets itself, so every callback shares them.
_SHARED = {"out_dir", "adapter", "experiment", "variant", "seed"}

# OverfitTinySubset replaces every batch of its fit: it cannot share the pilot's.
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
    if value is None:
        return {} if entry.default else None
    if isinstance(value, bool):
        return {} if value else None
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

    Returns, in this order: :class:`~lightning_pilot.PhaseMemoryMonitor`,
    :class:`~lightning_pilot.BatchInspector`, :class:`~lightning_pilot.EffectiveBatchAccountant`,
    :class:`~lightning_pilot.ResumeVerifier`, :class:`~lightning_pilot.ValidationPredictionWriter`
    (only when ``predictions=`` is given) and :class:`~lightning_pilot.DivergenceLedger`.
    They land in one Trainer as one run (one ``run_id``, one folder under ``out_dir``), and
    ``Trainer(fast_dev_run=N, callbacks=pilot_callbacks())`` still saves and reloads a
    checkpoint: the verifier saves at update ``at_step`` even where ``fast_dev_run`` disables
    checkpointing (give ``N >= at_step + compare_steps``, 4 with the defaults, for the
    comparison to run; with fewer updates its checks read ``not_checked`` with the reason).

    :class:`~lightning_pilot.OverfitTinySubset` is never part of the set: it changes training
    on purpose (every batch of its fit is the same few examples), so it needs a fit of its own,
    with a separate Trainer: ``Trainer(callbacks=[OverfitTinySubset(...)]).fit(model, ...)``.
    ``overfit=True`` or ``overfit={...}`` is refused with that explanation (``overfit=False``
    is accepted: there is nothing to leave out).

    Options per callback go under one key each; a dict configures the callback, ``True`` adds it
    with its defaults, ``False`` leaves it out, and ``None`` (not given) means included with its
    defaults (``predictions``: left out unless given):

    ============================  ==========================================
    key                           callback
    ============================  ==========================================
    ``phase_memory={...}``        :class:`~lightning_pilot.PhaseMemoryMonitor`
    ``batch_inspector={...}``     :class:`~lightning_pilot.BatchInspector`
    ``effective_batch={...}``     :class:`~lightning_pilot.EffectiveBatchAccountant`
    ``resume={...}``              :class:`~lightning_pilot.ResumeVerifier`
    ``predictions={...}``         :class:`~lightning_pilot.ValidationPredictionWriter`
    ``ledger={...}``              :class:`~lightning_pilot.DivergenceLedger`
    ============================  ==========================================

    Args:
        out_dir: the output folder of every callback (default ``<default_root_dir>/pilot``).
        experiment: the ledger's experiment name.
        variant: the ledger's variant name.
        seed: the seed recorded in the ledger (the Trainer's seeding stays yours).
        adapter: how every callback reads batches (default :class:`BatchAdapter`).
        **options: per-callback options, keyed as in the table.

    Returns:
        The callbacks, ready for ``Trainer(callbacks=...)`` (add your own to the list).

    Raises:
        ValueError: an unknown key (the message lists the valid ones), an unknown option of a
            callback, an option set for every callback at once (``out_dir``, ``adapter``,
            ``experiment``, ``variant``, ``seed``) given to one of them, ``overfit=True`` or
            ``overfit={...}`` (see above), or a shared argument out of range; the callbacks' own
            validation errors pass through.
        TypeError: an option value that is not a dict or a bool, or a shared argument of the
            wrong type.

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
    # Checked here, not only by the callbacks: they hold even when the ledger is left out.
    validate.path(owner, "out_dir", out_dir)
    validate.run_name(owner, "experiment", experiment)
    validate.run_name(owner, "variant", variant)
    validate.integer(owner, "seed", seed, minimum=0, optional=True)
    validate.instance(owner, "adapter", adapter, BatchAdapter)
    configured = {key: _options_for(key, options.get(key)) for key in PILOT_OPTION_KEYS}
    callbacks: list[PilotCallback] = []
    for key, kwargs in configured.items():
        if kwargs is None:
            continue
        cls = _CALLBACKS[key].load()
        shared = {"experiment": experiment, "variant": variant, "seed": seed, "adapter": adapter}
        for name in _parameters(cls):
            if name in shared and (name != "adapter" or adapter is not None):
                kwargs = dict(kwargs, **{name: shared[name]})
        callbacks.append(cls(**kwargs, out_dir=out_dir))
    return callbacks
