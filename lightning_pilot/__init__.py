"""lightning-pilot: PyTorch Lightning callbacks for pilot runs.

Before renting GPUs for a training campaign, a short pilot answers with measurements: does the
loop train the right task, does every phase fit in memory and how long does it take, does
training resume from a checkpoint, how many examples does one update see, and which variants
diverged or crashed and why. Add the callbacks to the Trainer you already have; they share one
run and write a Parquet phase table and an append-only run ledger.

Example:
    >>> import lightning_pilot
    >>> lightning_pilot.__version__
    '0.1.0'
"""

from lightning_pilot._version import __version__
from lightning_pilot.core.ids import new_run_id
from lightning_pilot.run import PilotCallback, PilotRun
from lightning_pilot.storage import read_ledger_records, read_phase_table

__all__ = [
    "PilotCallback",
    "PilotRun",
    "__version__",
    "new_run_id",
    "read_ledger_records",
    "read_phase_table",
]
