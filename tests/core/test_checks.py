"""core/checks.py without a Trainer: plain tensors and names in, named results out."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pilot.core.checks import (
    CheckResult,
    check_changed_without_gradient,
    check_eval_mode,
    check_gradients,
    check_loss,
    check_reached,
    check_sample_count,
    check_train_mode,
    check_update,
    fingerprint,
    frozen_regions,
    gradient_reach,
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


def test_gradients_name_missing_nonfinite_and_stray_parameters() -> None:
    model = nn.ModuleDict({"used": nn.Linear(2, 1), "unused": nn.Linear(2, 1)})
    model["used"](torch.ones(1, 2)).sum().backward()
    model["used"].bias.grad = torch.tensor([float("nan")])
    optimized = {id(model["unused"].weight), id(model["used"].bias)}
    results = {r.name: r for r in check_gradients(model.named_parameters(), optimized)}
    assert results["trainable_params_require_grad"] == CheckResult(
        "trainable_params_require_grad", "pass", ""
    )
    assert results["grads_reach_params"].detail.endswith(": unused.weight")
    assert results["grads_finite"].detail == "non-finite gradients in 1 parameter(s): used.bias"
    assert results["grads_without_optimizer"].verdict == "warn"
    assert results["grads_without_optimizer"].detail.endswith(": used.weight")


class _Encoder(nn.Module):
    """An encoder with a fixed position table (frozen by the model itself) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = nn.Embedding(4, 8)
        self.positions.requires_grad_(False)
        self.layer = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.layer(x + self.positions.weight)))  # type: ignore[no-any-return]


def _backward_encoder(model: _Encoder) -> set[int]:
    model(torch.ones(4, 8)).sum().backward()
    return {id(p) for p in model.parameters()}


def test_a_lone_tensor_frozen_before_the_fit_passes_named() -> None:
    model = _Encoder()  # positions: 32 of 584 optimized elements, the only tensor of its module
    model.layer = nn.Linear(8, 32)
    model.head = nn.Linear(32, 8)
    optimized = _backward_encoder(model)
    result = check_gradients(model.named_parameters(), optimized)[0]
    assert result == CheckResult(
        "trainable_params_require_grad",
        "pass",
        "1 lone parameter(s) frozen before the fit (requires_grad=False) are in the optimizer,"
        " which skips them: positions.weight",
    )


def test_a_frozen_submodule_or_a_large_share_warns_naming_it() -> None:
    model = _Encoder()  # positions: 32 of 131 elements = 24.4%: a large share of the model
    optimized = _backward_encoder(model)
    large = check_gradients(model.named_parameters(), optimized)[0]
    assert large.verdict == "warn"
    assert large.detail.startswith(
        "1 parameter(s) frozen before the fit (requires_grad=False, 24.4% of the optimized"
        " elements) are in the optimizer, in 1 frozen submodule(s): positions; torch skips them;"
    )
    model.head.requires_grad_(False)  # a whole layer (weight and bias) frozen
    optimized = _backward_encoder(model)
    head = check_gradients(model.named_parameters(), optimized)[0]
    assert head.verdict == "warn"
    assert "3 parameter(s) frozen before the fit (requires_grad=False, 45.0% of" in head.detail
    assert "in 2 frozen submodule(s): positions, head;" in head.detail
    assert head.detail.endswith(
        "if intended (adapter training, a frozen tower) nothing to do; otherwise set"
        " requires_grad=True before the fit"
    )


def test_a_frozen_submodule_is_named_though_part_of_it_is_not_optimized() -> None:
    model = nn.ModuleDict({"body": nn.Linear(32, 32), "head": nn.Linear(32, 2)})
    model["head"].requires_grad_(False)
    model["head"](model["body"](torch.ones(1, 32))).sum().backward()
    # The head's weight only (64 of 1,120 optimized elements): the frozen head is still a layer.
    optimized = {id(model["head"].weight), *(id(p) for p in model["body"].parameters())}
    result = check_gradients(model.named_parameters(), optimized)[0]
    assert result.verdict == "warn"
    assert result.detail.startswith(
        "1 parameter(s) frozen before the fit (requires_grad=False, 5.7% of the optimized"
        " elements) are in the optimizer, in 1 frozen submodule(s): head;"
    )


def test_a_parameter_frozen_mid_fit_fails() -> None:
    model = _Encoder()
    at_start = {id(p) for p in model.parameters() if p.requires_grad}
    model.layer.requires_grad_(False)  # after the first backward: it stops learning
    optimized = _backward_encoder(model)
    result = check_gradients(model.named_parameters(), optimized, trainable_at_start=at_start)[0]
    assert result.verdict == "fail"
    assert result.detail.startswith(
        "2 parameter(s) were trainable at the first backward of the fit, are in the optimizer"
        " and now have requires_grad=False, so they stopped learning mid-fit: layer.weight,"
        " layer.bias; find the hook or callback that froze them, or, if freezing them was"
        " meant, take them out of the optimizer; "
    )
    # The position table was frozen before the first backward: reported, not failed.
    assert "1 parameter(s) frozen before the fit" in result.detail
    # Switched off for this backward only (a toggle): skipped, not failed.
    toggled = check_gradients(
        model.named_parameters(), optimized, intended=at_start, trainable_at_start=at_start
    )[0]
    assert toggled.verdict == "warn"
    assert "2 parameter(s) switched off for this backward" in toggled.detail


def test_an_optimizer_with_nothing_that_learns_fails() -> None:
    model = _Encoder()
    model.layer.requires_grad_(False)
    model(torch.ones(4, 8)).sum().backward()
    frozen = {id(p) for p in (model.positions.weight, *model.layer.parameters())}
    head = {id(p) for p in model.head.parameters()}
    result = check_gradients(model.named_parameters(), frozen | head, optimizers=[head, frozen])[0]
    assert result.verdict == "fail"
    assert result.detail.startswith(
        "every parameter of optimizer(s) 1 has requires_grad=False: nothing it updates can"
        " learn; set requires_grad=True on what should train before the fit"
    )
    alone = check_gradients(model.named_parameters(), frozen)[0]
    assert alone.detail.startswith("every parameter of the optimizer has requires_grad=False")


def test_frozen_regions_are_the_largest_frozen_modules() -> None:
    names = ["a.x.weight", "a.x.bias", "a.y.weight", "b.weight"]
    assert frozen_regions(names, {"a.x.weight", "a.x.bias", "a.y.weight"}) == {
        "a": ["a.x.weight", "a.x.bias", "a.y.weight"]
    }
    assert frozen_regions(names, {"a.x.weight"}) == {"a.x.weight": ["a.x.weight"]}
    assert frozen_regions(names, set(names)) == {"": names}
    assert frozen_regions(["ab.weight", "a.weight"], {"a.weight"}) == {"a": ["a.weight"]}


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


def test_train_mode_fails_on_mode_dependent_modules_in_eval_mode() -> None:
    model = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Dropout(0.1), nn.Linear(4, 1))
    assert check_train_mode(model.named_modules()) == CheckResult("train_mode", "pass", "")
    model.eval()
    result = check_train_mode(model.named_modules())
    assert result.verdict == "fail"
    assert result.detail == (
        "2 module(s) whose outputs change with the mode are in eval mode during the training"
        " step: 1 (BatchNorm1d), 2 (Dropout); 3 more module(s) in eval mode during the training"
        " step, none of a type known to change the outputs (containers, mode-independent"
        " layers, unknown leaf types): <root> (Sequential), 0 (Linear), 3 (Linear); 5 module(s)"
        " in eval mode in all; call .train() on them, or do not call .eval() in on_train_start"
        " or another hook (Lightning does not switch modules back to train mode when training"
        " starts)"
    )


def test_train_mode_passes_frozen_modules_kept_in_eval_mode() -> None:
    tower = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Dropout(0.1))
    model = nn.ModuleDict({"tower": tower, "head": nn.Linear(4, 1)})
    tower.requires_grad_(False)
    tower.eval()  # a frozen tower kept in eval mode on purpose: its dropout included
    result = check_train_mode(model.named_modules())
    assert result == CheckResult(
        "train_mode",
        "pass",
        "4 module(s) in eval mode hold (or sit in a module holding) only frozen parameters,"
        " kept in eval mode on purpose (a frozen BatchNorm or tower): tower",
    )
    # The usual fine-tuning idiom: each BatchNorm frozen and in eval mode, the rest training.
    tower.requires_grad_(True).train()
    tower[1].requires_grad_(False).eval()
    assert check_train_mode(model.named_modules()).verdict == "pass"
    # ``trainable`` (what is meant to train) overrides requires_grad: a trainable BatchNorm fails.
    trainable = {id(p) for p in model.parameters()}
    assert check_train_mode(model.named_modules(), trainable).verdict == "fail"
    # A dropout switched off in a trainable block still fails.
    tower[1].train()
    tower[2].eval()
    failed = check_train_mode(model.named_modules())
    assert failed.detail.startswith(
        "1 module(s) whose outputs change with the mode are in eval mode during the training"
        " step: tower.2 (Dropout);"
    )


def test_train_mode_warns_on_mode_independent_modules_in_eval_mode() -> None:
    model = nn.Sequential(nn.Linear(2, 4), nn.Dropout(0.0), nn.Linear(4, 1)).eval()
    result = check_train_mode(model.named_modules())
    assert result.verdict == "warn"
    assert result.detail.startswith(
        "4 module(s) in eval mode during the training step, none of a type known to change"
        " the outputs"
    )
    assert "code that branches on `self.training`" in result.detail


def test_check_sample_count() -> None:
    assert check_sample_count(8, 8) == CheckResult("outputs_complete", "pass", "8 samples")
    assert check_sample_count(8, None, "no sized sampler").verdict == "not_checked"
    short = check_sample_count(6, 8)
    assert short.verdict == "fail"
    assert short.detail.endswith("check drop_last)")
    assert check_sample_count(9, 8).detail == "9 samples validated, expected 8"


def test_missing_gradients_are_judged_over_the_measured_backwards() -> None:
    # Two layers; the second is skipped (LayerDrop) in the first backward, runs in the second.
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 1))
    optimized = {id(p) for p in model.parameters()}
    model[2](model[0](torch.ones(1, 2))).sum().backward()  # layer 1 skipped
    reached_first, missing = gradient_reach(model.named_parameters(), optimized)
    assert missing == ["1.weight", "1.bias"]
    model.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    reached_second, _ = gradient_reach(model.named_parameters(), optimized)
    reached = {*reached_first, *reached_second}
    assert check_reached(missing, reached, backwards=2) == CheckResult(
        "grads_reach_params",
        "pass",
        "2 trainable parameter(s) received no gradient in some of 2 measured backward(s) and one"
        " in another (a layer skipped by LayerDrop or stochastic depth, or an expert no token was"
        " routed to, in those steps): 1.weight, 1.bias",
    )
    # Judged over the first backward alone, or by check_gradients without the evidence: a fail.
    assert check_reached(missing, reached_first).verdict == "fail"
    model.zero_grad()
    model[2](model[0](torch.ones(1, 2))).sum().backward()
    alone = {r.name: r for r in check_gradients(model.named_parameters(), optimized)}
    assert alone["grads_reach_params"].detail == (
        "2 trainable parameter(s) received no gradient in any of 1 measured backward(s) (not in"
        " the graph of the loss, or detached): 1.weight, 1.bias"
    )
    given = check_gradients(model.named_parameters(), optimized, reached=reached, backwards=2)
    assert _verdicts(given)["grads_reach_params"] == "pass"


def test_a_parameter_never_reached_fails_beside_one_skipped_in_some_steps() -> None:
    result = check_reached(["head.weight", "layers.3.fc.weight"], {"layers.3.fc.weight"}, 3)
    assert result.verdict == "fail"
    assert result.detail.startswith(
        "1 trainable parameter(s) received no gradient in any of 3 measured backward(s) (not in"
        " the graph of the loss, or detached): head.weight; 1 trainable parameter(s) received no"
        " gradient in some of 3 measured backward(s)"
    )


def test_unchanged_without_a_gradient_is_judged_over_the_measured_updates() -> None:
    before = {"skipped": (1.0, 1.0), "detached": (2.0, 2.0), "w": (3.0, 3.0)}
    after = {"skipped": (1.0, 1.0), "detached": (2.0, 2.0), "w": (3.5, 3.5)}
    common = {"trainable": set(before), "step_before": 0, "step_after": 1}
    gone = {"skipped", "detached"}
    # Received a gradient in another measured backward: named; never: failed.
    changed = check_update(before, after, **common, without_grad=gone, reached={"skipped", "w"})
    assert changed[0].verdict == "fail"
    assert changed[0].detail.startswith(
        "1 trainable parameter(s) with a nonzero or missing gradient did not change in the"
        " update: detached; 1 trainable parameter(s) had no gradient at some of 1 measured"
        " update(s), so the optimizer skipped them there, and received one in another"
    )
    # reached=None: left to the caller, who judges them once more updates are measured.
    deferred = check_update(before, after, **common, without_grad=gone, reached=None)
    assert deferred[0] == CheckResult("trainable_params_changed", "pass", "")
    later = check_changed_without_gradient(["skipped", "detached"], {"skipped"}, updates=3)
    assert later.verdict == "fail"
    assert later.detail.startswith(
        "1 trainable parameter(s) that received no gradient in any measured backward did not"
        " change in the update: detached; 1 trainable parameter(s) had no gradient at some of 3"
    )
