"""The phases of a measured update (data, forward, backward, optimizer step) and their checks
(docs/phase-table.md), from the moments a training loop calls."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pilot.core import checks
from lightning_pilot.core.batches import BatchView
from lightning_pilot.core.phase_meter import PhaseMeter
from lightning_pilot.core.phase_rows import PhaseRows
from lightning_pilot.core.phases import Occurrence

Fingerprint = dict[str, tuple[float, float]]


def intended_trainable(module: torch.nn.Module) -> set[int]:
    """``id`` of the parameters the module means to train: ``requires_grad``, or switched off
    by an open ``toggle_optimizer`` of a LightningModule (its private state, read defensively)."""
    state = getattr(module, "_param_requires_grad_state", None)
    saved: Mapping[Any, Any] = state if isinstance(state, Mapping) else {}
    return {id(p) for p in module.parameters() if p.requires_grad or saved.get(p, False)}


def batch_sizes_agree(view: BatchView) -> list[checks.CheckResult]:
    """The data phase's ``batch_sizes_agree``: the batch's tensors have one leading dimension."""
    sizes = {
        name: int(value.shape[0])
        for name in ("inputs", "targets", "attention_mask", "ids")
        if isinstance(value := getattr(view, name), torch.Tensor) and value.ndim >= 1
    }
    if not sizes:
        detail = f"no tensors found in the batch ({', '.join(view.missing)} missing)"
        return [checks.CheckResult("batch_sizes_agree", "not_checked", detail)]
    differ = f"leading dimensions differ: {sizes}" if len(set(sizes.values())) > 1 else None
    return [checks._judged("batch_sizes_agree", differ)]


@dataclass
class PendingUpdate:
    """The optimizer step being measured: what ``checks.check_update`` needs from before it."""

    step_before: int
    before: Fingerprint
    trainable: set[str]
    zero_grad: set[str]
    zero_lr: set[str]
    without_grad: set[str]
    first: bool  # the fit's first measured update: on the phase's first row

    @classmethod
    def of(
        cls,
        step: int,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        intended: set[int],
        *,
        before: Fingerprint | None,
        first: bool,
    ) -> PendingUpdate:
        """The update ``optimizer`` is about to make at ``step``: its parameters meant to move
        (optimized and ``intended``), their fingerprint (``before`` when taken already), those
        with a zero gradient, a zero learning rate or no gradient."""
        named = list(named_parameters)
        moving = intended & {id(p) for group in optimizer.param_groups for p in group["params"]}
        trainable = [(n, p) for n, p in named if id(p) in moving]
        resting = {
            id(p)
            for group in optimizer.param_groups
            if isinstance(group.get("lr"), int | float) and group["lr"] == 0
            for p in group["params"]
        }
        return cls(
            step,
            before or checks.fingerprint(named),
            trainable={n for n, _ in trainable},
            zero_grad=checks.zero_gradients(trainable),
            zero_lr={n for n, p in trainable if id(p) in resting},
            without_grad={n for n, p in trainable if p.grad is None},
            first=first,
        )


class TrainingStep:
    """The measured phases of the training loop's updates, counted and added to ``rows``,
    measured by ``meter`` (the module and optimizers are the meter's). Each moment is one
    method; ``track``: whether the CPU tensor tracker runs in the phase that starts. A method
    returns the message of a failed check when ``rows`` stops on failures (else ``None``)."""

    def __init__(self, rows: PhaseRows, meter: PhaseMeter) -> None:
        self.rows, self.meter = rows, meter
        self.pending: Occurrence | None = None  # the optimizer step measured, judged later
        self.update: PendingUpdate | None = None
        self.view: BatchView | None = None
        self.intended: set[int] = set()
        #: ids of the parameters meant to train at the fit's first backward.
        self.trainable_at_start: set[int] | None = None
        self.backward_first = True

    def flush(self, results: Iterable[checks.CheckResult] = ()) -> str | None:
        """Add the measured optimizer step waiting for its judgement, with ``results``."""
        pending, self.pending = self.pending, None
        return self.rows.add(pending, results)

    def batch_start(self, step: int, view: BatchView, *, track: bool = True) -> str | None:
        """A measured micro-batch starts: the data phase ends, the forward begins."""
        # Read before the training step can switch parameters off.
        self.intended = intended_trainable(self.meter.require_module())
        self.rows.count("data", step)
        self.rows.count("forward", step)
        if failed := self.rows.add(self.meter.end("data", step, view), batch_sizes_agree(view)):
            return failed
        self.view = view
        self.meter.begin("forward", track=track)
        return None

    def before_backward(self, step: int, loss: torch.Tensor, *, track: bool = True) -> str | None:
        """The forward computed ``loss``: the forward ends, the backward begins."""
        module = self.meter.require_module()
        self.backward_first = not self.rows.has("backward")
        self.rows.count("backward", step)
        occurrence = self.meter.end("forward", step, self.view)
        # The modes the forward ran in (what the training step switched to eval mode is seen).
        intended = self.intended | intended_trainable(module)
        mode = checks.check_train_mode(module.named_modules(), intended)
        if failed := self.rows.add(occurrence, [*checks.check_loss(loss), mode]):
            return failed
        self.meter.begin("backward", track=track)
        return None

    def after_backward(self, step: int) -> str | None:
        """The backward ends: its gradients are checked (``grads_reach_params`` over the
        measured backwards)."""
        module = self.meter.require_module()
        occurrence = self.meter.end("backward", step, self.view)
        per_optimizer = [
            {id(p) for g in o.param_groups for p in g["params"]} for o in self.meter.optimizers
        ]
        now = intended_trainable(module)
        if self.trainable_at_start is None:  # the fit's first backward
            self.trainable_at_start = now
        optimized: set[int] = set().union(*per_optimizer)
        results = checks.check_gradients(
            module.named_parameters(),
            optimized,
            self.intended | now,
            trainable_at_start=self.trainable_at_start,
            optimizers=per_optimizer,
        )
        reached, missing = checks.gradient_reach(module.named_parameters(), optimized)
        self.rows.evidence.backward(reached)
        kept = [r for r in results if r.name != "grads_reach_params"]
        if failed := self.rows.add(occurrence, kept):
            return failed
        return self.rows.defer(("backward", self.backward_first, "grads_reach_params"), missing)

    def before_optimizer_step(
        self, step: int, optimizer: torch.optim.Optimizer, *, track: bool = True
    ) -> str | None:
        """``optimizer`` is about to step: the optimizer step begins."""
        module = self.meter.require_module()
        # Several optimizers may step in one batch: the previous step is judged first.
        before, failed = self._judge(step)
        if failed:
            return failed
        first = not self.rows.has("optimizer_step")
        self.rows.count("optimizer_step", step)
        intended = self.intended | intended_trainable(module)
        named = module.named_parameters()
        self.update = PendingUpdate.of(step, optimizer, named, intended, before=before, first=first)
        self.meter.begin("optimizer_step", track=track)
        return None

    def optimizer_stepped(self) -> None:
        """The optimizer stepped: the phase ends, judged when the next moment comes."""
        if self.meter.open_phase == "optimizer_step":
            step = None if self.update is None else self.update.step_before
            self.pending = self.meter.end("optimizer_step", step)

    def judge_update(self, step_after: int) -> str | None:
        """Judge the optimizer step waiting, ``global_step`` now at ``step_after``."""
        return self._judge(step_after)[1]

    def _judge(self, step_after: int) -> tuple[Fingerprint | None, str | None]:
        """The fingerprint after the optimizer step waiting (``None``: none waits), a failure."""
        update, pending = self.update, self.pending
        if not (update and pending and pending.phase == "optimizer_step"):
            return None, None
        after = checks.fingerprint(self.meter.require_module().named_parameters())
        results = checks.check_update(
            update.before,
            after,
            trainable=update.trainable,
            step_before=update.step_before,
            step_after=step_after,
            zero_grad=update.zero_grad,
            zero_lr=update.zero_lr,
            without_grad=update.without_grad,
            reached=None,  # judged over the measured updates (GradientEvidence)
        )
        before = update.before
        skipped = [n for n in before if n in update.without_grad and before[n] == after.get(n)]
        self.rows.evidence.update()
        if failed := self.flush(results):
            return after, failed
        key = ("optimizer_step", update.first, "trainable_params_changed")
        return after, self.rows.defer(key, skipped)
