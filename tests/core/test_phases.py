"""core/phases.py without a Trainer: vocabularies, verdict rules and the aggregator."""

from __future__ import annotations

import pytest

from lightning_pilot.core.phases import (
    ESSENTIAL,
    REMEDIES,
    CheckResult,
    Occurrence,
    PhaseAggregator,
    judge,
)
from lightning_pilot.vocabulary import PHASES, VERDICTS, worst_verdict


def test_vocabularies() -> None:
    assert VERDICTS == ("pass", "warn", "fail", "not_checked")
    assert set(REMEDIES) <= set(PHASES)
    assert set(ESSENTIAL) <= set(PHASES)
    assert CheckResult("a", "pass").as_row() == {"name": "a", "verdict": "pass", "detail": ""}


@pytest.mark.parametrize(
    ("verdicts", "worst"),
    [
        ([], "not_checked"),
        (["not_checked", "pass"], "pass"),
        (["pass", "warn"], "warn"),
        (["warn", "fail", "pass"], "fail"),
    ],
)
def test_worst_verdict(verdicts: list[str], worst: str) -> None:
    assert worst_verdict(verdicts) == worst


def test_worst_verdict_refuses_other_words() -> None:
    with pytest.raises(ValueError, match="'ok' is not a verdict"):
        worst_verdict(["ok"])


def test_judge_lists_problems_then_the_remedy_then_what_was_not_proven() -> None:
    verdict, reason = judge(
        "backward",
        [("grads_finite", "fail", "nan in w"), ("x", "warn", ""), ("y", "not_checked", "why")],
    )
    assert verdict == "fail"
    assert reason == (
        "grads_finite: nan in w; x. If the check fails: check the graph, precision and"
        " normalisation. Not proven: y (why)"
    )


def test_judge_pass_names_what_it_did_not_cover_and_essential_checks_block_it() -> None:
    assert judge("forward", [("a", "pass", ""), ("b", "not_checked", "")]) == (
        "pass",
        "not proven: b",
    )
    verdict, reason = judge(
        "resume", [("a", "pass", ""), ("epoch_boundary.data_position", "not_checked", "x")]
    )
    assert (verdict, reason) == ("not_checked", "not proven: epoch_boundary.data_position (x)")
    assert judge("data", []) == ("not_checked", None)
    assert judge("nothing_known", [("a", "fail", "")]) == ("fail", "a")


def test_aggregator_keeps_the_first_occurrence_apart_and_folds_the_rest() -> None:
    agg = PhaseAggregator()
    for step, (seconds, clean, peak) in enumerate(
        [(0.9, True, 10), (0.5, False, 30), (0.1, True, 20), (0.2, True, 5)]
    ):
        agg.count("forward", step)
        agg.add(
            Occurrence(
                "forward",
                step,
                duration_s=seconds,
                synchronized=step != 3,
                values={
                    "peak_allocated_bytes": peak,
                    "baseline_allocated_bytes": peak - 1,
                    "param_bytes": step,
                    "notes": f"note {step}",
                },
                checks=[CheckResult("loss_finite", "fail" if step == 2 else "pass", str(step))],
                clean_timing=clean,
            )
        )
    first, rest = agg.rows()
    assert (first["first"], first["occurrences"], first["duration_s"]) == (True, 1, 0.9)
    assert (rest["occurrences"], rest["step_first"], rest["step_last"]) == (3, 1, 3)
    # Median and maximum from the occurrences the measurement did not slow down.
    assert (rest["duration_median_s"], rest["duration_max_s"]) == (0.1, 0.2)
    assert rest["duration_s"] == 0.5  # the first of the folded occurrences
    assert (rest["peak_allocated_bytes"], rest["baseline_allocated_bytes"]) == (30, 29)
    assert rest["param_bytes"] == 3  # the latest value
    assert rest["notes"] == "note 1"  # other columns keep the first value
    assert rest["synchronized"] is False
    assert rest["verdict"] == "fail"
    assert rest["checks"] == [{"name": "loss_finite", "verdict": "fail", "detail": "2"}]


def test_aggregator_counts_in_bulk_and_says_what_was_not_measured() -> None:
    agg = PhaseAggregator()
    agg.count("backward", 9, times=4, step_first=6)
    agg.count("data", 0, times=0)
    assert not agg.has("data")
    assert agg.has("backward")
    first, rest = agg.rows()
    assert (first["step_first"], first["occurrences"]) == (6, 1)
    assert (rest["step_first"], rest["step_last"], rest["occurrences"]) == (6, 9, 3)
    assert rest["reason"] == "not measured: outside the pilot window and the sampled updates"
    assert rest["duration_s"] is None
    assert rest["verdict"] == "not_checked"


def test_aggregator_orders_rows_by_phase_and_refuses_unknown_phases() -> None:
    agg = PhaseAggregator()
    agg.count("validation", 1)
    agg.add(Occurrence("validation", 1, checks=[CheckResult("x", "not_checked", "why")]))
    agg.count("setup", 0)
    agg.add(Occurrence("setup", 0))
    rows = agg.rows()
    assert [r["phase"] for r in rows] == ["setup", "validation"]
    assert rows[0]["reason"] == "no check applies to this phase"
    assert rows[1]["reason"] == "not proven: x (why)"
    with pytest.raises(ValueError, match="phase='warmup' is invalid"):
        agg.count("warmup", 0)
    with pytest.raises(ValueError, match="measured before it was counted"):
        agg.add(Occurrence("forward", 0))
