"""lightning_pilot.vocabulary: the phase, verdict and memory-category names."""

from __future__ import annotations

import pytest

from lightning_pilot.vocabulary import (
    CATEGORY_COLUMNS,
    ESTIMATE_PHASES,
    VERDICT_ORDER,
    phase_label,
    phase_of_label,
    worst_verdict,
)


def test_names_and_labels() -> None:
    assert VERDICT_ORDER == ("fail", "warn", "not_checked", "pass")
    labels = [phase_label(phase, first) for phase, first in ESTIMATE_PHASES]
    assert labels[1:4] == ["backward", "optimizer_step_first", "optimizer_step"]
    assert CATEGORY_COLUMNS["grad"] == "grad_bytes"


def test_phase_of_label_reads_a_label_back() -> None:
    assert phase_of_label("optimizer_step_first") == ("optimizer_step", True)
    assert phase_of_label("validation") == ("validation", False)
    with pytest.raises(ValueError, match="is not a phase"):
        phase_of_label("warmup_first")


def test_worst_verdict_ranks_not_checked_after_pass() -> None:
    assert worst_verdict(["pass", "not_checked"]) == "pass"
    assert worst_verdict(["pass", "warn", "not_checked"]) == "warn"
    assert worst_verdict(["not_checked"]) == worst_verdict([]) == "not_checked"
