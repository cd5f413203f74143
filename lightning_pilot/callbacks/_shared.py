"""What several pilot callbacks and the resume check read from a fit, or do to it, alike."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import TQDMProgressBar

from lightning_pilot.core.progress import Reporter, TrainerBar, choose_reporter


def step_loss(outputs: Any) -> Any:
    """The loss in what a training step returned: its ``"loss"`` entry, or the value itself."""
    # type() first: Lightning hands a plain dict, and an ABC isinstance check is slower.
    is_map = type(outputs) is dict or isinstance(outputs, Mapping)
    return outputs.get("loss") if is_map else outputs


@contextlib.contextmanager
def evaluating(module: torch.nn.Module) -> Iterator[None]:
    """``module`` in eval mode, its training mode put back after."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def trainer_progress(trainer: pl.Trainer, total: int, label: str) -> Reporter:
    """How the progress of ``label``'s work (``total`` units) is shown after ``trainer``'s fit,
    as the Trainer shows its own (:func:`~lightning_pilot.core.progress.choose_reporter`): a bar
    under Lightning's ``tqdm`` bar, plain lines beside another bar, nothing on other ranks."""
    bar = trainer.progress_bar_callback
    shown: TrainerBar = None
    if bar is not None and getattr(bar, "is_enabled", True):
        shown = "tqdm" if isinstance(bar, TQDMProgressBar) else "other"
    position = 2 * bar.process_position if isinstance(bar, TQDMProgressBar) else 0  # its main bar's
    return choose_reporter(
        label, total=total, global_zero=trainer.is_global_zero, trainer_bar=shown, position=position
    )
