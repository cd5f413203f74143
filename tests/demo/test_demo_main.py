"""``python -m lightning_pilot.demo``: the demo pilot passes and says where its files are."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_pilot import read_phase_table
from lightning_pilot.demo.__main__ import main


def test_demo_pilot_passes_and_writes_the_phase_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--out", str(tmp_path), "--steps", "6", "--checkpoint-every", "3"])
    out = capsys.readouterr().out
    assert code == 0
    table = read_phase_table(tmp_path)
    assert {"setup", "forward", "optimizer_step", "validation", "checkpoint_save"} <= set(
        table["phase"]
    )
    assert "fail" not in set(table["verdict"])
    assert "phase table: " in out
    assert str(tmp_path) in out


def test_demo_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--steps", "1"])
    assert exit_info.value.code == 2
    assert "--steps must be at least 2" in capsys.readouterr().err
