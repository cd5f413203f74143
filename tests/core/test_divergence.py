"""Divergence rules, run outcomes and curves, without a Trainer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from lightning_pilot.core.divergence import (
    Curves,
    DivergenceDetector,
    DivergenceEvent,
    DivergenceRules,
    exception_outcome,
    normal_outcome,
)

NAN, INF = float("nan"), float("inf")


def feed(
    detector: DivergenceDetector, losses: list[float], grads: list[Any] | None = None
) -> list[Any]:
    grads = grads or [None] * len(losses)
    return [
        detector.update(step, loss, grad)
        for step, (loss, grad) in enumerate(zip(losses, grads, strict=True), 1)
    ]


@pytest.mark.parametrize(
    ("losses", "grads", "cause", "step"),
    [
        ([3.0, 2.9, NAN], None, "nonfinite_loss", 3),
        ([3.0, INF], None, "nonfinite_loss", 2),
        ([3.0, 2.9, 2.8], [1.0, NAN, 1.0], "nonfinite_grad", 2),
        ([3.0, 2.9, 2.8], [1.0, 1.0, -INF], "nonfinite_grad", 3),
        # A NaN loss and a NaN gradient on one update: the loss rule has priority.
        ([3.0, NAN], [1.0, NAN], "nonfinite_loss", 2),
        # 10 x 3.0 = 30 is the blow-up threshold; three updates above it are fatal.
        ([3.0, 31.0, 40.0, 35.0], None, "loss_blowup", 4),
    ],
)
def test_fatal_rules_fire_at_the_right_update(
    losses: list[float], grads: list[Any] | None, cause: str, step: int
) -> None:
    detector = DivergenceDetector()
    decisions = feed(detector, losses, grads)
    fatal = [d for d in decisions if d.fatal]
    assert fatal[0].cause == cause
    assert fatal[0].step == step
    assert detector.first_fatal == (cause, step)
    assert any(e.event == cause and e.step == step for e in fatal[0].events)


def test_blowup_needs_consecutive_updates_and_respects_the_cap() -> None:
    # Above 30 twice, then back below: the run of blown-up updates resets.
    detector = DivergenceDetector()
    assert not any(d.fatal for d in feed(detector, [3.0, 31.0, 32.0, 5.0, 31.0, 33.0]))
    # With a cap of 100 the threshold is max(100, 10 x 3) = 100.
    capped = DivergenceDetector(DivergenceRules(blowup_cap=100.0))
    assert capped.blowup_threshold == 100.0
    assert not any(d.fatal for d in feed(capped, [3.0, 50.0, 60.0, 70.0]))
    assert capped.blowup_threshold == 100.0
    assert feed(capped, [101.0, 102.0, 103.0])[-1].cause == "loss_blowup"


def test_isolated_spikes_are_recorded_not_fatal() -> None:
    rules = DivergenceRules(window=4, warmup=4, spike_factor=3.0, spike_patience=3)
    detector = DivergenceDetector(rules)
    # Four normal losses of 1.0, then a two-update spike at 5.0, then back to normal.
    decisions = feed(detector, [1.0] * 4 + [5.0, 5.0] + [1.0] * 3)
    assert not any(d.fatal for d in decisions)
    events = [(e.step, e.event, e.reference, e.threshold) for d in decisions for e in d.events]
    assert events == [(5, "spike", 1.0, 3.0), (7, "spike_end", 1.0, 3.0)]
    assert detector.counts == {"spike": 1, "spike_end": 1}
    assert "isolated spike of 2 update(s)" in decisions[6].events[0].detail


def test_a_persistent_spike_is_fatal_and_spikes_stay_out_of_the_reference() -> None:
    rules = DivergenceRules(window=4, warmup=4, spike_factor=3.0, spike_patience=3)
    detector = DivergenceDetector(rules)
    decisions = feed(detector, [2.0] * 4 + [7.0] * 3)
    assert [d.cause for d in decisions][-1] == "loss_spike_persistent"
    assert decisions[-1].step == 7
    # The spike values never entered the window: the reference is still the 2.0 plateau.
    assert detector.reference == 2.0


def test_no_spike_rule_during_warmup() -> None:
    rules = DivergenceRules(window=3, warmup=5, spike_patience=1)
    detector = DivergenceDetector(rules)
    # The spike at update 3 falls inside the warm-up: not even recorded.
    decisions = feed(detector, [1.0, 1.0, 9.0, 1.0, 1.0, 1.0, 1.0])
    assert not any(d.events for d in decisions)
    assert detector.reference == 1.0
    assert detector.update(8, 9.0).cause == "loss_spike_persistent"


def test_negative_losses_switch_the_relative_rules_off() -> None:
    detector = DivergenceDetector(DivergenceRules(warmup=0, spike_patience=1))
    # While the reference mean is negative a "x 3" threshold means nothing: no rule applies.
    decisions = feed(detector, [-3.0, -1.0, 5.0])
    assert detector.blowup_threshold is None
    assert not any(d.events for d in decisions)


def test_gradient_overflow_under_a_scaler_is_not_fatal() -> None:
    detector = DivergenceDetector()
    decision = detector.update(1, 3.0, INF, grad_may_overflow=True)
    assert not decision.fatal
    assert [e.event for e in decision.events] == ["grad_overflow"]
    unchecked = DivergenceDetector(DivergenceRules(check_grad_norm=False))
    assert not unchecked.update(1, 3.0, NAN).fatal


def test_unmeasured_loss_skips_the_loss_rules() -> None:
    detector = DivergenceDetector()
    assert not detector.update(1, None, 2.0).fatal
    assert detector.initial_loss is None
    assert detector.updates == 1


def test_events_of_one_kind_are_capped_but_counted() -> None:
    detector = DivergenceDetector()
    listed = sum(len(d.events) for d in feed(detector, [NAN] * 150))
    assert listed == DivergenceDetector.MAX_EVENTS_PER_KIND
    assert detector.counts == {"nonfinite_loss": 150}
    assert detector.first_fatal == ("nonfinite_loss", 1)


def test_state_dict_round_trip_continues_the_same_decisions() -> None:
    rules = DivergenceRules(window=3, warmup=3, spike_patience=3, blowup_patience=2)
    losses = [2.0, 2.0, 2.0, 2.0, 7.0, 7.0]
    whole = DivergenceDetector(rules)
    expected = feed(whole, [*losses, 7.0])
    first = DivergenceDetector(rules)
    feed(first, losses)
    state = first.state_dict()
    second = DivergenceDetector(rules)
    second.load_state_dict(state)
    assert second.update(7, 7.0).cause == expected[-1].cause == "loss_spike_persistent"
    assert second.counts == whole.counts
    # An old or empty state loads with defaults.
    empty = DivergenceDetector(rules)
    empty.load_state_dict({})
    assert empty.updates == 0
    assert empty.first_fatal is None


def test_state_dict_survives_a_weights_only_torch_load(tmp_path: Any) -> None:
    detector = DivergenceDetector()
    feed(detector, [3.0, 31.0, 40.0, 35.0])
    path = tmp_path / "state.pt"
    torch.save({"detector": detector.state_dict()}, path)
    restored = torch.load(path, weights_only=True)["detector"]
    clone = DivergenceDetector()
    clone.load_state_dict(restored)
    assert clone.first_fatal == ("loss_blowup", 4)
    assert clone.initial_loss == 3.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"window": 0},
            ValueError,
            r"DivergenceRules\(window=0\) is invalid: expected an integer >= 1",
        ),
        ({"warmup": -1}, ValueError, r"warmup=-1\) is invalid"),
        (
            {"spike_factor": 1.0},
            ValueError,
            r"spike_factor=1.0\) is invalid: expected a finite number > 1",
        ),
        ({"spike_factor": NAN}, ValueError, r"spike_factor=nan\) is invalid"),
        ({"spike_patience": 2.5}, TypeError, r"spike_patience=2.5\) is invalid"),
        ({"blowup_factor": "10"}, TypeError, r"blowup_factor='10'\) is invalid"),
        ({"blowup_factor": None}, TypeError, r"blowup_factor=None\) is invalid"),
        (
            {"blowup_cap": -1.0},
            ValueError,
            r"blowup_cap=-1.0\) is invalid: expected a finite number > 0",
        ),
        ({"blowup_patience": True}, TypeError, r"blowup_patience=True\) is invalid"),
        (
            {"check_grad_norm": 1},
            TypeError,
            r"check_grad_norm=1\) is invalid: expected True or False",
        ),
    ],
)
def test_bad_rules_are_refused(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        DivergenceRules(**kwargs)


def test_rules_hold_plain_python_numbers() -> None:
    rules = DivergenceRules(window=np.int64(4), spike_factor=2, blowup_cap=np.float32(8.0))
    assert (type(rules.window), type(rules.spike_factor), type(rules.blowup_cap)) == (
        int,
        float,
        float,
    )
    assert DivergenceRules().blowup_cap is None


def test_detector_refuses_a_non_rules_object() -> None:
    with pytest.raises(
        TypeError, match=r"DivergenceDetector\(rules=\{'window': 3\}\) is invalid: expected a"
    ):
        DivergenceDetector({"window": 3})  # type: ignore[arg-type]


class SIGTERMException(SystemExit):
    """Same name as Lightning's (core matches by name, never importing Lightning)."""


@pytest.mark.parametrize(
    ("exception", "expected"),
    [
        (KeyboardInterrupt(), ("interrupted", "keyboard_interrupt")),
        (SIGTERMException(), ("interrupted", "sigterm")),
        (torch.OutOfMemoryError("CUDA out of memory"), ("oom", "cuda_oom")),
        (ValueError("bad"), ("failed", "exception:ValueError")),
        (SystemExit(3), ("failed", "exception:SystemExit")),
    ],
)
def test_exception_outcomes(exception: BaseException, expected: tuple[str, str]) -> None:
    assert exception_outcome(exception) == expected


def test_lightning_sigterm_exception_is_recognised() -> None:
    from lightning.pytorch.utilities.exceptions import SIGTERMException as Real

    assert exception_outcome(Real()) == ("interrupted", "sigterm")


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"divergence": "loss_blowup"}, ("diverged", "loss_blowup")),
        ({"early_stopping": True}, ("stopped", "early_stopping")),
        ({"time_limit": True}, ("stopped", "time_limit")),
        ({"updates_done": 150}, ("stopped", "step_shortfall")),
        ({"limit_reached": None}, ("stopped", "step_shortfall")),
        ({}, ("completed", "max_steps")),
        ({"limit_reached": "max_epochs", "planned_updates": None}, ("completed", "max_epochs")),
        # Divergence outranks everything (it is why the loop stopped early).
        ({"divergence": "nonfinite_loss", "early_stopping": True}, ("diverged", "nonfinite_loss")),
    ],
)
def test_normal_outcomes(kwargs: dict[str, Any], expected: tuple[str, str]) -> None:
    base: dict[str, Any] = {
        "divergence": None,
        "early_stopping": False,
        "time_limit": False,
        "limit_reached": "max_steps",
        "updates_done": 200,
        "planned_updates": 200,
    }
    assert normal_outcome(**(base | kwargs)) == expected


def test_curves_truncate_and_round_trip() -> None:
    curves = Curves()
    for step in range(1, 6):
        curves.add_train(step, 3.0 - step / 10, lr=1e-3 * step)
    curves.add_val(2, "val_loss", 2.5)
    curves.add_val(4, "val_loss", NAN)
    curves.truncate(3)
    record = curves.as_record()
    assert [p["step"] for p in record["train_loss"]] == [1, 2, 3]
    assert record["lr_curve"][-1] == {"step": 3, "value": pytest.approx(3e-3)}
    assert record["val_points"] == [{"step": 2, "name": "val_loss", "value": 2.5}]
    clone = Curves()
    clone.load_state_dict(curves.state_dict())
    assert clone.as_record() == record
    assert Curves().as_record() == {"train_loss": [], "lr_curve": [], "val_points": []}


def test_curves_since_a_mark_hold_only_the_later_points() -> None:
    curves = Curves()
    curves.add_train(1, 3.2, lr=1e-3)
    curves.add_val(1, "val_loss", 3.0)
    assert curves.as_record()["train_loss"] == [{"step": 1, "value": 3.2}]
    assert curves.as_record()["val_points"] == [{"step": 1, "name": "val_loss", "value": 3.0}]
    mark = curves.mark()
    curves.add_train(2, 3.1, lr=1e-3)
    assert curves.as_record(since=mark)["train_loss"] == [{"step": 2, "value": 3.1}]


def test_an_event_row_keeps_a_nan_loss() -> None:
    row = DivergenceEvent(4, "nonfinite_loss", NAN, None, None, None, "nan").as_row()
    assert np.isnan(row.pop("loss"))
    assert row == {
        "step": 4,
        "event": "nonfinite_loss",
        "grad_norm": None,
        "reference": None,
        "threshold": None,
        "detail": "nan",
    }
