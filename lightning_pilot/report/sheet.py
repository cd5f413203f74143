"""The choice sheet of one run in Markdown (``runs/<run_id>/sheet.md``), one function per
section over a :class:`~lightning_pilot.report.load.RunFolder`; a value no file holds is
written as "not measured (null)", never 0. See docs/cli.md for the sections."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Final

import pandas as pd

from lightning_pilot import storage
from lightning_pilot._version import __version__
from lightning_pilot.core import validate
from lightning_pilot.core.per_target import checkpointing_name, on_target
from lightning_pilot.core.update_plan import effective_batch_text
from lightning_pilot.report import analysis
from lightning_pilot.report.analysis import (
    Peak,
    StepTime,
    campaign,
    campaign_variants,
    memory_peak,
    sampled_out,
    standing,
    target_campaign,
)
from lightning_pilot.report.load import RunFolder, load_run
from lightning_pilot.report.tables import sampled_line, status_counts
from lightning_pilot.report.units import (
    CELL_LIMIT,
    NO_SEQUENCE,
    NOT_MEASURED,
    amount_range,
    as_number,
    as_text,
    format_amount,
    format_bytes,
    format_duration,
    is_null,
    joined,
    occurrence,
    records,
    seq_text,
    shown,
    size_text,
    terminal_safe,
)
from lightning_pilot.vocabulary import verdict_rank

#: The choice sheet's file name in the run folder (``sheet-2.md``, ... when it exists).
SHEET_NAME: Final = "sheet.md"
_OWNER: Final = "choice_sheet"
_MEMORY_HEADERS: Final = "phase|peak allocated|peak reserved|first time|median time|verdict"
#: How the memory section names the largest peak of each kind.
_LARGEST: Final = {
    "allocated": "Largest phase: **{}**, peak allocated {}.",
    "reserved": "Largest peak reserved: **{}**, {}.",
}
_CAMPAIGN_HEADERS: Final = (
    "variant (priority order)|pilot status|planned updates|hours|device-hours|cumulative hours"
)
_BATCH_FIELDS: Final = (
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
)
_RESULT_FIELDS: Final = (
    ("Experiment", "experiment"),
    ("Variant", "variant"),
    ("Seed", "seed"),
    ("Learning rate", "lr"),
    ("Status", "status"),
    ("Stop cause", "stop_cause"),
    ("Stop step", "stop_step"),
    ("Stop detail", "stop_detail"),
)


def _markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def cells(values: Sequence[str]) -> str:
        safe = (terminal_safe(v, limit=CELL_LIMIT).replace("|", "\\|") for v in values)
        return "| " + " | ".join(safe) + " |"

    return "\n".join([cells(headers), "|" + "---|" * len(headers), *(cells(r) for r in rows)])


def _value(record: dict[str, Any] | None, key: str) -> str:
    if record is None:
        return "not measured (no ledger record for this run)"
    value = record.get(key)
    return "not measured (null)" if is_null(value) else as_text(value)


def _section(title: str, lines: Sequence[str]) -> list[str]:
    return ["", title, "", *lines]


def _verdicts(phases: pd.DataFrame, summary: pd.DataFrame) -> list[str]:
    skipped = sampled_out(phases)
    not_passed = phases[(phases["verdict"] != "pass") & ~skipped]
    rank = not_passed["verdict"].map(verdict_rank)
    failures = int((phases["verdict"] == "fail").sum())
    head = f"**{failures} blocking failure(s)**: fix these before renting GPUs."
    lines = [head if failures else "No blocking failure.", ""]
    for row in not_passed.assign(_rank=rank).sort_values("_rank", kind="stable").itertuples():
        lines.append(
            f"- **{as_text(row.verdict)}** {as_text(row.phase)} ({occurrence(row.first)}, attempt"
            f" {as_text(row.attempt)}, rank {as_text(row.rank)}): {as_text(row.reason)}"
        )
    if skipped.any():
        lines.append(f"- {sampled_line(phases[skipped])}.")
    verdicts = ", ".join(f"{as_text(r.phase)}: {as_text(r.verdict)}" for r in summary.itertuples())
    worst = "Per phase (worst over measured occurrences, attempts and ranks): "
    return [*lines, "", worst + verdicts]


def _model(model: pd.DataFrame | None) -> list[str]:
    if model is None:
        return ["- Not measured: no model.parquet (PhaseMemoryMonitor writes it)."]
    first = model.iloc[0]
    return [
        f"- Module: `{as_text(first['model_class'])}`",
        f"- Parameters: {as_number(first['parameters'])}"
        f" ({as_number(first['trainable_parameters'])} trainable),"
        f" {format_bytes(first['param_bytes'])} of weights",
        f"- Optimizer: {as_text(first['optimizers'])}",
    ]


def _bytes(count: int) -> str:
    return f"{format_bytes(count)} ({count:,} bytes)"


def _memory(phases: pd.DataFrame, summary: pd.DataFrame) -> list[str]:
    rows = [
        [
            str(r.phase),
            format_bytes(r.peak_allocated_bytes),
            format_bytes(r.peak_reserved_bytes),
            format_duration(r.first_s),
            format_duration(r.median_s),
            NOT_MEASURED if is_null(r.verdict) else str(r.verdict),
        ]
        for r in summary.itertuples()
    ]
    table = _markdown_table(_MEMORY_HEADERS.split("|"), rows)
    lines = [f"Counter: {joined(phases['counter'])}.", "", table, ""]
    for kind, largest in _LARGEST.items():
        peak = memory_peak(summary, (kind,))
        if peak is None:
            lines.append(f"- Peak {kind}: not measured (null) in any phase.")
        else:
            lines.append("- " + largest.format(as_text(peak.phase), _bytes(peak.bytes)))
    return lines


def _headroom(phases: pd.DataFrame, peak: Peak | None, gpu_memory_bytes: int | None) -> list[str]:
    capacity = phases["device_capacity_bytes"].max()
    if is_null(capacity):
        lines = ["- Measured device capacity: not measured (null)."]
    else:
        lines = [
            f"- Measured device capacity: {format_bytes(capacity)} ({int(capacity):,} bytes,"
            f" device {joined(phases['device'])})."
        ]
    if gpu_memory_bytes is None:
        why = "- Target GPU: not given (pass `--gpu-memory 80GiB` or `gpu_memory_bytes=`);"
        return [*lines, f"{why} headroom not computed."]
    target = _bytes(gpu_memory_bytes)
    if peak is None:
        why = "no phase measured device memory (allocated and reserved are null)"
        return [*lines, f"- Headroom on a {target} GPU: not computed: {why}."]
    left = gpu_memory_bytes - peak.bytes
    basis = f"peak {peak.kind} {_bytes(peak.bytes)} in {as_text(peak.phase)}"
    if peak.kind == "allocated":
        basis += (
            "; peak reserved was not measured (null), so this compares peak allocated, which"
            " understates what a caching allocator holds"
        )
    verdict = "fits" if left >= 0 else "does NOT fit"
    return [
        *lines,
        f"- Headroom on a {target} GPU: {format_bytes(left)} ({left:,} bytes,"
        f" {100.0 * left / gpu_memory_bytes:.1f}% of the target): {verdict}; {basis}.",
    ]


def _sizes(phases: pd.DataFrame) -> list[str]:
    precisions = sorted({as_text(p) for p in phases["precision"].dropna()})
    batch, seq = phases["batch_size"].max(), phases["seq_len"].max()
    return [
        f"- Largest batch size seen: {'not measured' if is_null(batch) else as_number(batch)}",
        f"- Longest sequence length seen: {'not measured' if is_null(seq) else as_number(seq)}",
        f"- Precision: {', '.join(precisions) if precisions else 'not measured (null)'}",
    ]


def _counted(updates: pd.DataFrame | None) -> str:
    if updates is None:
        return "- updates.parquet: not present (no EffectiveBatchAccountant in the run)"
    count = analysis.count_updates(updates)
    examples = "not measured (null)" if count.examples is None else f"{count.examples:,}"
    again = ""
    if count.replayed:
        total = count.with_replays
        extra = "" if total is None else f", {total:,} with them"
        again = (
            f" ({count.replayed:,} update(s) run again by a later attempt resumed from an earlier"
            f" checkpoint counted once{extra})"
        )
    rows = f"{count.updates:,} update(s)"
    if count.steps_per_row > 1:
        rows = (
            f"{count.updates:,} batch window(s) of typically {count.steps_per_row} optimizer"
            " steps (manual optimization stepping several optimizers per batch)"
        )
    return (
        f"- Counted in updates.parquet: {rows}, K"
        f" {', '.join(map(str, count.ks)) or 'n/m'}, replicas"
        f" {', '.join(map(str, count.replicas))}, {examples} examples over all replicas{again}"
    )


def _batch(run: RunFolder) -> list[str]:
    record, lines = run.record, []
    if record is not None:
        sizes = [
            None if is_null(record.get(key)) else int(record[key])
            for key in ("micro_batch_size", "accumulate_grad_batches", "dp_replicas")
        ]
        lines.append(
            f"- Effective batch: {effective_batch_text(*sizes)} (micro-batch x accumulation x"
            " data-parallel replicas, from the ledger)"
        )
    lines += [f"- {label}: {_value(record, key)}" for label, key in _BATCH_FIELDS]
    world = sorted({int(w) for w in run.phases["world_size"].dropna()})
    lines.append(f"- Processes (world size, phase table): {', '.join(map(str, world)) or 'n/m'}")
    return [*lines, _counted(run.updates)]


def _step(step: StepTime) -> list[str]:
    parts = {phase: format_duration(value) for phase, value in step.parts.items()}
    if step.seconds is None:
        return [f"- One update: not measured: no duration for {', '.join(step.missing)}"]
    return [
        f"- One update: {format_duration(step.seconds)} ({step.accumulate} x (data"
        f" {parts['data']} + forward {parts['forward']} + backward {parts['backward']}) +"
        f" optimizer step {parts['optimizer_step']}, steady-state medians)"
    ]


def _expected(run: RunFolder) -> list[str]:
    if run.record is None:
        return ["Not measured: no ledger record for this run (no DivergenceLedger in the run)."]
    lines = [
        f"- {label}: {_value(run.record, key)}"
        if key != "stop_detail" or not is_null(run.record.get(key))
        else f"- {label}: none recorded"
        for label, key in _RESULT_FIELDS
    ]
    lines += [
        f"- Last {as_text(name)}: {as_number(value)} at update {as_text(step)}"
        for name, (step, value) in run.last.items()
    ] or ["- Metrics: not measured (no curve points in the ledger)"]
    return lines


def _standing(run: RunFolder, control: str | None) -> list[str]:
    comparison = run.comparison
    if isinstance(comparison, str):
        return [f"- Not measured: {comparison}"]
    better = "lower" if comparison.mode == "min" else "higher"
    lines = [
        f"- Agreed metric: {as_text(comparison.metric)} ({better} is better), experiment"
        f" {as_text(run.experiment)}; the median over each variant's runs:"
    ]
    for row in standing(comparison).to_dict("records"):
        mark = " [the control]" if control is not None and row["variant"] == control else ""
        counts = status_counts(row)
        lines.append(f"  - {as_text(row['variant'])}{mark}: {as_number(row['median'])} ({counts})")
    if control is not None and control not in set(comparison.summary["variant"]):
        lines.append(f"- Control {shown(control)}: not in the ledger of this experiment.")
    return lines


def _campaign(run: RunFolder, step: StepTime, reserve: float) -> list[str]:
    if step.seconds is None:
        return ["- Not computed: the step time was not measured."]
    devices = 1
    if run.record is not None and not is_null(run.record.get("devices")):
        devices = max(1, int(run.record["devices"]))
    variants = campaign_variants(run.runs, run.experiment)
    plan = campaign(run.phases, variants, step.seconds, reserve=reserve, devices=devices)
    (val_rate, val_time), (ckpt_rate, ckpt_time) = plan.validation, plan.checkpoint
    lines = [
        f"- Time per update, validation and checkpoints included at this run's rate:"
        f" {format_duration(plan.per_update_s)} ({format_duration(step.seconds)} step, validation"
        f" {val_rate:.3g}/update x {format_duration(val_time)}, checkpoint {ckpt_rate:.3g}/update x"
        f" {format_duration(ckpt_time)}); export once: {format_duration(plan.export_s)}.",
        f"- Devices per run: {devices}. Reserve kept for evaluation and export: {reserve:.0%}.",
        "- Assumes every variant runs this model and batch at this run's speed: a variant that"
        " changes them needs its own pilot.",
        "",
    ]
    if variants.empty:
        return [
            *lines,
            "- No variant with planned updates in the ledger: planned updates are recorded by"
            " EffectiveBatchAccountant (or the Trainer's max_steps) through DivergenceLedger.",
        ]
    rows = [
        [
            as_text(r.variant),
            as_text(r.status),
            f"{r.planned_updates:,}",
            format_amount(r.hours, 3),
            format_amount(r.device_hours, 3),
            format_amount(r.cumulative_hours, 3) if r.packaged else "not packaged",
        ]
        for r in plan.variants.itertuples()
    ]
    lines += [_markdown_table(_CAMPAIGN_HEADERS.split("|"), rows), ""]
    for days, members in plan.packages.items():
        fits = ", ".join(as_text(m) for m in members) if members else "none"
        lines.append(
            f"- {days}-day package ({days * 24 * (1 - reserve):.0f} h after the reserve): {fits}"
        )
    return lines


def _on_target(run: RunFolder, reserve: float, gpu_prices: Mapping[str, float] | None) -> list[str]:
    if run.estimate is None:
        return [
            "- Not estimated: add `TargetEstimator` to the pilot (or run `lightning-pilot"
            " estimate`) to see memory and step time on the GPU you are about to rent."
        ]
    configs = records(on_target(run.estimate))
    headers = ["target", "precision", "micro-batch x seq", "act. ckpt", "strategy",
               "memory per GPU (est. reserved)", "peak phase", "fits", "step time"]  # fmt: skip
    rows = [_target_row(c) for c in configs]
    lines = [
        "Estimated on fake tensors from this pilot's module and batch (docs/estimate.md):"
        " memory per GPU is the allocator's reserved bytes, the step time a roofline band.",
        "",
        _markdown_table(headers, rows),
        "",
    ]
    for c in configs:
        if c["status"] != "ok":
            lines.append(f"- {as_text(c['target'])} {as_text(c['precision'])}:"
                         f" {as_text(c['status'])}: {as_text(c['reason'])}")  # fmt: skip
    lines += _largest(run.largest)
    variants = campaign_variants(run.runs, run.experiment)
    fitting = [c for c in configs if c["fits"] is True and not is_null(c["step_low_s"])]
    if variants.empty or not fitting:
        return [*lines, f"- Campaign package on the target: not priced: {_unpriced(configs)}."]
    lines.append(
        "Campaign package on the target (training updates only, at the slow end of the band;"
        f" {reserve:.0%} of each package kept back), per fitting configuration:"
    )
    first: dict[tuple[Any, ...], dict[str, Any]] = {}
    for c in fitting:
        first.setdefault((c["target"], c["precision"], c["strategy"]), c)
    for c in first.values():
        price = (gpu_prices or {}).get(str(c["target"]))
        table, packages = target_campaign(
            variants, float(c["step_low_s"]), float(c["step_high_s"]),
            devices=int(c["devices"]), reserve=reserve, price_per_gpu_hour=price
        )  # fmt: skip
        hours = amount_range(table["gpu_hours_low"].sum(), table["gpu_hours_high"].sum(), 3)
        cost = "" if price is None else (
            f", {amount_range(table['cost_low'].sum(), table['cost_high'].sum())} at"
            f" {price:g}/GPU-hour"
        )  # fmt: skip
        fits = "; ".join(f"{d} days: {', '.join(as_text(m) for m in ms) or 'none'}"
                         for d, ms in packages.items())  # fmt: skip
        lines.append(
            f"- {as_text(c['target'])} x{size_text(c['devices'])} {as_text(c['precision'])}"
            f" micro-batch {size_text(c['micro_batch'])}: all variants {hours} GPU-hours{cost}."
            f" {fits}."
        )
    return lines


def _unpriced(configs: Sequence[Mapping[str, Any]]) -> str:
    """Why the package on the target is not priced: what was estimated, or how to estimate."""
    estimated = [c for c in configs if c["fits"] is True or c["fits"] is False]
    if not estimated:
        failed = (
            f"all {len(configs)} failed: the reasons are above; fix what they name, then"
            if configs
            else "the estimate table holds no configuration;"
        )
        return (
            f"nothing was estimated ({failed} estimate with `lightning-pilot estimate"
            " package.module:build --target NAME --micro-batch B` (docs/cli.md) or"
            " TargetEstimator in the pilot)"
        )
    if not any(c["fits"] is True for c in estimated):
        return (
            f"no configuration fits: none of the {len(estimated)} estimated fits its target;"
            " try a smaller micro-batch, activation checkpointing, a sharded strategy or a"
            " larger GPU"
        )
    if not any(c["fits"] is True and not is_null(c["step_low_s"]) for c in estimated):
        return "no fitting configuration has an estimated step time"
    return "no variant with planned updates in the ledger"


def _largest(frame: pd.DataFrame | None) -> list[str]:
    """The largest micro-batch and sequence length that fit each target."""
    if frame is None:
        return []
    lines = ["Largest that fits (micro-batch at the sequence length given; sequence length at"
             " the smallest micro-batch):"]  # fmt: skip
    for c in records(frame):
        where = (f"{as_text(c['target'])} {as_text(c['precision'])}, act. ckpt"
                 f" {as_text(checkpointing_name(c['checkpointing']))},"
                 f" {as_text(c['strategy'])}")  # fmt: skip
        batch, seq = c.get("largest_micro_batch"), c.get("largest_seq_len")
        at = seq_text(c.get("seq_len"))
        batch_text = ("micro-batch not found" if is_null(batch)
                      else f"micro-batch {size_text(batch)} at seq {at}")  # fmt: skip
        if not is_null(c.get("reason")):
            batch_text += f" ({as_text(c['reason'])})"
        if not is_null(seq):
            longest = (
                f"seq {size_text(seq)} at micro-batch {size_text(c.get('seq_len_micro_batch'))}"
            )
        elif is_null(c.get("seq_len_reason")) and c.get("status") == "ok":
            longest = f"sequence length {NOT_MEASURED} ({NO_SEQUENCE})"
        else:
            longest = "sequence length not found"
        if not is_null(c.get("seq_len_reason")):
            longest += f" ({as_text(c['seq_len_reason'])})"
        lines.append(f"- {where}: {batch_text}; {longest}")
    return [*lines, ""]


def _target_row(c: Mapping[str, Any]) -> list[str]:
    seq = seq_text(c["seq_len"])
    step = "n/m"
    if not is_null(c["step_low_s"]):
        step = f"{format_duration(c['step_low_s'])} to {format_duration(c['step_high_s'])}"
    return [
        as_text(c["target"]),
        as_text(c["precision"]),
        f"{size_text(c['micro_batch'])} x {seq}",
        as_text(c["checkpointing"]),
        as_text(c["strategy"]),
        "n/m" if is_null(c["reserved_bytes"]) else _bytes(int(c["reserved_bytes"])),
        as_text(c["phase"]),
        {True: "fits", False: "does NOT fit"}.get(c["fits"], "not estimated"),
        step,
    ]


def _plots(folder: storage.Location) -> list[str]:
    from lightning_pilot.report.plots import existing_plots  # no matplotlib: file names only

    found = existing_plots(folder)
    if not found:
        return [
            "- None drawn yet: `lightning-pilot plot <run folder>` draws them (matplotlib"
            " needed); a sheet written afterwards links them."
        ]
    return [f"![{text}]({name})" for name, text in found]


def render_choice_sheet(
    run: RunFolder,
    *,
    gpu_memory_bytes: int | None = None,
    reserve: float = 0.25,
    control: str | None = None,
    gpu_prices: Mapping[str, float] | None = None,
) -> str:
    """The choice sheet of a run :func:`~lightning_pilot.report.load.load_run` read, as
    :func:`choice_sheet`."""
    check_options(gpu_memory_bytes, reserve)
    summary = analysis.phase_summary(run.phases)
    step = analysis.step_time(run.phases, analysis.accumulation(run.record, run.updates))
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [
        f"# Choice sheet: run {as_text(run.path.name)}",
        "",
        f"Written {now} by lightning-pilot {__version__} from `{terminal_safe(run.path)}`."
        " `n/m` and 'not measured (null)' mean no measurement, never zero.",
        *_section("## Verdicts", _verdicts(run.phases, summary)),
        *_section("## Model", _model(run.model)),
        *_section("## Memory per GPU", _memory(run.phases, summary)),
        *_section("## Headroom", _headroom(run.phases, memory_peak(summary), gpu_memory_bytes)),
        *_section("## Sizes and precision", _sizes(run.phases)),
        *_section("## Batch and parallelism", _batch(run)),
        *_section("## Step time", _step(step)),
        *_section("## Expected result", _expected(run)),
        *_section("### Where the variants stand", _standing(run, control)),
        *_section("## Campaign package", _campaign(run, step, reserve)),
        *_section("## On the target GPU (estimated)", _on_target(run, reserve, gpu_prices)),
        *_section("## Plots", _plots(run.path)),
    ]
    return "\n".join(lines) + "\n"


def check_options(gpu_memory_bytes: Any, reserve: Any) -> None:
    """Raise for a target GPU that is not a positive int of bytes, or a reserve not in [0, 1)."""
    validate.integer(_OWNER, "gpu_memory_bytes", gpu_memory_bytes, minimum=1, optional=True)
    fraction = "a fraction in [0, 1)"
    if validate.number(_OWNER, "reserve", reserve, minimum=0, maximum=1, hint=fraction) == 1:
        raise ValueError(validate.invalid(_OWNER, "reserve", reserve, fraction))


def choice_sheet(
    run_dir: storage.PathLike,
    *,
    gpu_memory_bytes: int | None = None,
    reserve: float = 0.25,
    experiment: str | None = None,
    metric: str = "val_loss",
    control: str | None = None,
    gpu_prices: Mapping[str, float] | None = None,
) -> str:
    """The choice sheet of the run folder ``<out_dir>/runs/<run_id>`` (local, or at a URL
    fsspec understands) as Markdown, from its tables and ``<out_dir>/ledger`` when present:
    headroom on a GPU of ``gpu_memory_bytes``, 3, 7 and 30 day packages of the ``experiment``'s
    variants with ``reserve`` of each kept back, the variants on ``metric`` with ``control``
    marked, and the package on the target priced at ``gpu_prices`` (per GPU-hour and target).

    Raises:
        FileNotFoundError: ``run_dir`` does not exist.
        ValueError: ``run_dir`` is not a run folder, its phase table has no readable rows, or
            an option is invalid.
    """
    check_options(gpu_memory_bytes, reserve)
    run = load_run(run_dir, metric=metric, experiment=experiment)
    return render_choice_sheet(
        run,
        gpu_memory_bytes=gpu_memory_bytes,
        reserve=reserve,
        control=control,
        gpu_prices=gpu_prices,
    )


def write_choice_sheet(
    run_dir: storage.PathLike,
    *,
    gpu_memory_bytes: int | None = None,
    reserve: float = 0.25,
    experiment: str | None = None,
    metric: str = "val_loss",
    control: str | None = None,
    gpu_prices: Mapping[str, float] | None = None,
) -> storage.Location:
    """Write :func:`choice_sheet` to ``<run_dir>/sheet.md`` atomically and return its path;
    never overwrites (:func:`publish_choice_sheet`). Raises as :func:`choice_sheet`."""
    text = choice_sheet(
        run_dir,
        gpu_memory_bytes=gpu_memory_bytes,
        reserve=reserve,
        experiment=experiment,
        metric=metric,
        control=control,
        gpu_prices=gpu_prices,
    )
    return publish_choice_sheet(run_dir, text)


def publish_choice_sheet(run_dir: storage.PathLike, text: str) -> storage.Location:
    """Publish a sheet's text as ``<run_dir>/sheet.md`` and return its path; when that exists,
    ``sheet-2.md``, ``sheet-3.md``, ...: every sheet written stays as it was (on a remote
    ``run_dir``, through :func:`lightning_pilot.storage.publish_bytes`). ``OSError`` when the
    write fails; nothing is left behind."""
    folder, number = storage.location(run_dir), 1
    while True:
        final = folder / (SHEET_NAME if number == 1 else f"sheet-{number}.md")
        try:
            return storage.publish_bytes(text.encode("utf-8"), final)
        except FileExistsError:
            number += 1
