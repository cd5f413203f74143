"""core/per_target.py: an estimate's configurations named per target (on_target itself is
tested with the report in tests/report/test_analysis.py)."""

from __future__ import annotations

import pandas as pd

from lightning_pilot.core.per_target import checkpointing_name, on_target


def test_checkpointing_is_named_by_its_mode() -> None:
    assert [checkpointing_name(v) for v in (True, False, "selective", "later")] == [
        "full",
        "off",
        "selective",
        "later",
    ]


def test_on_target_names_the_checkpointing_and_takes_the_largest_phase() -> None:
    rows = pd.DataFrame(
        {
            "target": ["L4-24GB"] * 2,
            "precision": ["bf16-mixed"] * 2,
            "micro_batch": [8, 8],
            "seq_len": [512, 512],
            "checkpointing": [False] * 2,
            "strategy": ["single"] * 2,
            "devices": [1, 1],
            "phase": ["forward", "backward"],
            "status": ["ok", "ok"],
            "reason": [None, None],
            "peak_reserved_bytes": [3 << 30, 5 << 30],
            "fits": [True, True],
            "headroom_bytes": [21 << 30, 19 << 30],
            "step_time_low_s": [None, 0.2],
            "step_time_high_s": [None, 0.4],
        }
    )
    found = on_target(rows)[["checkpointing", "phase", "fits", "step_high_s"]]
    assert found.to_dict("records") == [
        {"checkpointing": "off", "phase": "backward", "fits": True, "step_high_s": 0.4}
    ]
