"""Comparison of variants across seeds: every run counted, failures ranked worst."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import pytest

from lightning_pilot.core.compare import bootstrap_ci, compare_runs, iqm


def frame(rows: list[tuple[str, int, str, float]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["variant", "seed", "status", "value"]).assign(
        run_id=[f"r{i:02d}" for i in range(len(rows))]
    )


SWEEP = frame(
    [
        *[("ctl", s, "completed", 2.0 + 0.1 * s) for s in range(6)],
        *[("low", s, "completed", 2.2 + 0.1 * s) for s in range(6)],
        ("high", 0, "completed", 1.9),
        ("high", 1, "diverged", float("nan")),
        ("high", 2, "completed", 2.0),
        ("high", 3, "oom", float("nan")),
        ("high", 4, "completed", 2.1),
        ("high", 5, "interrupted", float("nan")),
        ("high", 6, "running", float("nan")),
    ]
)


def test_every_run_is_counted_by_status() -> None:
    summary = compare_runs(SWEEP, control="ctl").summary.set_index("variant")
    high = summary.loc["high"]
    assert high["n_runs"] == 7
    assert (high["n_completed"], high["n_diverged"], high["n_oom"]) == (3, 1, 1)
    assert (high["n_interrupted"], high["n_running"], high["n_failed"]) == (1, 1, 0)
    # Completed runs plus failures (as the worst value); unfinished runs are not in statistics.
    assert high["n_in_statistics"] == 5
    assert "2 run(s) not in the statistics" in high["notes"]
    assert summary["n_runs"].sum() == len(SWEEP)


def test_failures_count_as_the_worst_value() -> None:
    summary = compare_runs(SWEEP, control="ctl").summary.set_index("variant")
    # high: [1.9, 2.0, 2.1, inf, inf] -> median 2.1, mean inf, IQM mean of middle 3 = inf.
    assert summary.loc["high", "median"] == pytest.approx(2.1)
    assert math.isinf(summary.loc["high", "mean"])
    assert summary.loc["high", "iqm"] == math.inf
    assert summary.loc["ctl", "median"] == pytest.approx(2.25)
    assert summary.loc["ctl", "iqm"] == pytest.approx(np.mean([2.1, 2.2, 2.3, 2.4]))


def test_failures_can_be_excluded_from_statistics_but_stay_counted() -> None:
    summary = compare_runs(SWEEP, failures="exclude").summary.set_index("variant")
    assert summary.loc["high", "n_in_statistics"] == 3
    assert summary.loc["high", "mean"] == pytest.approx(2.0)
    assert summary.loc["high", "n_diverged"] == 1


def test_diverged_runs_are_ranked_worst_and_never_dropped() -> None:
    runs = compare_runs(SWEEP).runs
    assert len(runs) == len(SWEEP)
    ranked = runs.dropna(subset=["rank"]).sort_values("rank")
    assert ranked["status"].tolist()[-2:] in (["diverged", "oom"], ["oom", "diverged"])
    assert ranked["rank"].tolist()[-2:] == [16, 16]  # tied worst
    assert ranked.iloc[0]["value"] == 1.9
    unfinished = runs[runs["status"].isin(["interrupted", "running"])]
    assert unfinished["rank"].isna().all()


def test_higher_is_better_flips_the_worst_value() -> None:
    result = compare_runs(SWEEP, mode="max")
    high = result.summary.set_index("variant").loc["high"]
    assert high["median"] == pytest.approx(1.9)  # [-inf, -inf, 1.9, 2.0, 2.1]
    ranked = result.runs.dropna(subset=["rank"]).sort_values("rank")
    assert ranked.iloc[0]["value"] == pytest.approx(2.7)  # low, seed 5
    assert set(ranked["status"].tolist()[-2:]) == {"diverged", "oom"}


def test_intervals_only_with_enough_runs() -> None:
    summary = compare_runs(SWEEP, min_runs_for_ci=6).summary.set_index("variant")
    ctl = summary.loc["ctl"]
    assert ctl["median_ci_low"] <= ctl["median"] <= ctl["median_ci_high"]
    assert ctl["mean_ci_low"] <= ctl["mean"] <= ctl["mean_ci_high"]
    assert 2.0 <= ctl["iqm_ci_low"] <= ctl["iqm_ci_high"] <= 2.5
    high = summary.loc["high"]
    assert math.isnan(high["mean_ci_low"])
    assert "intervals need >= 6 runs, got 5" in high["notes"]


def test_intervals_are_reproducible() -> None:
    one = compare_runs(SWEEP, random_state=3).summary
    two = compare_runs(SWEEP, random_state=3).summary
    pd.testing.assert_frame_equal(one, two)


def test_paired_differences_against_the_control() -> None:
    result = compare_runs(SWEEP, control="ctl", min_runs_for_ci=5)
    summary = result.summary.set_index("variant")
    low = summary.loc["low"]
    # low - ctl = +0.2 on every one of the 6 seeds: the control wins every seed.
    assert low["paired_n"] == 6
    assert low["paired_mean_diff"] == pytest.approx(0.2)
    assert low["paired_ci_low"] == pytest.approx(0.2)
    assert low["paired_ci_high"] == pytest.approx(0.2)
    assert (low["paired_wins"], low["paired_losses"]) == (0, 6)
    high = summary.loc["high"]
    # Pairs on seeds 0-4 (5 and 6 unfinished): -0.1, +inf, -0.2, +inf, -0.2.
    pairs = result.paired[result.paired["variant"] == "high"].set_index("seed")
    assert pairs.loc[0, "difference"] == pytest.approx(-0.1)
    assert pairs.loc[1, "difference"] == math.inf
    assert (high["paired_n"], high["paired_wins"], high["paired_losses"]) == (5, 3, 2)
    assert high["paired_median_diff"] == pytest.approx(-0.1)
    assert pd.isna(summary.loc["ctl", "paired_n"])


def test_the_latest_run_of_a_repeated_seed_is_paired() -> None:
    runs = frame(
        [
            ("ctl", 0, "completed", 1.0),
            ("new", 0, "completed", 5.0),
            ("new", 0, "completed", 2.0),  # a later run of the same seed
        ]
    )
    result = compare_runs(runs, control="ctl")
    assert result.paired["difference"].tolist() == [pytest.approx(1.0)]
    assert result.summary.set_index("variant").loc["new", "n_runs"] == 2
    assert "paired interval needs >= 5 seeds, got 1" in result.summary["notes"].iloc[1]


def test_both_failed_seeds_are_reported() -> None:
    runs = frame([("ctl", 0, "diverged", math.nan), ("new", 0, "failed", math.nan)])
    summary = compare_runs(runs, control="ctl").summary.set_index("variant")
    assert summary.loc["new", "paired_n"] == 0
    assert "1 seed(s) failed in both 'new' and the control" in summary.loc["new", "notes"]


def test_iqm_and_bootstrap() -> None:
    assert iqm(np.array([1.0, 2.0, 3.0])) == pytest.approx(2.0)  # n < 4: the mean
    assert iqm(np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 100.0])) == pytest.approx(3.5)
    low, high = bootstrap_ci(np.array([1.0, np.inf, 2.0]), np.median, rng=np.random.default_rng(0))
    assert low >= 1.0
    assert high == np.inf  # no NaN from infinities


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"control": "nope"}, ValueError, r"control='nope' is not a variant; the variants are"),
        ({"mode": "up"}, ValueError, r"mode='up' is invalid; expected 'min' or 'max'"),
        ({"failures": "drop"}, ValueError, r"failures='drop' is invalid"),
        ({"by": "arch"}, ValueError, r"runs has no column 'arch'"),
        ({"value": "loss"}, ValueError, r"runs has no column 'loss'"),
        ({"min_runs_for_ci": 1}, ValueError, r"min_runs_for_ci=1 is invalid"),
        ({"n_boot": 10}, ValueError, r"n_boot=10 is invalid"),
        ({"confidence": 95}, ValueError, r"confidence=95 is invalid"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        compare_runs(SWEEP, **kwargs)
