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
from lightning_pilot.callbacks.batch_inspector import BatchInspector
from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.label_checks import CausalLMWatch
from lightning_pilot.demo import (
    ClassificationDataModule,
    InstructionDataModule,
    TinyCausalLM,
    TinyClassifier,
    decode,
    example_group,
)
from lightning_pilot.schemas import EXAMPLES_SCHEMA
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
    assert REMEDY in row["reason"]


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
    assert REMEDY in row["reason"]


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
            r"examples=-1\) is invalid: expected an integer >= 0",
        ),
        ({"max_examples": 0}, ValueError, r"max_examples=0\) is invalid"),
        ({"decode": "utf8"}, TypeError, r"decode='utf8'\) is invalid: expected a callable"),
        ({"group_fn": 3}, TypeError, r"group_fn=3\) is invalid"),
        ({"num_classes": 4, "vocab_size": 4}, ValueError, "expected one of them, not both"),
        ({"batches": True}, TypeError, r"batches=True\) is invalid: expected an integer >= 1"),
        ({"num_classes": 1}, ValueError, r"num_classes=1\) is invalid"),
        ({"max_length": 0}, ValueError, r"max_length=0\) is invalid"),
        ({"pad_token_id": "0"}, TypeError, r"pad_token_id='0'\) is invalid"),
        ({"pad_token_id": -1}, ValueError, r"pad_token_id=-1\) is invalid: .* >= 0 or None"),
        ({"padding_warn": 2}, ValueError, r"padding_warn=2\) is invalid: .* from 0 to 1"),
        ({"padding_warn": float("nan")}, ValueError, r"padding_warn=nan\) is invalid: .*finite"),
        ({"padding_warn": "0.5"}, TypeError, r"padding_warn='0.5'\) is invalid"),
        ({"adapter": "x"}, TypeError, r"adapter='x'\) is invalid: expected a BatchAdapter"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        BatchInspector(**kwargs)


@pytest.mark.parametrize("name", ["num_classes", "vocab_size"])
def test_an_output_size_error_names_the_argument_given(name: str) -> None:
    with pytest.raises(ValueError, match=rf"^BatchInspector\({name}=-1\) is invalid") as caught:
        BatchInspector(**{name: -1})
    other = ({"num_classes", "vocab_size"} - {name}).pop()
    assert other not in str(caught.value)


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


# ---------------------------------------------------------------------------------------------
# Third-party modules: a DataModule that builds its test split in setup("test"), user code that
# raises, and labels shifted for a model that shifts them itself
# ---------------------------------------------------------------------------------------------


def test_boring_datamodule_with_a_test_split_built_in_setup_test_fits(make_trainer: Any) -> None:
    # Lightning's own BoringDataModule builds random_test in setup("test") only: during fit
    # its test_dataloader() raises AttributeError, which crashed on_train_start.
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    inspector = BatchInspector()
    trainer = make_trainer(callbacks=[inspector], max_steps=3)
    trainer.fit(BoringModel(), datamodule=BoringDataModule())

    assert trainer.global_step == 3
    test = inspector.checks["test/split_leakage"]
    assert test.verdict == "not_checked"
    assert test.detail.startswith("the test split is built in setup('test'), not for fit;")
    assert "test_dataloader() raised AttributeError during fit" in test.detail
    assert "build the test split in setup() for every stage" in test.detail
    # The other splits are still compared.
    assert inspector.checks["duplicate_inputs_across_splits"].detail == (
        "no input in two splits (examples scanned: train 64, val 64)"
    )
    row = _data_row(inspector)
    assert row["verdict"] == inspector.verdict
    assert "test/split_leakage" in {c["name"] for c in row["checks"]}


def test_user_code_that_raises_is_reported_and_the_fit_goes_on(make_trainer: Any) -> None:
    def bad_decode(tokens: Any) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    def bad_group(item: Any) -> Any:
        return item["conversation"]  # the items have no such key

    inspector = BatchInspector(decode=bad_decode, group_fn=bad_group, examples=2)
    trainer = make_trainer(callbacks=[inspector], max_steps=2)
    trainer.fit(_lm(), datamodule=InstructionDataModule(dataset_size=96, batch_size=8))

    assert trainer.global_step == 2
    leak = inspector.checks["split_leakage"]
    assert leak.verdict == "not_checked"
    assert leak.detail.startswith("group_fn raised KeyError: 'conversation' on a train item")
    assert "fix group_fn" in leak.detail
    decoded = inspector.checks["decode"]
    assert decoded.verdict == "not_checked"
    assert decoded.detail.startswith("decode raised UnicodeDecodeError")
    assert "fix decode=" in decoded.detail
    examples = read_snapshot_table(inspector.run.run_dir / "examples.parquet").to_pylist()
    assert len(examples) == 4
    assert all(r["input_text"] is None and r["target"] is None for r in examples)
    assert all("decode raised UnicodeDecodeError" in r["notes"] for r in examples)
    assert all(r["input_tokens"] for r in examples)  # the rest of the row is kept


def test_an_adapter_field_that_raises_is_reported(make_trainer: Any) -> None:
    inspector = BatchInspector(adapter=BatchAdapter(ids=lambda batch: batch["uid"]))
    trainer = make_trainer(callbacks=[inspector], max_steps=2)
    trainer.fit(TinyClassifier(), datamodule=ClassificationDataModule(dataset_size=128))

    assert trainer.global_step == 2
    read = inspector.checks["train/batch_read"]
    assert read.verdict == "not_checked"
    assert read.detail.startswith("reading a train batch raised KeyError: 'uid'")
    scan = inspector.checks["train/split_leakage"]
    assert scan.detail.startswith("reading the train dataset raised KeyError: 'uid'")


VOCAB, WIDTH, PROMPT = 50, 12, 4


def _gpt2() -> Any:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=32
    )
    return transformers.GPT2LMHeadModel(config)


def _causal_items(n: int, *, shifted: bool) -> list[dict[str, torch.Tensor]]:
    """Prompt + response rows, right-padded with 0; labels mask the prompt and the padding.

    ``shifted``: the labels are shifted left by hand (``labels[t] = input_ids[t + 1]``), the
    convention of a loss that does not shift.
    """
    generator = torch.Generator().manual_seed(0)
    items = []
    for index in range(n):
        length = 8 + index % (WIDTH - 7)
        input_ids = torch.zeros(WIDTH, dtype=torch.long)
        input_ids[:length] = torch.randint(1, VOCAB, (length,), generator=generator)
        mask = (torch.arange(WIDTH) < length).long()
        labels = torch.full((WIDTH,), -100, dtype=torch.long)
        if shifted:
            labels[PROMPT - 1 : length - 1] = input_ids[PROMPT:length]
        else:
            labels[PROMPT:length] = input_ids[PROMPT:length]
        items.append(
            {
                "ids": torch.tensor(index),
                "input_ids": input_ids,
                "attention_mask": mask,
                "labels": labels,
            }
        )
    return items


class HFCausalLM(pl.LightningModule):
    """A Hugging Face *LMHeadModel trained the Hugging Face way: labels=, the model shifts."""

    def __init__(self, shift_in_step: bool = False) -> None:
        super().__init__()
        self.model = _gpt2()
        self.shift_in_step = shift_in_step

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        labels = batch["labels"]
        if self.shift_in_step:  # shifted by hand once more, inside the step
            labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
        output = self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels
        )
        loss: torch.Tensor = output.loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit_causal(
    make_trainer: Any, *, shifted: bool, shift_in_step: bool = False
) -> tuple[BatchInspector, list[dict[str, Any]]]:
    inspector = BatchInspector()
    trainer = make_trainer(callbacks=[inspector], max_steps=3)
    loader = DataLoader(_causal_items(32, shifted=shifted), batch_size=8)
    module = HFCausalLM(shift_in_step)
    trainer.fit(module, train_dataloaders=loader)
    assert trainer.global_step == 3
    assert not module.model._forward_pre_hooks  # the watch ends with the verdict
    examples = read_snapshot_table(inspector.run.run_dir / "examples.parquet").to_pylist()
    return inspector, examples


def test_hf_convention_labels_equal_to_input_ids_pass(make_trainer: Any) -> None:
    inspector, examples = _fit_causal(make_trainer, shifted=False)

    shift = inspector.checks["train/label_shift"]
    assert shift.verdict == "pass"
    assert shift.detail.startswith("labels equal input_ids where counted")
    assert "16 identical" in shift.detail
    assert "GPT2LMHeadModel at 'model'" in shift.detail
    model = inspector.checks["causal_lm_labels"]
    assert model.verdict == "pass"
    assert model.detail.startswith("GPT2LMHeadModel at 'model' was given labels = input_ids")
    warned = [c.name for c in inspector.checks.values() if c.verdict in ("warn", "fail")]
    assert warned == []
    assert inspector.verdict == "pass"
    assert [r["label_relation"] for r in examples] == ["identical"] * 4


def test_labels_shifted_by_hand_for_a_model_that_shifts_are_caught(make_trainer: Any) -> None:
    inspector, examples = _fit_causal(make_trainer, shifted=True)

    shift = inspector.checks["train/label_shift"]
    assert shift.verdict == "warn"
    assert shift.detail.startswith(
        "labels are input_ids shifted left by 1; Hugging Face *ForCausalLM models shift labels"
        " internally, so this trains to predict 2 tokens ahead; pass labels = input_ids (with"
        " -100 on masked positions) to such models, or ignore this warning if your loss does"
        " not shift (labels[t] == input_ids[t+1] in rows: 16 shifted by 1"
    )
    # The model was given those labels: it shifts them again, which is certain.
    model = inspector.checks["causal_lm_labels"]
    assert model.verdict == "fail"
    assert "was given labels equal to its input_ids shifted left by 1" in model.detail
    assert "trains to predict 2 tokens ahead" in model.detail
    assert [r["label_relation"] for r in examples] == ["shifted by 1"] * 4
    row = _data_row(inspector)
    assert row["verdict"] == "fail"
    assert "train/label_shift: labels are input_ids shifted left by 1" in row["reason"]


def test_a_shift_inside_training_step_is_seen_on_the_model_call(make_trainer: Any) -> None:
    # The batch follows the convention; the step shifts the labels before the model shifts them.
    inspector, examples = _fit_causal(make_trainer, shifted=False, shift_in_step=True)

    assert inspector.checks["train/label_shift"].verdict == "pass"
    assert [r["label_relation"] for r in examples] == ["identical"] * 4
    model = inspector.checks["causal_lm_labels"]
    assert model.verdict == "fail"
    assert "shifted left by 1" in model.detail


def test_a_copy_of_a_watched_model_carries_an_inert_hook() -> None:
    # The resume check's in-process fallback deep-copies the module; a user may pickle it.
    import copy
    import pickle

    module = HFCausalLM()
    watch = CausalLMWatch.attach(module, ignore_index=-100, max_calls=8)
    assert watch is not None
    assert watch.name == "GPT2LMHeadModel at 'model'"
    ids = torch.randint(1, VOCAB, (2, 6))
    for other in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        [hook] = other.model._forward_pre_hooks.values()
        assert hook is not watch
        assert hook.max_calls == 0
        other.model(input_ids=ids, labels=ids)
    assert watch.calls == 0
    module.model(input_ids=ids, labels=ids)
    assert (watch.calls, watch.relations["identical"]) == (1, 2)
    watch.remove()
    assert not module.model._forward_pre_hooks
