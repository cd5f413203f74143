"""Shared fixtures: small real Trainers on CPU; one torch thread per process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

# The suite's models are tiny and it runs on 2 cores, often as 2 pytest-xdist workers beside
# the processes the tests start: a second intra-op thread per process only adds
# synchronisation. Set before any test (and inherited by every process a test starts).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

if "PYTEST_XDIST_WORKER" in os.environ:
    # Two workers may start DDP process groups at the same time: with no MASTER_PORT each
    # group's launcher picks a free port of its own (a MASTER_PORT given to the whole run
    # would be the same port for both).
    os.environ.pop("MASTER_PORT", None)


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
