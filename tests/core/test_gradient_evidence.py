"""core/gradient_evidence.py without a Trainer: missing gradients judged over the measured
updates, and the merge into the phase rows."""

from __future__ import annotations

from typing import Any

from lightning_pilot.core.gradient_evidence import GradientEvidence, merge_deferred
from lightning_pilot.core.phases import CheckResult

REACH = ("backward", False, "grads_reach_params")
CHANGED = ("optimizer_step", False, "trainable_params_changed")


def test_a_parameter_skipped_in_some_backwards_passes_and_one_never_reached_fails() -> None:
    evidence = GradientEvidence()
    for reached in (["a", "b", "head"], ["a", "head"], ["a", "head"]):  # b skipped twice
        evidence.backward(reached)
    evidence.defer(REACH, ["b", "lost"])
    evidence.defer(REACH, ["b"])  # named once per check
    result = evidence.results()[REACH]
    assert result.verdict == "fail"
    assert "received no gradient in any of 3 measured backward(s)" in result.detail
    assert result.detail.endswith("; 1 trainable parameter(s) received no gradient in some of 3"
                                  " measured backward(s) and one in another (a layer skipped by"
                                  " LayerDrop or stochastic depth, or an expert no token was"
                                  " routed to, in those steps): b")  # fmt: skip
    assert evidence.never == {"lost"}


def test_a_name_judged_never_reached_keeps_failing() -> None:
    evidence = GradientEvidence()
    evidence.backward(["a"])
    evidence.defer(REACH, ["late"])
    assert evidence.results()[REACH].verdict == "fail"
    evidence.backward(["late"])  # reached after it was judged: the row already said so
    assert evidence.results()[REACH].verdict == "fail"


def test_unchanged_without_gradient_is_judged_over_the_updates() -> None:
    evidence = GradientEvidence()
    evidence.backward(["expert.1"])
    for _ in range(4):
        evidence.update()
    evidence.defer(CHANGED, ["expert.1"])
    result = evidence.results()[CHANGED]
    assert (result.name, result.verdict) == ("trainable_params_changed", "pass")
    assert "at some of 4 measured update(s)" in result.detail


def test_failure_names_each_failed_check_once_and_settles_once() -> None:
    evidence = GradientEvidence()
    assert evidence.failure() is None
    evidence.backward(["a"])
    evidence.defer(REACH, ["a"])
    assert evidence.failure() is None  # a received a gradient in a measured backward
    later = GradientEvidence()
    later.backward(["a"])
    later.defer(("backward", True, "grads_reach_params"), ["z"])
    later.defer(REACH, ["z"])
    message = later.failure()
    assert message is not None
    assert message.startswith("failed over the measured updates: backward grads_reach_params:")
    assert message.count("backward grads_reach_params") == 1  # both rows fail the same way
    assert (later.settle(), later.settle(), later.settled) == (True, False, True)


def _row(checks: list[dict[str, str]], first: bool = False) -> dict[str, Any]:
    return {"phase": "backward", "first": first, "verdict": "pass", "reason": None,
            "checks": checks}  # fmt: skip


def test_merge_keeps_the_worst_verdict_and_both_details_and_judges_again() -> None:
    own = {"name": "grads_reach_params", "verdict": "pass", "detail": "12 parameters"}
    deferred = {REACH: CheckResult("grads_reach_params", "fail", "head.weight")}
    merged = merge_deferred(_row([own]), deferred)
    assert merged["checks"] == [
        {"name": "grads_reach_params", "verdict": "fail", "detail": "12 parameters; head.weight"}
    ]
    assert merged["verdict"] == "fail"
    assert merged["reason"].startswith("grads_reach_params: 12 parameters; head.weight. If the")


def test_merge_adds_a_new_check_and_leaves_other_rows_alone() -> None:
    deferred = {REACH: CheckResult("grads_reach_params", "pass", "b skipped")}
    row = _row([{"name": "grads_finite", "verdict": "pass", "detail": ""}])
    merged = merge_deferred(row, deferred)
    assert [c["name"] for c in merged["checks"]] == ["grads_finite", "grads_reach_params"]
    assert (merged["verdict"], merged["reason"]) == ("pass", None)
    first_row = _row([], first=True)
    assert merge_deferred(first_row, deferred) is first_row
