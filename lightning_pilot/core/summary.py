"""A run's summary for the Trainer's loggers, from its phase rows and what callbacks add
(docs/loggers.md lists the keys)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from lightning_pilot.vocabulary import VERDICTS, phase_label, verdict_rank

#: Verdicts as numbers, for loggers that plot only numbers (a higher code is worse).
VERDICT_CODES: Final = {"pass": 0.0, "warn": 1.0, "fail": 2.0, "not_checked": -1.0}

#: The phase-row columns logged per phase (first occurrence and later ones apart).
_PHASE_COLUMNS: Final = ("peak_allocated_bytes", "duration_s")


@dataclass
class Summary:
    """Metrics (numbers, for ``log_metrics``) and texts (words such as a verdict, for
    ``log_hyperparams``) under ``pilot/`` keys; a value not measured is left out, never 0.

    Example:
        >>> rows = [
        ...     {"phase": "forward", "first": True, "verdict": "pass", "peak_allocated_bytes": 2048,
        ...      "duration_s": 0.5},
        ...     {"phase": "resume", "first": True, "verdict": "fail", "peak_allocated_bytes": None,
        ...      "duration_s": None},
        ... ]
        >>> summary = Summary.of_phase_rows(rows)
        >>> summary.metrics["pilot/forward_first/peak_allocated_bytes"], summary.texts
        (2048.0, {'pilot/verdict/forward': 'pass', 'pilot/verdict/resume': 'fail'})
        >>> summary.metrics["pilot/verdicts/fail"], summary.metrics["pilot/verdict_code/resume"]
        (1.0, 2.0)
    """

    metrics: dict[str, float] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of_phase_rows(cls, rows: Iterable[Mapping[str, Any]]) -> Summary:
        """Per phase its peak and duration, its verdict (word and code); verdict counts."""
        summary = cls()
        verdicts: dict[str, list[str]] = {}
        counts = dict.fromkeys(VERDICTS, 0.0)
        for row in rows:
            phase, verdict = str(row.get("phase")), row.get("verdict")
            key = phase_label(phase, bool(row.get("first")))
            summary.add(**{f"{key}/{c}": row.get(c) for c in _PHASE_COLUMNS})
            if verdict in counts:
                counts[verdict] += 1
                verdicts.setdefault(phase, []).append(verdict)
        for phase, found in verdicts.items():
            # The worst of its rows in the display order (a row not checked outranks a pass).
            worst = min(found, key=verdict_rank)
            summary.texts[f"pilot/verdict/{phase}"] = worst
            summary.metrics[f"pilot/verdict_code/{phase}"] = VERDICT_CODES[worst]
        summary.add(**{f"verdicts/{verdict}": n for verdict, n in counts.items()})
        return summary

    def add(self, **values: Any) -> None:
        """Add values under ``pilot/<name>``: numbers as metrics, strings as texts; ``None`` and
        non-finite numbers are left out."""
        for name, value in values.items():
            key = f"pilot/{name}"
            if isinstance(value, str):
                self.texts[key] = value
            elif isinstance(value, int | float) and math.isfinite(value):
                self.metrics[key] = float(value)

    def update(self, other: Summary) -> None:
        """Take ``other``'s values (they win over the same keys here)."""
        self.metrics.update(other.metrics)
        self.texts.update(other.texts)
