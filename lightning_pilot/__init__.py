"""lightning-pilot: PyTorch Lightning callbacks for pilot runs (README.md, docs/architecture.md).

Names are imported on first use, so reading a ledger or running ``lightning-pilot --version``
does not pay for importing Lightning.

Example:
    >>> import lightning_pilot
    >>> lightning_pilot.__version__
    '0.4.0'
    >>> lightning_pilot.PilotRun.__name__
    'PilotRun'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_pilot import callbacks as _callbacks
from lightning_pilot._version import __version__

if TYPE_CHECKING:
    from lightning_pilot.callbacks import *  # noqa: F403 (the registry's names)
    from lightning_pilot.core.batches import BatchAdapter
    from lightning_pilot.core.compare import Comparison, compare_runs
    from lightning_pilot.core.divergence import DivergenceRules
    from lightning_pilot.core.ids import new_run_id
    from lightning_pilot.core.update_plan import UpdatePlan, plan_updates
    from lightning_pilot.ledger import Ledger
    from lightning_pilot.pilot import pilot_callbacks
    from lightning_pilot.report import choice_sheet, parse_size, write_choice_sheet
    from lightning_pilot.run import PilotCallback, PilotRun
    from lightning_pilot.storage import read_ledger_records, read_phase_table

_LAZY = {
    **_callbacks.LAZY,
    "BatchAdapter": "lightning_pilot.core.batches",
    "Comparison": "lightning_pilot.core.compare",
    "DivergenceRules": "lightning_pilot.core.divergence",
    "Ledger": "lightning_pilot.ledger",
    "PilotCallback": "lightning_pilot.run",
    "PilotRun": "lightning_pilot.run",
    "UpdatePlan": "lightning_pilot.core.update_plan",
    "choice_sheet": "lightning_pilot.report",
    "compare_runs": "lightning_pilot.core.compare",
    "new_run_id": "lightning_pilot.core.ids",
    "parse_size": "lightning_pilot.report",
    "pilot_callbacks": "lightning_pilot.pilot",
    "plan_updates": "lightning_pilot.core.update_plan",
    "read_ledger_records": "lightning_pilot.storage",
    "read_phase_table": "lightning_pilot.storage",
    "write_choice_sheet": "lightning_pilot.report",
}

__all__ = [
    "BatchAdapter",
    "Comparison",
    "DivergenceRules",
    "Ledger",
    "PilotCallback",
    "PilotRun",
    "UpdatePlan",
    "__version__",
    "choice_sheet",
    "compare_runs",
    "new_run_id",
    "parse_size",
    "pilot_callbacks",
    "plan_updates",
    "read_ledger_records",
    "read_phase_table",
    "write_choice_sheet",
]

__all__ += _callbacks.__all__


__getattr__, __dir__ = _callbacks.lazy_names(globals(), _LAZY)
