"""The arithmetic of an overfit run on a tiny subset (which examples, what loss, what verdict),
fed by :class:`~lightning_pilot.callbacks.overfit_tiny_subset.OverfitTinySubset` without a
Trainer (docs/data-and-overfit.md)."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch
from torch.utils.data import IterableDataset
from torchmetrics.functional.classification import multiclass_accuracy

from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.checks import CheckResult, shown_names


def select_indices(dataset_size: int, count: int, *, seed: int) -> list[int]:
    """Choose ``count`` distinct example indices of a dataset, sorted, the same for the same seed
    (``random.Random`` over the whole dataset; the torch generator stays untouched)."""
    if dataset_size < 1:
        raise ValueError(f"dataset_size={dataset_size!r} is invalid: the dataset is empty.")
    if count < 1:
        raise ValueError(f"count={count!r} is invalid: choose at least one example.")
    return sorted(random.Random(seed).sample(range(dataset_size), min(count, dataset_size)))


def expected_initial_loss(num_classes: int) -> float:
    """Cross-entropy of a model that predicts every class equally: ``-log(1/C) = log(C)``."""
    if num_classes < 2:
        raise ValueError(f"num_classes={num_classes!r} is invalid: expected at least 2 classes.")
    return math.log(num_classes)


def check_initial_loss(
    initial: float | None, num_classes: int | None, *, tolerance: float
) -> CheckResult:
    """The first loss is within a factor ``tolerance`` of ``log(C)`` (else a warning)."""
    name = "initial_loss"
    if initial is None or not math.isfinite(initial):
        return CheckResult(name, "not_checked", f"initial loss is {initial}")
    if num_classes is None or num_classes < 2:
        why = f"initial loss {initial:.4g}; the number of classes is unknown, so -log(1/C) is too"
        return CheckResult(name, "not_checked", why + ": give num_classes=")
    expected = expected_initial_loss(num_classes)
    detail = f"initial loss {initial:.4g}, expected -log(1/{num_classes}) = {expected:.4g}"
    if expected / tolerance <= initial <= expected * tolerance:
        return CheckResult(name, "pass", detail)
    why = (
        "the logits start far from uniform (initialisation scale, a summed or scaled loss)"
        if initial > expected
        else "the targets are predictable before training (a pretrained model, or labels"
        " leaking into the inputs)"
    )
    return CheckResult(name, "warn", f"{detail}: off by more than x{tolerance:g}; {why}")


def loss_target(
    initial: float | None, *, target_loss: float | None, target_fraction: float | None
) -> float | None:
    """The loss to reach: ``target_loss`` if given, else ``target_fraction * initial``."""
    if target_loss is not None:
        return target_loss
    if target_fraction is None or initial is None or not math.isfinite(initial):
        return None
    return target_fraction * initial


def check_loss_finite(curve: Sequence[tuple[int, float]]) -> CheckResult:
    """Every recorded loss is finite. ``curve`` holds ``(step, loss)`` pairs."""
    name = "loss_finite"
    if not curve:
        return CheckResult(name, "not_checked", "no training loss was recorded")
    bad = [step for step, value in curve if not math.isfinite(value)]
    if not bad:
        return CheckResult(name, "pass", f"{len(curve)} update(s), all finite")
    detail = (
        f"the loss is not finite at {len(bad)} of {len(curve)} update(s), first at step"
        f" {bad[0]}: a tiny subset must train with finite values"
    )
    return CheckResult(name, "fail", detail)


def check_loss_target(
    curve: Sequence[tuple[int, float]], target: float | None, *, budget: int | None
) -> CheckResult:
    """The loss reached ``target`` within the step budget."""
    name = "loss_target"
    if not curve:
        return CheckResult(name, "not_checked", "no training loss was recorded")
    if target is None:
        return CheckResult(name, "not_checked", "no target: the initial loss is unknown")
    first = curve[0][1]
    finite = [(step, value) for step, value in curve if math.isfinite(value)]
    reached = next(((step, value) for step, value in finite if value <= target), None)
    if reached is not None:
        detail = f"loss {first:.4g} -> {reached[1]:.4g} <= target {target:.4g} at step {reached[0]}"
        return CheckResult(name, "pass", detail)
    best = min((value for _, value in finite), default=math.nan)
    last_step = curve[-1][0]
    scope = f"in {last_step} step(s)" + (f" of a budget of {budget}" if budget else "")
    stalled = math.isfinite(best) and best >= 0.95 * first
    why = (
        "nothing learns: check that the loss is computed on outputs that carry gradients"
        " (no detach/no_grad) and that the trainable parameters are in the optimizer"
        if stalled
        else "it learns too slowly: raise the learning rate or the step budget, or check the"
        " targets"
    )
    detail = f"loss {first:.4g} -> best {best:.4g} {scope}, never reached the target {target:.4g}"
    return CheckResult(name, "fail", f"{detail}: {why}")


def predicted_classes(logits: torch.Tensor) -> torch.Tensor:
    """The class each row of ``logits`` predicts (``logit > 0`` for one binary output)."""
    logits = logits.detach()
    if logits.shape[-1] == 1:
        return (logits[..., 0] > 0).long()
    return logits.argmax(dim=-1)


def align_predictions(
    predicted: torch.Tensor, targets: torch.Tensor, *, shift: bool, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(predictions, targets)`` paired as the loss pairs them, or ``None`` when the shapes differ.
    ``shift=True`` with ``[B, T]`` targets (a causal LM shifting inside its loss): the class
    predicted at ``t - 1`` scores the label at ``t``; position 0 (prediction ``-1``) gets
    ``ignore_index``."""
    predicted = predicted.detach()
    if predicted.shape != targets.shape:
        return None
    if not shift or targets.ndim != 2:
        return predicted, targets
    shifted = torch.full_like(predicted, -1)
    shifted[:, 1:] = predicted[:, :-1]
    counted = targets.clone()
    counted[:, 0] = ignore_index
    return shifted, counted


def logits_of(output: Any) -> torch.Tensor | None:
    """The logits of a model's output (itself, ``["logits"]`` or ``.logits``), or ``None``."""
    if isinstance(output, torch.Tensor):
        return output
    found = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    return found if isinstance(found, torch.Tensor) else None


class Notes(dict[str, int]):
    """Each message's count, in the order first seen; iterating gives each message once,
    ``"... (seen N times)"`` when added again."""

    def add(self, message: str) -> None:
        """Count one more ``message``."""
        self[message] = self.get(message, 0) + 1

    def __iter__(self) -> Iterator[str]:
        for message, count in self.items():
            yield message if count == 1 else f"{message} (seen {count} times)"


@dataclass(frozen=True)
class Recovery:
    """The subset's score: accuracy (classes) or exact match (tokens), and the ids still wrong."""

    metric: str
    score: float
    examples: int
    wrong_ids: list[str] = field(default_factory=list)


def recovery(
    predictions: torch.Tensor,
    targets: torch.Tensor,
    ids: Sequence[Any],
    *,
    ignore_index: int,
    num_classes: int | None = None,
) -> Recovery:
    """Score ``[B]`` class or ``[B, T]`` token predictions against the targets, per example
    (``ignore_index`` positions do not count; ``num_classes=None``: read from the values)."""
    predictions, targets = predictions.detach().cpu(), targets.detach().cpu()
    counted = targets != ignore_index
    right = (predictions == targets) | ~counted
    if targets.ndim == 1:
        kept_p, kept_t = predictions[counted], targets[counted]
        # torchmetrics wants every value inside [0, C) and C >= 2 (one logit: two classes).
        tops = [int(kept.max()) + 1 for kept in (kept_p, kept_t) if kept.numel()]
        size = max([2, num_classes or 0, *tops])
        valid = (kept_t >= 0) & (kept_p >= 0)
        score = 0.0 if kept_t.numel() else math.nan
        if bool(valid.any()):
            accuracy = multiclass_accuracy(
                kept_p[valid], kept_t[valid], num_classes=size, average="micro"
            )
            score = float(accuracy) * int(valid.sum()) / kept_t.numel()
        wrong = [str(ids[i]) for i in torch.nonzero(~right).flatten().tolist()]
        return Recovery("accuracy", score, int(counted.sum()), wrong)
    per_example = right.all(dim=1)
    has_positions = counted.any(dim=1)
    scored = int(has_positions.sum())
    exact = int((per_example & has_positions).sum())
    wrong = [str(ids[i]) for i in torch.nonzero(has_positions & ~per_example).flatten().tolist()]
    score = exact / scored if scored else math.nan
    return Recovery("exact_match", score, scored, wrong)


def check_recovery(
    result: Recovery | None, *, required: float, step: int | None, unavailable: str | None = None
) -> CheckResult:
    """The model recovers at least ``required`` of the subset's targets (``unavailable``: why
    ``result`` is ``None``)."""
    name = "targets_recovered"
    if result is None:
        why = unavailable or "no predictions could be made on the subset"
        return CheckResult(name, "not_checked", why)
    if result.examples == 0 or not math.isfinite(result.score):
        return CheckResult(name, "not_checked", "no example has a position counted in the loss")
    at = f" at step {step}" if step is not None else ""
    detail = f"{result.metric} {result.score:.3f} on {result.examples} example(s){at}"
    if result.score >= required:
        return CheckResult(name, "pass", detail)
    wrong = shown_names(result.wrong_ids)
    return CheckResult(name, "fail", f"{detail}, required {required:.3f}; ids still wrong: {wrong}")


#: What ``targets_recovered`` tells a user whose model gives no predictions.
PREDICT_REMEDY: Final = "give predict_fn=fn(pl_module, batch) -> logits"


def error_text(err: BaseException) -> str:
    """``Type: message``, the message cut to 300 characters."""
    text = str(err)
    return f"{type(err).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def subset_batches(
    dataset: Any,
    count: int,
    *,
    seed: int,
    collate: Callable[[list[Any]], Any],
    batch_size: int | None,
    notes: Notes,
) -> tuple[list[Any], list[int]]:
    """``count`` seeded examples (an iterable dataset's first, noted) collated in batches of
    ``batch_size`` (``None``: one), and their dataset indices."""
    with torch.random.fork_rng(devices=[]):
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            items = list(itertools.islice(iter(dataset), count))
            indices = list(range(len(items)))
            notes.add("iterable dataset: the subset is its first examples")
        else:
            indices = select_indices(len(dataset), count, seed=seed)
            items = [dataset[i] for i in indices]
    size = batch_size or len(items)
    return [collate(items[i : i + size]) for i in range(0, len(items), size)], indices


def subset_ids(
    batches: Sequence[Any], indices: Sequence[int], adapter: BatchAdapter, notes: Notes
) -> list[str]:
    """The ids the subset's batches carry, else their dataset indices (noted)."""
    ids = [adapter.view(batch, count_tokens=False).ids_list() for batch in batches]
    if all(batch_ids is not None for batch_ids in ids):
        return [str(i) for batch_ids in ids for i in batch_ids or []]
    notes.add("ids are dataset indices: the batches carry no ids")
    return [str(i) for i in indices]


class LossCurve:
    """The overfit run's loss per update (the mean of its micro-batch losses, each multiplied back
    by the accumulation factor); the first micro-batch loss is the initial loss."""

    def __init__(self) -> None:
        self.points: list[tuple[int, float]] = []
        self.initial: float | None = None
        self._micro: list[float] = []

    def add(self, value: float) -> None:
        """One micro-batch's loss."""
        self._micro.append(value)
        if self.initial is None:
            self.initial = value

    @property
    def last_step(self) -> int:
        """The step of the last point (0 before the first)."""
        return self.points[-1][0] if self.points else 0

    def close(self, step: int) -> tuple[float, int] | None:
        """``(mean loss, micro-batches)`` of the update ending at ``step``, added to the curve;
        ``None`` when no update finished (the same step) or no loss was read."""
        if step == self.last_step or not self._micro:
            return None
        mean = sum(self._micro) / len(self._micro)
        micro, self._micro = len(self._micro), []
        self.points.append((step, mean))
        return mean, micro


def overfit_done(
    mean: float, target: float | None, result: Recovery | None, *, required: float
) -> bool:
    """Whether the overfit run stops: loss target and recovery reached, or a non-finite loss."""
    met = result is not None and target is not None and mean <= target and result.score >= required
    return bool(met) or not math.isfinite(mean)


def overfit_row(
    step: int,
    loss: float,
    micro: int,
    *,
    target: float | None,
    ids: list[str],
    result: Recovery | None,
) -> dict[str, Any]:
    """A row of ``overfit.parquet`` (no schema version): the loss, and the score when scored."""
    row: dict[str, Any] = dict(
        step=step, loss=loss, micro_batches=micro, target_loss=target, subset_ids=ids
    )
    if result is not None:
        row.update(metric=result.metric, score=result.score, wrong_ids=result.wrong_ids)
    return row


def _widen(values: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    """``[B, T]`` values padded on the right to ``[B, width]`` with ``fill``."""
    return torch.nn.functional.pad(values, (0, width - values.shape[1]), value=fill)


def join_scored(
    scored: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ids: Sequence[str],
    *,
    batch_size: int | None,
    ignore_index: int,
    notes: Notes,
) -> tuple[torch.Tensor, torch.Tensor, list[str]] | None:
    """The subset's ``(predictions, targets)`` joined, with their ids; token batches of different
    widths are padded at ``ignore_index``; ``None`` when they cannot join (noted)."""
    predictions, targets = [p for p, _ in scored], [t for _, t in scored]
    size = batch_size or len(ids)
    joined = [i for index in range(len(scored)) for i in ids[index * size :][:size]]
    if any(p.shape[1:] != predictions[0].shape[1:] for p in predictions):
        if any(p.ndim != 2 for p in predictions):
            notes.add("the subset's batches predict shapes that cannot be joined")
            return None
        width = max(p.shape[1] for p in predictions)
        predictions = [_widen(p, width, 0) for p in predictions]
        targets = [_widen(t, width, ignore_index) for t in targets]
    return torch.cat(predictions), torch.cat(targets), joined


def predicted_pair(
    out: Any, targets: torch.Tensor, *, shift: bool, ignore_index: int, call: str
) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, str | None]:
    """``((predictions, targets), None)`` from what ``call`` returned (logits; of the targets'
    shape: predictions, or one logit per target when not whole numbers), or ``(None, problem)``."""
    logits = logits_of(out)
    if logits is None:
        return None, f"{call} returned a {type(out).__name__} without logits"
    if logits.shape == targets.shape:
        if logits.is_floating_point() and not bool((logits == logits.round()).all()):
            # One logit per target (a binary head whose output was squeezed): its sign.
            return ((logits.detach() > 0).long(), targets), None
        return (logits.long(), targets), None  # predictions already (from predict_fn)
    predicted = predicted_classes(logits)
    aligned = align_predictions(predicted, targets, shift=shift, ignore_index=ignore_index)
    shapes = f"logits of shape {tuple(logits.shape)} for targets of shape {tuple(targets.shape)}"
    return aligned, None if aligned is not None else f"{call} returned {shapes}"


def captured_prediction(output: Any) -> torch.Tensor | None:
    """The classes predicted by the ``logits`` a submodule returned (named, never a bare tensor:
    that may be hidden states), or ``None``."""
    logits = None if isinstance(output, torch.Tensor) else logits_of(output)
    if logits is not None and logits.is_floating_point() and logits.ndim >= 2:
        return predicted_classes(logits)
    return None


def capture_note(why: str) -> str:
    """The note of predictions read from the training step (``why``: the forward gave none)."""
    return (
        f"predictions: {why}, so they are the argmax of the logits that a submodule returned"
        " in the training step (the last one called), before that update, in training mode"
    )


def unavailable_reason(
    source: str | None,
    *,
    seen: int,
    batches: int,
    problem: str | None,
    misaligned: str | None,
) -> str | None:
    """Why ``targets_recovered`` has no predictions, with the remedy (``source``: ``predict_fn``,
    ``forward`` or ``training_step``; ``seen``: subset batches predicted in the training step;
    ``problem``: why the last attempt gave nothing)."""
    if source == "training_step" and not seen:
        found = misaligned or (
            "no submodule called in the training step returned logits (a tensor named logits)"
        )
        return f"no predictions on the subset: {problem}, and {found}; {PREDICT_REMEDY}"
    if source == "training_step" and seen < batches:
        return (
            f"no predictions on the subset: the training step predicted {seen} of"
            f" its {batches} batch(es) before the fit ended"
        )
    if source == "predict_fn" and problem is not None:
        return (
            f"no predictions on the subset: {problem}; predict_fn must return logits"
            " or predictions shaped like the targets"
        )
    if problem is not None:
        return f"no predictions on the subset: {problem}"
    return None


def cut_short(results: Sequence[CheckResult], cause: str, *, budget: int) -> list[CheckResult]:
    """The checks of a run cut short by ``cause`` before its ``budget``: a failed target is
    ``not_checked`` (it says nothing yet about whether the loop can learn)."""
    return [
        CheckResult(
            c.name,
            "not_checked",
            f"{cause}, before the overfit budget of {budget}: {c.detail}; let the overfit run to"
            " its budget",
        )
        if c.name in ("loss_target", "targets_recovered") and c.verdict == "fail"
        else c
        for c in results
    ]


def overfit_checks(
    curve: LossCurve,
    *,
    target: float | None,
    last: Recovery | None,
    last_step: int | None,
    num_classes: int | None,
    tolerance: float,
    budget: int,
    required: float,
    unavailable: str | None,
    subset: bool,
    notes: Notes,
    trainer_limits: tuple[int | None, int | None],
) -> list[CheckResult]:
    """The overfit phase's checks (:func:`cut_short` when the run stopped before its ``budget``:
    a noted exception, or the Trainer's ``(max_steps, max_epochs)``); only ``subset``,
    ``not_checked`` with the notes, when no subset was built."""
    if not subset:
        return [CheckResult("subset", "not_checked", "; ".join(notes))]
    results = [
        check_loss_finite(curve.points),
        check_initial_loss(curve.initial, num_classes, tolerance=tolerance),
        check_loss_target(curve.points, target, budget=budget),
        check_recovery(last, required=required, step=last_step, unavailable=unavailable),
    ]
    steps_done = curve.last_step
    if steps_done >= budget:
        return results
    max_steps, max_epochs = trainer_limits
    cause = next(
        (note for note in notes if note.startswith("the fit failed")),
        f"the Trainer stopped the fit after {steps_done} update(s) (max_steps ="
        f" {max_steps}, max_epochs = {max_epochs})",
    )
    return cut_short(results, cause, budget=budget)


def phase_columns(
    curve: LossCurve, ids: Sequence[str], notes: Notes, *, batch_size: int | None
) -> dict[str, Any]:
    """The overfit phase row's columns: updates, first and last step, batch size and notes."""
    points = curve.points
    return {
        "occurrences": len(points),
        "step_first": points[0][0] if points else None,
        "step_last": points[-1][0] if points else None,
        "batch_size": batch_size or len(ids) or None,
        "notes": "; ".join([f"subset ids {list(ids)}", *notes]),
    }
