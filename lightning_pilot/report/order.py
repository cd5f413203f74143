"""The order the reports list phases and verdicts in: phases in campaign order (an unknown
phase last), verdicts worst first (an unknown verdict last).

Example:
    >>> sorted(["backward", "my_phase", "forward"], key=phase_rank)
    ['forward', 'backward', 'my_phase']
    >>> sorted(["pass", "fail", "later", "warn"], key=verdict_rank)
    ['fail', 'warn', 'pass', 'later']
"""

from __future__ import annotations

from typing import Any, Final

from lightning_pilot.core.phases import PHASES

#: Each phase's place in campaign order.
PHASE_ORDER: Final = {phase: index for index, phase in enumerate(PHASES)}
#: Each verdict's place, worst first.
VERDICT_RANK: Final = {"fail": 0, "warn": 1, "not_checked": 2, "pass": 3}


def phase_rank(phase: Any) -> int:
    """The sort key of a phase in campaign order; a phase of no known name sorts last."""
    return PHASE_ORDER.get(phase, 99)


def verdict_rank(verdict: Any) -> int:
    """The sort key of a verdict, worst first; a verdict of no known name sorts last."""
    return VERDICT_RANK.get(verdict, 9)
