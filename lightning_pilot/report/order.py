"""The order the reports list phases and verdicts in, from :mod:`lightning_pilot.vocabulary`:
phases in campaign order (an unknown phase last), verdicts worst first (an unknown verdict last).

Example:
    >>> sorted(["backward", "my_phase", "forward"], key=phase_rank)
    ['forward', 'backward', 'my_phase']
    >>> sorted(["pass", "fail", "later", "warn"], key=verdict_rank)
    ['fail', 'warn', 'pass', 'later']
"""

from __future__ import annotations

from typing import Final

from lightning_pilot.vocabulary import PHASE_RANK, VERDICT_RANK, phase_rank, verdict_rank

__all__ = ["PHASE_ORDER", "VERDICT_RANK", "phase_rank", "verdict_rank"]

#: Each phase's place in campaign order (:data:`lightning_pilot.vocabulary.PHASE_RANK`).
PHASE_ORDER: Final = PHASE_RANK
