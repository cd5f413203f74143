"""core/training_step.py without a Trainer: the phases of a measured update driven by hand, as
a training loop calls them, on real modules and optimizers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.phase_meter import PhaseMeter
from lightning_pilot.core.phase_rows import PhaseRows
from lightning_pilot.core.training_step import (
    PendingUpdate,
    TrainingStep,
    batch_sizes_agree,
    intended_trainable,
)


class TwoLayers(nn.Module):
    def __init__(self, *, detach_head: bool = False) -> None:
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.head = nn.Linear(4, 1)
        self.detach_head = detach_head

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.body(inputs)
        if self.detach_head:  # the head's output leaves the graph: no gradient reaches it
            return hidden.sum(-1, keepdim=True) + self.head(hidden).detach()
        return self.head(hidden)  # type: ignore[no-any-return]


def _setup(model: nn.Module, *, stop_on_fail: bool = False, lr: float = 0.1) -> Any:
    torch.manual_seed(0)
    meter, rows = PhaseMeter(model, track_cpu=False), PhaseRows(stop_on_fail=stop_on_fail)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    meter.optimizers = [optimizer]
    return meter, rows, optimizer, TrainingStep(rows, meter)


def _update(
    step: TrainingStep, model: nn.Module, optimizer: torch.optim.Optimizer, at: int, **kw: Any
) -> list[str | None]:
    """One measured update at global step ``at``, as the loop calls the moments."""
    inputs, targets = torch.randn(5, 3), torch.randn(5, 1)
    step.meter.begin("data", track=False)
    said = [step.batch_start(at, BatchAdapter().view((inputs, targets)))]
    loss = kw.get("loss", nn.functional.mse_loss(model(inputs), targets))
    said.append(step.before_backward(at, loss))
    loss.backward()
    said.append(step.after_backward(at))
    said.append(step.before_optimizer_step(at, optimizer))
    if kw.get("steps", True):
        optimizer.step()
    step.optimizer_stepped()
    optimizer.zero_grad()
    said.append(step.judge_update(at + 1))
    return said


def _rows(rows: PhaseRows) -> dict[tuple[str, bool], dict[str, Any]]:
    return {(r["phase"], r["first"]): r for r in rows.rows()}


def test_three_updates_pass_with_every_phase_counted_and_measured() -> None:
    model = TwoLayers()
    _, rows, optimizer, step = _setup(model)
    for at in range(3):
        assert _update(step, model, optimizer, at) == [None] * 5
    found = _rows(rows)
    assert {r["verdict"] for r in found.values()} == {"pass"}
    later = found[("optimizer_step", False)]
    assert (later["occurrences"], later["measured_occurrences"]) == (2, 2)
    assert (later["step_first"], later["step_last"]) == (1, 2)
    data = found[("data", True)]
    assert (data["batch_size"], data["input_shapes"]) == (5, "inputs=[5, 3], targets=[5, 1]")
    checks = {c["name"]: c["verdict"] for c in found[("optimizer_step", True)]["checks"]}
    assert checks == {
        "trainable_params_changed": "pass",
        "frozen_params_unchanged": "pass",
        "step_counted": "pass",
    }
    assert rows.evidence.backwards == rows.evidence.updates == 3


def test_an_update_that_changes_nothing_fails_its_optimizer_step() -> None:
    model = TwoLayers()
    _, rows, optimizer, step = _setup(model)
    _update(step, model, optimizer, 0, steps=False)  # the optimizer never stepped
    [changed] = [c for c in _rows(rows)[("optimizer_step", True)]["checks"]
                 if c["name"] == "trainable_params_changed"]  # fmt: skip
    assert changed["verdict"] == "fail"
    assert changed["detail"].startswith("4 trainable parameter(s) with a nonzero or missing")


def test_a_nan_loss_stops_before_the_backward_begins() -> None:
    model = TwoLayers()
    meter, rows, _optimizer, step = _setup(model, stop_on_fail=True)
    meter.begin("data", track=False)
    inputs = torch.randn(5, 3)
    assert step.batch_start(0, BatchAdapter().view((inputs, torch.randn(5, 1)))) is None
    loss = model(inputs).sum() * float("nan")
    failed = step.before_backward(0, loss)
    assert failed is not None
    assert failed.startswith("forward failed at step 0: loss_finite:")
    assert meter.open_phase is None  # the backward was not begun
    assert _rows(rows)[("forward", True)]["verdict"] == "fail"


def test_a_detached_head_fails_once_the_evidence_is_complete() -> None:
    model = TwoLayers(detach_head=True)
    _, rows, optimizer, step = _setup(model, stop_on_fail=True)
    for at in range(2):
        assert _update(step, model, optimizer, at) == [None] * 5  # not settled yet
    failed = rows.settle(may_fail=True)
    assert failed is not None
    assert "2 trainable parameter(s) received no gradient in any of 2 measured" in failed
    assert failed.endswith("head.weight, head.bias")
    found = _rows(rows)
    assert found[("backward", True)]["verdict"] == "fail"
    assert found[("optimizer_step", True)]["verdict"] == "fail"  # and did not change
    # Settled: the next measured backward that misses them stops at once.
    said = _update(step, model, optimizer, 2)
    assert said[2] is not None
    assert said[2].startswith("failed over the measured updates")


def test_a_layer_frozen_mid_fit_while_still_optimized_fails_the_backward() -> None:
    model = TwoLayers()
    _, rows, optimizer, step = _setup(model)
    _update(step, model, optimizer, 0)
    model.head.requires_grad_(False)  # stops learning, still in the optimizer
    _update(step, model, optimizer, 1)
    found = _rows(rows)
    assert found[("backward", True)]["verdict"] == "pass"
    later = found[("backward", False)]
    assert later["verdict"] == "fail"
    assert "head.weight" in later["reason"]


def test_what_was_trainable_at_the_batch_start_is_judged_as_meant_to_train() -> None:
    # The training step switches the head off for itself (no toggle_optimizer state saved):
    # read at the batch start, the head is still meant to train, and it never changes.
    model = TwoLayers()
    meter, rows, optimizer, step = _setup(model)
    inputs, targets = torch.randn(5, 3), torch.randn(5, 1)
    meter.begin("data", track=False)
    step.batch_start(0, BatchAdapter().view((inputs, targets)))
    model.head.requires_grad_(False)
    loss = nn.functional.mse_loss(model(inputs), targets)
    step.before_backward(0, loss)
    loss.backward()
    step.after_backward(0)
    step.before_optimizer_step(0, optimizer)
    optimizer.step()
    step.optimizer_stepped()
    model.head.requires_grad_(True)
    step.judge_update(1)
    rows.settle(may_fail=False)
    found = _rows(rows)
    assert found[("optimizer_step", True)]["verdict"] == "fail"
    assert found[("optimizer_step", True)]["reason"].startswith(
        "trainable_params_changed: 2 trainable parameter(s) that received no gradient in any"
        " measured backward did not change in the update: head.weight, head.bias."
    )


def test_two_optimizers_in_one_batch_are_judged_one_after_the_other() -> None:
    model = TwoLayers()
    meter, rows, _, step = _setup(model)
    first, second = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model.body, model.head))
    meter.optimizers = [first, second]
    inputs, targets = torch.randn(5, 3), torch.randn(5, 1)
    meter.begin("data", track=False)
    step.batch_start(0, BatchAdapter().view((inputs, targets)))
    loss = nn.functional.mse_loss(model(inputs), targets)
    step.before_backward(0, loss)
    loss.backward()
    step.after_backward(0)
    for at, optimizer in enumerate((first, second)):  # global_step moves once per optimizer
        assert step.before_optimizer_step(at, optimizer) is None
        optimizer.step()
        step.optimizer_stepped()
    assert step.judge_update(2) is None
    found = _rows(rows)
    # Each optimizer moved its own layer only; the other's layer stayed as it was.
    assert {r["verdict"] for r in found.values()} == {"pass"}
    assert found[("optimizer_step", False)]["occurrences"] == 1
    assert rows.evidence.updates == 2


def test_pending_update_names_zero_lr_zero_grad_and_missing_gradients() -> None:
    model = nn.ModuleDict({"a": nn.Linear(2, 1), "b": nn.Linear(2, 1), "c": nn.Linear(2, 1)})
    (model["a"](torch.ones(1, 2)) + model["b"](torch.zeros(1, 2)) * 0).sum().backward()
    sgd = torch.optim.SGD(
        [
            {"params": model["a"].parameters()},
            {"params": model["b"].parameters()},
            {"params": model["c"].parameters(), "lr": 0.0},
        ],
        lr=0.1,
    )
    intended = intended_trainable(model) - {id(model["a"].bias)}
    update = PendingUpdate.of(3, sgd, model.named_parameters(), intended, before=None, first=True)
    assert update.trainable == {"a.weight", "b.weight", "b.bias", "c.weight", "c.bias"}
    assert update.zero_grad == {"b.weight", "b.bias"}
    assert update.zero_lr == {"c.weight", "c.bias"}
    assert update.without_grad == {"c.weight", "c.bias"}
    assert set(update.before) == {n for n, _ in model.named_parameters()}
    assert (update.step_before, update.first) == (3, True)


@pytest.mark.parametrize(
    ("batch", "verdict", "detail"),
    [
        ((torch.ones(4, 2), torch.ones(4)), "pass", ""),
        ((torch.ones(4, 2), torch.ones(3)), "fail", "leading dimensions differ"),
        ({"note": "no tensors"}, "not_checked", "no tensors found in the batch"),
    ],
)
def test_batch_sizes_agree(batch: Any, verdict: str, detail: str) -> None:
    [result] = batch_sizes_agree(BatchAdapter().view(batch))
    assert (result.name, result.verdict) == ("batch_sizes_agree", verdict)
    assert result.detail.startswith(detail)


def test_intended_trainable_reads_what_toggle_optimizer_saved() -> None:
    model = TwoLayers()
    model.head.requires_grad_(False)
    assert intended_trainable(model) == {id(model.body.weight), id(model.body.bias)}
    model._param_requires_grad_state = {model.head.weight: True, model.head.bias: False}
    assert id(model.head.weight) in intended_trainable(model)
    assert id(model.head.bias) not in intended_trainable(model)
    model._param_requires_grad_state = "not a mapping"  # read defensively
    assert len(intended_trainable(model)) == 2
