"""Tests of the grouped classification task and TinyClassifier (lightning_pilot.demo.classifier)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from demo_helpers import LossRecorder, assert_same_batches, make_trainer
from lightning.pytorch import seed_everything
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_pilot.demo import (
    ClassificationDataModule,
    GroupedClassificationDataset,
    TinyClassifier,
    example_group,
)
from lightning_pilot.demo._data import SeededShuffleSampler


def set_up(**overrides: Any) -> ClassificationDataModule:
    options: dict[str, Any] = {"dataset_size": 240, "seed": 7, "batch_size": 16}
    datamodule = ClassificationDataModule(**{**options, **overrides})
    datamodule.setup("fit")
    return datamodule


def groups_of(dataset: Any) -> set[int]:
    return {example_group(dataset[i]) for i in range(len(dataset))}


# --- data ---------------------------------------------------------------------------------------


def test_items_and_batches_have_the_documented_format() -> None:
    datamodule = set_up(num_features=5, num_classes=3)
    item = datamodule.train_dataset[0]
    assert set(item) == {"ids", "inputs", "labels", "group"}
    for key in ("ids", "labels", "group"):
        assert type(item[key]) is int, key
    assert item["inputs"].shape == (5,)

    for batch in datamodule.train_dataloader():
        assert set(batch) == {"ids", "inputs", "labels", "group"}
        size = len(batch["ids"])
        assert batch["inputs"].shape == (size, 5)
        assert batch["inputs"].dtype == torch.float32
        for key in ("ids", "labels", "group"):
            assert batch[key].shape == (size,)
            assert batch[key].dtype == torch.long
        assert int(batch["labels"].min()) >= 0
        assert int(batch["labels"].max()) < 3


def test_groups_share_one_class_and_hold_examples_per_group_examples() -> None:
    dataset = GroupedClassificationDataset(size=50, seed=0, examples_per_group=8)
    assert dataset.num_groups == 7  # 6 full groups and one of 2
    label_of_group: dict[int, int] = {}
    size_of_group: dict[int, int] = {}
    for index in range(len(dataset)):
        example = dataset[index]
        assert example["ids"] == index
        assert example["group"] == index // 8
        group = example_group(example)
        assert label_of_group.setdefault(group, example["labels"]) == example["labels"]
        size_of_group[group] = size_of_group.get(group, 0) + 1
    assert sorted(size_of_group.values()) == [2, 8, 8, 8, 8, 8, 8]
    assert len(set(label_of_group.values())) > 1


def test_same_seed_gives_identical_batches_and_another_seed_does_not() -> None:
    first, second = set_up(), set_up()
    assert_same_batches(list(first.train_dataloader()), list(second.train_dataloader()))
    assert_same_batches(list(first.test_dataloader()), list(second.test_dataloader()))
    other = set_up(seed=8)
    assert not torch.equal(
        next(iter(first.train_dataloader()))["inputs"],
        next(iter(other.train_dataloader()))["inputs"],
    )


def test_group_split_keeps_every_group_in_one_split() -> None:
    datamodule = set_up(split_by="group", examples_per_group=4)
    train, val, test = (
        groups_of(datamodule.train_dataset),
        groups_of(datamodule.val_dataset),
        groups_of(datamodule.test_dataset),
    )
    assert not train & val
    assert not train & test
    assert not val & test
    assert len(train | val | test) == 60
    # 10% of the 60 groups each, whole groups of 4 examples.
    assert len(val) == len(test) == 6
    assert len(datamodule.val_dataset) == len(datamodule.test_dataset) == 24


def test_example_split_lets_groups_leak_across_splits() -> None:
    datamodule = set_up(split_by="example", examples_per_group=4)
    train, val, test = (
        groups_of(datamodule.train_dataset),
        groups_of(datamodule.val_dataset),
        groups_of(datamodule.test_dataset),
    )
    assert train & val
    assert train & test
    assert len(datamodule.val_dataset) == len(datamodule.test_dataset) == 24


@pytest.mark.parametrize("split_by", ["group", "example"])
def test_ids_are_unique_across_splits_and_cover_the_data(split_by: str) -> None:
    datamodule = set_up(split_by=split_by)
    seen: list[int] = []
    for loader in (
        datamodule.train_dataloader(),
        datamodule.val_dataloader(),
        datamodule.test_dataloader(),
    ):
        seen += torch.cat([batch["ids"] for batch in loader]).tolist()
    assert sorted(seen) == list(range(240))


def test_evaluation_loaders_are_in_id_order_even_when_training_shuffles() -> None:
    datamodule = set_up(shuffle=True)
    ids = torch.cat([batch["ids"] for batch in datamodule.val_dataloader()])
    assert torch.equal(ids, ids.sort().values)
    train_ids = torch.cat([batch["ids"] for batch in datamodule.train_dataloader()])
    assert not torch.equal(train_ids, train_ids.sort().values)


# --- stateful loaders ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_loader_state_dict_round_trips(num_workers: int) -> None:
    loader = set_up(stateful=True, num_workers=num_workers).train_dataloader()
    assert isinstance(loader, StatefulDataLoader)
    iterator = iter(loader)
    consumed = [next(iterator) for _ in range(4)]
    state = loader.state_dict()
    remaining = list(iterator)

    resumed = set_up(stateful=True, num_workers=num_workers).train_dataloader()
    assert isinstance(resumed, StatefulDataLoader)
    resumed.load_state_dict(state)
    assert_same_batches(list(resumed), remaining)
    # The stateful loader serves the plain loader's order.
    assert_same_batches(consumed + remaining, list(set_up().train_dataloader()))


def test_stateful_loader_resumes_at_the_right_epoch() -> None:
    loader = set_up(stateful=True).train_dataloader()
    assert isinstance(loader, StatefulDataLoader)
    first_epoch = list(loader)
    state = loader.state_dict()  # taken between epochs
    second_epoch = list(loader)
    assert not torch.equal(first_epoch[0]["ids"], second_epoch[0]["ids"])

    resumed = set_up(stateful=True).train_dataloader()
    assert isinstance(resumed, StatefulDataLoader)
    resumed.load_state_dict(state)
    assert_same_batches(list(resumed), second_epoch)


def test_lightning_style_set_epoch_replays_the_orders_of_a_continuous_run() -> None:
    loader = set_up().train_dataloader()
    continuous = [list(loader) for _ in range(3)]  # the sampler advances its epoch itself
    assert not torch.equal(continuous[0][0]["ids"], continuous[1][0]["ids"])
    # A restarted run (fresh loader) told the epoch, as Lightning does, sees the same order.
    restarted = set_up().train_dataloader()
    assert isinstance(restarted.sampler, SeededShuffleSampler)
    restarted.sampler.set_epoch(2)
    assert_same_batches(list(restarted), continuous[2])


def test_sampler_visits_every_index_and_repeats_an_epoch_it_is_set_back_to() -> None:
    sampler = SeededShuffleSampler(size=5, seed=0)
    first = list(sampler)
    assert sorted(first) == [0, 1, 2, 3, 4]
    assert sampler.epoch == 1  # advanced by the complete pass
    sampler.set_epoch(0)
    assert list(sampler) == first


def test_stateful_without_torchdata_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes the import fail as if torchdata were not installed.
    monkeypatch.setitem(sys.modules, "torchdata.stateful_dataloader", None)
    with pytest.raises(ImportError, match=r"pip install 'lightning-pilot\[stateful\]'"):
        ClassificationDataModule(stateful=True)


# --- argument validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"examples_per_group": 0},
            ValueError,
            r"ClassificationDataModule\(examples_per_group=0\) is invalid: expected an integer "
            r">= 1\.",
        ),
        (
            {"split_by": "document"},
            ValueError,
            r"\(split_by='document'\) is invalid: expected one of 'group', 'example'",
        ),
        ({"num_classes": 1}, ValueError, r"\(num_classes=1\).*integer >= 2"),
        ({"num_features": 2.0}, TypeError, r"\(num_features=2\.0\)"),
        ({"batch_size": -3}, ValueError, r"\(batch_size=-3\).*integer >= 1"),
        ({"test_size": "0.1"}, TypeError, r"\(test_size='0\.1'\)"),
        ({"stateful": None}, TypeError, r"\(stateful=None\).*True or False"),
        (
            # 16 examples in groups of 8 are 2 groups: too few for three splits.
            {"dataset_size": 16, "examples_per_group": 8},
            ValueError,
            r"\(dataset_size=16\) is invalid: expected a size large enough for 2 group",
        ),
    ],
)
def test_datamodule_rejects_bad_arguments(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        ClassificationDataModule(**kwargs)


def test_split_by_example_needs_fewer_examples_than_split_by_group() -> None:
    ClassificationDataModule(dataset_size=16, examples_per_group=8, split_by="example")
    with pytest.raises(ValueError, match=r"dataset_size=16"):
        ClassificationDataModule(dataset_size=16, examples_per_group=8, split_by="group")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"hidden": 0},
            ValueError,
            r"TinyClassifier\(hidden=0\) is invalid: expected an integer >= 1\.",
        ),
        ({"lr": -1.0}, ValueError, r"\(lr=-1\.0\).*finite number > 0"),
        ({"num_classes": 1}, ValueError, r"\(num_classes=1\)"),
        ({"weight_decay": "none"}, TypeError, r"\(weight_decay='none'\)"),
    ],
)
def test_model_rejects_bad_arguments(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        TinyClassifier(**kwargs)


# --- model --------------------------------------------------------------------------------------


def test_training_learns_the_classes(tmp_path: Path) -> None:
    # Measured on seeds 0-9 (150 steps, one thread): final / initial loss 0.01-0.10.
    seed_everything(0, verbose=False)
    datamodule = ClassificationDataModule(dataset_size=1024, seed=0, batch_size=32)
    model = TinyClassifier()
    recorder = LossRecorder()
    trainer = make_trainer(
        tmp_path, max_steps=150, limit_val_batches=2, callbacks=[recorder], num_sanity_val_steps=0
    )
    trainer.fit(model, datamodule)
    initial = recorder.losses[0]
    final = sum(recorder.losses[-10:]) / 10
    assert final / initial < 0.2
    assert {"train_loss", "val_loss", "val_acc"} <= set(trainer.callback_metrics)
    assert float(trainer.callback_metrics["val_acc"]) > 0.8

    results = trainer.test(model, datamodule=datamodule, verbose=False)
    assert results[0]["test_acc"] > 0.8


def test_checkpoint_rebuilds_model_and_datamodule(tmp_path: Path) -> None:
    datamodule = ClassificationDataModule(
        dataset_size=128, seed=2, batch_size=16, num_features=6, split_by="example"
    )
    model = TinyClassifier(num_features=6, hidden=8, lr=5e-3)
    trainer = make_trainer(tmp_path, max_steps=2, limit_val_batches=1, num_sanity_val_steps=0)
    trainer.fit(model, datamodule)
    path = tmp_path / "tiny.ckpt"
    trainer.save_checkpoint(path)

    restored = TinyClassifier.load_from_checkpoint(path)
    assert dict(restored.hparams) == dict(model.hparams)
    for name, tensor in model.state_dict().items():
        assert torch.equal(restored.state_dict()[name], tensor), name

    rebuilt = ClassificationDataModule.load_from_checkpoint(path)
    assert dict(rebuilt.hparams) == dict(datamodule.hparams)
    assert rebuilt.split_by == "example"
    rebuilt.setup("fit")
    assert_same_batches(list(rebuilt.train_dataloader()), list(datamodule.train_dataloader()))


def test_predict_returns_ids_predictions_labels_and_groups(tmp_path: Path) -> None:
    datamodule = ClassificationDataModule(dataset_size=64, seed=0, batch_size=8)
    model = TinyClassifier(hidden=8)
    predicted = make_trainer(tmp_path).predict(model, datamodule=datamodule)
    assert predicted is not None
    outputs = [output for output in predicted if isinstance(output, dict)]
    assert len(outputs) == len(predicted)
    for output in outputs:
        assert set(output) == {"ids", "predictions", "labels", "group"}
        assert output["predictions"].shape == output["ids"].shape
        assert output["predictions"].dtype == torch.long
    datamodule.setup("predict")
    predicted_ids = torch.cat([output["ids"] for output in outputs])
    expected = [datamodule.test_dataset[i]["ids"] for i in range(len(datamodule.test_dataset))]
    assert predicted_ids.tolist() == expected
