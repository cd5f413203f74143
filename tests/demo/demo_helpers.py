"""Helpers shared by the demo-task tests (imported by test_lm.py and test_classifier.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

# Trainer arguments shared by every test (plus default_root_dir=tmp_path).
QUIET_CPU = {
    "accelerator": "cpu",
    "devices": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def make_trainer(tmp_path: Path, **overrides: Any) -> Trainer:
    """A quiet single-process CPU Trainer writing only under ``tmp_path``."""
    return Trainer(**{**QUIET_CPU, "default_root_dir": tmp_path, **overrides})


class LossRecorder(Callback):
    """Keeps the training loss of every step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.losses.append(float(outputs["loss"]))


def assert_same_batches(first: list[dict[str, Tensor]], second: list[dict[str, Tensor]]) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
