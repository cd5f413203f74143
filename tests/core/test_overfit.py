"""Pure overfit arithmetic: subset choice, expected loss, targets and recovery."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_pilot.core.overfit import (
    Notes,
    Recovery,
    align_predictions,
    check_initial_loss,
    check_loss_finite,
    check_loss_target,
    check_recovery,
    expected_initial_loss,
    logits_of,
    loss_target,
    predicted_classes,
    recovery,
    select_indices,
)


def test_select_indices_is_deterministic_sorted_and_bounded() -> None:
    first = select_indices(500, 8, seed=3)
    assert first == select_indices(500, 8, seed=3)
    assert first != select_indices(500, 8, seed=4)
    assert first == sorted(first)
    assert len(set(first)) == 8
    assert all(0 <= i < 500 for i in first)
    assert select_indices(5, 8, seed=0) == [0, 1, 2, 3, 4]
    state = torch.random.get_rng_state()
    select_indices(100, 8, seed=0)
    assert torch.equal(state, torch.random.get_rng_state())
    with pytest.raises(ValueError, match="dataset_size=0 is invalid"):
        select_indices(0, 8, seed=0)
    with pytest.raises(ValueError, match="count=0 is invalid"):
        select_indices(10, 0, seed=0)


def test_expected_initial_loss_is_log_c() -> None:
    assert expected_initial_loss(4) == pytest.approx(-math.log(1 / 4))
    assert expected_initial_loss(23) == pytest.approx(3.1355, abs=1e-4)
    with pytest.raises(ValueError, match="num_classes=1 is invalid"):
        expected_initial_loss(1)


@pytest.mark.parametrize(
    ("initial", "classes", "verdict", "detail"),
    [
        (1.40, 4, "pass", "initial loss 1.4, expected -log(1/4) = 1.386"),
        (9.00, 4, "warn", "the logits start far from uniform"),
        (0.05, 4, "warn", "the targets are predictable before training"),
        (1.40, None, "not_checked", "the number of classes is unknown"),
        (None, 4, "not_checked", "initial loss is None"),
    ],
)
def test_check_initial_loss(
    initial: float | None, classes: int | None, verdict: str, detail: str
) -> None:
    result = check_initial_loss(initial, classes, tolerance=2.0)
    assert result.verdict == verdict
    assert detail in result.detail


def test_loss_target_absolute_wins_over_fraction() -> None:
    assert loss_target(2.0, target_loss=0.5, target_fraction=0.1) == 0.5
    assert loss_target(2.0, target_loss=None, target_fraction=0.1) == pytest.approx(0.2)
    assert loss_target(None, target_loss=None, target_fraction=0.1) is None
    assert loss_target(math.nan, target_loss=None, target_fraction=0.1) is None


def test_loss_finite_and_target() -> None:
    curve = [(1, 1.4), (2, 0.9), (3, 0.1)]
    assert check_loss_finite(curve).verdict == "pass"
    bad = check_loss_finite([(1, 1.4), (2, math.nan), (3, math.inf)])
    assert bad.verdict == "fail"
    assert "not finite at 2 of 3 update(s), first at step 2" in bad.detail
    assert check_loss_finite([]).verdict == "not_checked"
    reached = check_loss_target(curve, 0.14, budget=10)
    assert (reached.verdict, reached.detail) == (
        "pass",
        "loss 1.4 -> 0.1 <= target 0.14 at step 3",
    )
    flat = check_loss_target([(1, 1.39), (2, 1.39), (3, 1.38)], 0.139, budget=3)
    assert flat.verdict == "fail"
    assert "nothing learns" in flat.detail
    assert "in 3 step(s) of a budget of 3" in flat.detail
    slow = check_loss_target([(1, 1.4), (2, 0.8)], 0.14, budget=2)
    assert "learns too slowly" in slow.detail
    assert check_loss_target(curve, None, budget=10).verdict == "not_checked"


def test_predicted_classes_are_aligned_with_causal_labels() -> None:
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = logits[0, 1, 3] = logits[0, 2, 1] = 1.0
    targets = torch.zeros(1, 3, dtype=torch.long)

    def aligned(logits: torch.Tensor, targets: torch.Tensor, shift: bool) -> Any:
        pair = align_predictions(predicted_classes(logits), targets, shift=shift)
        return None if pair is None else pair[0].tolist()

    assert aligned(logits, targets, shift=True) == [[-1, 2, 3]]
    assert aligned(logits, targets, shift=False) == [[2, 3, 1]]
    assert aligned(torch.eye(3), torch.tensor([0, 1, 1]), shift=True) == [0, 1, 2]
    assert aligned(torch.zeros(2, 5), torch.zeros(3, dtype=torch.long), shift=True) is None


def test_recovery_accuracy_and_exact_match_list_wrong_ids() -> None:
    rec = recovery(
        torch.tensor([0, 1, 2, 3]),
        torch.tensor([0, 1, 2, 0]),
        [10, 11, 12, 13],
        ignore_index=-100,
        num_classes=4,
    )
    assert (rec.metric, rec.score, rec.examples, rec.wrong_ids) == ("accuracy", 0.75, 4, ["13"])
    labels = torch.tensor([[-100, 5, 6], [-100, 7, 8], [-100, -100, -100]])
    predictions = torch.tensor([[-1, 5, 6], [-1, 7, 9], [-1, 0, 0]])
    seq = recovery(predictions, labels, ["a", "b", "c"], ignore_index=-100)
    # "c" has no label position: it is not scored.
    assert (seq.metric, seq.score, seq.examples, seq.wrong_ids) == ("exact_match", 0.5, 2, ["b"])


def test_check_recovery() -> None:
    good = check_recovery(Recovery("accuracy", 1.0, 8), required=1.0, step=12)
    assert (good.verdict, good.detail) == ("pass", "accuracy 1.000 on 8 example(s) at step 12")
    bad = check_recovery(Recovery("accuracy", 0.75, 8, ["3", "9"]), required=1.0, step=40)
    assert bad.verdict == "fail"
    assert bad.detail.endswith("ids still wrong: 3, 9")
    assert check_recovery(None, required=1.0, step=None).verdict == "not_checked"
    empty = check_recovery(Recovery("exact_match", math.nan, 0), required=1.0, step=1)
    assert empty.verdict == "not_checked"


def test_check_recovery_says_why_there_are_no_predictions() -> None:
    why = "no predictions on the subset: the module has no forward; give predict_fn="
    check = check_recovery(None, required=1.0, step=None, unavailable=why)
    assert (check.verdict, check.detail) == ("not_checked", why)


def test_shifted_labels_that_include_position_zero_are_scored_like_the_loss() -> None:
    # A causal LM trained on labels = input_ids: the loss scores labels[1:] with logits[:-1];
    # labels[0] has no prediction and must not count against the example.
    labels = torch.tensor([[11, 12, 13, -100], [21, 22, 23, 24]])
    predicted = torch.tensor([[12, 13, 99, 99], [22, 23, 24, 99]])  # argmax at t: label t+1
    aligned = align_predictions(predicted, labels, shift=True, ignore_index=-100)
    assert aligned is not None
    predictions, targets = aligned
    assert predictions.tolist() == [[-1, 12, 13, 99], [-1, 22, 23, 24]]
    assert targets.tolist() == [[-100, 12, 13, -100], [-100, 22, 23, 24]]
    assert labels[0, 0] == 11  # the caller's labels are left alone
    rec = recovery(predictions, targets, ["a", "b"], ignore_index=-100)
    assert (rec.metric, rec.score, rec.wrong_ids) == ("exact_match", 1.0, [])
    # Without the shift (token classification) position t scores label t.
    unshifted = align_predictions(predicted, labels, shift=False)
    assert unshifted is not None
    assert unshifted[0] is predicted or torch.equal(unshifted[0], predicted)
    assert unshifted[1] is labels
    assert align_predictions(predicted, labels[:, :3], shift=True) is None


def test_logits_of_model_outputs() -> None:
    transformers = pytest.importorskip("transformers")
    logits = torch.randn(2, 3, 5)
    output = transformers.modeling_outputs.CausalLMOutput(loss=torch.tensor(1.0), logits=logits)
    assert logits_of(output) is logits
    assert logits_of({"logits": logits}) is logits
    assert logits_of(SimpleNamespace(logits=logits)) is logits
    assert logits_of(logits) is logits
    assert (
        logits_of(transformers.modeling_outputs.BaseModelOutput(last_hidden_state=logits)) is None
    )
    assert logits_of({"loss": torch.tensor(1.0)}) is None
    assert logits_of(SimpleNamespace(logits=[1, 2])) is None


def test_notes_keep_each_message_once_with_a_count() -> None:
    notes = Notes()
    for _ in range(1000):
        notes.add("forward(inputs) raised TypeError: bad")
    notes.add("ids are dataset indices")
    assert list(notes) == [
        "forward(inputs) raised TypeError: bad (seen 1000 times)",
        "ids are dataset indices",
    ]
    assert len(notes) == 2
    assert "ids are dataset indices" in notes
    assert len("; ".join(notes)) < 100
