"""Reports on what the callbacks wrote, without a Trainer, torch or Lightning.

* :mod:`~lightning_pilot.report.units`: human units and :func:`terminal_safe`, which every
  value from a file passes through before it is printed.
* :mod:`~lightning_pilot.report.analysis`: pure functions over DataFrames (the gate, memory,
  step time, campaign packages, variant costs).
* :mod:`~lightning_pilot.report.load`: what run folders and ledgers hold, read through
  :mod:`lightning_pilot.storage` and :class:`lightning_pilot.Ledger`.
* :mod:`~lightning_pilot.report.tables` (console), :mod:`~lightning_pilot.report.sheet`
  (the Markdown choice sheet) and :mod:`~lightning_pilot.report.plots` (PNG, with the optional
  matplotlib; imported on its own).

Example:
    >>> from lightning_pilot.report import format_bytes, format_duration, parse_size
    >>> parse_size("80GiB"), format_bytes(parse_size("141G")), format_duration(None)
    (85899345920, '141.0 GiB', 'n/m')
"""

from lightning_pilot.core.validate import parse_size
from lightning_pilot.report.analysis import GATE_STATUSES, sampled_out, step_time
from lightning_pilot.report.load import variant_costs
from lightning_pilot.report.sheet import (
    SHEET_NAME,
    choice_sheet,
    publish_choice_sheet,
    write_choice_sheet,
)
from lightning_pilot.report.tables import (
    comparison_text,
    gate_result,
    ledger_text,
    phase_table_text,
    plan_text,
    render_table,
    variant_costs_text,
)
from lightning_pilot.report.units import (
    CELL_LIMIT,
    MAX_SIZE,
    NOT_MEASURED,
    TEXT_LIMIT,
    format_bytes,
    format_duration,
    terminal_safe,
)

__all__ = [
    "CELL_LIMIT",
    "GATE_STATUSES",
    "MAX_SIZE",
    "NOT_MEASURED",
    "SHEET_NAME",
    "TEXT_LIMIT",
    "choice_sheet",
    "comparison_text",
    "format_bytes",
    "format_duration",
    "gate_result",
    "ledger_text",
    "parse_size",
    "phase_table_text",
    "plan_text",
    "publish_choice_sheet",
    "render_table",
    "sampled_out",
    "step_time",
    "terminal_safe",
    "variant_costs",
    "variant_costs_text",
    "write_choice_sheet",
]
