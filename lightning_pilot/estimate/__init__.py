"""Before renting: memory per GPU and step time on a target GPU, estimated on a CPU.

:func:`estimate` runs the user's LightningModule (live, or built by a factory without
allocating) on fake tensors through its own ``training_step``, ``configure_optimizers`` and
``validation_step``, and answers per target GPU, precision, micro-batch, sequence length,
activation checkpointing and strategy: the peak allocated and reserved bytes per phase with
their categories, whether it fits, and a step-time band. ``docs/estimate.md`` describes the
method, what is measured and what is modelled.

Example:
    >>> from lightning_pilot.estimate import TARGETS, Strategy
    >>> "H100-SXM-80GB" in TARGETS, Strategy.parse("ddp:8").devices
    (True, 8)
"""

from __future__ import annotations

from lightning_pilot.estimate.batches import reshape_batch
from lightning_pilot.estimate.grid import estimate, trace_configuration
from lightning_pilot.estimate.precision import PRECISIONS
from lightning_pilot.estimate.precision_traces import extrapolate
from lightning_pilot.estimate.recorder import PhaseTrace, Recorder, UntraceableError
from lightning_pilot.estimate.reference import PHASE_ORDER, measure_cpu
from lightning_pilot.estimate.rows import Estimate
from lightning_pilot.estimate.session import Session
from lightning_pilot.estimate.strategies import Strategy
from lightning_pilot.estimate.targets import TARGETS, Target, target
from lightning_pilot.vocabulary import CATEGORIES

__all__ = [
    "CATEGORIES",
    "PHASE_ORDER",
    "PRECISIONS",
    "TARGETS",
    "Estimate",
    "PhaseTrace",
    "Recorder",
    "Session",
    "Strategy",
    "Target",
    "UntraceableError",
    "estimate",
    "extrapolate",
    "measure_cpu",
    "reshape_batch",
    "target",
    "trace_configuration",
]
