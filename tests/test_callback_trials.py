"""Situations found by trying the pilot callbacks as a new user would, each on a real Trainer:
a binary classifier with one logit, and manual optimisation with two optimizers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pandas as pd
import pytest
import torch
from tiny_models import IdExamples
from torch import Tensor, nn
from torch.nn.functional import binary_cross_entropy_with_logits, softplus
from torch.utils.data import DataLoader

from lightning_pilot import (
    BatchInspector,
    EffectiveBatchAccountant,
    OverfitTinySubset,
    PhaseMemoryMonitor,
    choice_sheet,
    read_phase_table,
)


class OneLogitClassifier(pl.LightningModule):
    """A binary classifier as it is usually written: one logit, ``BCEWithLogits`` on the 0/1
    labels (kept as integers in the dataset)."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.lr = lr
        self.body = nn.Linear(8, 32)
        self.fc = nn.Linear(32, 1)

    def forward(self, inputs: Tensor) -> Tensor:
        return self.fc(torch.relu(self.body(inputs)))  # [B, 1]

    def _loss(self, batch: dict[str, Any]) -> Tensor:
        logits = self(batch["inputs"]).reshape(-1)
        return binary_cross_entropy_with_logits(logits, batch["labels"].float())

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def _checks(callback: Any, phase: str) -> dict[str, dict[str, Any]]:
    table = read_phase_table(callback.run.run_dir)
    rows = table[(table["phase"] == phase) & table["first"]].to_dict("records")
    assert len(rows) == 1
    return {check["name"]: check for check in rows[0]["checks"]}


def test_one_logit_binary_labels_are_in_range(make_trainer: Any) -> None:
    """labels 0 and 1 for a head of one output are a binary logit's, not a class index 1
    outside [0, 0] (a ``fail`` that stopped every correct binary classifier at the gate)."""
    torch.manual_seed(0)
    inspector = BatchInspector()
    trainer = make_trainer(callbacks=[inspector], max_steps=2)
    trainer.fit(
        OneLogitClassifier(),
        DataLoader(IdExamples(16), batch_size=4),
        DataLoader(IdExamples(8), batch_size=4),
    )

    check = _checks(inspector, "data")["train/label_range"]
    assert check["verdict"] == "pass", check["detail"]
    assert check["detail"] == (
        "labels in [0, 1] for one output, a binary logit (from out_features of the head 'fc')"
    )


def test_one_output_with_labels_beyond_one_is_not_called_out_of_range(make_trainer: Any) -> None:
    """Integer targets beyond 1 for a head of one output are a regression's (counts): the
    labels are not indices into the output, so the check says it cannot judge them."""

    class CountRegressor(OneLogitClassifier):
        def _loss(self, batch: dict[str, Any]) -> Tensor:
            prediction = self(batch["inputs"]).squeeze(1)
            return (prediction - batch["labels"].float()).pow(2).mean()

    class Counts(IdExamples):
        def __getitem__(self, index: int) -> dict[str, Any]:
            return super().__getitem__(index) | {"labels": torch.tensor(index % 5)}

    torch.manual_seed(0)
    inspector = BatchInspector()
    trainer = make_trainer(callbacks=[inspector], max_steps=2)
    trainer.fit(
        CountRegressor(), DataLoader(Counts(16), batch_size=8), DataLoader(Counts(8), batch_size=8)
    )

    check = _checks(inspector, "data")["train/label_range"]
    assert check["verdict"] == "not_checked"
    assert check["detail"].startswith("labels span [0, 4] and the model has one output")
    assert "give num_classes= if they are" in check["detail"]


class SqueezedOneLogit(OneLogitClassifier):
    """The same classifier whose forward returns its logits squeezed to ``[B]``."""

    def forward(self, inputs: Tensor) -> Tensor:
        return super().forward(inputs).squeeze(1)


@pytest.mark.parametrize("module", [OneLogitClassifier, SqueezedOneLogit])
@pytest.mark.parametrize(("lr", "verdict"), [(1e-2, "pass"), (0.0, "fail")])
def test_overfit_reads_a_single_logit_by_its_sign(
    make_trainer: Any, tmp_path: Path, module: type[OneLogitClassifier], lr: float, verdict: str
) -> None:
    """A one-logit classifier that memorised the subset recovers every target: its class is
    ``logit > 0``. Before, the argmax of a ``[B, 1]`` output was always class 0 (half the
    examples wrong) and a ``[B]`` output was read as predictions and truncated to integers
    (all wrong). One that cannot learn (lr=0) still fails."""
    torch.manual_seed(0)
    callback = OverfitTinySubset(max_steps=60, out_dir=tmp_path / "pilot")
    trainer = make_trainer(callbacks=[callback], max_steps=60)
    trainer.fit(
        module(lr=lr),
        DataLoader(IdExamples(64), batch_size=4, shuffle=True),
        DataLoader(IdExamples(8), batch_size=4),
    )

    recovered = _checks(callback, "overfit")["targets_recovered"]
    assert recovered["verdict"] == verdict, recovered["detail"]
    if verdict == "pass":
        assert recovered["detail"].startswith("accuracy 1.000 on 8 example(s)")


class TwoOptimizerGAN(pl.LightningModule):
    """Manual optimisation with two optimizers stepping once each per batch: Lightning's
    ``global_step`` (and ``max_steps``) counts both steps. ``generator_steps=False`` steps the
    discriminator alone: one optimizer step per batch."""

    def __init__(self, generator_steps: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator_steps = generator_steps
        self.generator = nn.Linear(8, 8)
        self.discriminator = nn.Linear(8, 1)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        real = batch["inputs"]
        fake = self.generator(torch.randn_like(real))
        d_loss = (
            softplus(-self.discriminator(real)).mean()
            + softplus(self.discriminator(fake.detach())).mean()
        )
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        if not self.generator_steps:
            return d_loss.detach()
        g_loss = softplus(-self.discriminator(fake)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        return (d_loss + g_loss).detach()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.generator.parameters(), lr=1e-3),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-3),
        ]


@pytest.mark.parametrize(
    ("generator_steps", "updates", "examples", "line"),
    [
        (False, [1, 2, 3, 4], 16, "4 updates; 16 examples"),
        (True, [2, 4], 8, "4 updates (2 optimizer steps per batch window); 8 examples"),
    ],
)
def test_two_optimizers_in_manual_optimisation_count_every_step(
    make_trainer: Any, generator_steps: bool, updates: list[int], examples: int, line: str
) -> None:
    """``updates_done`` counts optimizer steps as ``global_step`` does; a batch that stepped
    both optimizers is one row of the updates table, its examples counted once."""
    accountant = EffectiveBatchAccountant()
    trainer = make_trainer(callbacks=[accountant, PhaseMemoryMonitor()], max_steps=4)
    trainer.fit(TwoOptimizerGAN(generator_steps), DataLoader(IdExamples(32), batch_size=4))

    assert trainer.global_step == 4
    summary = accountant.summary
    assert summary["updates_done"] == trainer.global_step
    assert accountant.run.ledger_fields["updates_done"] == 4
    assert (summary["examples_seen"], summary["micro_batches"]) == (examples, examples // 4)
    assert summary["line"] == f"4 examples per update (4 x 1 x 1 replica); {line}; last window full"
    notes = [f["detail"] for f in summary["flags"] if f["flag"] == "note"]
    assert [f["flag"] for f in summary["flags"] if f["flag"] != "note"] == []
    per_window = [n for n in notes if n.startswith("2 optimizer steps per batch window")]
    assert len(per_window) == generator_steps
    rows = pd.read_parquet(Path(accountant.run.run_dir) / "updates.parquet")
    assert rows["update"].tolist() == updates
    assert rows["examples"].tolist() == [4] * len(updates)  # one batch per row, counted once
    assert rows["micro_batches"].tolist() == [1] * len(updates)
    assert rows["optimizer_stepped"].all()
    counted = "2 batch window(s) of typically 2 optimizer steps" if generator_steps else "4 upd"
    assert f"Counted in updates.parquet: {counted}" in choice_sheet(accountant.run.run_dir)


def test_two_optimizers_resume_to_the_global_step(make_trainer: Any, tmp_path: Path) -> None:
    """A GAN fit to step 4 and resumed to step 8 counts 8 updates over 4 batch windows."""
    first = EffectiveBatchAccountant()
    trainer = make_trainer(callbacks=[first], max_steps=4)
    trainer.fit(TwoOptimizerGAN(), DataLoader(IdExamples(32), batch_size=4))
    checkpoint = tmp_path / "step4.ckpt"
    trainer.save_checkpoint(checkpoint)

    second = EffectiveBatchAccountant()
    trainer = make_trainer(callbacks=[second, PhaseMemoryMonitor()], max_steps=8)
    trainer.fit(TwoOptimizerGAN(), DataLoader(IdExamples(32), batch_size=4), ckpt_path=checkpoint)

    assert trainer.global_step == 8
    summary = second.summary
    assert (summary["updates_done"], summary["examples_seen"]) == (8, 16)
    assert not [f for f in summary["flags"] if "checkpoint" in f["detail"]], summary["flags"]
    assert "(2 optimizer steps per batch window)" in summary["line"]
    rows = pd.read_parquet(Path(second.run.run_dir) / "updates.parquet")
    assert rows[["attempt", "update"]].sort_values("update").values.tolist() == [
        [1, 2],
        [1, 4],
        [2, 6],
        [2, 8],
    ]
    sheet = choice_sheet(second.run.run_dir)
    assert "Counted in updates.parquet: 4 batch window(s) of typically 2 optimizer steps" in sheet


class ManualAccumulation(pl.LightningModule):
    """Manual optimisation that steps every second batch (its own gradient accumulation)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Linear(8, 2)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss = nn.functional.cross_entropy(self.net(batch["inputs"]), batch["labels"])
        self.manual_backward(loss / 2)
        if batch_idx % 2 == 1:
            optimizer = self.optimizers()
            optimizer.step()  # type: ignore[union-attr]
            optimizer.zero_grad()  # type: ignore[union-attr]
        return loss.detach()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_manual_accumulation_counts_the_micro_batches_each_update_saw(make_trainer: Any) -> None:
    accountant = EffectiveBatchAccountant()
    trainer = make_trainer(callbacks=[accountant], max_steps=3)
    trainer.fit(ManualAccumulation(), DataLoader(IdExamples(32), batch_size=4))

    summary = accountant.summary
    assert summary["updates_done"] == trainer.global_step == 3
    assert summary["examples_seen"] == 24  # 6 batches of 4
    assert summary["line"].startswith("8 examples per update (4 x 2 x 1 replica); 3 updates")
    flags = [f["flag"] for f in summary["flags"]]
    assert not [f for f in flags if f.startswith("plan_") or f == "k_changed"], flags
    assert any("manual optimization" in f["detail"] for f in summary["flags"]), flags
    rows = pd.read_parquet(Path(accountant.run.run_dir) / "updates.parquet")
    assert rows["examples"].tolist() == [8, 8, 8]
    assert rows["weight"].tolist() == [1.0, 1.0, 1.0]  # each window as full as the module made it
    assert not rows["window_partial"].any()
