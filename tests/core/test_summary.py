"""core/summary: a run's summary for loggers, without a Trainer."""

from __future__ import annotations

import math

from lightning_pilot.core.summary import VERDICT_CODES, Summary


def test_not_measured_is_left_out_never_zero() -> None:
    summary = Summary()
    summary.add(a=None, b=math.nan, c=math.inf, d=3, e=0.0, f="words", g=True)
    assert summary.metrics == {"pilot/d": 3.0, "pilot/e": 0.0, "pilot/g": 1.0}
    assert summary.texts == {"pilot/f": "words"}


def test_a_phase_gets_its_worst_verdict_and_counts_add_up() -> None:
    rows = [
        {"phase": "data", "first": True, "verdict": "pass", "peak_allocated_bytes": 10},
        {"phase": "data", "first": False, "verdict": "warn", "peak_allocated_bytes": 12},
        {"phase": "resume", "first": True, "verdict": "not_checked", "duration_s": 1.5},
        {"phase": "export", "first": True, "verdict": "fail"},
    ]
    summary = Summary.of_phase_rows(rows)
    assert summary.texts == {
        "pilot/verdict/data": "warn",
        "pilot/verdict/resume": "not_checked",
        "pilot/verdict/export": "fail",
    }
    assert summary.metrics["pilot/verdict_code/data"] == VERDICT_CODES["warn"] == 1.0
    assert summary.metrics["pilot/data_first/peak_allocated_bytes"] == 10.0
    assert summary.metrics["pilot/data/peak_allocated_bytes"] == 12.0
    assert summary.metrics["pilot/resume_first/duration_s"] == 1.5
    assert "pilot/export_first/duration_s" not in summary.metrics
    counts = {v: summary.metrics[f"pilot/verdicts/{v}"] for v in VERDICT_CODES}
    assert counts == {"pass": 1.0, "warn": 1.0, "fail": 1.0, "not_checked": 1.0}


def test_added_values_win_over_the_phase_rows() -> None:
    summary = Summary.of_phase_rows([{"phase": "x", "first": True, "verdict": "pass"}])
    extra = Summary()
    extra.add(**{"verdict/x": "fail", "batch/tokens_seen": 7})
    summary.update(extra)
    assert summary.texts["pilot/verdict/x"] == "fail"
    assert summary.metrics["pilot/batch/tokens_seen"] == 7.0
