"""``python -m lightning_pilot.demo``: its arguments (its main on the quick demo is tested in
test_pilot_demo.py, on the demo run shared there)."""

from __future__ import annotations

import pytest

from lightning_pilot.demo.__main__ import main


def test_demo_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--steps", "1"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --steps" in capsys.readouterr().err
