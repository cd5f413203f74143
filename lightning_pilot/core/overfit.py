"""Pure arithmetic of an overfit run on a tiny subset: which examples, what loss, what verdict.

:class:`~lightning_pilot.callbacks.overfit_tiny_subset.OverfitTinySubset` feeds these functions;
they never see a Trainer. The checks and their messages: docs/data-and-overfit.md.

Example:
    >>> from lightning_pilot.core.overfit import expected_initial_loss, select_indices
    >>> select_indices(1000, 8, seed=0)
    [41, 265, 394, 430, 776, 864, 911, 988]
    >>> round(expected_initial_loss(4), 4)  # -log(1/4) for 4 equally likely classes
    1.3863
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torchmetrics.functional.classification import multiclass_accuracy

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
        return CheckResult(
            name,
            "not_checked",
            f"initial loss {initial:.4g}; the number of classes is unknown, so -log(1/C) is too:"
            " give num_classes=",
        )
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
    if bad:
        return CheckResult(
            name,
            "fail",
            f"the loss is not finite at {len(bad)} of {len(curve)} update(s), first at step"
            f" {bad[0]}: a tiny subset must train with finite values",
        )
    return CheckResult(name, "pass", f"{len(curve)} update(s), all finite")


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
        return CheckResult(
            name,
            "pass",
            f"loss {first:.4g} -> {reached[1]:.4g} <= target {target:.4g} at step {reached[0]}",
        )
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
    return CheckResult(
        name,
        "fail",
        f"loss {first:.4g} -> best {best:.4g} {scope}, never reached the target {target:.4g}:"
        f" {why}",
    )


def predictions_from_logits(logits: torch.Tensor, targets: torch.Tensor, *, shift: bool) -> Any:
    """Predicted classes (``argmax`` of the last dimension) shaped like ``targets``, or ``None``;
    ``shift=True``: position ``t`` is predicted at ``t - 1``, position 0 gets ``-1``.

    Example:
        >>> logits = torch.tensor([[[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]])
        >>> predictions_from_logits(logits, torch.zeros(1, 3, dtype=torch.long), shift=True)
        tensor([[-1,  1,  0]])
    """
    aligned = align_predictions(logits.detach().argmax(dim=-1), targets, shift=shift)
    return None if aligned is None else aligned[0]


def align_predictions(
    predicted: torch.Tensor, targets: torch.Tensor, *, shift: bool, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Predicted classes paired with the targets the way the loss pairs them, as
    ``(predictions, targets)`` of the targets' shape, or ``None`` when the shapes differ.

    ``[B]`` targets (one label per example) and ``shift=False`` pair position ``t`` with ``t``.
    ``shift=True`` with ``[B, T]`` targets is a causal LM that shifts inside its loss (the
    Hugging Face ``*ForCausalLM`` convention): the class predicted at ``t - 1`` scores the label
    at ``t``, and position 0, which no prediction scores, is set to ``ignore_index`` in the
    returned targets (its prediction is ``-1``), so it never counts.

    Example:
        >>> predicted = torch.tensor([[7, 8, 9]])
        >>> align_predictions(predicted, torch.tensor([[5, 7, 8]]), shift=True)
        (tensor([[-1,  7,  8]]), tensor([[-100,    7,    8]]))
        >>> align_predictions(predicted, torch.tensor([[7, 8, 9]]), shift=False)[0]
        tensor([[7, 8, 9]])
        >>> align_predictions(torch.tensor([1, 0]), torch.tensor([1, 1]), shift=True)[0]
        tensor([1, 0])
        >>> align_predictions(predicted, torch.tensor([1]), shift=True) is None
        True
    """
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
    """The logits in a model's output: the tensor itself, ``output["logits"]`` of a mapping (a
    Hugging Face ``ModelOutput`` is one), or ``output.logits``; ``None`` when there are none.

    Example:
        >>> logits_of({"loss": torch.tensor(1.0), "logits": torch.zeros(2, 3)}).shape
        torch.Size([2, 3])
        >>> logits_of(torch.ones(2)), logits_of({"loss": torch.tensor(1.0)})
        (tensor([1., 1.]), None)
    """
    if isinstance(output, torch.Tensor):
        return output
    found = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    return found if isinstance(found, torch.Tensor) else None


class Notes:
    """Messages kept in the order first seen, each once, with how many times it was added:
    ``"... (seen N times)"`` when more than once.

    Example:
        >>> notes = Notes()
        >>> for _ in range(1000):
        ...     notes.add("forward raised TypeError")
        >>> notes.add("ids are dataset indices")
        >>> list(notes)
        ['forward raised TypeError (seen 1000 times)', 'ids are dataset indices']
    """

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def add(self, message: str) -> None:
        """Count one more ``message``."""
        self._counts[message] = self._counts.get(message, 0) + 1

    def __iter__(self) -> Iterator[str]:
        for message, count in self._counts.items():
            yield message if count == 1 else f"{message} (seen {count} times)"

    def __len__(self) -> int:
        return len(self._counts)

    def __contains__(self, message: object) -> bool:
        return message in self._counts


@dataclass(frozen=True)
class Recovery:
    """How many examples of the subset the model gets right: ``score`` is accuracy
    (classification) or exact match (token targets); ``wrong_ids`` lists the others."""

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
    """Score ``[B]`` class or ``[B, T]`` token predictions against targets, example by example
    (positions at ``ignore_index`` do not count; ``num_classes=None``: read from the values).

    Example:
        >>> rec = recovery(torch.tensor([0, 2, 1]), torch.tensor([0, 2, 2]), ["a", "b", "c"],
        ...                ignore_index=-100, num_classes=3)
        >>> rec.metric, round(rec.score, 3), rec.wrong_ids
        ('accuracy', 0.667, ['c'])
    """
    predictions, targets = predictions.detach().cpu(), targets.detach().cpu()
    counted = targets != ignore_index
    right = (predictions == targets) | ~counted
    if targets.ndim == 1:
        kept_p, kept_t = predictions[counted], targets[counted]
        # torchmetrics wants every value inside [0, C): size C to hold them all.
        size = max(
            num_classes or 2,
            int(kept_p.max()) + 1 if kept_p.numel() else 2,
            int(kept_t.max()) + 1 if kept_t.numel() else 2,
        )
        valid = (kept_t >= 0) & (kept_p >= 0)
        score = (
            float(
                multiclass_accuracy(kept_p[valid], kept_t[valid], num_classes=size, average="micro")
            )
            * int(valid.sum())
            / kept_t.numel()
            if kept_t.numel() and bool(valid.any())
            else (0.0 if kept_t.numel() else math.nan)
        )
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
    there are no predictions, said when ``result`` is ``None``)."""
    name = "targets_recovered"
    if result is None:
        return CheckResult(
            name, "not_checked", unavailable or "no predictions could be made on the subset"
        )
    if result.examples == 0 or not math.isfinite(result.score):
        return CheckResult(name, "not_checked", "no example has a position counted in the loss")
    at = f" at step {step}" if step is not None else ""
    detail = f"{result.metric} {result.score:.3f} on {result.examples} example(s){at}"
    if result.score >= required:
        return CheckResult(name, "pass", detail)
    return CheckResult(
        name,
        "fail",
        f"{detail}, required {required:.3f}; ids still wrong: {shown_names(result.wrong_ids)}",
    )
