"""Progress of a pilot callback's own work around the fit, shown as the Trainer shows its bar.

Example:
    >>> import lightning.pytorch as pl
    >>> from lightning.pytorch.callbacks import ProgressBar
    >>> trainer = pl.Trainer(callbacks=[ProgressBar()], logger=False,
    ...                      enable_checkpointing=False, enable_model_summary=False)
    >>> type(trainer_progress(trainer, 3, "Work")).__name__  # a bar, not tqdm: plain lines
    'LineReporter'
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar

from lightning_pilot.core.progress import Reporter, TrainerBar, choose_reporter

__all__ = ["trainer_progress"]


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
