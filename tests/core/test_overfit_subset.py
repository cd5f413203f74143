"""The overfit run's subset, loss curve, stop decision, predictions, notes and checks, without a
Trainer."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset, default_collate

from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.checks import CheckResult
from lightning_pilot.core.overfit import (
    LossCurve,
    Notes,
    Recovery,
    capture_note,
    captured_prediction,
    cut_short,
    error_text,
    join_scored,
    overfit_checks,
    overfit_done,
    overfit_row,
    phase_columns,
    predicted_classes,
    predicted_pair,
    recovery,
    select_indices,
    subset_batches,
    subset_ids,
    unavailable_reason,
)


class _Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self):  # type: ignore[no-untyped-def]
        for i in range(100):
            yield {"x": torch.full((3,), float(i)), "y": torch.tensor(i % 4)}


def test_the_subset_is_the_seeded_indices_collated_in_batches() -> None:
    data = TensorDataset(torch.arange(200.0)[:, None], torch.arange(200) % 5)
    notes = Notes()
    state = torch.random.get_rng_state()
    batches, indices = subset_batches(
        data, 8, seed=3, collate=default_collate, batch_size=3, notes=notes
    )
    assert torch.equal(state, torch.random.get_rng_state())
    assert indices == select_indices(200, 8, seed=3)
    assert [len(b[1]) for b in batches] == [3, 3, 2]
    assert torch.cat([b[0] for b in batches]).flatten().tolist() == [float(i) for i in indices]
    assert list(notes) == []
    ids = subset_ids(batches, indices, BatchAdapter(), notes)
    assert ids == [str(i) for i in indices]
    assert list(notes) == ["ids are dataset indices: the batches carry no ids"]


def test_an_iterable_subset_is_its_first_examples_in_one_batch() -> None:
    notes = Notes()
    batches, indices = subset_batches(
        _Stream(), 5, seed=0, collate=default_collate, batch_size=None, notes=notes
    )
    assert indices == [0, 1, 2, 3, 4]
    assert len(batches) == 1
    assert batches[0]["y"].tolist() == [0, 1, 2, 3, 0]
    assert list(notes) == ["iterable dataset: the subset is its first examples"]


def test_subset_ids_come_from_the_batches_when_they_carry_them() -> None:
    batches = [
        {"x": torch.zeros(2, 3), "ids": ["a7", "b2"]},
        {"x": torch.zeros(1, 3), "ids": ["c9"]},
    ]
    notes = Notes()
    assert subset_ids(batches, [7, 2, 9], BatchAdapter(), notes) == ["a7", "b2", "c9"]
    assert len(notes) == 0


def test_the_loss_curve_averages_each_updates_micro_batches() -> None:
    curve = LossCurve()
    assert curve.close(0) is None  # nothing read yet
    for value in (1.39, 1.41, 1.37, 1.43):  # K = 4 micro-batches of update 1
        curve.add(value)
        assert curve.close(0) is None  # global_step has not moved
    mean, micro = curve.close(1) or (math.nan, 0)
    assert mean == pytest.approx(1.4)
    assert micro == 4
    curve.add(0.7)
    curve.add(0.5)
    assert curve.close(2) == (pytest.approx(0.6), 2)
    assert curve.close(2) is None
    assert curve.initial == 1.39
    assert curve.last_step == 2
    assert [s for s, _ in curve.points] == [1, 2]


@pytest.mark.parametrize(
    ("mean", "target", "score", "expected"),
    [
        (0.12, 0.14, 1.0, True),
        (0.12, 0.14, 0.875, False),  # 7 of 8 recovered, 1.0 required
        (0.15, 0.14, 1.0, False),  # the loss target not reached
        (0.12, None, 1.0, False),  # no target
        (0.12, 0.14, None, False),  # not scored at this update
        (math.inf, 0.14, None, True),  # a loss that is not finite ends it
        (math.nan, None, None, True),
    ],
)
def test_the_overfit_stops_when_both_targets_are_met_or_the_loss_is_not_finite(
    mean: float, target: float | None, score: float | None, expected: bool
) -> None:
    result = None if score is None else Recovery("accuracy", score, 8)
    assert overfit_done(mean, target, result, required=1.0) is expected


def test_an_overfit_row_carries_the_score_when_scored() -> None:
    row = overfit_row(
        6,
        0.21,
        4,
        target=0.14,
        ids=["a", "b"],
        result=Recovery("exact_match", 0.5, 2, ["b"]),
    )
    assert row == {
        "step": 6,
        "loss": 0.21,
        "micro_batches": 4,
        "target_loss": 0.14,
        "subset_ids": ["a", "b"],
        "metric": "exact_match",
        "score": 0.5,
        "wrong_ids": ["b"],
    }


def test_batches_padded_to_their_own_length_are_widened_when_joined() -> None:
    first = (torch.tensor([[5, 6], [7, 8]]), torch.tensor([[5, 6], [7, -100]]))
    second = (torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 2, 3, 9]]))
    notes = Notes()
    joined = join_scored(
        [first, second], ["a", "b", "c"], batch_size=2, ignore_index=-100, notes=notes
    )
    assert joined is not None
    predictions, targets, ids = joined
    assert predictions.tolist() == [[5, 6, 0, 0], [7, 8, 0, 0], [1, 2, 3, 4]]
    assert targets.tolist() == [[5, 6, -100, -100], [7, -100, -100, -100], [1, 2, 3, 9]]
    assert ids == ["a", "b", "c"]
    images = [(torch.zeros(1, 4, 4), torch.zeros(1, 4, 4)), (torch.zeros(1, 5, 5),) * 2]
    assert join_scored(images, ["a", "b"], batch_size=1, ignore_index=-100, notes=notes) is None
    assert list(notes) == ["the subset's batches predict shapes that cannot be joined"]


def test_predictions_of_a_causal_lm_are_shifted_like_its_loss() -> None:
    logits = torch.zeros(1, 4, 10)
    logits[0, torch.arange(4), torch.tensor([3, 4, 5, 6])] = 1.0
    pair, problem = predicted_pair(
        {"logits": logits},
        torch.tensor([[2, 3, 4, 5]]),
        shift=True,
        ignore_index=-100,
        call="forward(inputs)",
    )
    assert problem is None
    assert pair is not None
    assert pair[0].tolist() == [[-1, 3, 4, 5]]
    assert pair[1].tolist() == [[-100, 3, 4, 5]]
    _, problem = predicted_pair(
        torch.zeros(2, 7, 10),
        torch.zeros(2, 6, dtype=torch.long),
        shift=True,
        ignore_index=-100,
        call="predict_fn(pl_module, batch)",
    )
    assert problem == (
        "predict_fn(pl_module, batch) returned logits of shape (2, 7, 10) for targets of"
        " shape (2, 6)"
    )


def test_only_named_logits_are_captured() -> None:
    logits = torch.tensor([[[0.1, 2.0, 0.3], [1.5, 0.0, 0.2]]])
    assert captured_prediction({"logits": logits}).tolist() == [[1, 0]]  # type: ignore[union-attr]
    assert captured_prediction(logits) is None  # a bare tensor may be hidden states
    assert captured_prediction({"logits": torch.tensor([1, 2])}) is None  # ids, not logits
    assert capture_note("the module has no forward").startswith(
        "predictions: the module has no forward, so they are the argmax"
    )


def test_the_reason_there_are_no_predictions() -> None:
    none_seen = unavailable_reason(
        "training_step", seen=0, batches=2, problem="the module has no forward", misaligned=None
    )
    assert none_seen == (
        "no predictions on the subset: the module has no forward, and no submodule called in"
        " the training step returned logits (a tensor named logits); give"
        " predict_fn=fn(pl_module, batch) -> logits"
    )
    failed = unavailable_reason(
        "predict_fn", seen=0, batches=1, problem="predict_fn raised KeyError: 'x'", misaligned=None
    )
    assert failed is not None
    assert failed.endswith("predict_fn must return logits or predictions shaped like the targets")
    assert unavailable_reason("forward", seen=0, batches=1, problem=None, misaligned=None) is None


def test_a_run_cut_short_leaves_its_targets_not_checked() -> None:
    curve = LossCurve()
    for step, value in enumerate((1.39, 1.2, 1.1), 1):
        curve.add(value)
        curve.close(step)
    checks = overfit_checks(
        curve,
        target=0.139,
        last=Recovery("accuracy", 0.25, 8, ["1", "2", "3", "4", "5", "6"]),
        last_step=3,
        num_classes=4,
        tolerance=2.0,
        budget=200,
        required=1.0,
        unavailable=None,
        subset=True,
        notes=Notes(),
        trainer_limits=(3, None),
    )
    verdicts = {c.name: c.verdict for c in checks}
    assert verdicts == {
        "loss_finite": "pass",
        "initial_loss": "pass",
        "loss_target": "not_checked",
        "targets_recovered": "not_checked",
    }
    assert checks[2].detail.startswith(
        "the Trainer stopped the fit after 3 update(s) (max_steps = 3, max_epochs = None),"
        " before the overfit budget of 200: loss 1.39 -> best 1.1"
    )
    notes = Notes()
    notes.add("the fit failed: RuntimeError: CUDA error")
    failed = overfit_checks(
        curve,
        target=0.139,
        last=None,
        last_step=None,
        num_classes=4,
        tolerance=2.0,
        budget=200,
        required=1.0,
        unavailable=None,
        subset=True,
        notes=notes,
        trainer_limits=(-1, 1000),
    )
    assert failed[2].detail.startswith("the fit failed: RuntimeError: CUDA error, before")
    assert failed[3].verdict == "not_checked"  # no predictions: never a fail to cut


def test_no_subset_is_one_check_with_the_notes() -> None:
    notes = Notes()
    notes.add("no single training DataLoader: the subset could not be built")
    checks = overfit_checks(
        LossCurve(),
        target=None,
        last=None,
        last_step=None,
        num_classes=None,
        tolerance=2.0,
        budget=200,
        required=1.0,
        unavailable=None,
        subset=False,
        notes=notes,
        trainer_limits=(-1, 1),
    )
    assert checks == [
        CheckResult(
            "subset",
            "not_checked",
            "no single training DataLoader: the subset could not be built",
        )
    ]


def test_cut_short_keeps_passes_and_the_phase_columns() -> None:
    kept = cut_short([CheckResult("targets_recovered", "pass", "1.0")], "stopped", budget=9)
    assert kept == [CheckResult("targets_recovered", "pass", "1.0")]
    curve = LossCurve()
    curve.add(2.0)
    curve.close(4)
    curve.add(1.0)
    curve.close(5)
    notes = Notes()
    notes.add("iterable dataset: the subset is its first examples")
    assert phase_columns(curve, ["a", "b", "c"], notes, batch_size=2) == {
        "occurrences": 2,
        "step_first": 4,
        "step_last": 5,
        "batch_size": 2,
        "notes": "subset ids ['a', 'b', 'c']; iterable dataset: the subset is its first examples",
    }
    assert phase_columns(LossCurve(), [], Notes(), batch_size=None)["batch_size"] is None


def test_error_text_is_cut_at_300_characters() -> None:
    assert error_text(KeyError("x")) == "KeyError: 'x'"
    long = error_text(RuntimeError("e" * 400))
    assert long == "RuntimeError: " + "e" * 300 + "..."


def test_one_logit_per_row_predicts_by_its_sign() -> None:
    assert predicted_classes(torch.tensor([[0.2, 0.7, 0.1]])).tolist() == [1]
    assert predicted_classes(torch.tensor([[1.5], [-0.3]])).tolist() == [1, 0]


def test_predicted_pair_reads_logits_a_squeezed_binary_logit_or_names_the_problem() -> None:
    targets = torch.tensor([1, 1])
    logits = torch.tensor([[0.1, 0.9], [0.8, 0.2]])
    for out in (logits, torch.tensor([2.5, -0.4])):
        pair, problem = predicted_pair(
            out, targets, shift=False, ignore_index=-100, call="forward(inputs)"
        )
        assert problem is None
        assert pair is not None
        assert (pair[0].tolist(), pair[1].tolist()) == ([1, 0], [1, 1])
    missing = predicted_pair(
        (1, 2), torch.tensor([1]), shift=False, ignore_index=-100, call="forward(inputs)"
    )
    assert missing == (None, "forward(inputs) returned a tuple without logits")


def test_one_logit_recovery_scores_a_subset_of_one_class() -> None:
    """A one-logit binary model's output size is 1: its subset of all-0 labels, all predicted
    0, is fully recovered (torchmetrics refuses fewer than two classes)."""
    zeros = torch.zeros(4, dtype=torch.long)
    result = recovery(zeros, zeros, ["a", "b", "c", "d"], ignore_index=-100, num_classes=1)
    assert (result.metric, result.score, result.examples, result.wrong_ids) == (
        "accuracy",
        1.0,
        4,
        [],
    )
    half = recovery(
        torch.tensor([0, 1]), torch.tensor([0, 0]), [7, 8], ignore_index=-100, num_classes=1
    )
    assert (half.score, half.wrong_ids) == (0.5, ["8"])
