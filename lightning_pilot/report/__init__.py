"""Reports on what the callbacks wrote, without a Trainer, torch or Lightning: ``load`` reads,
pure functions over DataFrames analyse (``analysis``, ``plot_data``), and ``tables`` (console),
``sheet`` (the Markdown choice sheet) and ``plots`` (PNG, optional matplotlib) render. See
docs/architecture.md and docs/cli.md.

Example:
    >>> from lightning_pilot.report import format_bytes, format_duration, parse_size
    >>> parse_size("80GiB"), format_bytes(parse_size("141G")), format_duration(None)
    (85899345920, '141.0 GiB', 'n/m')
"""

from lightning_pilot.core.validate import parse_size
from lightning_pilot.report.analysis import GATE_STATUSES, sampled_out
from lightning_pilot.report.load import read_estimate, variant_costs
from lightning_pilot.report.sheet import choice_sheet, write_choice_sheet
from lightning_pilot.report.tables import (
    comparison_text,
    gate_result,
    ledger_text,
    phase_table_text,
    plan_text,
    render_table,
    variant_costs_text,
)
from lightning_pilot.report.units import NOT_MEASURED, format_bytes, format_duration, terminal_safe

__all__ = [
    "GATE_STATUSES",
    "NOT_MEASURED",
    "choice_sheet",
    "comparison_text",
    "format_bytes",
    "format_duration",
    "gate_result",
    "ledger_text",
    "parse_size",
    "phase_table_text",
    "plan_text",
    "read_estimate",
    "render_table",
    "sampled_out",
    "terminal_safe",
    "variant_costs",
    "variant_costs_text",
    "write_choice_sheet",
]
