"""The report's pure analysis and its rendering, on small hand-made frames: no Trainer, no files."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from lightning_pilot.core.per_target import on_target
from lightning_pilot.report import analysis, gate_result, phase_table_text, terminal_safe
from lightning_pilot.report.analysis import (
    campaign,
    campaign_variants,
    largest,
    median,
    run_costs,
    standing,
    summarize_costs,
    target_campaign,
    value_at,
)
from lightning_pilot.report.load import Reads, RunFolder
from lightning_pilot.report.sheet import render_choice_sheet
from lightning_pilot.report.units import (
    amount_range,
    as_number,
    format_amount,
    seq_text,
    size_text,
)


def phase_rows(*rows: tuple[Any, ...], run_id: str = "r1") -> pd.DataFrame:
    """Phase rows from ``(phase, first, alloc, reserved, duration, median, verdict)``."""
    columns = ["phase", "first", "peak_allocated_bytes", "peak_reserved_bytes", "duration_s",
               "duration_median_s", "verdict"]  # fmt: skip
    frame = pd.DataFrame(rows, columns=columns).astype(
        {"peak_allocated_bytes": "Int64", "peak_reserved_bytes": "Int64", "first": "boolean",
         "duration_s": "Float64", "duration_median_s": "Float64"}
    )  # fmt: skip
    return frame.assign(
        run_id=run_id, attempt=1, rank=0, world_size=1, device="cpu", counter="cpu",
        occurrences=[1 if first else 4 for first in frame["first"]],
        measured_occurrences=[1 if first else 4 for first in frame["first"]],
        checks=[[] for _ in range(len(frame))], reason=None, batch_size=8, seq_len=None,
        precision="32-true", device_capacity_bytes=None,
    )  # fmt: skip


PHASES = phase_rows(
    ("backward", True, 300, None, 0.3, 0.3, "pass"),
    ("data", True, None, None, 0.5, 0.5, "warn"),
    ("data", False, None, None, 0.2, 0.01, "pass"),
    ("forward", True, 100, None, 0.2, 0.2, "pass"),
    ("forward", False, 200, None, 0.1, 0.02, "pass"),
    ("optimizer_step", False, 250, None, 0.1, 0.05, "pass"),
    ("backward", False, 400, None, 0.1, 0.03, "fail"),
    ("my_phase", True, None, None, None, None, None),
)


def runs_frame(*rows: tuple[Any, ...]) -> pd.DataFrame:
    """Ledger runs from ``(run_id, experiment, variant, status, planned_updates)``."""
    columns = ["run_id", "experiment", "variant", "status", "planned_updates"]
    return pd.DataFrame(rows, columns=columns).assign(seed=0, stop_cause="x", stop_step=None)


# -- the gate ----------------------------------------------------------------------------------


def test_gate_names_failed_rows_and_runs_and_never_passes_an_unknown_status() -> None:
    phases = PHASES.copy()
    phases.at[6, "checks"] = [
        {"name": "grads", "verdict": "fail"},
        {"name": "x", "verdict": "pass"},
    ]
    runs = runs_frame(("r1", "e", "a", "completed", 6), ("r2", "e", "b", "oom", 6),
                      ("r3", "e", "c", "newer", 6), ("r4", "e", "d", None, 6))  # fmt: skip
    verdict = analysis.gate(phases, runs)
    assert verdict.failed
    assert verdict.failed_rows[["phase", "failed_checks"]].values.tolist() == [
        ["backward", ["grads"]]
    ]
    assert verdict.failed_runs["run_id"].tolist() == ["r2", "r3"]
    assert verdict.failed_runs["judged"].tolist() == [True, False]
    assert not analysis.gate(None, runs.iloc[[0, 3]]).failed
    assert not analysis.gate(None, None).failed


def test_gate_result_text_from_hand_made_frames() -> None:
    runs = runs_frame(("r1", "e", "a\x1b[2J", "completed", 6), ("r3", "e", "c", "weird", 6))
    failed, text = gate_result(None, runs)
    assert failed
    assert text.splitlines() == [
        "Result: 1 run(s) with an unknown status (exit 1):",
        "  run r3  variant c  seed 0  status weird (unknown status, not judged)  stop cause x",
    ]
    clean, text = gate_result(None, runs.iloc[:1], skipped=["f.parquet: bad"])
    assert not clean
    assert text.endswith("(exit 2):\n  skipped f.parquet: bad")


def test_sampled_out_rows_are_later_happened_unmeasured_and_unchecked() -> None:
    rows = PHASES.iloc[:3].assign(verdict=["pass", "not_checked", "not_checked"])
    rows["measured_occurrences"] = [1, 0, 0]
    rows.loc[1, "first"] = False
    assert analysis.sampled_out(rows).tolist() == [False, True, True]
    assert analysis.sampled_out(rows.iloc[:0]).tolist() == []
    text = phase_table_text(rows)
    assert "Not passed" not in text
    assert text.endswith("sampled updates): data (later, 5 occurrence(s))")


# -- memory and time ---------------------------------------------------------------------------


def test_phase_summary_in_campaign_order_with_peaks_times_and_worst_verdicts() -> None:
    summary = analysis.phase_summary(PHASES).set_index("phase")
    assert summary.index.tolist() == ["data", "forward", "backward", "optimizer_step", "my_phase"]
    assert summary.loc["backward", "peak_allocated_bytes"] == 400
    assert summary.loc["backward", "first_s"] == 0.3
    assert summary.loc["backward", "median_s"] == 0.03  # later occurrences: the steady state
    assert summary.loc["backward", "verdict"] == "fail"
    assert summary.loc["data", "verdict"] == "warn"
    assert summary.loc["my_phase", "verdict"] is None
    assert pd.isna(summary.loc["data", "peak_allocated_bytes"])


def test_memory_peak_prefers_reserved_and_says_when_nothing_was_measured() -> None:
    summary = analysis.phase_summary(PHASES)
    assert analysis.memory_peak(summary) == analysis.Peak("allocated", 400, "backward")
    with_reserved = PHASES.assign(peak_reserved_bytes=pd.array([None] * 6 + [500, 900], "Int64"))
    peak = analysis.memory_peak(analysis.phase_summary(with_reserved))
    assert peak == analysis.Peak("reserved", 900, "my_phase")
    empty = PHASES.assign(peak_allocated_bytes=pd.array([None] * 8, "Int64"))
    assert analysis.memory_peak(analysis.phase_summary(empty)) is None


def test_step_time_from_steady_medians_or_the_missing_phases() -> None:
    step = analysis.step_time(PHASES, accumulate=4)
    assert step.seconds == pytest.approx(4 * (0.01 + 0.02 + 0.03) + 0.05)
    missing = analysis.step_time(PHASES[PHASES["phase"] != "data"], accumulate=1)
    assert (missing.seconds, missing.missing) == (None, ["data"])


def test_accumulation_prefers_the_ledger_then_the_counted_updates() -> None:
    updates = pd.DataFrame({"accumulate_grad_batches": [None, 3, 2]})
    assert analysis.accumulation({"accumulate_grad_batches": 8}, updates) == 8
    assert analysis.accumulation({"accumulate_grad_batches": None}, updates) == 3
    assert analysis.accumulation(None, None) == 1


def test_count_updates_counts_a_replayed_update_once_and_a_null_as_not_measured() -> None:
    updates = pd.DataFrame({"rank": [0, 0, 0, 1], "attempt": [1, 1, 2, 1], "update": [1, 2, 2, 1],
                            "accumulate_grad_batches": [2, 2, 4, 2], "dp_replicas": [2] * 4,
                            "examples_all_ranks": [8, 8, None, 8]})  # fmt: skip
    count = analysis.count_updates(updates)
    assert (count.updates, count.ks, count.replicas, count.replayed) == (2, [2, 4], [2], 1)
    assert (count.examples, count.with_replays) == (None, None)


# -- the campaign ------------------------------------------------------------------------------


def test_campaign_variants_of_one_experiment_each_once_with_planned_updates() -> None:
    runs = runs_frame(("r1", "e", "a", "completed", 10), ("r2", "e", "a", "diverged", 20),
                      ("r3", "e", "", "completed", 30), ("r4", "e", "c", "completed", None),
                      ("r5", "other", "d", "completed", 5))  # fmt: skip
    variants = campaign_variants(runs, "e")
    assert variants.values.tolist() == [["a", 10, "completed"], ["r3", 30, "completed"]]
    assert campaign_variants(None, "e").empty


def test_campaign_packages_in_priority_order_never_a_failed_or_unknown_variant() -> None:
    phases = phase_rows(("optimizer_step", False, None, None, 1.0, 1.0, "pass"),
                        ("validation", False, None, None, 6.0, 6.0, "pass"))  # fmt: skip
    variants = pd.DataFrame({"variant": ["a", "b", "c", "d", "e"],
                             "planned_updates": [3600, 3600, 3600, 36000, 3600],
                             "status": ["completed", "diverged", "new", None, "completed"]},
                            )  # fmt: skip
    plan = campaign(phases, variants, 1.0, reserve=0.5, devices=2)
    assert plan.validation == (1.0, 6.0)  # 4 validations in 4 updates, 6 s each
    assert plan.per_update_s == 7.0
    table = plan.variants.set_index("variant")
    assert table["hours"].tolist() == [7.0, 7.0, 7.0, 70.0, 7.0]
    assert table["device_hours"].tolist() == [14.0, 14.0, 14.0, 140.0, 14.0]
    assert table["packaged"].tolist() == [True, False, False, True, True]
    assert plan.packages == {3: ["a"], 7: ["a", "d", "e"], 30: ["a", "d", "e"]}


def test_standing_best_median_first_unmeasured_last() -> None:
    summary = pd.DataFrame({"variant": ["a", "b", "c"], "median": [2.0, None, 1.0]})
    comparison: Any = type("C", (), {"summary": summary})()
    assert standing(comparison)["variant"].tolist() == ["c", "a", "b"]


# -- variant costs -----------------------------------------------------------------------------


def test_run_costs_and_a_variant_that_cuts_the_task_is_not_the_same_experiment() -> None:
    examples = pd.DataFrame({"split": ["train", "train", "val"], "truncated": [True, False, True],
                             "loss_tokens": [10, 20, 99]})  # fmt: skip
    costs = run_costs(PHASES, examples, accumulate=1)
    assert (costs["peak_allocated_bytes"], costs["peak_phase"]) == (400, "backward")
    assert costs["peak_reserved_bytes"] is None
    assert (costs["truncated_fraction"], costs["loss_positions"]) == (0.5, 15.0)
    assert run_costs(PHASES.iloc[:0], None, 1) == {}
    per_run = pd.DataFrame([{"variant": "ctl", **costs}, {"variant": "ctl", **costs},
                            {"variant": "short", **costs, "truncated_fraction": 0.9},
                            {"variant": "bare", "step_s": 1.0}])  # fmt: skip
    summary = summarize_costs(per_run, control="ctl").set_index("variant")
    assert summary["runs_measured"].tolist() == [2, 1, 1]
    assert summary["same_experiment"].tolist() == [True, False, None]
    assert summary.loc["short", "why"] == "truncated 90% vs 50% in the control"
    assert summary.loc["bare", "why"] == "not measured (no BatchInspector examples)"
    assert set(summarize_costs(per_run)["same_experiment"]) == {None}
    assert summarize_costs(per_run.iloc[:0]).empty


# -- the sheet from a hand-made run ------------------------------------------------------------


def test_choice_sheet_renders_a_run_without_files() -> None:
    record = {"experiment": "e", "variant": "a", "status": "completed", "devices": 1,
              "accumulate_grad_batches": 2, "micro_batch_size": 4, "dp_replicas": 1}  # fmt: skip
    run = RunFolder(
        path=Path("out/runs/r1"), phases=PHASES, updates=None, model=None, record=record,
        last={"val_loss": (6, 1.25)}, runs=runs_frame(("r1", "e", "a", "completed", 100)),
        experiment="e", comparison="no comparison here.",
    )  # fmt: skip
    sheet = render_choice_sheet(run, gpu_memory_bytes=1000, reserve=0.0)
    assert "**1 blocking failure(s)**" in sheet
    assert "- Largest phase: **backward**, peak allocated 400 B (400 bytes)." in sheet
    assert (
        "- Headroom on a 1000 B (1,000 bytes) GPU: 600 B (600 bytes, 60.0% of the target): fits"
        in sheet
    )
    assert (
        "- One update: 170.0 ms (2 x (data 10.0 ms + forward 20.0 ms + backward 30.0 ms)" in sheet
    )
    assert "- Last val_loss: 1.25 at update 6" in sheet
    assert "- Not measured: no comparison here." in sheet
    assert "| a | completed | 100 |" in sheet
    assert "| my_phase | n/m | n/m | n/m | n/m | n/m |" in sheet
    with pytest.raises(
        ValueError, match=r"choice_sheet\(reserve=1\) is invalid: expected a fraction in"
    ):
        render_choice_sheet(run, reserve=1)


def test_terminal_safe_is_idempotent_and_cuts_with_the_count() -> None:
    text = "a\x1b[31m\u202e" + "x" * 3000
    once = terminal_safe(text)
    assert once == terminal_safe(once)
    assert len(once) == 2000
    assert once.endswith("more chars]")
    assert "\x1b" not in once
    assert once.startswith("a\\x1b[31m\\u202ex")


def _estimate_rows() -> pd.DataFrame:
    base = {"precision": "bf16-mixed", "micro_batch": 8, "seq_len": 1024,
            "checkpointing": False, "strategy": "single", "devices": 1}  # fmt: skip
    rows = [
        base | {"target": "L4-24GB", "phase": "forward", "status": "ok", "reason": None,
                "peak_reserved_bytes": 20 << 30, "fits": True, "headroom_bytes": 4 << 30,
                "step_time_low_s": 0.5, "step_time_high_s": 0.9},
        base | {"target": "L4-24GB", "phase": "optimizer_step", "status": "ok", "reason": None,
                "peak_reserved_bytes": 26 << 30, "fits": False,
                "headroom_bytes": -(2 << 30), "step_time_low_s": None, "step_time_high_s": None},
        base | {"target": "H100-SXM-80GB", "phase": "forward", "status": "ok", "reason": None,
                "peak_reserved_bytes": 20 << 30, "fits": True, "headroom_bytes": 60 << 30,
                "step_time_low_s": 0.1, "step_time_high_s": 0.2},
        base | {"target": "H100-SXM-80GB", "phase": "validation", "status": "untraceable",
                "reason": "aten.nonzero: data-dependent", "peak_reserved_bytes": None,
                "fits": None, "headroom_bytes": None, "step_time_low_s": None,
                "step_time_high_s": None},
    ]  # fmt: skip
    return pd.DataFrame(rows)


def test_on_target_takes_the_worst_phase_and_never_hides_an_untraced_one() -> None:
    configs = on_target(_estimate_rows()).set_index("target")
    l4 = configs.loc["L4-24GB"]
    assert (l4["reserved_bytes"], l4["phase"], l4["fits"]) == (26 << 30, "optimizer_step", False)
    assert l4["headroom_bytes"] == -(2 << 30)
    assert (l4["step_low_s"], l4["step_high_s"], l4["status"]) == (0.5, 0.9, "ok")
    h100 = configs.loc["H100-SXM-80GB"]
    # A phase that could not be traced: not "fits", and the reason is kept.
    assert h100["fits"] is None
    assert (h100["status"], h100["reason"]) == ("untraceable", "aten.nonzero: data-dependent")


def test_target_campaign_prices_gpu_hours_and_money_at_the_slow_end() -> None:
    variants = pd.DataFrame(
        {"variant": ["ctl", "big", "bad"], "planned_updates": [72_000, 720_000, 1_000],
         "status": ["completed", "completed", "diverged"]}
    )  # fmt: skip
    table, packages = target_campaign(
        variants, 0.1, 0.2, devices=8, reserve=0.25, price_per_gpu_hour=3.0
    )
    ctl = table.set_index("variant").loc["ctl"]
    assert (ctl["hours_low"], ctl["hours_high"]) == (2.0, 4.0)
    assert (ctl["gpu_hours_low"], ctl["gpu_hours_high"]) == (16.0, 32.0)
    assert (ctl["cost_low"], ctl["cost_high"]) == (48.0, 96.0)
    # 4 h + 40 h at the slow end: the 3-day package (54 h after the reserve) holds both; a
    # diverged variant is never packaged.
    assert packages == {3: ["ctl", "big"], 7: ["ctl", "big"], 30: ["ctl", "big"]}
    assert not table.set_index("variant").loc["bad", "packaged"]
    no_price, _ = target_campaign(variants, 0.1, 0.2, devices=1, reserve=0.25)
    assert no_price["cost_high"].isna().all()


# -- units, reductions and what was read -------------------------------------------------------


def test_reductions_skip_nulls_and_return_none_when_nothing_was_measured() -> None:
    values = pd.Series([3.0, None, 1.0])
    assert [float(reduce(values)) for reduce in (largest, median)] == [3.0, 2.0]
    assert largest(values.iloc[[1]]) is None
    assert value_at(pd.Series({"forward": 0.5, "data": None}), "forward") == 0.5


def test_amounts_and_sizes_print_as_written_never_zero_for_a_small_amount() -> None:
    values = (12345.6, 42.125, 0.0042, 0.00612, 0.00000057, 0.0, None)
    expected = ["12,346", "42.12", "0.0042", "0.0061", "< 0.0001", "0", "n/m"]
    assert [format_amount(v) for v in values] == expected
    assert format_amount(0.000123456, digits=3) == "0.000123"
    infinite = [float("inf"), float("-inf")]
    assert (
        [format_amount(v) for v in infinite] == [as_number(v) for v in infinite] == ["inf", "-inf"]
    )
    assert amount_range(0.0042, 0.0061) == "0.0042 to 0.0061"
    assert amount_range(0.00001, 0.00002) == "< 0.0001"
    assert amount_range(3, None) == "3.00 to n/m"
    assert [size_text(v) for v in (2048, 32.0, None, float("nan"))] == ["2048", "32", "n/m", "n/m"]
    given = ["2048", "as given", "as given", "32"]
    assert [seq_text(v) for v in (2048, None, float("nan"), 32.0)] == given


def test_reads_names_a_skipped_file_once_and_keeps_other_warnings_apart() -> None:
    reads = Reads()
    with reads.capture():
        message = "lightning-pilot: skipped unreadable file x: bad"
        warnings.warn(message, RuntimeWarning, stacklevel=1)
    assert (reads.skipped(), reads.notes()) == (["unreadable file x: bad"], [])
