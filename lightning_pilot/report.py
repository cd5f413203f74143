"""Console tables for phase tables, ledgers and comparisons, and the choice sheet.

Everything here reads files that the callbacks wrote; nothing needs a Trainer or imports
Lightning. Tables are plain fixed-width text with human units (bytes as KiB/MiB/GiB, durations
as ms/s); a value that was not measured prints ``n/m``, never 0.

* :func:`phase_table_text`, :func:`ledger_text`, :func:`comparison_text`, :func:`plan_text`:
  the tables the ``lightning-pilot`` command prints.
* :func:`choice_sheet` / :func:`write_choice_sheet`: the choice sheet of one run, in Markdown
  (``runs/<run_id>/sheet.md``): memory per GPU and the phase that sets the peak, the largest
  sizes seen, precision, micro-batch, accumulation, replicas, strategy, the verdict of every
  phase (blocking failures first), the expected result, and the headroom on a target GPU.
* :func:`gate_result`: the command line's exit verdict (a failed check, or a run that
  diverged or failed) and the ``Result:`` summary naming them.
* :func:`sampled_out`: later occurrences counted but not measured by design (sampling); they
  are not listed as problems.
* :func:`parse_size`: ``"80GiB"``, ``"80GB"``, ``"141G"``, ``"24000MiB"`` to bytes.
* :func:`terminal_safe`: text read from a file made safe to print: control characters (escape
  sequences, carriage returns, newlines inside a value) shown as visible escapes, absurd lengths
  cut. Every value from a file passes through it before it reaches a table or a line.

Example:
    >>> from lightning_pilot.report import format_bytes, format_duration, parse_size
    >>> parse_size("80GiB"), parse_size("80GB"), parse_size("24000MiB")
    (85899345920, 80000000000, 25165824000)
    >>> format_bytes(parse_size("141G")), format_bytes(None)
    ('141.0 GiB', 'n/m')
    >>> format_duration(0.0123), format_duration(2.5), format_duration(None)
    ('12.3 ms', '2.50 s', 'n/m')
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final

import pandas as pd

from lightning_pilot import storage
from lightning_pilot._version import __version__
from lightning_pilot.core import validate
from lightning_pilot.core.accounting import UpdatePlan, effective_batch_text
from lightning_pilot.core.compare import FAILED_STATUSES, STATUS_ORDER, Comparison
from lightning_pilot.core.phases import PHASES

__all__ = [
    "GATE_STATUSES",
    "NOT_MEASURED",
    "SHEET_NAME",
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
    "terminal_safe",
    "write_choice_sheet",
]

#: How a null (not measured) value prints.
NOT_MEASURED: Final = "n/m"
#: The choice sheet's file name in the run folder (``sheet-2.md``, ... when it exists).
SHEET_NAME: Final = "sheet.md"
#: Ledger statuses that fail the command line's exit code (the CI gate): the run did not train
#: to its end (``diverged``, ``oom``, ``failed``; see ``docs/ledger.md``).
GATE_STATUSES: Final = FAILED_STATUSES

#: The largest size :func:`parse_size` accepts: what a signed 64-bit byte count holds (8 EiB).
MAX_SIZE: Final = validate.INT64_MAX
#: The longest a value from a file prints (:func:`terminal_safe`), in a line and in a table cell.
TEXT_LIMIT: Final = 2000
CELL_LIMIT: Final = 200
# C0 and C1 control characters (ESC, CR, BEL, NUL, newline, ...), DEL, the Unicode line and
# paragraph separators, the bidirectional overrides and isolates (text that reads reversed) and
# lone surrogates (bytes of a file name that are not UTF-8, which no terminal can print).
_UNSAFE: Final = re.compile(
    "[\x00-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
_UNSAFE_BUT_NEWLINE: Final = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
_ORDER: Final = {phase: index for index, phase in enumerate(PHASES)}
_VERDICT_RANK: Final = {"fail": 0, "warn": 1, "not_checked": 2, "pass": 3}


# --------------------------------------------------------------------------------------------
# Units
# --------------------------------------------------------------------------------------------


_NAMED_ESCAPES: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED_ESCAPES:
        return _NAMED_ESCAPES[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def terminal_safe(
    text: object, *, limit: int | None = TEXT_LIMIT, keep_newlines: bool = False
) -> str:
    r"""Text from a file, made safe to print on a terminal.

    Every C0 and C1 control character (an escape sequence's ESC, a carriage return, a bell, a
    newline inside a value), DEL, the Unicode line separators, the bidirectional overrides and
    lone surrogates become visible escapes (``\x1b``, ``\u202e``), so a file can neither drive
    the terminal nor break a table's row in two. Text longer than ``limit`` is cut, saying how
    much was left out. Applying it twice changes nothing.

    Args:
        text: the value (``str()`` of it).
        limit: the most characters returned; ``None``: no limit.
        keep_newlines: keep ``\n`` (for whole blocks of output whose lines are ours).

    Example:
        >>> print(terminal_safe("ctl\x1b[2J\r\nFAKE"))
        ctl\x1b[2J\r\nFAKE
        >>> terminal_safe("x" * 50, limit=20)
        'xx...[48 more chars]'
    """
    value = str(text)
    pattern = _UNSAFE_BUT_NEWLINE if keep_newlines else _UNSAFE
    value = pattern.sub(_escape, value)
    if limit is not None and len(value) > limit:
        marker = f"...[{len(value)} more chars]"  # never shorter than the final marker
        keep = max(0, limit - len(marker))
        value = value[:keep] + f"...[{len(value) - keep} more chars]"
    return value


def _shown(text: object) -> str:
    """``repr`` of a user's value for an error message, cut when absurdly long."""
    shown = repr(text)
    return shown if len(shown) <= 60 else f"{shown[:40]}...{shown[-12:]} ({len(shown)} chars)"


def parse_size(text: str, name: str = "size") -> int:
    """Parse a memory size into bytes.

    ``KiB``/``MiB``/``GiB``/``TiB`` and the bare letters ``K``/``M``/``G``/``T`` are powers of
    1024 (as ``nvidia-smi`` and ``torch.cuda`` report them); ``KB``/``MB``/``GB``/``TB`` are
    powers of 1000. A plain number is bytes. Case does not matter.

    Args:
        text: the size, e.g. ``"80GiB"``, ``"80GB"``, ``"141G"``, ``"24000MiB"``.
        name: the argument's name, for the error message.

    Raises:
        ValueError: not a size of at least 1 byte with a known unit, or more than
            :data:`MAX_SIZE` (a 400-digit number, ``inf``, ``nan``).

    Example:
        >>> parse_size("1.5 GiB")
        1610612736
        >>> parse_size("80 parsecs", "gpu_memory")
        Traceback (most recent call last):
        ...
        ValueError: gpu_memory='80 parsecs' is not a size: expected a number and a unit ...
    """
    # One size parser (ASCII digits only: '١٢G' is not 12 GiB), shared with the constructors.
    return validate.parse_size(text, name)


def _null(value: Any) -> bool:
    if value is None or value is pd.NA or value is pd.NaT:
        return True
    return isinstance(value, float) and math.isnan(value)


def format_bytes(value: Any) -> str:
    """Bytes in B/KiB/MiB/GiB/TiB with one decimal; null prints ``n/m``."""
    if _null(value):
        return NOT_MEASURED
    size = float(value)
    sign = "-" if size < 0 else ""
    size = abs(size)
    if size < 1024:
        return f"{sign}{size:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{sign}{size:.1f} {unit}"


def format_duration(value: Any) -> str:
    """Seconds as ms below one second, s below ten minutes, else minutes; null prints ``n/m``."""
    if _null(value):
        return NOT_MEASURED
    seconds = float(value)
    if seconds < 1.0:
        return f"{seconds * 1000:.1f} ms"
    if seconds < 600.0:
        return f"{seconds:.2f} s"
    return f"{seconds / 60:.1f} min"


def _text(value: Any) -> str:
    """A value from a file as text: ``n/m`` when null, else :func:`terminal_safe`."""
    if _null(value):
        return NOT_MEASURED
    if isinstance(value, float):
        return f"{value:.4g}"
    return terminal_safe(value)


def _joined(values: Any) -> str:
    """Distinct non-null values from a file, sorted and joined; ``n/m`` when there are none."""
    return ", ".join(sorted({_text(v) for v in values if not _null(v)})) or NOT_MEASURED


def _number(value: Any) -> str:
    if _null(value):
        return NOT_MEASURED
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, float):
        return f"{value:.4g}"
    return f"{int(value):,}"


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def render_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()
) -> str:
    """Fixed-width text table: a header, a rule and the rows; ``right``: right-aligned columns.

    Every cell passes through :func:`terminal_safe` (capped at :data:`CELL_LIMIT`): a value
    from a file cannot break its row or drive the terminal.

    Example:
        >>> print(render_table(["phase", "peak"], [["forward", "1.0 MiB"]], right=[1]))
        phase       peak
        -------  -------
        forward  1.0 MiB
    """
    headers = [terminal_safe(h, limit=CELL_LIMIT) for h in headers]
    rows = [[terminal_safe(cell, limit=CELL_LIMIT) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(row) for row in rows]
    return "\n".join(out)


def _markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def cells(values: Sequence[str]) -> str:
        safe = (terminal_safe(v, limit=CELL_LIMIT).replace("|", "\\|") for v in values)
        return "| " + " | ".join(safe) + " |"

    return "\n".join([cells(headers), "|" + "---|" * len(headers), *(cells(r) for r in rows)])


def _occurrence(first: Any) -> str:
    if _null(first):
        return "all"
    return "first" if bool(first) else "later"


def _no_checks(value: Any) -> bool:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return True
    return len(value) == 0


def sampled_out(frame: pd.DataFrame) -> pd.Series:
    """Phase rows of later occurrences that happened but were, by design, not measured.

    PhaseMemoryMonitor measures the pilot window and one update in ``sample_every``; a later
    validation is measured only when the update before it was. Such a row keeps its count, its
    null measurements and ``verdict="not_checked"`` with the reason, so the table stays honest;
    but it is not a problem to act on, so the tables list it apart, never under "Not passed".

    Returns:
        A boolean Series aligned with ``frame``: ``first`` is false, ``occurrences > 0``,
        ``measured_occurrences == 0``, no check recorded and verdict ``not_checked``.
    """
    if frame.empty:
        return pd.Series(False, index=frame.index, dtype=bool)
    later = ~frame["first"].fillna(True).astype(bool)
    happened = frame["occurrences"].fillna(0).astype("int64") > 0
    unmeasured = frame["measured_occurrences"].fillna(-1).astype("int64") == 0
    unchecked = (frame["verdict"] == "not_checked") & frame["checks"].map(_no_checks)
    mask: pd.Series = (later & happened & unmeasured & unchecked).astype(bool)
    return mask


def _sampled_line(rows: pd.DataFrame) -> str:
    """One line naming the sampled-out rows (:func:`sampled_out`), each phase once."""
    counts: dict[str, int] = {}
    for data in rows.to_dict("records"):
        key = f"{_text(data['phase'])} ({_occurrence(data['first'])}"
        counts[key] = counts.get(key, 0) + int(data["occurrences"])
    named = ", ".join(f"{key}, {count} occurrence(s))" for key, count in counts.items())
    return f"Not measured by design (outside the pilot window and the sampled updates): {named}"


def gate_result(
    phases: pd.DataFrame | None,
    runs: pd.DataFrame | None,
    *,
    skipped: Sequence[str] = (),
) -> tuple[bool, str]:
    """The command line's exit verdict and the ``Result:`` summary that names the reasons.

    The gate fails when a phase row has verdict ``fail``, or a ledger run has a status in
    :data:`GATE_STATUSES` (``diverged``, ``oom``, ``failed``) or a status the ledger does not
    define (a newer writer's, or a forged one: it cannot be judged, so it never passes). The
    summary names every run that fails it: its id, variant, and the failed checks, or its
    status and stop cause. Files that could not be read (``skipped``) are named too: with them
    the summary never reads as a clean result, since what they held was not checked (the
    command line exits 2 then, unless the gate failed on what was read).

    Args:
        phases: the phase rows in scope (:func:`~lightning_pilot.read_phase_table`), or
            ``None`` when no phase table was read.
        runs: the ledger runs in scope (:meth:`lightning_pilot.Ledger.runs`), or ``None``
            when no ledger was read.
        skipped: what could not be read, one description per file (``"<path>: <why>"``).

    Returns:
        ``(failed, text)``: ``failed`` only for a failed check or a run that did not end well.

    Example:
        >>> import pandas as pd
        >>> runs = pd.DataFrame({"run_id": ["r1", "r2"], "variant": ["ctl", "hot"],
        ...                      "seed": [0, 0], "status": ["completed", "diverged"],
        ...                      "stop_cause": ["max_steps", "loss_blowup"], "stop_step": [6, 4]})
        >>> failed, text = gate_result(None, runs)
        >>> failed
        True
        >>> print(text)
        Result: 1 run(s) diverged or failed (exit 1):
          run r2  variant hot  seed 0  status diverged  stop cause loss_blowup at step 4
        >>> gate_result(None, runs.iloc[:1])
        (False, 'Result: no failed check, no diverged or failed run (1 ledger run(s) checked;
        no phase table read).')
    """
    variants: dict[str, Any] = {}
    bad_runs = pd.DataFrame()
    unknown = 0
    if runs is not None and not runs.empty:
        if "variant" in runs.columns:
            variants = dict(zip(runs["run_id"].astype(str), runs["variant"], strict=True))
        status = runs["status"].astype(object)
        strange = status.notna() & ~status.isin(storage.STATUSES)
        unknown = int(strange.sum())
        bad_runs = runs[status.isin(GATE_STATUSES) | strange]
    failed_checks: dict[str, list[str]] = {}
    if phases is not None and not phases.empty:
        for data in phases[phases["verdict"] == "fail"].to_dict("records"):
            checks: Any = [] if _no_checks(data["checks"]) else data["checks"]
            names = [_text(c["name"]) for c in checks if c["verdict"] == "fail"]
            label = f"{_text(data['phase'])} ({_occurrence(data['first'])})"
            item = f"{label}: {', '.join(names) or 'verdict fail'}"
            found = failed_checks.setdefault(str(data["run_id"]), [])
            if item not in found:
                found.append(item)
    unread = _skipped_lines(skipped)
    if not failed_checks and bad_runs.empty:
        counted = []
        if runs is not None:
            counted.append(f"{len(runs)} ledger run(s) checked")
        else:
            counted.append("no ledger read: run statuses not checked")
        if phases is None:
            counted.append("no phase table read")
        if skipped:
            return False, "\n".join(
                [
                    f"Result: {len(skipped)} file(s) skipped (unreadable), so not everything in"
                    " scope was checked: no failed check and no diverged or failed run in what"
                    " was read (" + "; ".join(counted) + ") (exit 2):",
                    *unread,
                ]
            )
        return False, (
            "Result: no failed check, no diverged or failed run (" + "; ".join(counted) + ")."
        )
    parts = []
    if failed_checks:
        parts.append(f"a check failed (verdict fail) in {len(failed_checks)} run(s)")
    if len(bad_runs) > unknown:
        parts.append(f"{len(bad_runs) - unknown} run(s) diverged or failed")
    if unknown:
        parts.append(f"{unknown} run(s) with an unknown status")
    lines = ["Result: " + " and ".join(parts) + " (exit 1):"]
    for run_id, items in failed_checks.items():
        variant = variants.get(run_id)
        named = f"  variant {_text(variant)}" if run_id in variants else ""
        lines.append(f"  run {_text(run_id)}{named}  check failed: {'; '.join(items)}")
    for data in bad_runs.to_dict("records"):
        step = data.get("stop_step")
        at = "" if _null(step) else f" at step {_number(step)}"
        why = "" if data.get("status") in GATE_STATUSES else " (unknown status, not judged)"
        lines.append(
            f"  run {_text(data['run_id'])}  variant {_text(data.get('variant'))}  seed"
            f" {_text(data.get('seed'))}  status {_text(data.get('status'))}{why}  stop"
            f" cause {_text(data.get('stop_cause'))}{at}"
        )
    if unread:
        lines += [f"  and {len(skipped)} file(s) skipped (unreadable), not checked:", *unread]
    return True, "\n".join(lines)


def _skipped_lines(skipped: Sequence[str], most: int = 20) -> list[str]:
    """One line per file that could not be read, the first ``most`` of them."""
    lines = [f"  skipped {terminal_safe(item)}" for item in skipped[:most]]
    if len(skipped) > most:
        lines.append(f"  and {len(skipped) - most} more")
    return lines


def phase_table_text(frame: pd.DataFrame) -> str:
    """The phase table as text: one block per run, attempt and rank, reasons below each block.

    Rows keep :func:`~lightning_pilot.storage.read_phase_table`'s order (runs in time order,
    phases in campaign order, first occurrence before the rest).
    """
    if frame.empty:
        return "(no phase rows)"
    blocks = []
    for (run_id, attempt, rank), rows in frame.groupby(
        ["run_id", "attempt", "rank"], sort=False, dropna=False
    ):
        head = (
            f"run {_text(run_id)}  attempt {_text(attempt)}  rank {_text(rank)}  device"
            f" {_joined(rows['device'])}  counter {_joined(rows['counter'])}"
        )
        table_rows = [
            [
                str(row.phase),
                _occurrence(row.first),
                _number(row.occurrences),
                _number(row.batch_size),
                _number(row.seq_len),
                format_bytes(row.peak_allocated_bytes),
                format_bytes(row.peak_reserved_bytes),
                format_duration(row.duration_s),
                format_duration(row.duration_median_s),
                str(row.verdict),
            ]
            for row in rows.itertuples(index=False)
        ]
        table = render_table(
            [
                "phase",
                "occ.",
                "count",
                "batch",
                "seq",
                "peak alloc",
                "peak reserved",
                "time",
                "median",
                "verdict",
            ],
            table_rows,
            right=[2, 3, 4, 5, 6, 7, 8],
        )
        skipped = sampled_out(rows)
        reasons = [
            f"  {_text(row.verdict)}: {_text(row.phase)} ({_occurrence(row.first)}):"
            f" {_text(row.reason)}"
            for row in rows[~skipped].itertuples(index=False)
            if row.verdict != "pass"
        ]
        reasons.sort(key=lambda line: _VERDICT_RANK.get(line.split(":")[0].strip(), 9))
        block = [head, table]
        if reasons:
            block += ["Not passed:", *reasons]
        if skipped.any():
            block.append(_sampled_line(rows[skipped]))
        blocks.append("\n".join(block))
    return "\n\n".join(blocks)


def ledger_text(runs: pd.DataFrame) -> str:
    """The folded ledger (:meth:`lightning_pilot.Ledger.runs`) as text, one row per run."""
    if runs.empty:
        return "(no runs in the ledger)"
    rows = []
    for data in runs.to_dict("records"):
        updates = _number(data.get("updates_done"))
        if not _null(data.get("planned_updates")):
            updates += f"/{_number(data.get('planned_updates'))}"
        rows.append(
            [
                str(data["run_id"]),
                _text(data.get("experiment")),
                _text(data.get("variant")),
                _text(data.get("seed")),
                _text(data.get("status")),
                _text(data.get("stop_cause")),
                updates,
                _number(data.get("effective_batch_size")),
                _text(data.get("lr")),
            ]
        )
    return render_table(
        [
            "run_id",
            "experiment",
            "variant",
            "seed",
            "status",
            "stop cause",
            "updates",
            "eff. batch",
            "lr",
        ],
        rows,
        right=[3, 6, 7, 8],
    )


def _with_ci(row: Mapping[Any, Any], name: str) -> str:
    value = _number(row.get(name))
    low, high = row.get(f"{name}_ci_low"), row.get(f"{name}_ci_high")
    if _null(low) or _null(high):
        return value
    return f"{value} [{_number(low)}, {_number(high)}]"


def _status_counts(row: Mapping[Any, Any]) -> str:
    """``"3 completed, 1 diverged"``; a status outside the ledger's vocabulary (a newer
    writer's, a forged one) is counted as what it is, ``unknown``, never as another."""
    counts = [f"{row[f'n_{status}']} {status}" for status in STATUS_ORDER if row.get(f"n_{status}")]
    unknown = int(row["n_runs"]) - sum(int(row.get(f"n_{status}") or 0) for status in STATUS_ORDER)
    if unknown > 0:
        counts.append(f"{unknown} unknown")
    return ", ".join(counts)


def comparison_text(comparison: Comparison, by: str = "variant") -> str:
    """A :class:`~lightning_pilot.core.compare.Comparison` as text.

    The summary (every run counted by status; median, mean and IQM with their bootstrap
    intervals when there were enough runs; paired differences against the control), then
    every run ranked best first, failed runs last, unfinished runs unranked.
    """
    summary_rows = []
    notes = []
    for row in comparison.summary.to_dict("records"):
        counts = _status_counts(row)
        paired = ""
        if comparison.control is not None and row[by] != comparison.control:
            if _null(row.get("paired_n")):
                paired = NOT_MEASURED
            else:
                paired = (
                    f"{_number(row.get('paired_mean_diff'))} over {row['paired_n']} seed(s),"
                    f" {row['paired_wins']} won"
                )
                if not _null(row.get("paired_ci_low")):
                    paired += (
                        f" [{_number(row['paired_ci_low'])}, {_number(row['paired_ci_high'])}]"
                    )
        summary_rows.append(
            [
                str(row[by]),
                str(row["n_runs"]),
                counts or "none",
                str(row["n_in_statistics"]),
                _with_ci(row, "median"),
                _with_ci(row, "mean"),
                _with_ci(row, "iqm"),
                paired,
            ]
        )
        if row.get("notes"):
            notes.append(f"  {_text(row[by])}: {terminal_safe(row['notes'])}")
    headers = [by, "runs", "by status", "in stats", "median", "mean", "iqm"]
    if comparison.control is not None:
        headers.append(f"vs {comparison.control} (mean diff)")
    else:
        summary_rows = [r[:-1] for r in summary_rows]
    direction = "lower" if comparison.mode == "min" else "higher"
    parts = [
        f"metric {terminal_safe(comparison.metric)} ({direction} is better)",
        render_table(headers, summary_rows, right=[1, 3]),
    ]
    if notes:
        parts += ["Notes:", *notes]
    runs = comparison.runs.copy()
    runs["_unranked"] = runs["rank"].isna()
    runs = runs.sort_values(["_unranked", "rank"], kind="stable")
    run_rows = [
        [
            "-" if _null(r["rank"]) else str(r["rank"]),
            str(r.get("run_id", "")),
            str(r[by]),
            _text(r["seed"]),
            _text(r["status"]),
            _text(r.get("stop_cause")),
            _number(r["value"]),
        ]
        for r in runs.to_dict("records")
    ]
    parts += [
        "",
        "Runs, best first (diverged, oom and failed runs rank worst; '-': unfinished, unranked):",
        render_table(
            ["rank", "run_id", by, "seed", "status", "stop cause", "value"],
            run_rows,
            right=[0, 3, 6],
        ),
    ]
    return "\n".join(parts)


def plan_text(plan: UpdatePlan) -> str:
    """An :class:`~lightning_pilot.core.accounting.UpdatePlan` as its summary line and fields."""
    fields = [
        ("dataset size", f"{plan.dataset_size:,}"),
        ("micro-batch size", f"{plan.micro_batch_size:,}"),
        ("accumulate_grad_batches (K)", f"{plan.accumulate_grad_batches:,}"),
        ("data-parallel replicas", f"{plan.dp_replicas:,}"),
        ("examples per update", f"{plan.examples_per_update:,}"),
        ("epochs (budget)", "none" if plan.epochs is None else f"{plan.epochs:,}"),
        ("max_steps (budget)", "none" if plan.max_steps is None else f"{plan.max_steps:,}"),
        ("micro-batches per replica per epoch", f"{plan.micro_batches_per_epoch:,}"),
        ("updates per epoch", f"{plan.updates_per_epoch:,}"),
        (
            "last window",
            f"{plan.last_window_micro_batches} of {plan.accumulate_grad_batches} micro-batches"
            f" (weight {plan.last_window_weight:.2f})",
        ),
        ("total updates", f"{plan.total_updates:,}"),
        ("examples seen", f"{plan.examples_seen:,}"),
        ("epochs completed", f"{plan.epochs_completed:,}"),
        ("ends mid-epoch", "yes" if plan.ends_mid_epoch else "no"),
        ("partial windows stepped", f"{plan.partial_windows:,}"),
        ("padding duplicates per epoch", f"{plan.duplicates_per_epoch:,}"),
    ]
    width = max(len(name) for name, _ in fields)
    return "\n".join([plan.describe(), "", *(f"{n.ljust(width)}  {v}" for n, v in fields)])


# --------------------------------------------------------------------------------------------
# The choice sheet
# --------------------------------------------------------------------------------------------


def _run_folder(run_dir: str | os.PathLike[str]) -> Path:
    root = Path(run_dir)
    if not root.exists():
        raise FileNotFoundError(f"run_dir={str(root)!r} does not exist.")
    if not (root / "phases.parquet").is_dir():
        runs = root / "runs"
        found = sorted(p.name for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else []
        hint = f"; runs here: {', '.join(found)}" if found else ""
        raise ValueError(
            f"run_dir={str(root)!r} is not a run folder: expected <out_dir>/runs/<run_id> holding"
            f" phases.parquet{hint}."
        )
    return root


def _ledger_rows(run: Path) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The run's folded ledger row and its last curve values (``{name: (step, value)}``)."""
    from lightning_pilot.ledger import Ledger

    folder = run.parent.parent / "ledger"
    if not folder.is_dir():
        return None, {}
    ledger = Ledger(folder)
    runs = ledger.runs()
    mine = runs[runs["run_id"] == run.name]
    if mine.empty:
        return None, {}
    curves = ledger.curves()
    curves = curves[curves["run_id"] == run.name]
    last: dict[str, Any] = {}
    for name, points in curves.groupby("name", sort=True):
        point = points.sort_values("step", kind="stable").iloc[-1]
        last[str(name)] = (point["step"], point["value"])
    record = {str(key): value for key, value in mine.iloc[-1].to_dict().items()}
    return record, last


def _updates(run: Path) -> pd.DataFrame | None:
    folder = run / "updates.parquet"
    if not folder.is_dir():
        return None
    frame: pd.DataFrame = storage.read_snapshot_table(folder).to_pandas()
    return frame if len(frame) else None


def _max(series: pd.Series) -> Any:
    values = series.dropna()
    return None if values.empty else values.max()


def _memory_section(phases: pd.DataFrame) -> tuple[list[str], dict[str, Any]]:
    per_phase = []
    for phase, rows in phases.groupby("phase", sort=False):
        per_phase.append(
            {
                "phase": str(phase),
                "alloc": _max(rows["peak_allocated_bytes"]),
                "reserved": _max(rows["peak_reserved_bytes"]),
                "first": _max(rows["duration_s"].where(rows["first"].fillna(True).astype(bool))),
                "median": _steady_median(rows),
                "verdict": _phase_verdict(rows),
            }
        )
    per_phase.sort(key=lambda r: _ORDER.get(r["phase"], len(_ORDER)))
    table = _markdown_table(
        ["phase", "peak allocated", "peak reserved", "first time", "median time", "verdict"],
        [
            [
                r["phase"],
                format_bytes(r["alloc"]),
                format_bytes(r["reserved"]),
                format_duration(r["first"]),
                format_duration(r["median"]),
                r["verdict"],
            ]
            for r in per_phase
        ],
    )
    reserved = [r for r in per_phase if r["reserved"] is not None]
    allocated = [r for r in per_phase if r["alloc"] is not None]
    peak: dict[str, Any] = {"kind": None}
    if reserved:
        top = max(reserved, key=lambda r: r["reserved"])
        peak = {"kind": "reserved", "bytes": int(top["reserved"]), "phase": top["phase"]}
    elif allocated:
        top = max(allocated, key=lambda r: r["alloc"])
        peak = {"kind": "allocated", "bytes": int(top["alloc"]), "phase": top["phase"]}
    lines = [table, ""]
    if allocated:
        top_alloc = max(allocated, key=lambda r: r["alloc"])
        lines.append(
            f"- Largest phase: **{_text(top_alloc['phase'])}**, peak allocated"
            f" {format_bytes(top_alloc['alloc'])} ({int(top_alloc['alloc']):,} bytes)."
        )
    else:
        lines.append("- Peak allocated: not measured (null) in any phase.")
    if reserved:
        lines.append(
            f"- Largest peak reserved: **{_text(peak['phase'])}**, {format_bytes(peak['bytes'])}"
            f" ({peak['bytes']:,} bytes)."
        )
    else:
        lines.append("- Peak reserved: not measured (null) in any phase.")
    return lines, peak


def _steady_median(rows: pd.DataFrame) -> Any:
    """The later occurrences' median duration (steady state), else the first occurrence's."""
    later = _max(rows["duration_median_s"].where(~rows["first"].fillna(False).astype(bool)))
    return _max(rows["duration_median_s"]) if later is None else later


def _worst(verdicts: pd.Series) -> str:
    known = [str(v) for v in verdicts.dropna()]
    return min(known, key=lambda v: _VERDICT_RANK.get(v, 9)) if known else NOT_MEASURED


def _phase_verdict(rows: pd.DataFrame) -> str:
    """The worst verdict of a phase's rows, leaving out the sampled-out ones when others exist."""
    measured = rows[~sampled_out(rows)]
    return _worst((measured if len(measured) else rows)["verdict"])


def _headroom_lines(
    peak: dict[str, Any], phases: pd.DataFrame, gpu_memory_bytes: int | None
) -> list[str]:
    capacity = _max(phases["device_capacity_bytes"])
    lines = []
    if capacity is None:
        lines.append("- Measured device capacity: not measured (null).")
    else:
        lines.append(
            f"- Measured device capacity: {format_bytes(capacity)} ({int(capacity):,} bytes,"
            f" device {_joined(phases['device'])})."
        )
    if gpu_memory_bytes is None:
        lines.append(
            "- Target GPU: not given (pass `--gpu-memory 80GiB` or `gpu_memory_bytes=`);"
            " headroom not computed."
        )
        return lines
    target = f"{format_bytes(gpu_memory_bytes)} ({gpu_memory_bytes:,} bytes)"
    if peak["kind"] is None:
        lines.append(
            f"- Headroom on a {target} GPU: not computed: no phase measured device memory"
            " (allocated and reserved are null)."
        )
        return lines
    used = peak["bytes"]
    left = gpu_memory_bytes - used
    basis = f"peak {peak['kind']} {format_bytes(used)} ({used:,} bytes) in {_text(peak['phase'])}"
    if peak["kind"] == "allocated":
        basis += (
            "; peak reserved was not measured (null), so this compares peak allocated, which"
            " understates what a caching allocator holds"
        )
    verdict = "fits" if left >= 0 else "does NOT fit"
    lines.append(
        f"- Headroom on a {target} GPU: {format_bytes(left)} ({left:,} bytes,"
        f" {100.0 * left / gpu_memory_bytes:.1f}% of the target): {verdict}; {basis}."
    )
    return lines


def _value(record: dict[str, Any] | None, key: str) -> str:
    if record is None:
        return "not measured (no ledger record for this run)"
    value = record.get(key)
    return "not measured (null)" if _null(value) else _text(value)


def _model_rows(run: Path) -> pd.DataFrame | None:
    folder = run / "model.parquet"
    if not folder.is_dir():
        return None
    frame: pd.DataFrame = storage.read_snapshot_table(folder).to_pandas()
    return frame if len(frame) else None


def _phase_median(phases: pd.DataFrame, phase: str) -> float | None:
    rows = phases[phases["phase"] == phase]
    if rows.empty:
        return None
    value = _steady_median(rows)
    return None if _null(value) else float(value)


def step_time(phases: pd.DataFrame, accumulate: int) -> tuple[float | None, str]:
    """Seconds per update from the phase medians: K micro-batches of data, forward and backward,
    then one optimizer step. Returns the time and how it was made (or why it is missing).

    Example:
        >>> frame = pd.DataFrame({"phase": ["data", "forward", "backward", "optimizer_step"],
        ...                       "first": [False] * 4, "duration_median_s": [1.0, 2.0, 3.0, 4.0]})
        >>> step_time(frame, 2)[0]
        16.0
    """
    parts = {p: _phase_median(phases, p) for p in ("data", "forward", "backward", "optimizer_step")}
    missing = [p for p, v in parts.items() if v is None]
    if missing:
        return None, f"not measured: no duration for {', '.join(missing)}"
    micro = sum(v for p, v in parts.items() if p != "optimizer_step" and v is not None)
    total = accumulate * micro + (parts["optimizer_step"] or 0.0)
    how = (
        f"{accumulate} x (data {format_duration(parts['data'])} + forward"
        f" {format_duration(parts['forward'])} + backward {format_duration(parts['backward'])})"
        f" + optimizer step {format_duration(parts['optimizer_step'])}, steady-state medians"
    )
    return total, how


def _per_update(phases: pd.DataFrame, phase: str, updates: int) -> tuple[float, float]:
    """How often ``phase`` happened per update in this run, and its median duration."""
    rows = phases[phases["phase"] == phase]
    median = _phase_median(phases, phase)
    if rows.empty or median is None or updates <= 0:
        return 0.0, 0.0
    return float(rows["occurrences"].fillna(0).sum()) / updates, median


def campaign_lines(
    run: Path,
    phases: pd.DataFrame,
    record: dict[str, Any] | None,
    step_seconds: float | None,
    *,
    reserve: float,
    experiment: str | None = None,
) -> list[str]:
    """The campaign package of MISSION.md section 7: device-hours per variant, 3/7/30 days."""
    if step_seconds is None:
        return ["- Not computed: the step time was not measured."]
    updates = _max(phases[phases["phase"] == "optimizer_step"]["occurrences"])
    done = int(updates) if updates is not None else 0
    val_rate, val_time = _per_update(phases, "validation", done)
    ckpt_rate, ckpt_time = _per_update(phases, "checkpoint_save", done)
    export = _phase_median(phases, "export") or 0.0
    per_update = step_seconds + val_rate * val_time + ckpt_rate * ckpt_time
    devices = 1
    if record is not None and not _null(record.get("devices")):
        devices = max(1, int(record["devices"]))
    variants = _variants(run, record, experiment)
    lines = [
        f"- Time per update, validation and checkpoints included at this run's rate:"
        f" {format_duration(per_update)} ({format_duration(step_seconds)} step, validation"
        f" {val_rate:.3g}/update x {format_duration(val_time)}, checkpoint {ckpt_rate:.3g}/update x"
        f" {format_duration(ckpt_time)}); export once: {format_duration(export)}.",
        f"- Devices per run: {devices}. Reserve kept for evaluation and export: {reserve:.0%}.",
        "- Assumes every variant runs this model and batch at this run's speed: a variant that"
        " changes them needs its own pilot.",
        "",
    ]
    if not variants:
        lines.append(
            "- No variant with planned updates in the ledger: planned updates are recorded by"
            " EffectiveBatchAccountant (or the Trainer's max_steps) through DivergenceLedger."
        )
        return lines
    rows, cumulative = [], 0.0
    packages: dict[int, list[str]] = {3: [], 7: [], 30: []}
    for name, planned, status in variants:
        hours = (planned * per_update + export) / 3600.0
        # A variant that diverged or failed in the pilot is priced but never packaged as is;
        # nor is one whose status the ledger does not define (it cannot be judged).
        packaged = status not in GATE_STATUSES and (
            status in storage.STATUSES or status == NOT_MEASURED
        )
        if packaged:
            cumulative += hours
            for days, members in packages.items():
                if cumulative <= days * 24.0 * (1.0 - reserve):
                    members.append(name)
        rows.append(
            [
                name,
                status,
                f"{planned:,}",
                f"{hours:.3g}",
                f"{hours * devices:.3g}",
                f"{cumulative:.3g}" if packaged else "not packaged",
            ]
        )
    lines.append(
        _markdown_table(
            [
                "variant (priority order)",
                "pilot status",
                "planned updates",
                "hours",
                "device-hours",
                "cumulative hours",
            ],
            rows,
        )
    )
    lines.append("")
    for days, members in packages.items():
        fits = ", ".join(_text(m) for m in members) if members else "none"
        lines.append(
            f"- {days}-day package ({days * 24 * (1 - reserve):.0f} h after the reserve): {fits}"
        )
    return lines


def _variants(
    run: Path, record: dict[str, Any] | None, experiment: str | None
) -> list[tuple[str, int, str]]:
    """Variants of an experiment (default: this run's) with planned updates, in ledger order."""
    from lightning_pilot.ledger import Ledger

    folder = run.parent.parent / "ledger"
    if not folder.is_dir() or (record is None and experiment is None):
        return []
    runs = Ledger(folder).runs()
    wanted = experiment if experiment is not None else (record or {}).get("experiment")
    runs = runs[runs["experiment"] == wanted]
    found: dict[str, tuple[int, str]] = {}
    for row in runs.itertuples(index=False):
        planned = getattr(row, "planned_updates", None)
        name = _text(getattr(row, "variant", None) or row.run_id)
        if planned is not None and not _null(planned) and name not in found:
            found[name] = (int(planned), _text(getattr(row, "status", None)))
    return [(name, planned, status) for name, (planned, status) in found.items()]


def choice_sheet(
    run_dir: str | os.PathLike[str],
    *,
    gpu_memory_bytes: int | None = None,
    reserve: float = 0.25,
    experiment: str | None = None,
    metric: str = "val_loss",
    control: str | None = None,
) -> str:
    """The choice sheet of one run as Markdown (see the module docstring).

    Reads ``<run_dir>/phases.parquet``, ``<run_dir>/updates.parquet`` when present, and the
    run's records in ``<out_dir>/ledger`` when present. A value no file holds is written as
    "not measured (null)", never 0.

    Args:
        run_dir: the run folder, ``<out_dir>/runs/<run_id>``.
        gpu_memory_bytes: the target GPU's memory in bytes (see :func:`parse_size`), for the
            headroom line; ``None`` leaves headroom out.
        reserve: the fraction of each 3, 7 or 30 day package kept for evaluation and export.
        experiment: the ledger experiment whose variants fill the campaign package (default:
            this run's experiment).
        metric: the agreed quality metric for "where the variants stand".
        control: the control variant, marked in that list.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist.
        ValueError: ``run_dir`` is not a run folder, its phase table has no readable rows, or
            ``gpu_memory_bytes`` is not a positive int.
    """
    if gpu_memory_bytes is not None and (
        not isinstance(gpu_memory_bytes, int)
        or isinstance(gpu_memory_bytes, bool)
        or gpu_memory_bytes <= 0
    ):
        raise ValueError(
            f"gpu_memory_bytes={gpu_memory_bytes!r} is invalid: expected an int > 0 (bytes) or"
            " None."
        )
    if not isinstance(reserve, int | float) or isinstance(reserve, bool) or not 0 <= reserve < 1:
        raise ValueError(f"reserve={reserve!r} is invalid: expected a fraction in [0, 1).")
    run = _run_folder(run_dir)
    phases = storage.read_phase_table(run)
    if phases.empty:
        raise ValueError(f"{run / 'phases.parquet'} holds no readable phase rows.")
    record, last = _ledger_rows(run)
    updates = _updates(run)
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    out = [
        f"# Choice sheet: run {_text(run.name)}",
        "",
        f"Written {now} by lightning-pilot {__version__} from `{terminal_safe(run)}`."
        " `n/m` and 'not measured (null)' mean no measurement, never zero.",
        "",
        "## Verdicts",
        "",
    ]
    skipped = sampled_out(phases)
    not_passed = phases[(phases["verdict"] != "pass") & ~skipped].copy()
    not_passed["_rank"] = not_passed["verdict"].map(_VERDICT_RANK).fillna(9)
    not_passed = not_passed.sort_values("_rank", kind="stable")
    failures = int((phases["verdict"] == "fail").sum())
    if failures:
        out.append(f"**{failures} blocking failure(s)**: fix these before renting GPUs.")
    else:
        out.append("No blocking failure.")
    out.append("")
    for row in not_passed.itertuples(index=False):
        out.append(
            f"- **{_text(row.verdict)}** {_text(row.phase)} ({_occurrence(row.first)}, attempt"
            f" {_text(row.attempt)}, rank {_text(row.rank)}): {_text(row.reason)}"
        )
    if skipped.any():
        out.append(f"- {_sampled_line(phases[skipped])}.")
    verdicts = [
        f"{_text(phase)}: {_text(_phase_verdict(rows))}"
        for phase, rows in sorted(
            phases.groupby("phase", sort=False), key=lambda item: _ORDER.get(str(item[0]), 99)
        )
    ]
    out += [
        "",
        "Per phase (worst over measured occurrences, attempts and ranks): " + ", ".join(verdicts),
    ]

    model = _model_rows(run)
    out += ["", "## Model", ""]
    if model is None:
        out.append("- Not measured: no model.parquet (PhaseMemoryMonitor writes it).")
    else:
        first = model.iloc[0]
        out += [
            f"- Module: `{_text(first['model_class'])}`",
            f"- Parameters: {_number(first['parameters'])}"
            f" ({_number(first['trainable_parameters'])} trainable),"
            f" {format_bytes(first['param_bytes'])} of weights",
            f"- Optimizer: {_text(first['optimizers'])}",
        ]
    memory_lines, peak = _memory_section(phases)
    counters = _joined(phases["counter"])
    out += ["", "## Memory per GPU", "", f"Counter: {counters}.", "", *memory_lines]
    out += ["", "## Headroom", "", *_headroom_lines(peak, phases, gpu_memory_bytes)]

    precisions = sorted({_text(p) for p in phases["precision"].dropna()})
    batch, seq = _max(phases["batch_size"]), _max(phases["seq_len"])
    out += [
        "",
        "## Sizes and precision",
        "",
        f"- Largest batch size seen: {_number(batch) if batch is not None else 'not measured'}",
        f"- Longest sequence length seen: {_number(seq) if seq is not None else 'not measured'}",
        f"- Precision: {', '.join(precisions) if precisions else 'not measured (null)'}",
    ]
    out += ["", "## Batch and parallelism", ""]
    if record is not None:
        out.append(
            "- Effective batch: "
            + effective_batch_text(
                None if _null(record.get("micro_batch_size")) else int(record["micro_batch_size"]),
                None
                if _null(record.get("accumulate_grad_batches"))
                else int(record["accumulate_grad_batches"]),
                None if _null(record.get("dp_replicas")) else int(record["dp_replicas"]),
            )
            + " (micro-batch x accumulation x data-parallel replicas, from the ledger)"
        )
    for label, key in (
        ("Micro-batch size", "micro_batch_size"),
        ("Accumulation (K)", "accumulate_grad_batches"),
        ("Data-parallel replicas", "dp_replicas"),
        ("Effective batch size", "effective_batch_size"),
        ("Planned updates", "planned_updates"),
        ("Updates done", "updates_done"),
        ("Examples seen", "examples_seen"),
        ("Tokens seen", "tokens_seen"),
        ("Sharding strategy", "strategy"),
        ("Devices", "devices"),
    ):
        out.append(f"- {label}: {_value(record, key)}")
    world = sorted({int(w) for w in phases["world_size"].dropna()})
    out.append(f"- Processes (world size, phase table): {', '.join(map(str, world)) or 'n/m'}")
    if updates is not None:
        ks = sorted({int(k) for k in updates["accumulate_grad_batches"].dropna()})
        replicas = sorted({int(r) for r in updates["dp_replicas"].dropna()})
        rank0 = updates[updates["rank"] == updates["rank"].min()]
        # An update run again by a later attempt (resumed from an earlier checkpoint) counts
        # once, as the latest attempt ran it: the trajectory the final model followed.
        order = [c for c in ("attempt", "update") if c in rank0.columns]
        latest = rank0.sort_values(order).drop_duplicates("update", keep="last")
        replayed = len(rank0) - len(latest)
        examples = latest["examples_all_ranks"]
        counted = "not measured (null)" if examples.isna().any() else f"{int(examples.sum()):,}"
        again = ""
        if replayed:
            total = rank0["examples_all_ranks"]
            extra = "" if total.isna().any() else f", {int(total.sum()):,} with them"
            again = (
                f" ({replayed:,} update(s) run again by a later attempt resumed from an earlier"
                f" checkpoint counted once{extra})"
            )
        out.append(
            f"- Counted in updates.parquet: {len(latest):,} update(s), K"
            f" {', '.join(map(str, ks)) or 'n/m'}, replicas {', '.join(map(str, replicas))},"
            f" {counted} examples over all replicas{again}"
        )
    else:
        out.append("- updates.parquet: not present (no EffectiveBatchAccountant in the run)")

    accumulate = 1
    if record is not None and not _null(record.get("accumulate_grad_batches")):
        accumulate = int(record["accumulate_grad_batches"])
    elif updates is not None and updates["accumulate_grad_batches"].notna().any():
        accumulate = int(updates["accumulate_grad_batches"].dropna().max())
    seconds, how = step_time(phases, accumulate)
    out += ["", "## Step time", ""]
    out.append(
        f"- One update: {format_duration(seconds)} ({how})"
        if seconds is not None
        else f"- One update: {how}"
    )

    out += ["", "## Expected result", ""]
    if record is None:
        out.append("Not measured: no ledger record for this run (no DivergenceLedger in the run).")
    else:
        for label, key in (
            ("Experiment", "experiment"),
            ("Variant", "variant"),
            ("Seed", "seed"),
            ("Learning rate", "lr"),
            ("Status", "status"),
            ("Stop cause", "stop_cause"),
            ("Stop step", "stop_step"),
            ("Stop detail", "stop_detail"),
        ):
            value = _value(record, key)
            if key == "stop_detail" and _null(record.get(key)):
                value = "none recorded"
            out.append(f"- {label}: {value}")
        if last:
            for name, (step, value) in last.items():
                out.append(f"- Last {_text(name)}: {_number(value)} at update {_text(step)}")
        else:
            out.append("- Metrics: not measured (no curve points in the ledger)")
    out += ["", "### Where the variants stand", ""]
    out += standing_lines(run, record, metric=metric, control=control, experiment=experiment)
    out += ["", "## Campaign package", ""]
    out += campaign_lines(run, phases, record, seconds, reserve=reserve, experiment=experiment)
    return "\n".join(out) + "\n"


def write_choice_sheet(
    run_dir: str | os.PathLike[str],
    *,
    gpu_memory_bytes: int | None = None,
    reserve: float = 0.25,
    experiment: str | None = None,
    metric: str = "val_loss",
    control: str | None = None,
) -> Path:
    """Write :func:`choice_sheet` to ``<run_dir>/sheet.md`` atomically; never overwrites.

    When ``sheet.md`` exists (an earlier sheet, perhaps for another target GPU), the new sheet
    is ``sheet-2.md``, then ``sheet-3.md``, ...: every sheet written stays as it was.

    Returns:
        The path written.

    Raises:
        FileNotFoundError, ValueError: as :func:`choice_sheet`.
    """
    text = choice_sheet(
        run_dir,
        gpu_memory_bytes=gpu_memory_bytes,
        reserve=reserve,
        experiment=experiment,
        metric=metric,
        control=control,
    )
    return publish_choice_sheet(run_dir, text)


def publish_choice_sheet(run_dir: str | os.PathLike[str], text: str) -> Path:
    """Publish a sheet's text as ``<run_dir>/sheet.md`` (``sheet-2.md``, ... when taken).

    Returns:
        The path written.

    Raises:
        OSError: the write failed (a read-only mount, a full disk); nothing is left behind.
    """
    data = text.encode("utf-8")
    run = Path(run_dir)
    number = 1
    while True:
        final = run / (SHEET_NAME if number == 1 else f"sheet-{number}.md")
        try:
            return storage.publish_bytes(data, final)
        except FileExistsError:
            number += 1  # an earlier sheet keeps its name and content


def _run_costs(run: Path, accumulate: int) -> dict[str, Any]:
    """Memory, step time and data shape of one run, from its phase table and examples."""
    costs: dict[str, Any] = {}
    try:
        phases = storage.read_phase_table(run)
    except (FileNotFoundError, ValueError):
        return costs
    if phases.empty:
        return costs
    alloc = phases.dropna(subset=["peak_allocated_bytes"])
    if len(alloc):
        top = alloc.iloc[int(alloc["peak_allocated_bytes"].astype("float64").to_numpy().argmax())]
        costs["peak_allocated_bytes"] = int(top["peak_allocated_bytes"])
        costs["peak_phase"] = str(top["phase"])
    reserved = _max(phases["peak_reserved_bytes"])
    costs["peak_reserved_bytes"] = None if reserved is None else int(reserved)
    costs["step_s"] = step_time(phases, accumulate)[0]
    examples = run / "examples.parquet"
    if examples.is_dir():
        frame = storage.read_snapshot_table(examples).to_pandas()
        train = frame[frame["split"] == "train"] if "split" in frame else frame
        if len(train) and train["truncated"].notna().any():
            costs["truncated_fraction"] = float(train["truncated"].dropna().astype(bool).mean())
        if len(train) and train["loss_tokens"].notna().any():
            costs["loss_positions"] = float(train["loss_tokens"].dropna().mean())
    return costs


def variant_costs(
    out_dir: str | os.PathLike[str],
    runs: pd.DataFrame,
    *,
    by: str = "variant",
    control: str | None = None,
) -> pd.DataFrame:
    """Each variant's memory, step time and data shape next to its quality (MISSION section 4).

    For every run of ``runs`` (``Ledger.runs()``) with a phase table under
    ``<out_dir>/runs/<run_id>``: the largest peak allocated (and its phase), the largest peak
    reserved, the time per update (:func:`step_time`), and from BatchInspector's examples the
    fraction of truncated training sequences and the mean number of positions counted in the
    loss. Per variant: the median over its runs. A variant whose truncation or loss positions
    differ from the control's (by more than 5 points or 5 %) is flagged as not the same
    experiment: a memory saving bought by cutting the task does not answer the same question.

    Returns:
        One row per variant: ``runs_measured``, ``peak_allocated_bytes``, ``peak_phase``,
        ``peak_reserved_bytes``, ``step_s``, ``truncated_fraction``, ``loss_positions``,
        ``same_experiment`` (``True``/``False``/``None`` when unknown) and ``why``.
    """
    from lightning_pilot.core.ids import validate_run_id

    root = Path(out_dir)
    rows = []
    for run in runs.itertuples(index=False):
        try:
            validate_run_id(str(run.run_id), "run_id")  # a forged id never becomes a path
        except (TypeError, ValueError):
            continue
        k = getattr(run, "accumulate_grad_batches", None)
        costs = _run_costs(root / "runs" / str(run.run_id), 1 if k is None or _null(k) else int(k))
        if costs:
            rows.append({by: getattr(run, by)} | costs)
    columns = [
        by, "runs_measured", "peak_allocated_bytes", "peak_phase", "peak_reserved_bytes",
        "step_s", "truncated_fraction", "loss_positions", "same_experiment", "why",
    ]  # fmt: skip
    if not rows:
        return pd.DataFrame(columns=columns)
    frame = pd.DataFrame(rows)
    for column in ("peak_allocated_bytes", "peak_reserved_bytes", "step_s", "truncated_fraction",
                   "loss_positions", "peak_phase"):  # fmt: skip
        if column not in frame:
            frame[column] = None
    grouped = []
    for name, group in frame.groupby(by, sort=False):
        phase = group["peak_phase"].dropna()
        grouped.append(
            {
                by: name,
                "runs_measured": len(group),
                "peak_allocated_bytes": _max(group["peak_allocated_bytes"]),
                "peak_phase": phase.mode().iloc[0] if len(phase) else None,
                "peak_reserved_bytes": _max(group["peak_reserved_bytes"]),
                "step_s": group["step_s"].dropna().median()
                if group["step_s"].notna().any()
                else None,
                "truncated_fraction": group["truncated_fraction"].dropna().median()
                if group["truncated_fraction"].notna().any()
                else None,
                "loss_positions": group["loss_positions"].dropna().median()
                if group["loss_positions"].notna().any()
                else None,
            }
        )
    result = pd.DataFrame(grouped)
    reference = result[result[by] == control].iloc[0] if control in set(result[by]) else None
    same, why = [], []
    for row in result.to_dict("records"):
        if reference is None or row[by] == control:
            same.append(None if reference is None else True)
            why.append("no control to compare with" if reference is None else "the control")
            continue
        reasons = []
        for column, label in (
            ("truncated_fraction", "truncated"),
            ("loss_positions", "loss positions"),
        ):
            mine, theirs = row[column], reference[column]
            if _null(mine) or _null(theirs):
                continue
            if column == "truncated_fraction" and abs(mine - theirs) > 0.05:
                reasons.append(f"{label} {mine:.0%} vs {theirs:.0%} in the control")
            if column == "loss_positions" and abs(mine - theirs) > 0.05 * max(abs(theirs), 1e-9):
                reasons.append(f"{label} {mine:.3g} vs {theirs:.3g} per example in the control")
        known = not (_null(row["truncated_fraction"]) and _null(row["loss_positions"]))
        same.append(None if not known else not reasons)  # plain bools, never numpy ones
        why.append("; ".join(reasons) if reasons else ("same data shape" if known else
                   "not measured (no BatchInspector examples)"))  # fmt: skip
    result["same_experiment"] = pd.Series(same, dtype=object)
    result["why"] = why
    return result[columns]


def variant_costs_text(costs: pd.DataFrame, by: str = "variant") -> str:
    """:func:`variant_costs` as a terminal table."""
    if costs.empty:
        return "No phase tables for these runs: add PhaseMemoryMonitor to see their costs."
    rows = []
    for row in costs.to_dict("records"):
        same = row["same_experiment"]
        rows.append(
            [
                str(row[by]),
                str(row["runs_measured"]),
                format_bytes(row["peak_allocated_bytes"])
                + (f" ({row['peak_phase']})" if not _null(row["peak_phase"]) else ""),
                format_bytes(row["peak_reserved_bytes"]),
                format_duration(row["step_s"]),
                NOT_MEASURED
                if _null(row["truncated_fraction"])
                else f"{row['truncated_fraction']:.0%}",
                NOT_MEASURED if _null(row["loss_positions"]) else f"{row['loss_positions']:.3g}",
                NOT_MEASURED if same is None else ("yes" if same else "NO: " + str(row["why"])),
            ]
        )
    headers = [by, "runs", "peak allocated", "peak reserved", "update time", "truncated",
               "loss positions", "same experiment"]  # fmt: skip
    return render_table(headers, rows)


def standing_lines(
    run: Path, record: dict[str, Any] | None, *, metric: str, control: str | None,
    experiment: str | None,
) -> list[str]:  # fmt: skip
    """Where each variant of the experiment stands on the agreed metric, the control marked."""
    from lightning_pilot.ledger import Ledger

    folder = run.parent.parent / "ledger"
    wanted = experiment if experiment is not None else (record or {}).get("experiment")
    if not folder.is_dir() or wanted is None:
        return ["- Not measured: no ledger for this run's experiment."]
    try:
        comparison = Ledger(folder).compare(metric, experiment=str(wanted))
    except ValueError as err:
        return [f"- Not measured: {terminal_safe(err)}"]
    better = "lower" if comparison.mode == "min" else "higher"
    lines = [
        f"- Agreed metric: {_text(metric)} ({better} is better), experiment {_text(wanted)};"
        " the median over each variant's runs:"
    ]
    ordered = comparison.summary.sort_values("median", kind="stable", na_position="last")
    for row in ordered.to_dict("records"):
        mark = " [the control]" if control is not None and row["variant"] == control else ""
        counts = _status_counts(row)
        lines.append(f"  - {_text(row['variant'])}{mark}: {_number(row['median'])} ({counts})")
    if control is not None and control not in set(comparison.summary["variant"]):
        lines.append(f"- Control {_shown(control)}: not in the ledger of this experiment.")
    return lines
