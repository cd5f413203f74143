"""Console tables (fixed-width text, human units) of the phase table, the ledger, comparisons,
plans and costs, and the gate's ``Result:`` lines: what the ``lightning-pilot`` command prints.

Example:
    >>> print(render_table(["phase", "peak"], [["forward", "1.0 MiB"]], right=[1]))
    phase       peak
    -------  -------
    forward  1.0 MiB
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import pandas as pd

from lightning_pilot.core.compare import STATUS_ORDER, Comparison
from lightning_pilot.core.per_target import checkpointing_name, on_target
from lightning_pilot.core.update_plan import UpdatePlan
from lightning_pilot.report.analysis import gate, sampled_out
from lightning_pilot.report.units import (
    CELL_LIMIT,
    NO_SEQUENCE,
    NOT_MEASURED,
    as_number,
    as_text,
    format_bytes,
    format_duration,
    is_null,
    joined,
    occurrence,
    records,
    seq_text,
    size_text,
    terminal_safe,
)
from lightning_pilot.vocabulary import verdict_rank

_PHASE_HEADERS: Final = "phase|occ.|count|batch|seq|peak alloc|peak reserved|time|median|verdict"
_LEDGER_HEADERS: Final = "run_id|experiment|variant|seed|status|stop cause|updates|eff. batch|lr"
_LEDGER_TEXT_COLUMNS: Final = ("experiment", "variant", "seed", "status", "stop_cause")
_ESTIMATE_HEADERS: Final = (
    "target|precision|micro-batch|seq|ckpt|strategy|memory per GPU|peak phase|fits|step time|status"
)
_COST_HEADERS: Final = (
    "runs|peak allocated|peak reserved|update time|truncated|loss positions|same experiment"
)


def render_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()
) -> str:
    """Fixed-width text table: a header, a rule and the rows; ``right``: right-aligned columns.
    Every cell passes through :func:`~lightning_pilot.report.terminal_safe`."""
    headers = [terminal_safe(h, limit=CELL_LIMIT) for h in headers]
    rows = [[terminal_safe(cell, limit=CELL_LIMIT) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in pairs).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *map(line, rows)])


def sampled_line(rows: pd.DataFrame) -> str:
    """One line naming the sampled-out rows (:func:`sampled_out`), each phase once."""
    counts: dict[str, int] = {}
    for data in rows.to_dict("records"):
        key = f"{as_text(data['phase'])} ({occurrence(data['first'])}"
        counts[key] = counts.get(key, 0) + int(data["occurrences"])
    named = ", ".join(f"{key}, {count} occurrence(s))" for key, count in counts.items())
    return f"Not measured by design (outside the pilot window and the sampled updates): {named}"


def _skipped_lines(skipped: Sequence[str], most: int = 20) -> list[str]:
    lines = [f"  skipped {terminal_safe(item)}" for item in skipped[:most]]
    if len(skipped) > most:
        lines.append(f"  and {len(skipped) - most} more")
    return lines


def _clean_result(
    phases: pd.DataFrame | None, runs: pd.DataFrame | None, skipped: Sequence[str]
) -> str:
    counted = "no ledger read: run statuses not checked"
    if runs is not None:
        counted = f"{len(runs)} ledger run(s) checked"
    counted += "; no phase table read" if phases is None else ""
    if not skipped:
        return f"Result: no failed check, no diverged or failed run ({counted})."
    head = (
        f"Result: {len(skipped)} file(s) skipped (unreadable), so not everything in scope was"
        f" checked: no failed check and no diverged or failed run in what was read ({counted})"
        " (exit 2):"
    )
    return "\n".join([head, *_skipped_lines(skipped)])


def gate_result(
    phases: pd.DataFrame | None, runs: pd.DataFrame | None, *, skipped: Sequence[str] = ()
) -> tuple[bool, str]:
    """The command line's exit verdict and the ``Result:`` lines that name the reasons.

    ``(failed, text)`` of the :func:`~lightning_pilot.report.analysis.gate` of the phase rows
    and ledger runs in scope (``None``: not read); files ``skipped`` are named too.

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
    verdict = gate(phases, runs)
    if not verdict.failed:
        return False, _clean_result(phases, runs, skipped)
    failed_checks: dict[str, dict[str, None]] = {}  # run: its items, each once
    for row in verdict.failed_rows.to_dict("records"):
        names = ", ".join(as_text(name) for name in row["failed_checks"]) or "verdict fail"
        item = f"{as_text(row['phase'])} ({occurrence(row['first'])}): {names}"
        failed_checks.setdefault(str(row["run_id"]), {})[item] = None
    bad = verdict.failed_runs
    unknown = len(bad) - int(bad["judged"].sum())
    parts = []
    if failed_checks:
        parts.append(f"a check failed (verdict fail) in {len(failed_checks)} run(s)")
    if len(bad) > unknown:
        parts.append(f"{len(bad) - unknown} run(s) diverged or failed")
    if unknown:
        parts.append(f"{unknown} run(s) with an unknown status")
    lines = ["Result: " + " and ".join(parts) + " (exit 1):"]
    variants: dict[str, Any] = {}
    if runs is not None and "variant" in runs.columns:
        variants = dict(zip(runs["run_id"].astype(str), runs["variant"], strict=True))
    for run_id, items in failed_checks.items():
        named = f"  variant {as_text(variants[run_id])}" if run_id in variants else ""
        lines.append(f"  run {as_text(run_id)}{named}  check failed: {'; '.join(items)}")
    for data in bad.to_dict("records"):
        step = data.get("stop_step")
        at = "" if is_null(step) else f" at step {as_number(step)}"
        why = "" if data["judged"] else " (unknown status, not judged)"
        lines.append(
            f"  run {as_text(data['run_id'])}  variant {as_text(data.get('variant'))}  seed"
            f" {as_text(data.get('seed'))}  status {as_text(data.get('status'))}{why}  stop"
            f" cause {as_text(data.get('stop_cause'))}{at}"
        )
    if skipped:
        lines += [f"  and {len(skipped)} file(s) skipped (unreadable), not checked:"]
        lines += _skipped_lines(skipped)
    return True, "\n".join(lines)


def _phase_block(key: Any, rows: pd.DataFrame) -> str:
    run_id, attempt, rank = key
    head = (
        f"run {as_text(run_id)}  attempt {as_text(attempt)}  rank {as_text(rank)}  device"
        f" {joined(rows['device'])}  counter {joined(rows['counter'])}"
    )
    cells = [
        [
            str(row.phase),
            occurrence(row.first),
            as_number(row.occurrences),
            as_number(row.batch_size),
            as_number(row.seq_len),
            format_bytes(row.peak_allocated_bytes),
            format_bytes(row.peak_reserved_bytes),
            format_duration(row.duration_s),
            format_duration(row.duration_median_s),
            str(row.verdict),
        ]
        for row in rows.itertuples(index=False)
    ]
    block = [head, render_table(_PHASE_HEADERS.split("|"), cells, right=range(2, 9))]
    skipped = sampled_out(rows)
    reasons = [
        f"  {as_text(row.verdict)}: {as_text(row.phase)} ({occurrence(row.first)}):"
        f" {as_text(row.reason)}"
        for row in rows[~skipped].itertuples(index=False)
        if row.verdict != "pass"
    ]
    reasons.sort(key=lambda line: verdict_rank(line.split(":")[0].strip()))
    if reasons:
        block += ["Not passed:", *reasons]
    if skipped.any():
        block.append(sampled_line(rows[skipped]))
    return "\n".join(block)


def phase_table_text(frame: pd.DataFrame) -> str:
    """The phase table as text: one block per run, attempt and rank (in the table's order),
    the reasons below each block."""
    if frame.empty:
        return "(no phase rows)"
    groups = frame.groupby(["run_id", "attempt", "rank"], sort=False, dropna=False)
    return "\n\n".join(_phase_block(key, rows) for key, rows in groups)


def ledger_text(runs: pd.DataFrame) -> str:
    """The folded ledger (:meth:`lightning_pilot.Ledger.runs`) as text, one row per run."""
    if runs.empty:
        return "(no runs in the ledger)"
    rows = []
    for data in runs.to_dict("records"):
        updates = as_number(data.get("updates_done"))
        if not is_null(data.get("planned_updates")):
            updates += f"/{as_number(data.get('planned_updates'))}"
        rows.append(
            [
                str(data["run_id"]),
                *(as_text(data.get(key)) for key in _LEDGER_TEXT_COLUMNS),
                updates,
                as_number(data.get("effective_batch_size")),
                as_text(data.get("lr")),
            ]
        )
    return render_table(_LEDGER_HEADERS.split("|"), rows, right=[3, 6, 7, 8])


def _with_ci(row: Mapping[Any, Any], name: str) -> str:
    value = as_number(row.get(name))
    low, high = row.get(f"{name}_ci_low"), row.get(f"{name}_ci_high")
    if is_null(low) or is_null(high):
        return value
    return f"{value} [{as_number(low)}, {as_number(high)}]"


def status_counts(row: Mapping[Any, Any]) -> str:
    """``"3 completed, 1 diverged"``; a status outside the ledger's vocabulary counts as
    ``unknown``."""
    counts = [f"{row[f'n_{status}']} {status}" for status in STATUS_ORDER if row.get(f"n_{status}")]
    unknown = int(row["n_runs"]) - sum(int(row.get(f"n_{status}") or 0) for status in STATUS_ORDER)
    if unknown > 0:
        counts.append(f"{unknown} unknown")
    return ", ".join(counts)


def _paired(row: Mapping[Any, Any]) -> str:
    if is_null(row.get("paired_n")):
        return NOT_MEASURED
    paired = (
        f"{as_number(row.get('paired_mean_diff'))} over {row['paired_n']} seed(s),"
        f" {row['paired_wins']} won"
    )
    if not is_null(row.get("paired_ci_low")):
        paired += f" [{as_number(row['paired_ci_low'])}, {as_number(row['paired_ci_high'])}]"
    return paired


def _ranked_runs(comparison: Comparison, by: str) -> str:
    runs = comparison.runs.assign(_unranked=comparison.runs["rank"].isna())
    rows = [
        [
            "-" if is_null(r["rank"]) else str(r["rank"]),
            str(r.get("run_id", "")),
            str(r[by]),
            as_text(r["seed"]),
            as_text(r["status"]),
            as_text(r.get("stop_cause")),
            as_number(r["value"]),
        ]
        for r in runs.sort_values(["_unranked", "rank"], kind="stable").to_dict("records")
    ]
    headers = ["rank", "run_id", by, "seed", "status", "stop cause", "value"]
    return render_table(headers, rows, right=[0, 3, 6])


def comparison_text(comparison: Comparison, by: str = "variant") -> str:
    """A :class:`~lightning_pilot.core.compare.Comparison` as text: the summary, then every
    run ranked best first."""
    control = comparison.control
    headers = [by, "runs", "by status", "in stats", "median", "mean", "iqm"]
    if control is not None:
        headers.append(f"vs {control} (mean diff)")
    rows, notes = [], []
    for row in comparison.summary.to_dict("records"):
        cells = [str(row[by]), str(row["n_runs"]), status_counts(row) or "none"]
        cells += [
            str(row["n_in_statistics"]),
            *(_with_ci(row, s) for s in ("median", "mean", "iqm")),
        ]
        if control is not None:
            cells.append("" if row[by] == control else _paired(row))
        rows.append(cells)
        if row.get("notes"):
            notes.append(f"  {as_text(row[by])}: {terminal_safe(row['notes'])}")
    direction = "lower" if comparison.mode == "min" else "higher"
    parts = [
        f"metric {terminal_safe(comparison.metric)} ({direction} is better)",
        render_table(headers, rows, right=[1, 3]),
    ]
    if notes:
        parts += ["Notes:", *notes]
    runs = "Runs, best first (diverged, oom and failed runs rank worst; '-': unfinished, unranked):"
    return "\n".join([*parts, "", runs, _ranked_runs(comparison, by)])


def plan_text(plan: UpdatePlan) -> str:
    """An :class:`~lightning_pilot.core.update_plan.UpdatePlan` as its summary line and fields."""
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


def variant_costs_text(costs: pd.DataFrame, by: str = "variant") -> str:
    """:func:`~lightning_pilot.report.variant_costs` as a terminal table."""
    if costs.empty:
        return "No phase tables for these runs: add PhaseMemoryMonitor to see their costs."
    rows = []
    for row in costs.to_dict("records"):
        same, phase = row["same_experiment"], row["peak_phase"]
        truncated, positions = row["truncated_fraction"], row["loss_positions"]
        rows.append(
            [
                str(row[by]),
                str(row["runs_measured"]),
                format_bytes(row["peak_allocated_bytes"])
                + ("" if is_null(phase) else f" ({phase})"),
                format_bytes(row["peak_reserved_bytes"]),
                format_duration(row["step_s"]),
                NOT_MEASURED if is_null(truncated) else f"{truncated:.0%}",
                NOT_MEASURED if is_null(positions) else f"{positions:.3g}",
                NOT_MEASURED if same is None else ("yes" if same else "NO: " + str(row["why"])),
            ]
        )
    return render_table([by, *_COST_HEADERS.split("|")], rows)


def _largest_line(row: Mapping[str, Any]) -> str:
    """One row of the largest table (micro-batch and sequence length); ``n/m`` where not found."""
    mode = checkpointing_name(row["checkpointing"])
    where = f"{row['target']} ({row['precision']}, checkpointing {mode})"
    batch = f"micro-batch {size_text(row.get('largest_micro_batch'))} at seq"
    batch += f" {seq_text(row.get('seq_len'))}"
    if is_null(row.get("largest_micro_batch")) and not is_null(row.get("reason")):
        batch += f" ({row['reason']})"
    longest = row.get("largest_seq_len")
    if is_null(longest):
        why = row.get("seq_len_reason")
        if is_null(why):
            why = NO_SEQUENCE if row.get("status") == "ok" else "not searched"
        length = f"seq n/m ({why})"
    else:
        length = f"seq {size_text(longest)}"
        if longest == row.get("max_seq_len"):
            length += " (the model's maximum)"
        length += f" at micro-batch {size_text(row.get('seq_len_micro_batch'))}"
    return f"largest on {where}: {batch}; {length} ({row['status']})"


def _estimate_row(c: Mapping[str, Any]) -> list[str]:
    step = "n/m"
    if not is_null(c["step_low_s"]):
        step = f"{format_duration(c['step_low_s'])}-{format_duration(c['step_high_s'])}"
    memory = "n/m" if is_null(c["reserved_bytes"]) else format_bytes(int(c["reserved_bytes"]))
    fits = {True: "fits", False: "NO"}.get(c["fits"], "n/m")
    return [as_text(c["target"]), as_text(c["precision"]), size_text(c["micro_batch"]),
            seq_text(c["seq_len"]), as_text(c["checkpointing"]),
            as_text(c["strategy"]), memory, as_text(c["phase"]), fits, step,
            as_text(c["status"])]  # fmt: skip


def estimate_result(
    estimate: pd.DataFrame, largest: Sequence[Mapping[str, Any]]
) -> tuple[bool, list[str]]:
    """What ``lightning-pilot estimate`` prints of an estimate table and its largest rows, line
    by line, and whether a configuration could not be estimated."""
    configs = records(on_target(estimate))
    lines = [render_table(_ESTIMATE_HEADERS.split("|"), [_estimate_row(c) for c in configs])]
    lines += [_largest_line(row) for row in largest]
    failed = [c for c in configs if c["status"] != "ok"]
    lines += [
        f"not estimated: {c['target']} {c['precision']} micro-batch {c['micro_batch']}:"
        f" {as_text(c['reason'])}"
        for c in failed
    ]
    return bool(failed), lines
