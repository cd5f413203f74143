"""Shared fixtures: small real Trainers on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest


@pytest.fixture
def make_trainer(tmp_path: Path) -> Any:
    """Build a quiet CPU Trainer rooted in ``tmp_path``; keyword arguments override defaults."""

    def make(**overrides: Any) -> pl.Trainer:
        options: dict[str, Any] = {
            "accelerator": "cpu",
            "devices": 1,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": tmp_path,
            "max_steps": 4,
            "limit_val_batches": 2,
        }
        options.update(overrides)
        return pl.Trainer(**options)

    return make
