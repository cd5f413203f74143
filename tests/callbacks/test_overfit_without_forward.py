"""OverfitTinySubset on the usual Hugging Face wrapper: ``self.model = HFModel(...)``, no
``forward``, ``training_step`` returns ``self.model(**batch).loss``. Real tiny transformers
models built from configs; one fit per module, shared by the tests that read it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from tiny_models import bert_config
from torch import Tensor
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader

from lightning_pilot import read_phase_table
from lightning_pilot.callbacks.overfit_tiny_subset import OverfitTinySubset
from lightning_pilot.storage import read_snapshot_table

transformers = pytest.importorskip("transformers")

VOCAB, WIDTH = 64, 10
REMEDY = "predict_fn="


def _lm_items(count: int) -> list[dict[str, Tensor]]:
    """Random token rows of 7 to 10 tokens, right-padded with 0; the labels are the inputs
    (Hugging Face causal LM convention: the model shifts) with the padding at -100."""
    generator = torch.Generator().manual_seed(0)
    items = []
    for index in range(count):
        length = 7 + index % 4
        input_ids = torch.zeros(WIDTH, dtype=torch.long)
        input_ids[:length] = torch.randint(1, VOCAB, (length,), generator=generator)
        mask = (torch.arange(WIDTH) < length).long()
        labels = torch.where(mask.bool(), input_ids, torch.full_like(input_ids, -100))
        items.append({"input_ids": input_ids, "attention_mask": mask, "labels": labels})
    return items


def _class_items(count: int) -> list[dict[str, Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        {
            "input_ids": torch.randint(1, VOCAB, (WIDTH,), generator=generator),
            "attention_mask": torch.ones(WIDTH, dtype=torch.long),
            "labels": torch.randint(0, 4, (), generator=generator),
        }
        for _ in range(count)
    ]


class HFWrapper(pl.LightningModule):
    """The usual wrapper: no ``forward``; the training step returns the model's own loss."""

    def __init__(self, model: torch.nn.Module, lr: float = 0.01) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        loss: Tensor = self.model(**batch).loss
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class BatchForward(HFWrapper):
    """A forward that takes the batch's own keywords: ``pl_module(inputs, mask)`` fails."""

    def forward(self, **batch: Tensor) -> Any:
        return self.model(**batch)


class HandMadeHead(pl.LightningModule):
    """No forward, and no submodule returns ``logits``: a base model and a head of its own."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.GPT2Config(
            n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=32
        )
        self.body = transformers.GPT2Model(config)
        self.head = torch.nn.Linear(16, VOCAB)

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        hidden = self.body(batch["input_ids"], attention_mask=batch["attention_mask"])
        logits = self.head(hidden.last_hidden_state)[:, :-1]
        return cross_entropy(logits.reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=32
    )
    return transformers.GPT2LMHeadModel(config)


def _bert() -> Any:
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(bert_config(vocab_size=VOCAB, num_labels=4))


def _fit(
    root: Path, module: pl.LightningModule, items: list[dict[str, Tensor]], **options: Any
) -> tuple[OverfitTinySubset, pl.Trainer]:
    overfit = OverfitTinySubset(**options)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        max_epochs=1000,
        callbacks=[overfit],
    )
    with pytest.warns(UserWarning, match="OverfitTinySubset changes training"):
        trainer.fit(module, train_dataloaders=DataLoader(items, batch_size=16))
    return overfit, trainer


def _rows(overfit: OverfitTinySubset) -> dict[str, dict[str, Any]]:
    table = read_phase_table(overfit.run.run_dir)
    return {row["phase"]: row for row in table.to_dict("records")}


@pytest.fixture(scope="module")
def gpt2_fit(tmp_path_factory: pytest.TempPathFactory) -> tuple[OverfitTinySubset, pl.Trainer]:
    root = tmp_path_factory.mktemp("gpt2")
    return _fit(root, HFWrapper(_gpt2()), _lm_items(64), max_steps=100)


def test_gpt2_wrapper_memorises_eight_rows_within_its_own_budget(
    gpt2_fit: tuple[OverfitTinySubset, pl.Trainer],
) -> None:
    overfit, trainer = gpt2_fit
    assert overfit.verdict == "pass", overfit.checks
    # Stopped by its own decision (target and recovery met, 53 updates here), not the
    # Trainer's 1000 epochs.
    assert trainer.global_step < 100
    recovered = overfit.checks["targets_recovered"]
    assert recovered.verdict == "pass"
    assert recovered.detail.startswith("exact_match 1.000 on 8 example(s) at step ")
    assert overfit.checks["loss_target"].verdict == "pass"
    assert "expected -log(1/64) = 4.159" in overfit.checks["initial_loss"].detail


def test_gpt2_wrapper_row_is_short_and_no_hook_failed(
    gpt2_fit: tuple[OverfitTinySubset, pl.Trainer],
) -> None:
    overfit, trainer = gpt2_fit
    rows = _rows(overfit)
    assert "pilot" not in rows  # no hook of the callback raised
    row = rows["overfit"]
    assert row["verdict"] == "pass"
    assert row["reason"] != row["reason"]  # NaN: a pass has no reason
    assert "training step" in row["notes"]  # where the predictions came from, said once
    assert row["notes"].count("training step") == 1
    curve = read_snapshot_table(overfit.run.run_dir / "overfit.parquet").to_pylist()
    assert curve[-1]["score"] == 1.0
    assert curve[-1]["wrong_ids"] == []
    # The forward hooks that read the logits are gone after the fit.
    model = trainer.lightning_module
    assert not any(m._forward_hooks for m in model.modules())


def test_gpt2_wrapper_stops_at_its_budget_with_a_verdict(tmp_path: Path) -> None:
    overfit, trainer = _fit(tmp_path, HFWrapper(_gpt2()), _lm_items(64), max_steps=4)
    assert trainer.global_step == 4
    assert overfit.verdict == "fail", overfit.checks
    assert overfit.checks["loss_target"].verdict == "fail"
    recovered = overfit.checks["targets_recovered"]
    assert recovered.verdict == "fail"
    assert recovered.detail.startswith("exact_match 0.000 on 8 example(s) at step 4")
    row = _rows(overfit)["overfit"]
    assert len(row["reason"]) < 800


def test_bert_classifier_wrapper_recovers_eight_labels(tmp_path: Path) -> None:
    overfit, trainer = _fit(tmp_path, HFWrapper(_bert()), _class_items(64), max_steps=100)
    assert overfit.verdict == "pass", overfit.checks
    assert trainer.global_step < 100
    assert overfit.checks["targets_recovered"].detail.startswith("accuracy 1.000 on 8")
    assert "pilot" not in _rows(overfit)


def test_a_forward_that_cannot_take_the_inputs_falls_back_once(tmp_path: Path) -> None:
    overfit, trainer = _fit(tmp_path, BatchForward(_bert()), _class_items(64), max_steps=100)
    assert overfit.verdict == "pass", overfit.checks
    assert trainer.global_step < 100
    notes = _rows(overfit)["overfit"]["notes"]
    assert notes.count("raised TypeError") == 1, notes
    assert "pilot" not in _rows(overfit)


def test_no_logits_anywhere_is_one_not_checked_with_the_remedy(tmp_path: Path) -> None:
    torch.manual_seed(0)
    overfit, trainer = _fit(tmp_path, HandMadeHead(), _lm_items(64), max_steps=20)
    assert trainer.global_step == 20  # the loss alone never stops it early: no recovery
    recovered = overfit.checks["targets_recovered"]
    assert recovered.verdict == "not_checked"
    assert recovered.detail.count(REMEDY) == 1, recovered.detail
    assert overfit.checks["loss_finite"].verdict == "pass"
    assert overfit.verdict is not None
    row = _rows(overfit)["overfit"]
    assert row["reason"].count(REMEDY) <= 1
    assert len(row["reason"]) < 800
    assert len(row["notes"]) < 800
    assert "pilot" not in _rows(overfit)
