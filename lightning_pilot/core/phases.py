"""The phase and verdict vocabularies of the phase table.

These are the words a phase row may use. They live here, free of Lightning, so that the
storage layer, the callbacks and the readers agree on them.

Example:
    >>> from lightning_pilot.core.phases import PHASES, worst_verdict
    >>> "optimizer_step" in PHASES
    True
    >>> worst_verdict(["pass", "warn", "not_checked"])
    'warn'
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal, get_args

Phase = Literal[
    "setup",
    "data",
    "forward",
    "backward",
    "optimizer_step",
    "validation",
    "test",
    "predict",
    "checkpoint_save",
    "checkpoint_load",
    "export",
    "resume",
    "overfit",
]
Verdict = Literal["pass", "warn", "fail", "not_checked"]
Counter = Literal["cuda_allocator", "accelerator_allocator", "cpu_tensor_tracker", "none"]

PHASES: Final[tuple[str, ...]] = get_args(Phase)
VERDICTS: Final[tuple[str, ...]] = get_args(Verdict)
COUNTERS: Final[tuple[str, ...]] = get_args(Counter)

# A failed check outranks a warning, which outranks a pass. ``not_checked`` only wins when
# nothing was checked at all: one real measurement says more than an absent one.
_SEVERITY: Final[dict[str, int]] = {"not_checked": 0, "pass": 1, "warn": 2, "fail": 3}


def worst_verdict(verdicts: Iterable[str]) -> str:
    """Combine verdicts of several checks into the verdict of their phase.

    Args:
        verdicts: verdicts from :data:`VERDICTS`.

    Returns:
        ``fail`` if any failed, else ``warn`` if any warned, else ``pass`` if any passed,
        else ``not_checked`` (also for an empty input).

    Raises:
        ValueError: a verdict outside the vocabulary.
    """
    worst = "not_checked"
    for verdict in verdicts:
        if verdict not in _SEVERITY:
            raise ValueError(f"verdict={verdict!r} is not a verdict; expected one of {VERDICTS}.")
        if _SEVERITY[verdict] > _SEVERITY[worst]:
            worst = verdict
    return worst
