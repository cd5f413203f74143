"""OverfitTinySubset in real fits: full recovery on both demo tasks, and the planted bugs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader, TensorDataset

from lightning_pilot import read_phase_table
from lightning_pilot.callbacks.overfit_tiny_subset import OverfitTinySubset
from lightning_pilot.demo import (
    ClassificationDataModule,
    InstructionDataModule,
    TinyCausalLM,
    TinyClassifier,
)
from lightning_pilot.storage import read_snapshot_table

REMEDY = "If the check fails: fix the loop on the tiny subset before any long run"


@pytest.fixture(autouse=True)
def _seeded() -> None:
    # The demo models draw their initial weights from the global generator.
    torch.manual_seed(0)


def _overfit_row(callback: OverfitTinySubset) -> dict[str, Any]:
    table = read_phase_table(callback.run.run_dir)
    rows = table[table["phase"] == "overfit"].to_dict("records")
    assert len(rows) == 1
    return rows[0]


def _curve(callback: OverfitTinySubset) -> list[dict[str, Any]]:
    return read_snapshot_table(callback.run.run_dir / "overfit.parquet").to_pylist()


class RecordingClassifier(TinyClassifier):
    """Remembers the ids every training and validation step saw."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: dict[str, set[int]] = {"train": set(), "val": set()}

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        self.seen["train"] |= set(batch["ids"].tolist())
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        if not self.trainer.sanity_checking:
            self.seen["val"] |= set(batch["ids"].tolist())
        return super().validation_step(batch, batch_idx)


class FrozenZeroHead(TinyClassifier):
    """Planted bug: the head is frozen at zero, so every class scores the same forever."""

    def __init__(self) -> None:
        super().__init__()
        head = self.net[2]
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
        head.requires_grad_(False)


class DetachedLoss(TinyClassifier):
    """Planted bug: the loss is computed on detached logits; requires_grad_ silences the error."""

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        loss = cross_entropy(self(batch["inputs"]).detach(), batch["labels"])
        return loss.requires_grad_(True)


def test_classifier_overfits_eight_examples_and_validates_on_them(make_trainer: Any) -> None:
    overfit = OverfitTinySubset(max_steps=100)
    model = RecordingClassifier()
    trainer = make_trainer(callbacks=[overfit], max_steps=-1, max_epochs=50, limit_val_batches=3)
    with pytest.warns(UserWarning, match="OverfitTinySubset changes training"):
        trainer.fit(model, datamodule=ClassificationDataModule(dataset_size=256, batch_size=32))

    assert overfit.verdict == "pass"
    assert len(overfit.subset_ids) == 8
    subset = {int(i) for i in overfit.subset_ids}
    assert model.seen["train"] == subset
    assert model.seen["val"] == subset
    assert trainer.global_step < 100  # stopped once the target was met
    row = _overfit_row(overfit)
    assert row["verdict"] == "pass"
    assert {c["name"] for c in row["checks"]} == {
        "loss_finite",
        "initial_loss",
        "loss_target",
        "targets_recovered",
    }
    assert str(overfit.subset_ids) in row["notes"]
    curve = _curve(overfit)
    assert [r["step"] for r in curve] == list(range(1, trainer.global_step + 1))
    assert curve[-1]["score"] == 1.0
    assert curve[-1]["wrong_ids"] == []
    assert curve[-1]["loss"] <= curve[-1]["target_loss"] < curve[0]["loss"]
    assert curve[0]["subset_ids"] == overfit.subset_ids
    # Everything is handed back: the hook and the validation limit.
    assert "on_before_batch_transfer" not in vars(model)
    assert trainer.limit_val_batches == 3


def test_lm_overfits_eight_examples_to_exact_match(make_trainer: Any) -> None:
    overfit = OverfitTinySubset(max_steps=150)
    trainer = make_trainer(callbacks=[overfit], max_steps=-1, max_epochs=100)
    model = TinyCausalLM(d_model=32, n_heads=2, n_layers=1)
    with pytest.warns(UserWarning, match="changes training"):
        trainer.fit(model, datamodule=InstructionDataModule(dataset_size=256, batch_size=16))

    assert overfit.verdict == "pass", overfit.checks
    recovered = overfit.checks["targets_recovered"].detail
    assert recovered.startswith("exact_match 1.000 on 8 example(s)")
    assert "expected -log(1/23) = 3.135" in overfit.checks["initial_loss"].detail
    assert _overfit_row(overfit)["verdict"] == "pass"


def test_lm_subset_in_batches_of_different_widths_is_scored(make_trainer: Any) -> None:
    # Batches of 2 of the 8 examples, each padded to its own longest example: the widths
    # differ, and the predictions are joined at the widest (the padding does not count).
    overfit = OverfitTinySubset(max_steps=150, batch_size=2)
    trainer = make_trainer(callbacks=[overfit], max_steps=-1, max_epochs=200)
    data = InstructionDataModule(dataset_size=256, batch_size=16)
    with pytest.warns(UserWarning, match="changes training"):
        trainer.fit(TinyCausalLM(d_model=32, n_heads=2, n_layers=1), datamodule=data)
    widths = {batch["labels"].shape[1] for batch in overfit._batches}
    assert len(widths) > 1, widths
    recovered = overfit.checks["targets_recovered"]
    assert recovered.verdict == "pass", overfit.checks
    assert recovered.detail.startswith("exact_match 1.000 on 8 example(s)")


def test_loaders_passed_to_fit_tuple_batches_and_accumulation(make_trainer: Any) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(100, 6, generator=generator)
    y = torch.randint(0, 3, (100,), generator=generator)

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)
            )
            self.val_sizes: list[int] = []
            self.sanity_sizes: list[int] = []

        def forward(self, inputs: Tensor) -> Tensor:
            logits: Tensor = self.net(inputs)
            return logits

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            inputs, labels = batch
            return cross_entropy(self(inputs), labels)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            # The sanity check runs before the subset exists: it sees the loader's batches.
            sizes = self.sanity_sizes if self.trainer.sanity_checking else self.val_sizes
            sizes.append(len(batch[1]))

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.02)

    overfit = OverfitTinySubset(max_steps=80, batch_size=4)
    model = Model()
    trainer = make_trainer(
        callbacks=[overfit], max_steps=-1, max_epochs=30, accumulate_grad_batches=2
    )
    with pytest.warns(UserWarning, match="changes training"):
        trainer.fit(
            model,
            train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=10, shuffle=True),
            val_dataloaders=DataLoader(TensorDataset(x, y), batch_size=50),
        )

    assert overfit.verdict == "pass", overfit.checks
    # No ids in tuple batches: the dataset indices stand in for them.
    assert "ids are dataset indices" in _overfit_row(overfit)["notes"]
    assert overfit.subset_ids == [str(i) for i in sorted(int(i) for i in overfit.subset_ids)]
    curve = _curve(overfit)
    assert {r["micro_batches"] for r in curve} == {2}
    # Validation saw the two subset batches of 4, not the loader's batches of 50.
    assert set(model.val_sizes) == {4}
    assert model.sanity_sizes == [50, 50]


def test_frozen_head_cannot_learn(make_trainer: Any) -> None:
    overfit = OverfitTinySubset(max_steps=15)
    trainer = make_trainer(callbacks=[overfit], max_steps=-1, max_epochs=20)
    with pytest.warns(UserWarning, match="overfit verdict fail"):
        trainer.fit(FrozenZeroHead(), datamodule=ClassificationDataModule(dataset_size=128))

    assert overfit.verdict == "fail"
    assert trainer.global_step == 15  # the budget, not the target, ended it
    target = overfit.checks["loss_target"]
    assert target.verdict == "fail"
    assert "nothing learns" in target.detail
    recovered = overfit.checks["targets_recovered"]
    assert recovered.verdict == "fail"
    wrong = recovered.detail.split("ids still wrong: ")[1].split(", ")
    assert set(wrong) <= set(overfit.subset_ids)
    assert wrong
    # A zero head predicts every class equally: the initial loss is exactly log(4).
    assert overfit.checks["initial_loss"].detail.startswith("initial loss 1.386")
    row = _overfit_row(overfit)
    assert row["verdict"] == "fail"
    assert row["reason"].endswith(REMEDY)


def test_loss_on_detached_logits_learns_nothing(make_trainer: Any) -> None:
    overfit = OverfitTinySubset(max_steps=10)
    trainer = make_trainer(callbacks=[overfit], max_steps=-1, max_epochs=20)
    with pytest.warns(UserWarning, match="overfit verdict fail"):
        trainer.fit(DetachedLoss(), datamodule=ClassificationDataModule(dataset_size=128))

    assert overfit.checks["loss_finite"].verdict == "pass"
    target = overfit.checks["loss_target"]
    assert target.verdict == "fail"
    assert "nothing learns: check that the loss is computed on outputs that carry gradients" in (
        target.detail
    )
    curve = _curve(overfit)
    assert len({round(r["loss"], 6) for r in curve}) == 1  # the very same loss every update


def test_user_exception_propagates_and_the_row_is_kept(make_trainer: Any) -> None:
    class Failing(TinyClassifier):
        def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
            if self.global_step == 3:
                raise ArithmeticError("user bug at step 3")
            return super().training_step(batch, batch_idx)

    overfit = OverfitTinySubset(max_steps=50)
    model = Failing()
    trainer = make_trainer(callbacks=[overfit], max_steps=-1, max_epochs=20)
    with (
        pytest.raises(ArithmeticError, match="user bug at step 3"),
        pytest.warns(UserWarning, match="changes training"),
    ):
        trainer.fit(model, datamodule=ClassificationDataModule(dataset_size=128))
    row = _overfit_row(overfit)
    assert "the fit failed: ArithmeticError: user bug at step 3" in row["notes"]
    assert row["step_last"] == 3
    assert "on_before_batch_transfer" not in vars(model)
    # Cut short by the user's error: "learns too slowly" would be a false diagnosis.
    target = overfit.checks["loss_target"]
    assert target.verdict == "not_checked"
    assert target.detail.startswith("the fit failed: ArithmeticError")


def test_a_trainer_that_stops_before_the_budget_gives_no_false_fail(make_trainer: Any) -> None:
    overfit = OverfitTinySubset(max_steps=200)
    trainer = make_trainer(callbacks=[overfit], max_steps=2)
    with pytest.warns(UserWarning, match="changes training"):
        trainer.fit(TinyClassifier(), datamodule=ClassificationDataModule(dataset_size=128))
    target = overfit.checks["loss_target"]
    assert target.verdict == "not_checked"
    assert "the Trainer stopped the fit after 2 update(s)" in target.detail
    # Nor a pass: the claim "the loop learns these examples" rests on the target and on
    # recovering the targets, and neither was proven.
    assert overfit.verdict == "not_checked"
    row = _overfit_row(overfit)
    assert row["verdict"] == "not_checked"
    assert row["reason"].startswith("not proven: ")
    assert "loss_target (the Trainer stopped the fit after 2 update(s)" in row["reason"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_examples": 0}, ValueError, r"OverfitTinySubset\(num_examples=0\) is invalid"),
        ({"seed": -1}, ValueError, r"seed=-1\) is invalid: expected an integer >= 0"),
        ({"max_steps": 0}, ValueError, r"max_steps=0\) is invalid"),
        (
            {"target_loss": -1.0},
            ValueError,
            r"target_loss=-1.0\) is invalid: expected a finite number > 0 or None",
        ),
        ({"target_fraction": 1.5}, ValueError, r"target_fraction=1.5\) is invalid: .* \(0, 1\]"),
        ({"required_recovery": 0}, ValueError, r"required_recovery=0\) is invalid"),
        ({"check_every": 0}, ValueError, r"check_every=0\) is invalid"),
        ({"batch_size": 0}, ValueError, r"batch_size=0\) is invalid"),
        ({"num_classes": 1}, ValueError, r"num_classes=1\) is invalid"),
        ({"shift_labels": "yes"}, TypeError, r"shift_labels='yes'\) is invalid: expected True or"),
        ({"seed": 1.0}, TypeError, r"seed=1.0\) is invalid: expected an integer >= 0"),
        (
            {"init_tolerance": 1},
            ValueError,
            r"init_tolerance=1\) is invalid: expected a finite number > 1",
        ),
        ({"predict_fn": 3}, TypeError, r"predict_fn=3\) is invalid: expected a callable"),
        ({"adapter": "x"}, TypeError, r"adapter='x'\) is invalid: expected a BatchAdapter"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        OverfitTinySubset(**kwargs)


@pytest.mark.parametrize(
    "name", ["target_loss", "target_fraction", "required_recovery", "init_tolerance"]
)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), pytest.param(10**400, id="10**400")])
def test_float_options_must_be_finite(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"OverfitTinySubset\({name}=.*finite"):
        OverfitTinySubset(**{name: value})


def test_a_predict_fn_that_raises_is_said_once_and_the_budget_holds(make_trainer: Any) -> None:
    def predict_fn(module: pl.LightningModule, batch: Any) -> Tensor:
        raise ValueError("no such head")

    overfit = OverfitTinySubset(max_steps=12, predict_fn=predict_fn)
    trainer = make_trainer(callbacks=[overfit], max_steps=-1, max_epochs=50)
    with pytest.warns(UserWarning, match="changes training"):
        trainer.fit(TinyClassifier(), datamodule=ClassificationDataModule(dataset_size=128))

    assert trainer.global_step == 12  # the budget, whatever happened to the predictions
    assert overfit.verdict == "not_checked"  # the recovery is essential to a pass
    recovered = overfit.checks["targets_recovered"]
    assert recovered.verdict == "not_checked"
    assert recovered.detail == (
        "no predictions on the subset: predict_fn(pl_module, batch) raised ValueError: no such"
        " head; predict_fn must return logits or predictions shaped like the targets"
    )
    assert overfit.checks["loss_target"].verdict == "pass"
    table = read_phase_table(overfit.run.run_dir)
    assert set(table["phase"]) == {"overfit"}  # no hook of the callback raised
    notes = _overfit_row(overfit)["notes"]
    # 12 updates and the last look at on_train_end: one message, counted.
    assert notes.count("no such head") == 1
    assert "predict_fn(pl_module, batch) raised ValueError: no such head (seen 13 times)" in notes
