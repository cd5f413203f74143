"""Run ids without a Trainer: the format, the order, uniqueness and what a path may hold."""

from __future__ import annotations

import pytest

from lightning_pilot.core.ids import new_run_id, validate_run_id

# 2026-12-01 18:09:50.123456789 UTC
NOW_NS = 1_796_148_590_123_456_789


def test_the_id_carries_the_utc_time_to_the_millisecond() -> None:
    run_id = new_run_id(NOW_NS)
    assert run_id.startswith("20261201T180950123Z-")
    assert len(run_id) == len("20261201T180950123Z-") + 16
    assert validate_run_id(run_id, "run_id") == run_id


def test_string_order_is_creation_order_and_one_millisecond_still_differs() -> None:
    earlier, later = new_run_id(NOW_NS), new_run_id(NOW_NS + 1_000_000)
    assert earlier < later
    same_instant = {new_run_id(NOW_NS) for _ in range(1_000)}
    assert len(same_instant) == 1_000  # 64 random bits each


@pytest.mark.parametrize(
    "value",
    [
        "../../etc",
        "20261201T180950123Z-0123456789abcdeg",  # not hex
        "20261201T180950123Z-0123456789ABCDEF",  # upper case is not what new_run_id makes
        "20261201T180950123Z-0123456789abcdef/..",
        "20261201T180950123-0123456789abcdef",
        "",
    ],
)
def test_anything_else_is_refused_before_it_becomes_a_path(value: str) -> None:
    with pytest.raises(ValueError, match=r"run_id=.* is not a run id"):
        validate_run_id(value, "run_id")


def test_a_non_string_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="run_id must be a string run id, got int"):
        validate_run_id(12, "run_id")
