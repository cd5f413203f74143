"""Tests of lightning_pilot.report against phase tables and ledgers written by real fits."""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pandas as pd
import pytest
import torch

from lightning_pilot import (
    DivergenceLedger,
    EffectiveBatchAccountant,
    Ledger,
    PhaseMemoryMonitor,
    plan_updates,
    read_phase_table,
)
from lightning_pilot.core.per_target import on_target
from lightning_pilot.demo import ClassificationDataModule, TinyClassifier
from lightning_pilot.estimate import estimate
from lightning_pilot.report import (
    GATE_STATUSES,
    NOT_MEASURED,
    choice_sheet,
    comparison_text,
    format_bytes,
    format_duration,
    gate_result,
    ledger_text,
    parse_size,
    phase_table_text,
    plan_text,
    render_table,
    sampled_out,
    write_choice_sheet,
)
from lightning_pilot.report.analysis import campaign_variants, target_campaign
from lightning_pilot.report.load import load_run
from lightning_pilot.report.sheet import render_choice_sheet
from lightning_pilot.report.units import amount_range, format_amount


class UnusedParameterClassifier(TinyClassifier):
    """A classifier with a trainable parameter outside the loss: its checks fail."""

    def __init__(self) -> None:
        super().__init__(hidden=8)
        self.unused = torch.nn.Parameter(torch.zeros(3))


def fit_run(
    out: Path,
    variant: str,
    *,
    seed: int = 0,
    lr: float = 1e-2,
    model: pl.LightningModule | None = None,
    ledger: bool = True,
) -> Path:
    """One tiny real fit with the pilot callbacks; returns its run folder."""
    pl.seed_everything(seed, verbose=False)
    before = set((out / "runs").iterdir()) if (out / "runs").is_dir() else set()
    monitor = PhaseMemoryMonitor(out_dir=out)
    callbacks: list[pl.Callback] = [monitor, EffectiveBatchAccountant(out_dir=out)]
    if ledger:
        callbacks.append(
            DivergenceLedger(experiment="cli", variant=variant, seed=seed, out_dir=out)
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        max_steps=6,
        val_check_interval=3,
        accumulate_grad_batches=2,
        callbacks=callbacks,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(
            model or TinyClassifier(hidden=8, lr=lr),
            datamodule=ClassificationDataModule(dataset_size=256, batch_size=8, seed=seed),
        )
    (new,) = set((out / "runs").iterdir()) - before
    return new


@pytest.fixture(scope="module")
def pilot(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An output folder with a clean control run, a diverged run and a run whose checks fail."""
    out = tmp_path_factory.mktemp("pilot")
    ctl = fit_run(out, "ctl", seed=0)
    hot = fit_run(out, "hot", seed=0, lr=1e3)
    broken = fit_run(out, "broken", model=UnusedParameterClassifier())
    lone = tmp_path_factory.mktemp("lone")
    alone = fit_run(lone, "alone", ledger=False)
    return {"out": out, "ctl": ctl, "hot": hot, "broken": broken, "alone": alone}


# -- units --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 1024**3),
        ("80GB", 80 * 1000**3),
        ("141G", 141 * 1024**3),
        ("24000MiB", 24000 * 1024**2),
        ("24000mib", 24000 * 1024**2),
        (" 1.5 TiB ", int(1.5 * 1024**4)),
        ("512", 512),
        ("512B", 512),
        ("64KB", 64_000),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "80 parsecs", "-1GiB", "0GiB", "8 0GB", "80GiBs"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=rf"gpu_memory={re.escape(repr(text))} is not a size"):
        parse_size(text, "gpu_memory")


def test_formats() -> None:
    assert [format_amount(v) for v in (0.0042, 0.00612, 0.042, 0.5, 1.8, 42.125, 12_345.6)] == [
        "0.0042", "0.0061", "0.042", "0.50", "1.80", "42.12", "12,346",
    ]  # fmt: skip
    assert format_amount(0.00004) == "< 0.0001"
    assert format_amount(0) == "0"
    assert format_amount(None) == format_amount(float("nan")) == NOT_MEASURED
    assert amount_range(0.0042, 0.0061) == "0.0042 to 0.0061"
    assert amount_range(0.00001, 0.00003) == "< 0.0001"
    assert format_bytes(0) == "0 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(80 * 1024**3) == "80.0 GiB"
    assert format_bytes(-2 * 1024**2) == "-2.0 MiB"
    assert format_bytes(None) == format_bytes(float("nan")) == NOT_MEASURED
    assert format_duration(0.0004) == "0.4 ms"
    assert format_duration(12.345) == "12.35 s"
    assert format_duration(1200) == "20.0 min"


def test_render_table_aligns_columns() -> None:
    text = render_table(["a", "bytes"], [["long name", "1"], ["x", "22"]], right=[1])
    assert text.splitlines() == [
        "a          bytes",
        "---------  -----",
        "long name      1",
        "x             22",
    ]


# -- tables of real runs ------------------------------------------------------------------------


def test_phase_table_text_lists_reasons_below(pilot: dict[str, Any]) -> None:
    frame = read_phase_table(pilot["broken"])
    text = phase_table_text(frame)
    assert f"run {pilot['broken'].name}  attempt 1  rank 0  device cpu" in text
    forward = frame[(frame["phase"] == "forward") & frame["first"]].iloc[0]
    line = next(row for row in text.splitlines() if row.startswith("forward         first"))
    assert format_bytes(forward["peak_allocated_bytes"]) in line
    assert format_duration(forward["duration_s"]) in line
    assert line.endswith("pass")
    below = text.split("Not passed:")[1].splitlines()
    assert below[1].startswith("  fail: backward (first): grads_reach_params")
    assert "unused" in below[1]
    # The CPU has no caching allocator: reserved is null, shown as n/m, never 0.
    assert frame["peak_reserved_bytes"].isna().all()
    assert f"{NOT_MEASURED}  " in line
    assert " 0 B" not in text


def test_sampled_out_validations_are_counted_not_listed_as_problems(pilot: dict[str, Any]) -> None:
    frame = read_phase_table(pilot["ctl"])
    # Validation ran after 3 and 6 updates (and at the end); only the first was in the pilot
    # window. The later ones are counted, their measurements null, their verdict not_checked.
    later = frame[(frame["phase"] == "validation") & ~frame["first"].astype(bool)].iloc[0]
    assert later["occurrences"] >= 1
    assert later["measured_occurrences"] == 0
    assert later["verdict"] == "not_checked"
    assert pd.isna(later["peak_allocated_bytes"])
    assert sampled_out(frame).tolist() == [
        row.phase == "validation" and not row.first for row in frame.itertuples()
    ]
    text = phase_table_text(frame)
    assert "Not passed" not in text
    assert re.search(r"^validation\s+later\s+\d+\s.*\snot_checked$", text, re.MULTILINE)
    assert text.endswith(
        "Not measured by design (outside the pilot window and the sampled updates):"
        f" validation (later, {later['occurrences']} occurrence(s))"
    )
    sheet = choice_sheet(pilot["ctl"])
    verdicts = sheet.split("## Verdicts")[1].split("## Model")[0]
    assert "**not_checked**" not in verdicts
    assert "- Not measured by design (outside the pilot window" in verdicts
    assert "validation: pass" in verdicts.split("Per phase")[1]
    assert re.search(r"^\| validation \|.*\| pass \|$", sheet, re.MULTILINE)
    # A measured later row that failed is still listed: only unmeasured, unchecked rows move.
    broken = phase_table_text(read_phase_table(pilot["broken"]))
    assert "  fail: backward (later): grads_reach_params" in broken.split("Not passed:")[1]


def test_gate_result_names_the_runs_that_fail_it(pilot: dict[str, Any]) -> None:
    runs = Ledger(pilot["out"]).runs()
    failed, text = gate_result(read_phase_table(pilot["out"]), runs)
    assert failed
    lines = text.splitlines()
    assert len(lines) == 3
    assert lines[1].startswith(f"  run {pilot['broken'].name}  variant broken  check failed: ")
    hot = runs[runs["variant"] == "hot"].iloc[0]
    assert lines[2] == (
        f"  run {hot['run_id']}  variant hot  seed 0  status diverged  stop cause"
        f" {hot['stop_cause']} at step {int(hot['stop_step'])}"
    )
    ctl = runs[runs["variant"] == "ctl"]
    assert gate_result(read_phase_table(pilot["ctl"]), ctl) == (
        False,
        "Result: no failed check, no diverged or failed run (1 ledger run(s) checked).",
    )
    assert GATE_STATUSES == ("diverged", "oom", "failed")


def test_ledger_text_and_comparison(pilot: dict[str, Any]) -> None:
    ledger = Ledger(pilot["out"])
    runs = ledger.runs()
    text = ledger_text(runs)
    hot = runs[runs["variant"] == "hot"].iloc[0]
    assert hot["status"] == "diverged"
    hot_line = next(line for line in text.splitlines() if line.startswith(hot["run_id"]))
    assert "diverged" in hot_line
    assert str(hot["stop_cause"]) in hot_line
    assert f"{int(hot['updates_done'])}/{int(hot['planned_updates'])}" in hot_line

    comparison = ledger.compare("train_loss", control="ctl")
    text = comparison_text(comparison)
    assert "metric train_loss (lower is better)" in text
    assert "vs ctl (mean diff)" in text
    ranked = text.split("Runs, best first")[1].splitlines()[3:]
    assert len(ranked) == len(runs) == 3
    assert "diverged" in ranked[-1]  # worst, never dropped
    summary = text.split("Runs, best first")[0]
    assert re.search(r"^hot\s+1\s+1 diverged\s+1\s+inf", summary, re.MULTILINE)


def test_plan_text_is_the_plan() -> None:
    plan = plan_updates(1000, 4, 8, 2, epochs=3)
    text = plan_text(plan)
    assert text.splitlines()[0] == plan.describe()
    assert re.search(rf"total updates\s+{plan.total_updates:,}$", text, re.MULTILINE)
    assert re.search(rf"examples seen\s+{plan.examples_seen:,}$", text, re.MULTILINE)
    assert re.search(r"max_steps \(budget\)\s+none$", text, re.MULTILINE)


# -- the choice sheet ---------------------------------------------------------------------------


def test_choice_sheet_headroom_with_real_numbers(pilot: dict[str, Any]) -> None:
    frame = read_phase_table(pilot["ctl"])
    assert frame["peak_reserved_bytes"].isna().all()
    peak = int(frame["peak_allocated_bytes"].max())
    phase = frame.loc[frame["peak_allocated_bytes"].astype(float).idxmax(), "phase"]
    target = parse_size("80GiB")
    sheet = choice_sheet(pilot["ctl"], gpu_memory_bytes=target)
    left = target - peak
    assert (
        f"- Headroom on a 80.0 GiB ({target:,} bytes) GPU: {format_bytes(left)} ({left:,} bytes,"
        in sheet
    )
    assert f"peak allocated {format_bytes(peak)} ({peak:,} bytes) in {phase}" in sheet
    assert "peak reserved was not measured (null)" in sheet
    assert f"- Largest phase: **{phase}**, peak allocated" in sheet
    assert "No blocking failure." in sheet
    runs = Ledger(pilot["out"]).runs().set_index("run_id")
    row = runs.loc[pilot["ctl"].name]
    assert f"- Micro-batch size: {int(row['micro_batch_size'])}" in sheet
    assert "- Accumulation (K): 2" in sheet
    assert f"- Effective batch size: {int(row['effective_batch_size'])}" in sheet
    assert f"- Sharding strategy: {row['strategy']}" in sheet
    assert f"- Status: {row['status']}" in sheet
    assert f"- Largest batch size seen: {int(frame['batch_size'].max())}" in sheet
    assert f"- Precision: {frame['precision'].dropna().iloc[0]}" in sheet
    assert "Counted in updates.parquet: 6 update(s), K 2, replicas 1, 96 examples" in sheet


def test_choice_sheet_does_not_fit_and_failures_first(pilot: dict[str, Any]) -> None:
    frame = read_phase_table(pilot["broken"])
    peak = int(frame["peak_allocated_bytes"].max())
    small = peak // 2
    sheet = choice_sheet(pilot["broken"], gpu_memory_bytes=small)
    assert f"{format_bytes(small - peak)} ({small - peak:,} bytes" in sheet
    assert "does NOT fit" in sheet
    failures = int((frame["verdict"] == "fail").sum())
    assert f"**{failures} blocking failure(s)**" in sheet
    verdicts = sheet.split("## Verdicts")[1].split("Per phase")[0]
    first = next(line for line in verdicts.splitlines() if line.startswith("- **"))
    assert first.startswith("- **fail** backward")


def test_choice_sheet_without_ledger_or_target_says_not_measured(pilot: dict[str, Any]) -> None:
    sheet = choice_sheet(pilot["alone"])
    assert "Target GPU: not given" in sheet
    assert "- Sharding strategy: not measured (no ledger record for this run)" in sheet
    assert "Not measured: no ledger record for this run" in sheet
    assert "Counted in updates.parquet: 6 update(s)" in sheet


def test_write_choice_sheet_never_overwrites(pilot: dict[str, Any]) -> None:
    run = pilot["hot"]
    first = write_choice_sheet(run)
    second = write_choice_sheet(run, gpu_memory_bytes=parse_size("24000MiB"))
    assert (first.name, second.name) == ("sheet.md", "sheet-2.md")
    assert "Target GPU: not given" in first.read_text()
    assert "Headroom on a 23.4 GiB" in second.read_text()
    assert "- Status: diverged" in second.read_text()
    assert not [p for p in run.iterdir() if p.name.startswith(".")]


def test_choice_sheet_bad_input(pilot: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"choice_sheet\(gpu_memory_bytes=0\) is invalid"):
        choice_sheet(pilot["ctl"], gpu_memory_bytes=0)
    with pytest.raises(ValueError, match=r"is not a run folder.*runs here: "):
        choice_sheet(pilot["out"])
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        choice_sheet(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"\(reserve=1.5\) is invalid: .*a fraction in \[0, 1\)"):
        choice_sheet(pilot["ctl"], reserve=1.5)
    with pytest.raises(ValueError, match=r"\(reserve=1\) is invalid: expected a fraction in"):
        choice_sheet(pilot["ctl"], reserve=1)


def test_variant_costs_flag_a_variant_that_cuts_the_task(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from lightning_pilot import BatchInspector, DivergenceLedger, PhaseMemoryMonitor
    from lightning_pilot.demo import InstructionDataModule, TinyCausalLM
    from lightning_pilot.report import variant_costs, variant_costs_text

    # The same task at two maximum lengths: 8 tokens cuts most responses out of the loss.
    for variant, max_length in (("full", 32), ("short", 8)):
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=2, limit_val_batches=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=tmp_path,
            callbacks=[
                PhaseMemoryMonitor(), BatchInspector(),
                DivergenceLedger(experiment="length", variant=variant, seed=0),
            ],
        )  # fmt: skip
        data = InstructionDataModule(dataset_size=64, batch_size=4, max_length=max_length)
        trainer.fit(TinyCausalLM(max_length=32, d_model=16, n_layers=1), datamodule=data)
    out = tmp_path / "pilot"
    costs = variant_costs(out, Ledger(out).runs(), control="full").set_index("variant")
    assert costs.loc["full", "same_experiment"] is True
    assert costs.loc["short", "same_experiment"] is False
    assert "truncated" in costs.loc["short", "why"]
    assert costs.loc["short", "truncated_fraction"] > costs.loc["full", "truncated_fraction"]
    assert costs.loc["short", "peak_allocated_bytes"] > 0
    assert costs.loc["short", "step_s"] > 0
    text = variant_costs_text(costs.reset_index())
    assert "NO: truncated" in text


def test_parse_size_takes_ascii_digits_only() -> None:
    from lightning_pilot.report import parse_size

    assert parse_size("12G") == 12 * 1024**3
    for text in ("١٢G", "１２G"):  # Arabic-Indic and fullwidth digits are not sizes
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(text)


def test_sheet_counts_an_update_run_again_by_a_later_attempt_once(tmp_path: Path) -> None:
    """Attempt 2 resumed from an earlier checkpoint runs updates 3 and 4 again: the sheet
    counts the trajectory's examples once, and says how many the replay added."""
    from lightning_pilot.report import choice_sheet
    from lightning_pilot.run import PilotRun
    from lightning_pilot.schemas import UPDATES_SCHEMA

    first = PilotRun(default_out_dir=tmp_path)
    second = PilotRun(default_out_dir=tmp_path)
    second.adopt(first.identity())
    for run, updates in ((first, range(1, 5)), (second, range(3, 7))):
        run.put_phase_row({"phase": "setup", "counter": "none", "verdict": "pass"}, source="test")
        run.register_table("updates", UPDATES_SCHEMA)
        run.append_rows(
            "updates",
            [
                {"update": u, "accumulate_grad_batches": 1, "dp_replicas": 1,
                 "micro_batches": 1, "examples": 4, "examples_all_ranks": 4}
                for u in updates
            ],
        )  # fmt: skip
        run.flush()
    assert second.attempt == 2
    sheet = choice_sheet(first.run_dir)
    assert (
        "- Counted in updates.parquet: 6 update(s), K 1, replicas 1, 24 examples over all"
        " replicas (2 update(s) run again by a later attempt resumed from an earlier checkpoint"
        " counted once, 32 with them)"
    ) in sheet


# -- the choice sheet on the target GPU, from a real estimate --------------------------------


@pytest.fixture(scope="module")
def on_l4(pilot: dict[str, Any]) -> dict[str, Any]:
    """The control run with two real estimates of its module on an L4: one that fits, its
    batch without a sequence dimension, and one whose every configuration fails."""
    data = ClassificationDataModule(dataset_size=256, batch_size=8, seed=0)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    common: dict[str, Any] = {"targets": ["L4-24GB"], "micro_batches": [4], "workers": 1}
    fits = estimate(TinyClassifier(hidden=8), batch, **common)
    # Activation checkpointing with no block classes to wrap: no configuration is estimated.
    failed = estimate(
        TinyClassifier(hidden=8), batch, checkpointing=[True], largest=False, **common
    )
    run = load_run(pilot["ctl"])
    return {"run": run, "fits": fits, "failed": failed}


def on_target_section(run: Any, result: Any, **options: Any) -> str:
    largest = result.largest_frame() if result.largest else None
    loaded = dataclasses.replace(run, estimate=result.frame(), largest=largest)
    text = render_choice_sheet(loaded, **options)
    return text.split("## On the target GPU (estimated)")[1].split("## Plots")[0]


def test_sheet_on_target_prints_no_nan_or_none(on_l4: dict[str, Any]) -> None:
    section = on_target_section(on_l4["run"], on_l4["fits"])
    assert not re.search(r"\b(None|nan|NaN)\b", section), section
    assert "| L4-24GB | bf16-mixed | 4 x as given | off | single |" in section
    (largest,) = [line for line in section.splitlines() if line.startswith("- L4-24GB bf16")]
    assert largest == (
        "- L4-24GB bf16-mixed, act. ckpt off, single: micro-batch 1024 at seq as given (fits at"
        " max_micro_batch=1024, the end of the search); sequence length n/m (the batch has no"
        " sequence dimension)"
    )


def test_sheet_prices_a_short_pilot_in_figures_that_are_not_zero(on_l4: dict[str, Any]) -> None:
    run, result = on_l4["run"], on_l4["fits"]
    (config,) = on_target(result.frame()).to_dict("records")
    variants = campaign_variants(run.runs, run.experiment)
    assert list(variants["planned_updates"]) == [6, 6, 6]  # ctl, hot and broken: 6 updates each

    def priced(price: float) -> str:
        section = on_target_section(run, result, gpu_prices={"L4-24GB": price})
        (line,) = [line for line in section.splitlines() if line.startswith("- L4-24GB x1")]
        return line

    # At 1.8 per GPU-hour, 18 updates of well under a millisecond cost far below a cent.
    line = priced(1.8)
    assert "0 to 0" not in line
    assert "all variants < 0.0001 GPU-hours, < 0.0001 at 1.8/GPU-hour." in line
    # At a price that makes the figure visible, its two significant digits are the table's.
    table, _ = target_campaign(
        variants, config["step_low_s"], config["step_high_s"], devices=1, reserve=0.25,
        price_per_gpu_hour=20_000.0,
    )  # fmt: skip
    low, high = table["cost_low"].sum(), table["cost_high"].sum()
    assert 0.0001 < low < high < 1, (low, high)
    expected = f"{format_amount(low)} to {format_amount(high)} at 20000/GPU-hour"
    assert expected in priced(20_000.0)
    assert re.fullmatch(r"0\.0*[1-9]\d", format_amount(low))  # two significant digits


def test_sheet_says_nothing_was_estimated_not_that_nothing_fits(on_l4: dict[str, Any]) -> None:
    section = on_target_section(on_l4["run"], on_l4["failed"])
    assert (
        "| L4-24GB | bf16-mixed | 4 x as given | full | single | n/m | n/m | not estimated |"
        in (section)
    )
    assert "no configuration fits" not in section
    assert (
        "- Campaign package on the target: not priced: nothing was estimated (all 1 failed: the"
        " reasons are above; fix what they name, then estimate with `lightning-pilot estimate"
        " package.module:build --target NAME --micro-batch B` (docs/cli.md) or TargetEstimator"
        " in the pilot)."
    ) in section
    assert "activation checkpointing needs checkpoint_classes" in section


def test_an_estimate_with_the_boolean_checkpointing_column_still_reads(
    pilot: dict[str, Any], on_l4: dict[str, Any], tmp_path: Path
) -> None:
    """Estimate files of schema version 1 (largest: version 2) hold ``checkpointing`` as a
    boolean: the report reads True as ``full`` and False as ``off``."""
    import json
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from lightning_pilot.schemas import ESTIMATE_SCHEMA, LARGEST_SCHEMA, SCHEMA_METADATA_KEY

    def old(schema: pa.Schema, version: int) -> pa.Schema:
        index = schema.get_field_index("checkpointing")
        made = schema.set(index, pa.field("checkpointing", pa.bool_()))
        meta = json.dumps({"name": "estimate", "version": version}).encode()
        return made.with_metadata({SCHEMA_METADATA_KEY: meta})

    run_dir = tmp_path / "run"
    shutil.copytree(pilot["ctl"], run_dir)
    fits, failed = on_l4["fits"], on_l4["failed"]
    for name, rows, schema in (
        ("estimate", fits.rows + failed.rows, old(ESTIMATE_SCHEMA, 1)),
        ("estimate_largest", fits.largest, old(LARGEST_SCHEMA, 2)),
    ):
        (run_dir / f"{name}.parquet").mkdir()
        table = pa.Table.from_pylist([{k: r.get(k) for k in schema.names} for r in rows], schema)
        assert table.schema.field("checkpointing").type == pa.bool_()
        pq.write_table(table, run_dir / f"{name}.parquet" / "written-by-hand.parquet")
    run = load_run(run_dir)
    assert run.estimate is not None
    # The reader conforms the file to the current schema: the boolean read by its mode's name.
    assert set(run.estimate["checkpointing"]) == {"full", "off"}
    assert sorted(on_target(run.estimate)["checkpointing"]) == ["full", "off"]
    text = render_choice_sheet(run)
    assert "| L4-24GB | bf16-mixed | 4 x as given | off | single |" in text
    assert "| L4-24GB | bf16-mixed | 4 x as given | full | single | n/m |" in text
    assert "- L4-24GB bf16-mixed, act. ckpt off, single: micro-batch 1024" in text


def test_an_estimate_of_schema_version_2_reads_with_the_version_3_names(tmp_path: Path) -> None:
    """A version 2 estimate file (``estimated_reserved_bytes``, ``weights_bytes``,
    ``gradients_bytes``, phase ``optimizer_step_first``) reads through the public reader with
    the current schema's columns; its weights, not split into parameters and buffers, go to
    the notes, and the split columns are null, never 0."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from lightning_pilot.report import read_estimate
    from lightning_pilot.schemas import ESTIMATE_SCHEMA, SCHEMA_METADATA_KEY

    meta = {SCHEMA_METADATA_KEY: json.dumps({"name": "estimate", "version": 2}).encode()}
    old = pa.schema(
        [
            ("target", pa.string()),
            ("checkpointing", pa.string()),
            ("phase", pa.string()),
            ("status", pa.string()),
            ("peak_allocated_bytes", pa.int64()),
            ("estimated_reserved_bytes", pa.int64()),
            ("weights_bytes", pa.int64()),
            ("gradients_bytes", pa.int64()),
            ("optimizer_state_bytes", pa.int64()),
            ("notes", pa.string()),
        ],
        metadata=meta,
    )
    rows = [
        ["L4-24GB", "off", "optimizer_step_first", "ok", 700, 900, 100, 100, 200, None],
        ["L4-24GB", "off", "optimizer_step", "ok", 650, 800, 100, 100, 200, "later"],
    ]
    table = pa.Table.from_pylist([dict(zip(old.names, r, strict=True)) for r in rows], old)
    (tmp_path / "estimate.parquet").mkdir()
    pq.write_table(table, tmp_path / "estimate.parquet" / "v2.parquet")
    frame = read_estimate(tmp_path / "estimate.parquet")
    assert frame is not None
    assert list(frame.columns) == ESTIMATE_SCHEMA.names
    assert not {"estimated_reserved_bytes", "weights_bytes", "gradients_bytes"} & set(frame)
    assert frame[["phase", "first"]].values.tolist() == [
        ["optimizer_step", True],
        ["optimizer_step", False],
    ]
    assert frame["peak_reserved_bytes"].tolist() == [900, 800]
    assert frame["grad_bytes"].tolist() == [100, 100]
    assert frame["optimizer_state_bytes"].tolist() == [200, 200]
    assert frame["param_bytes"].isna().all()
    assert frame["buffer_bytes"].isna().all()
    assert frame["notes"].tolist() == [
        "schema version 2: weights_bytes 100 (parameters and buffers, not split)",
        "later; schema version 2: weights_bytes 100 (parameters and buffers, not split)",
    ]
    assert on_target(frame)["reserved_bytes"].tolist() == [900]
