"""The stand-in Trainer ``configure_optimizers`` sees when the estimate runs without one.

A LightningModule's ``configure_optimizers`` often reads ``self.trainer`` (OneCycleLR's
``self.trainer.estimated_stepping_batches``); :func:`estimate` runs it on a module with no
Trainer attached, so :func:`stand_in_trainer` attaches :class:`StandInTrainer` while it runs
and the rows' notes say so. A failure of ``configure_optimizers`` becomes
:class:`ConfigureError`, whose message names the remedy.

Example:
    >>> from lightning_pilot.demo import TinyCausalLM
    >>> module, notes = TinyCausalLM(d_model=8, n_heads=1, n_layers=1), []
    >>> with stand_in_trainer(module, notes):
    ...     module.trainer.estimated_stepping_batches
    1000
    >>> module._trainer is None, notes[0].startswith("configure_optimizers ran without a Trainer")
    (True, True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Final

__all__ = ["STAND_IN_STEPS", "ConfigureError", "StandInTrainer", "stand_in_trainer"]

#: ``trainer.estimated_stepping_batches`` (and ``max_steps``) of the stand-in Trainer a module
#: without one sees in ``configure_optimizers`` (a schedule's length changes neither memory
#: nor step time).
STAND_IN_STEPS: Final = 1000


class StandInTrainer:
    """What ``configure_optimizers`` may read of ``self.trainer`` when the estimate runs
    without a Trainer: a stated number of steps on one device, epoch and step 0."""

    estimated_stepping_batches = STAND_IN_STEPS
    max_steps = STAND_IN_STEPS
    num_training_batches = STAND_IN_STEPS
    max_epochs = 1
    current_epoch = 0
    global_step = 0
    accumulate_grad_batches = 1
    num_devices = 1
    num_nodes = 1
    world_size = 1
    global_rank = 0
    local_rank = 0
    is_global_zero = True

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"trainer.{name}: estimate() runs without a Trainer, and its stand-in has only"
            " estimated_stepping_batches, max_steps, num_training_batches (all"
            f" {STAND_IN_STEPS}), max_epochs (1), current_epoch, global_step, world_size,"
            " num_devices, num_nodes, global_rank, local_rank, accumulate_grad_batches,"
            " is_global_zero"
        )


class ConfigureError(Exception):
    """``configure_optimizers`` failed: the row names the phase and the remedy."""

    def __init__(self, err: Exception) -> None:
        super().__init__(
            f"configure_optimizers() failed: {type(err).__name__}: {err}. The estimate needs"
            " the optimizer it returns: make configure_optimizers work without a Trainer"
            " (estimate() stands one in with the attributes above), or estimate at the end"
            " of a fit with TargetEstimator, where the fit's Trainer is attached"
        )


@contextlib.contextmanager
def stand_in_trainer(module: Any, notes: list[str]) -> Iterator[None]:
    """A LightningModule with no Trainer attached gets :class:`StandInTrainer` while its
    ``configure_optimizers`` runs (``self.trainer.estimated_stepping_batches``, OneCycleLR's
    idiom), and ``notes`` (the rows') say so. A module with a Trainer (or Fabric) is left
    alone."""
    if not hasattr(type(module), "trainer") or getattr(module, "_trainer", True) is not None:
        yield
        return
    if getattr(module, "_fabric", None) is not None:
        yield
        return
    stand_in = StandInTrainer()
    module._trainer = stand_in
    try:
        yield
    finally:
        module._trainer = None
    notes.append(
        f"configure_optimizers ran without a Trainer: a stand-in gave"
        f" estimated_stepping_batches={STAND_IN_STEPS} (a schedule's length changes neither"
        " memory nor step time)"
    )
