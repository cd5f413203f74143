"""``python -m lightning_pilot.demo``: the demo runs, passes and says where its files are."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_pilot import Ledger, read_phase_table
from lightning_pilot.demo.__main__ import main


def test_quick_demo_passes_and_writes_its_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--out", str(tmp_path), "--quick"])
    out = capsys.readouterr().out
    assert code == 0
    table = read_phase_table(tmp_path)
    assert {"setup", "forward", "optimizer_step", "validation", "checkpoint_save"} <= set(
        table["phase"]
    )
    assert "fail" not in set(table["verdict"])
    assert len(Ledger(tmp_path).runs()) == 5  # the pilot and four comparison fits
    assert "Phase table of the pilot run" in out
    assert f"ledger:      {tmp_path / 'ledger'}" in out


def test_demo_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--steps", "1"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --steps" in capsys.readouterr().err
