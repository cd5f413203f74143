"""One validation, test or predict loop as a phase: what its batches showed, the samples expected
from its loaders, and its checks (docs/phase-table.md)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sized
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_pilot.core import checks
from lightning_pilot.core.batches import BatchView
from lightning_pilot.core.phases import Occurrence


@dataclass
class EvalLoop:
    """What the batches of one evaluation loop showed (``measured=False``: not looked at):
    samples, largest batch and sequence, modules left in training mode, gradients enabled."""

    phase: str
    measured: bool = True
    samples: int = 0
    seq_len: int | None = None
    batch_size: int | None = None
    training: dict[str, torch.nn.Module] = field(default_factory=dict)
    grad: bool = False

    def add_batch(
        self,
        view: BatchView,
        named_modules: Iterable[tuple[str, torch.nn.Module]],
        *,
        grad_enabled: bool,
    ) -> None:
        """One batch, the module's submodules as it ran, and whether gradients were enabled."""
        self.samples += view.batch_size or 0
        if view.seq_len is not None:
            self.seq_len = max(view.seq_len, self.seq_len or view.seq_len)
        if view.batch_size is not None:
            self.batch_size = max(view.batch_size, self.batch_size or view.batch_size)
        for name, module in named_modules:
            if module.training:  # with its module: the check tells dropout from containers
                self.training.setdefault(name or "<root>", module)
        self.grad = self.grad or grad_enabled

    def results(self, expected: int | None, why_unknown: str) -> list[checks.CheckResult]:
        """The loop's checks: eval mode and no gradients (not for predict), and the samples
        seen against ``expected`` (``None``: unknown, ``why_unknown``)."""
        results: list[checks.CheckResult] = []
        if self.phase != "predict":
            results = checks.check_eval_mode(list(self.training.items()), self.grad, self.phase)
        return [*results, checks.check_sample_count(self.samples, expected, why_unknown)]

    def finish(
        self, occurrence: Occurrence | None, expected: int | None, why_unknown: str
    ) -> list[checks.CheckResult]:
        """The loop's checks, its largest batch and sequence noted on ``occurrence``."""
        if occurrence is not None:
            occurrence.values.update(seq_len=self.seq_len, batch_size=self.batch_size)
        return self.results(expected, why_unknown)


def limit_name(phase: str) -> str:
    """The Trainer argument limiting the batches of ``phase`` (``limit_val_batches``, ...)."""
    return "limit_val_batches" if phase == "validation" else f"limit_{phase}_batches"


def expected_samples(phase: str, loaders: Any, limit: int | float) -> tuple[int | None, str]:
    """The samples per rank an evaluation of ``phase`` over ``loaders`` (one, a sequence or a
    mapping) sees with the batch ``limit`` (:func:`limit_name`); ``None`` and why when unknown
    or partial by design."""
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    elif not isinstance(loaders, list | tuple):
        loaders = [] if loaders is None else [loaders]
    total = 0
    for loader in loaders:
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
        if not (isinstance(loader, DataLoader) and isinstance(sampler, Sized)):
            return None, f"the {phase} loader has no sized sampler"
        # As the Trainer reads it: an int is a number of batches, a float a fraction.
        if (isinstance(limit, float) and limit < 1.0) or (
            isinstance(limit, int) and limit < len(loader)
        ):
            return None, f"{limit_name(phase)}={limit} evaluates part of the data by design"
        total += len(sampler)  # per rank under a DistributedSampler
    return total, ""
