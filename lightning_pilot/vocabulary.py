"""The words every table, report and plot shares (no torch, no pyarrow): phases, verdicts and
memory categories. A measured phase row and an estimated row name the same quantity by the same
column and join on ``("phase", "first")``."""

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
    "pilot",
]
#: Every phase a phase row may name, in campaign order.
PHASES: Final[tuple[str, ...]] = get_args(Phase)
#: Each phase's place in campaign order.
PHASE_RANK: Final[dict[str, int]] = {phase: index for index, phase in enumerate(PHASES)}

#: The phases an estimate models, in campaign order, as the phase table's ``(phase, first)``
#: (the first optimizer step allocates the optimizer state; the others are later occurrences).
ESTIMATE_PHASES: Final[tuple[tuple[str, bool], ...]] = (
    ("forward", False),
    ("backward", False),
    ("optimizer_step", True),
    ("optimizer_step", False),
    ("validation", False),
    ("checkpoint_save", False),
)


def phase_label(phase: str, first: bool) -> str:
    """The one-word name of a phase row: ``phase``, or ``phase + "_first"`` for a first one."""
    return f"{phase}_first" if first else phase


def phase_of_label(label: str) -> tuple[str, bool]:
    """``(phase, first)`` of a :func:`phase_label`; a label not of a known phase raises."""
    if label in PHASE_RANK:
        return label, False
    stem = label.removesuffix("_first")
    if stem != label and stem in PHASE_RANK:
        return stem, True
    raise ValueError(f"phase label {label!r} is not a phase nor a phase + '_first'; {PHASES}")


def phase_rank(phase: object) -> int:
    """The sort key of a phase in campaign order; a phase of no known name sorts last."""
    return PHASE_RANK.get(phase, 99) if isinstance(phase, str) else 99


Verdict = Literal["pass", "warn", "fail", "not_checked"]
VERDICTS: Final[tuple[str, ...]] = get_args(Verdict)
#: The verdicts worst first, as reports list them.
VERDICT_ORDER: Final[tuple[str, ...]] = ("fail", "warn", "not_checked", "pass")
#: Each verdict's place in :data:`VERDICT_ORDER` (0: the worst).
VERDICT_RANK: Final[dict[str, int]] = {verdict: i for i, verdict in enumerate(VERDICT_ORDER)}

#: The order :func:`worst_verdict` aggregates in: ``not_checked`` after ``pass``.
_AGGREGATION_ORDER: Final = (*(v for v in VERDICT_ORDER if v != "not_checked"), "not_checked")
_AGGREGATION_RANK: Final = {verdict: i for i, verdict in enumerate(_AGGREGATION_ORDER)}


def verdict_rank(verdict: object) -> int:
    """The sort key of a verdict, worst first; a verdict of no known name sorts last."""
    return VERDICT_RANK.get(verdict, 9) if isinstance(verdict, str) else 9


def worst_verdict(verdicts: Iterable[str]) -> str:
    """The verdict of several checks together: ``fail``, else ``warn``, else ``pass``, else
    ``not_checked`` (also for none): one real measurement says more than an absent one. A
    verdict outside :data:`VERDICTS` raises ``ValueError``."""
    best = len(_AGGREGATION_ORDER) - 1
    for verdict in verdicts:
        rank = _AGGREGATION_RANK.get(verdict)
        if rank is None:
            raise ValueError(f"verdict={verdict!r} is not a verdict; expected one of {VERDICTS}.")
        best = min(best, rank)
    return _AGGREGATION_ORDER[best]


#: What the bytes live at a phase's peak are, in the order an estimate assigns them (first
#: match wins); activations are what autograd saves for backward.
CATEGORIES: Final[tuple[str, ...]] = (
    "param",
    "buffer",
    "grad",
    "optimizer_state",
    "batch",
    "activations",
    "temporaries",
)
#: The column of each category, in the phase table and the estimate alike.
CATEGORY_COLUMNS: Final[dict[str, str]] = {name: f"{name}_bytes" for name in CATEGORIES}
#: The categories the phase table measures (the model's state); the estimate has them all.
MEASURED_CATEGORIES: Final[tuple[str, ...]] = ("param", "buffer", "grad", "optimizer_state")
