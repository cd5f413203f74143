"""core/checks.py without a Trainer: plain tensors and names in, named results out."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pilot.core.checks import (
    CheckResult,
    check_eval_mode,
    check_gradients,
    check_loss,
    check_sample_count,
    check_update,
    fingerprint,
    shown_names,
    zero_gradients,
)


def _verdicts(results: list[CheckResult]) -> dict[str, str]:
    return {r.name: r.verdict for r in results}


def test_shown_names_cuts_at_eight() -> None:
    assert shown_names(["a", "b"]) == "a, b"
    assert shown_names([str(i) for i in range(10)]) == "0, 1, 2, 3, 4, 5, 6, 7 and 2 more"


@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        (torch.tensor(0.5), {"loss_scalar": "pass", "loss_finite": "pass"}),
        (torch.tensor([0.5, 1.0]), {"loss_scalar": "fail", "loss_finite": "pass"}),
        (torch.tensor(float("inf")), {"loss_scalar": "pass", "loss_finite": "fail"}),
        (None, {"loss_scalar": "not_checked", "loss_finite": "not_checked"}),
    ],
)
def test_check_loss(loss: torch.Tensor | None, expected: dict[str, str]) -> None:
    assert _verdicts(check_loss(loss)) == expected


def test_check_loss_names_nan_and_the_shape() -> None:
    assert check_loss(torch.tensor(float("nan")))[1].detail == "loss is nan"
    assert "shape (2,)" in check_loss(torch.ones(2))[0].detail


def _backward(layer: nn.Module) -> None:
    layer(torch.ones(1, 2)).sum().backward()


def test_gradients_pass_for_a_plain_backward() -> None:
    layer = nn.Linear(2, 1)
    _backward(layer)
    results = check_gradients(layer.named_parameters(), {id(p) for p in layer.parameters()})
    assert _verdicts(results) == {
        "trainable_params_require_grad": "pass",
        "grads_reach_params": "pass",
        "grads_finite": "pass",
    }


def test_gradients_name_frozen_missing_nonfinite_and_stray_parameters() -> None:
    model = nn.ModuleDict({"used": nn.Linear(2, 1), "unused": nn.Linear(2, 1)})
    frozen = nn.Parameter(torch.ones(1), requires_grad=False)
    model.register_parameter("frozen", frozen)
    model["used"](torch.ones(1, 2)).sum().backward()
    model["used"].bias.grad = torch.tensor([float("nan")])
    optimized = {id(frozen), id(model["unused"].weight), id(model["used"].bias)}
    results = {r.name: r for r in check_gradients(model.named_parameters(), optimized)}
    assert results["trainable_params_require_grad"].verdict == "fail"
    assert results["trainable_params_require_grad"].detail.endswith(": frozen")
    assert results["grads_reach_params"].detail.endswith(": unused.weight")
    assert results["grads_finite"].detail == "non-finite gradients in 1 parameter(s): used.bias"
    assert results["grads_without_optimizer"].verdict == "warn"
    assert results["grads_without_optimizer"].detail.endswith(": used.weight")


def test_gradients_skip_parameters_switched_off_for_one_backward() -> None:
    layer = nn.Linear(2, 1)
    layer.weight.requires_grad_(False)
    _backward(layer)
    optimized = {id(p) for p in layer.parameters()}
    result = check_gradients(layer.named_parameters(), optimized, intended=optimized)[0]
    assert (result.verdict, result.detail.split(": ")[-1]) == ("pass", "weight")


def test_fingerprint_and_zero_gradients() -> None:
    a = torch.tensor([3.0, 4.0], requires_grad=True)
    b = torch.tensor([1.0], requires_grad=True)
    (a.sum() * 0 + b.sum()).backward()
    assert fingerprint([("a", a)]) == {"a": (7.0, 5.0)}
    assert fingerprint([]) == {}
    assert zero_gradients([("a", a), ("b", b)]) == {"a"}
    assert zero_gradients([]) == set()


def test_check_update() -> None:
    before = {"w": (1.0, 1.0), "frozen": (2.0, 2.0), "lora": (3.0, 3.0), "warm": (4.0, 4.0)}
    after = {"w": (1.5, 1.5), "frozen": (2.0, 2.0), "lora": (3.0, 3.0), "warm": (4.0, 4.0)}
    results = check_update(
        before,
        after,
        trainable={"w", "lora", "warm"},
        step_before=0,
        step_after=1,
        zero_grad={"lora"},
        zero_lr={"warm"},
    )
    assert _verdicts(results) == {
        "trainable_params_changed": "pass",
        "frozen_params_unchanged": "pass",
        "step_counted": "pass",
    }
    assert "learning rate of 0" in results[0].detail
    assert "zero gradient" in results[0].detail
    failed = check_update(after, before, trainable={"frozen"}, step_before=0, step_after=2)
    assert _verdicts(failed) == {
        "trainable_params_changed": "fail",
        "frozen_params_unchanged": "fail",
        "step_counted": "fail",
    }
    assert failed[1].detail == "1 frozen parameter(s) changed: w"
    assert failed[2].detail == "global_step went from 0 to 2 in one update; expected +1"


def test_eval_mode_ranks_what_changes_the_outputs() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).train()
    modules = [("model", model), *model.named_children()]
    result, no_grad = check_eval_mode(modules, grad_enabled=True, phase="test")
    assert result.verdict == "fail"
    assert "1 (BatchNorm1d)" in result.detail
    assert (no_grad.verdict, no_grad.detail) == (
        "fail",
        "autograd was enabled during test (memory for activations is kept)",
    )
    inert = check_eval_mode([("model", nn.Sequential(nn.Linear(2, 2)))], grad_enabled=False)
    assert _verdicts(inert) == {"eval_mode": "warn", "no_grad": "pass"}
    assert _verdicts(check_eval_mode([], grad_enabled=False)) == {
        "eval_mode": "pass",
        "no_grad": "pass",
    }
    unknown = check_eval_mode(["custom"], grad_enabled=False)[0]
    assert unknown.verdict == "fail"
    assert "not known to be mode-independent: custom" in unknown.detail


def test_eval_mode_reads_dropout_rates_kept_as_attributes() -> None:
    attention = nn.MultiheadAttention(4, 1, dropout=0.1)
    result = check_eval_mode([("attn", attention)], grad_enabled=False)[0]
    assert "attn (MultiheadAttention, dropout=0.1)" in result.detail
    off = check_eval_mode([("drop", nn.Dropout(0.0))], grad_enabled=False)[0]
    assert off.verdict == "warn"


def test_check_sample_count() -> None:
    assert check_sample_count(8, 8) == CheckResult("outputs_complete", "pass", "8 samples")
    assert check_sample_count(8, None, "no sized sampler").verdict == "not_checked"
    short = check_sample_count(6, 8)
    assert short.verdict == "fail"
    assert short.detail.endswith("check drop_last)")
    assert check_sample_count(9, 8).detail == "9 samples validated, expected 8"
