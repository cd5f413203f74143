"""A tiny MLP classifier on synthetic Gaussian data in groups (standing in for the document
several examples are cut from): ``inputs = class_mean[label] + group_offset[group] + noise``.
Splitting by group keeps each group in one split; splitting by example lets groups leak, which
leakage checks should catch. Items hold ``ids``, ``inputs``, ``labels`` and ``group``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from torch.nn.functional import cross_entropy
from torch.utils.data import Dataset, Subset
from torchmetrics.functional.classification import multiclass_accuracy

from lightning_pilot.core import validate
from lightning_pilot.demo._data import EvaluatedModule, SplitDataModule

# Against class means and noise of scale 1: large enough to be worth memorising.
_GROUP_OFFSET_SCALE = 0.5


def example_group(example: Mapping[str, Any]) -> int:
    """The group of one dataset item as an ``int``: a ready-made ``group_fn`` for leakage checks.

    Example:
        >>> example_group(GroupedClassificationDataset(size=8, seed=0, examples_per_group=4)[5])
        1
    """
    return int(example["group"])


class GroupedClassificationDataset(Dataset[dict[str, Any]]):
    """Seeded synthetic classification examples: example ``i`` belongs to group
    ``i // examples_per_group``, and each group draws one class and one offset.

    Example:
        >>> dataset = GroupedClassificationDataset(size=10, seed=0, num_features=3)
        >>> len(dataset), dataset.num_groups
        (10, 2)
        >>> sorted(dataset[0])
        ['group', 'ids', 'inputs', 'labels']
        >>> dataset[0]["inputs"].shape
        torch.Size([3])
    """

    def __init__(
        self,
        size: int,
        seed: int,
        *,
        num_features: int = 16,
        num_classes: int = 4,
        examples_per_group: int = 8,
    ) -> None:
        owner = type(self).__name__
        validate.integer(owner, "size", size, minimum=1)
        validate.integer(owner, "seed", seed, minimum=0)
        validate.integer(owner, "num_features", num_features, minimum=1)
        validate.integer(owner, "num_classes", num_classes, minimum=2)
        validate.integer(owner, "examples_per_group", examples_per_group, minimum=1)
        self.examples_per_group = examples_per_group
        self.num_groups = -(-size // examples_per_group)
        generator = torch.Generator().manual_seed(seed)
        class_means = torch.randn(num_classes, num_features, generator=generator)
        group_labels = torch.randint(num_classes, (self.num_groups,), generator=generator)
        offsets = torch.randn(self.num_groups, num_features, generator=generator)
        noise = torch.randn(size, num_features, generator=generator)
        self.groups = torch.arange(size) // examples_per_group
        self.labels = group_labels[self.groups]
        self.inputs = class_means[self.labels] + _GROUP_OFFSET_SCALE * offsets[self.groups] + noise

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def __getitem__(self, index: int) -> dict[str, Any]:
        inputs = self.inputs[index].clone()  # a view would drag the whole matrix to a worker
        labels, group = int(self.labels[index]), int(self.groups[index])
        return {"ids": int(index), "inputs": inputs, "labels": labels, "group": group}


class ClassificationDataModule(SplitDataModule):
    """Train/validation/test loaders of the grouped classification task: ``split_by`` shuffles
    whole groups (no group in two splits) or examples into splits, ``val_size`` and ``test_size``
    of the units (at least one each). ``stateful=True`` serves torchdata ``StatefulDataLoader``
    instances (extra ``lightning-pilot[stateful]``); epoch ``e``'s training order depends only
    on ``(seed, e)``. Predict serves the test split.

    Example:
        >>> datamodule = ClassificationDataModule(dataset_size=64, seed=0, batch_size=8)
        >>> datamodule.setup("fit")
        >>> batch = next(iter(datamodule.train_dataloader()))
        >>> sorted(batch)
        ['group', 'ids', 'inputs', 'labels']
        >>> batch["inputs"].shape
        torch.Size([8, 16])
    """

    def __init__(
        self,
        dataset_size: int = 2048,
        seed: int = 0,
        batch_size: int = 32,
        num_features: int = 16,
        num_classes: int = 4,
        examples_per_group: int = 8,
        split_by: Literal["group", "example"] = "group",
        val_size: float = 0.1,
        test_size: float = 0.1,
        stateful: bool = False,
        shuffle: bool = True,
        num_workers: int = 0,
    ) -> None:
        super().__init__(
            dataset_size, seed, batch_size, val_size, test_size, stateful, shuffle, num_workers
        )
        owner = type(self).__name__
        self.num_features = validate.integer(owner, "num_features", num_features, minimum=1)
        self.num_classes = validate.integer(owner, "num_classes", num_classes, minimum=2)
        self.examples_per_group = validate.integer(
            owner, "examples_per_group", examples_per_group, minimum=1
        )
        self.split_by: Literal["group", "example"] = validate.choice(
            owner, "split_by", split_by, ("group", "example")
        )
        num_groups = -(-self.dataset_size // self.examples_per_group)
        units = num_groups if self.split_by == "group" else self.dataset_size
        self._split_counts = self._counts(units, self.split_by)
        self.save_hyperparameters()

    def _make_splits(self) -> dict[str, Subset[dict[str, Any]]]:
        dataset = GroupedClassificationDataset(
            self.dataset_size,
            self.seed,
            num_features=self.num_features,
            num_classes=self.num_classes,
            examples_per_group=self.examples_per_group,
        )
        generator = torch.Generator().manual_seed(self.seed)
        order = torch.randperm(sum(self._split_counts), generator=generator)  # groups or examples
        n_train, n_val, _ = self._split_counts
        split_of_unit = torch.empty_like(order)
        split_of_unit[order[:n_train]] = 0
        split_of_unit[order[n_train : n_train + n_val]] = 1
        split_of_unit[order[n_train + n_val :]] = 2
        unit_of_example = dataset.groups if self.split_by == "group" else torch.arange(len(dataset))
        split_of_example = split_of_unit[unit_of_example]
        return {
            name: Subset(dataset, torch.nonzero(split_of_example == code).flatten().tolist())
            for code, name in enumerate(("train", "val", "test"))
        }


class TinyClassifier(EvaluatedModule):
    """A one-hidden-layer MLP trained on :class:`ClassificationDataModule` batches, AdamW at a
    constant ``lr``; logs ``train_loss``, ``val_loss``/``val_acc`` and ``test_loss``/``test_acc``.
    Keep ``num_features`` and ``num_classes`` equal to the data module's.

    Example:
        >>> model = TinyClassifier(num_features=3, num_classes=2)
        >>> model(torch.zeros(5, 3)).shape
        torch.Size([5, 2])
    """

    def __init__(
        self,
        num_features: int = 16,
        num_classes: int = 4,
        hidden: int = 64,
        lr: float = 1e-2,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        validate.integer(owner, "num_features", num_features, minimum=1)
        validate.integer(owner, "num_classes", num_classes, minimum=2)
        validate.integer(owner, "hidden", hidden, minimum=1)
        self.lr = validate.number(owner, "lr", lr, minimum=0, allow_minimum=False)
        self.weight_decay = validate.number(owner, "weight_decay", weight_decay, minimum=0)
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(num_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, inputs: Tensor) -> Tensor:
        """Class logits ``FloatTensor[B, num_classes]`` of ``FloatTensor[B, num_features]``."""
        logits: Tensor = self.net(inputs)
        return logits

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        """Compute and log ``train_loss`` on one batch."""
        loss = cross_entropy(self.forward(batch["inputs"]), batch["labels"])
        self.log("train_loss", loss, prog_bar=True, batch_size=len(batch["labels"]))
        return loss

    def _evaluate(self, batch: Mapping[str, Tensor], prefix: str) -> Tensor:
        logits = self.forward(batch["inputs"])
        loss = cross_entropy(logits, batch["labels"])
        accuracy = multiclass_accuracy(
            logits.detach(), batch["labels"], num_classes=logits.shape[-1], average="micro"
        )
        size = len(batch["labels"])
        self.log(f"{prefix}_loss", loss, prog_bar=True, batch_size=size)
        self.log(f"{prefix}_acc", accuracy, prog_bar=True, batch_size=size)
        return loss

    def predict_step(
        self, batch: Mapping[str, Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, Tensor]:
        """``ids``, ``predictions`` (argmax class) and ``labels`` and ``group`` when present."""
        output = {"ids": batch["ids"], "predictions": self.forward(batch["inputs"]).argmax(dim=-1)}
        return output | {key: batch[key] for key in ("labels", "group") if key in batch}

    def configure_optimizers(self) -> OptimizerLRScheduler:
        """AdamW at a constant learning rate."""
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
