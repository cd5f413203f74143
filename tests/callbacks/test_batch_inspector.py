"""BatchInspector in real fits: the data verdict, the examples table and the planted bugs."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pandas as pd
import pytest
import torch
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader, TensorDataset

from lightning_pilot import PhaseMemoryMonitor, read_phase_table
from lightning_pilot.callbacks.batch_inspector import EXAMPLES_SCHEMA, BatchInspector
from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.demo import (
    ClassificationDataModule,
    InstructionDataModule,
    TinyCausalLM,
    TinyClassifier,
    decode,
    example_group,
)
from lightning_pilot.storage import read_snapshot_table

REMEDY = "If the check fails: fix the dataset or the transform"


@pytest.fixture(autouse=True)
def _seeded() -> None:
    # The demo models draw their initial weights from the global generator.
    torch.manual_seed(0)


def _data_row(inspector: BatchInspector) -> dict[str, Any]:
    table = read_phase_table(inspector.run.run_dir)
    rows = table[(table["phase"] == "data") & table["first"]].to_dict("records")
    assert len(rows) == 1
    return rows[0]


def _lm() -> TinyCausalLM:
    return TinyCausalLM(d_model=16, n_heads=2, n_layers=1)


class InstructionAsTargetDataModule(InstructionDataModule):
    """Planted bug: the labels are the inputs on every real token (the instruction is trained)."""

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        mask = batch["attention_mask"].bool()
        batch["labels"] = torch.where(
            mask, batch["input_ids"], torch.full_like(batch["input_ids"], -100)
        )
        return batch


class ShiftedTrainLabels(ClassificationDataModule):
    """Planted bug: the training transform shifts every label by one class; validation does not."""

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer is not None and self.trainer.training:
            batch["labels"] = batch["labels"] + 1
        return batch


def test_clean_classifier_passes_and_writes_examples(make_trainer: Any) -> None:
    inspector = BatchInspector(group_fn=example_group, examples=3)
    trainer = make_trainer(callbacks=[inspector])
    data = ClassificationDataModule(dataset_size=128, batch_size=16, split_by="group")
    trainer.fit(TinyClassifier(), datamodule=data)

    assert inspector.verdict == "pass"
    leak = inspector.checks["split_leakage"]
    assert leak.verdict == "pass"
    assert "examples scanned: train" in leak.detail
    assert "test" in leak.detail
    assert inspector.checks["train/label_range"].detail.startswith("labels in [0, 3] within 4")
    assert inspector.checks["class_histograms"].detail.startswith("train: 0:")
    row = _data_row(inspector)
    assert row["verdict"] == "pass"
    assert pd.isna(row["reason"])
    names = {c["name"] for c in row["checks"]}
    assert {"train/ids_present_unique", "val/label_range", "split_leakage"} <= names
    examples = read_snapshot_table(inspector.run.run_dir / "examples.parquet").to_pylist()
    assert [r["split"] for r in examples] == ["train"] * 3 + ["val"] * 3
    assert all(len(r["input_values"]) == 16 and r["target"] in "0123" for r in examples)
    assert set(EXAMPLES_SCHEMA.names) <= set(examples[0])


def test_clean_lm_passes_with_decoded_examples(make_trainer: Any) -> None:
    inspector = BatchInspector(decode=decode, examples=2)
    trainer = make_trainer(callbacks=[inspector], max_steps=2)
    trainer.fit(_lm(), datamodule=InstructionDataModule(dataset_size=96, batch_size=8))

    assert inspector.verdict != "fail"
    assert inspector.checks["train/instruction_masked"].verdict == "pass"
    assert inspector.checks["train/padding_not_in_loss"].verdict == "pass"
    assert inspector.checks["train/truncation"].detail.endswith("reach max_length=32")
    examples = read_snapshot_table(inspector.run.run_dir / "examples.parquet").to_pylist()
    first = examples[0]
    assert first["input_text"].startswith("<bos>")
    assert "<sep>" in first["input_text"]
    assert first["target"].endswith("<eos>")
    assert first["loss_tokens"] == len(first["loss_positions"]) > 0
    assert first["truncated"] is False


def test_lm_labels_that_include_the_instruction_warn(make_trainer: Any) -> None:
    inspector = BatchInspector()
    trainer = make_trainer(callbacks=[inspector], max_steps=2)
    trainer.fit(_lm(), datamodule=InstructionAsTargetDataModule(dataset_size=96, batch_size=8))

    check = inspector.checks["train/instruction_masked"]
    assert check.verdict == "warn"
    assert "labels equal input_ids on all" in check.detail
    assert "the instruction (prompt) is a target too" in check.detail
    row = _data_row(inspector)
    assert row["verdict"] == "warn"
    assert "the instruction (prompt) is a target too" in row["reason"]
    assert row["reason"].endswith(REMEDY)


def test_group_shared_by_train_and_validation_fails(make_trainer: Any) -> None:
    inspector = BatchInspector(group_fn=example_group)
    trainer = make_trainer(callbacks=[inspector], max_steps=1)
    data = ClassificationDataModule(dataset_size=128, batch_size=16, split_by="example")
    trainer.fit(TinyClassifier(), datamodule=data)

    leak = inspector.checks["split_leakage"]
    assert leak.verdict == "fail"
    assert "found in more than one split" in leak.detail
    assert "(train+val" in leak.detail
    row = _data_row(inspector)
    assert row["verdict"] == "fail"
    assert "split_leakage" in row["reason"]
    assert row["reason"].endswith(REMEDY)


def test_head_too_small_for_the_labels_fails_before_the_crash(make_trainer: Any) -> None:
    inspector = BatchInspector()
    trainer = make_trainer(callbacks=[inspector])
    data = ClassificationDataModule(dataset_size=128, batch_size=16)
    with pytest.raises(IndexError, match="out of bounds"):
        trainer.fit(TinyClassifier(num_classes=3), datamodule=data)

    row = _data_row(inspector)
    assert row["verdict"] == "fail"
    check = next(c for c in row["checks"] if c["name"] == "train/label_range")
    assert check["verdict"] == "fail"
    assert (
        "outside [0, 2] (the model has 3 outputs, from out_features of the last"
        in (check["detail"])
    )


def test_labels_shifted_by_one_class_are_caught(make_trainer: Any) -> None:
    # The transform shifts the training labels; with the head the data needs, 4 is out of range.
    strict = BatchInspector(num_classes=4)
    trainer = make_trainer(callbacks=[strict], max_steps=2)
    with pytest.raises(IndexError):
        trainer.fit(TinyClassifier(num_classes=4), datamodule=ShiftedTrainLabels(dataset_size=128))
    detail = strict.checks["train/label_range"].detail
    assert strict.checks["train/label_range"].verdict == "fail"
    assert "labels look shifted by one class" in detail
    assert "from num_classes/vocab_size given" in detail


def test_shifted_split_labels_warn_from_the_histograms(make_trainer: Any) -> None:
    class Shifted(TensorDataset):
        def __getitem__(self, index: int) -> Any:
            x, y = super().__getitem__(index)
            return x, y + 1

    x, y = torch.randn(64, 4), torch.arange(64) % 3

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return cross_entropy(self.layer(batch[0]), batch[1])

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            return cross_entropy(self.layer(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    inspector = BatchInspector()
    trainer = make_trainer(callbacks=[inspector], max_steps=2)
    trainer.fit(
        Model(),
        train_dataloaders=DataLoader(Shifted(x, y), batch_size=16),
        val_dataloaders=DataLoader(TensorDataset(x, y), batch_size=16),
    )
    assert inspector.checks["val_classes_in_train"].verdict == "warn"
    assert (
        "val class(es) 0 never occur in training" in inspector.checks["val_classes_in_train"].detail
    )
    assert "train [1, 3], val [0, 2]" in inspector.checks["label_ranges_agree"].detail
    # Tuple batches carry no ids: named, not_checked, and training went on.
    ids = inspector.checks["train/ids_present_unique"]
    assert (ids.verdict, trainer.global_step) == ("not_checked", 2)
    assert "field 'ids' not found" in ids.detail


def test_composes_with_phase_memory_monitor_on_one_data_row(make_trainer: Any) -> None:
    inspector, monitor = BatchInspector(group_fn=example_group), PhaseMemoryMonitor()
    trainer = make_trainer(callbacks=[monitor, inspector], max_steps=3)
    trainer.fit(TinyClassifier(), datamodule=ClassificationDataModule(dataset_size=128))
    row = _data_row(inspector)
    assert set(row["source"].split(",")) == {"PhaseMemoryMonitor", "BatchInspector"}
    assert row["duration_s"] is not None
    assert row["duration_s"] > 0
    assert any(c["name"] == "split_leakage" for c in row["checks"])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batches": 0}, ValueError, r"BatchInspector\(batches=0\) is invalid"),
        (
            {"examples": -1},
            ValueError,
            r"examples=-1\) is invalid: examples must be an integer >= 0",
        ),
        ({"max_examples": 0}, ValueError, r"max_examples=0\) is invalid"),
        ({"decode": "utf8"}, TypeError, r"decode='utf8'\) is invalid: expected a callable"),
        ({"group_fn": 3}, TypeError, r"group_fn=3\) is invalid"),
        ({"num_classes": 4, "vocab_size": 4}, ValueError, "give one of them"),
        ({"num_classes": 1}, ValueError, r"num_classes=1\) is invalid"),
        ({"max_length": 0}, ValueError, r"max_length=0\) is invalid"),
        ({"pad_token_id": "0"}, ValueError, r"pad_token_id='0'\) is invalid"),
        ({"padding_warn": 2}, ValueError, r"padding_warn=2\) is invalid: expected a fraction"),
        ({"adapter": "x"}, TypeError, r"adapter='x'\) is invalid: expected a BatchAdapter"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        BatchInspector(**kwargs)


def test_custom_adapter_reads_renamed_fields(make_trainer: Any) -> None:
    class Renamed(ClassificationDataModule):
        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            return {"key": batch["ids"], "features": batch["inputs"], "labels": batch["labels"]}

    class Model(TinyClassifier):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return cross_entropy(self(batch["features"]), batch["labels"])

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            return None

    inspector = BatchInspector(adapter=BatchAdapter(ids="key"))
    trainer = make_trainer(callbacks=[inspector], max_steps=2)
    trainer.fit(Model(), datamodule=Renamed(dataset_size=128))
    assert inspector.checks["train/ids_present_unique"].verdict == "pass"
