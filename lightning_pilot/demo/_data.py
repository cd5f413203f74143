"""Shared helpers of the demo tasks: the shuffling sampler, the split DataModule and the
validation and test steps of the models."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import Tensor
from torch.utils.data import DataLoader, Sampler, SequentialSampler, Subset

from lightning_pilot.core import validate


def stateful_dataloader_class(owner: str) -> type[DataLoader[Any]]:
    """torchdata's ``StatefulDataLoader``; ``ImportError`` saying how to install it."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as error:
        raise ImportError(
            f"{owner}(stateful=True) needs torchdata's StatefulDataLoader, which is not "
            "installed. Install the optional extra with: pip install 'lightning-pilot[stateful]'"
        ) from error
    loader_class: type[DataLoader[Any]] = StatefulDataLoader
    return loader_class


class SeededShuffleSampler(Sampler[int]):
    """Shuffle in an order that depends only on ``(seed, epoch)`` (``torch.randperm`` seeded
    with ``seed + epoch``, as ``DistributedSampler``), resumable mid-epoch through
    ``state_dict``; without :meth:`set_epoch`, the epoch advances after each complete pass."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed, self.epoch = size, seed, 0
        self._yielded = self._resume_at = 0

    def __len__(self) -> int:
        return self.size

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next pass visits."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(
            self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)
        ).tolist()
        start, self._resume_at = self._resume_at, 0
        self._yielded = start  # here, not in the generator: state_dict() is right before next()
        return self._visit(order[start:])

    def _visit(self, indices: list[int]) -> Iterator[int]:
        for index in indices:
            self._yielded += 1
            yield index
        self.epoch += 1
        self._yielded = 0

    def state_dict(self) -> dict[str, int]:
        """The epoch and the number of its indices already drawn."""
        return {"epoch": self.epoch, "yielded": self._yielded}

    def load_state_dict(self, state_dict: Mapping[str, int]) -> None:
        """Continue from a :meth:`state_dict`: the next pass skips the indices already drawn."""
        self.epoch = int(state_dict["epoch"])
        self._resume_at = int(state_dict["yielded"])


class SplitDataModule(LightningDataModule):
    """What both demo DataModules share: their common arguments, three splits and loaders."""

    def __init__(
        self,
        dataset_size: int,
        seed: int,
        batch_size: int,
        val_size: float,
        test_size: float,
        stateful: bool,
        shuffle: bool,
        num_workers: int,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self.dataset_size = validate.integer(owner, "dataset_size", dataset_size, minimum=3)
        self.seed = validate.integer(owner, "seed", seed, minimum=0)
        self.batch_size = validate.integer(owner, "batch_size", batch_size, minimum=1)
        self.val_size = validate.number(
            owner, "val_size", val_size, minimum=0, allow_minimum=False, maximum=1
        )
        self.test_size = validate.number(
            owner, "test_size", test_size, minimum=0, allow_minimum=False, maximum=1
        )
        if self.val_size + self.test_size >= 1.0:
            raise ValueError(
                f"{owner}(val_size={val_size!r}, test_size={test_size!r}) is invalid: "
                "val_size + test_size must be below 1 so that some data is left to train on."
            )
        self.stateful = validate.boolean(owner, "stateful", stateful)
        self.shuffle = validate.boolean(owner, "shuffle", shuffle)
        self.num_workers = validate.integer(owner, "num_workers", num_workers, minimum=0)
        if self.stateful:
            stateful_dataloader_class(owner)  # fails now, not when the first loader is built
        self._splits: dict[str, Subset[dict[str, Any]]] = {}

    def setup(self, stage: str | None = None) -> None:
        """Generate the examples and split them (once, for every stage)."""
        if not self._splits:
            self._splits = self._make_splits()

    def _make_splits(self) -> dict[str, Subset[dict[str, Any]]]:
        raise NotImplementedError

    def _counts(self, units: int, unit: str) -> tuple[int, int, int]:
        """``units`` (examples or groups) as train, validation and test counts, each held-out
        split at least one unit; ``ValueError`` when no unit is left for training."""
        val, test = max(1, round(self.val_size * units)), max(1, round(self.test_size * units))
        if units - val - test >= 1:
            return units - val - test, val, test
        requirement = (
            f"a size large enough for {units} {unit}(s) to leave training data after val_size="
            f"{self.val_size!r} and test_size={self.test_size!r} take at least one {unit} each"
        )
        owner, size = type(self).__name__, self.dataset_size
        raise ValueError(validate.invalid(owner, "dataset_size", size, requirement))

    def _split(self, name: str) -> Subset[dict[str, Any]]:
        if not self._splits:
            raise RuntimeError(
                f"{type(self).__name__}.{name}_dataset is not available before setup(); "
                "call datamodule.setup() first (Trainer does it for you)."
            )
        return self._splits[name]

    @property
    def train_dataset(self) -> Subset[dict[str, Any]]:
        """The training examples (after :meth:`setup`)."""
        return self._split("train")

    @property
    def val_dataset(self) -> Subset[dict[str, Any]]:
        """The validation examples (after :meth:`setup`)."""
        return self._split("val")

    @property
    def test_dataset(self) -> Subset[dict[str, Any]]:
        """The test examples (after :meth:`setup`)."""
        return self._split("test")

    def _collate(self) -> Callable[[list[Any]], Any] | None:
        return None  # PyTorch's default collate

    def _loader(self, dataset: Subset[dict[str, Any]], *, shuffle: bool) -> DataLoader[Any]:
        """A fresh loader with a fresh seeded sampler: loaders built alike yield the same batches
        without touching the global random state."""
        loader_class: type[DataLoader[Any]] = DataLoader
        if self.stateful:
            loader_class = stateful_dataloader_class(type(self).__name__)
        sampler: Sampler[int] = (
            SeededShuffleSampler(len(dataset), self.seed) if shuffle else SequentialSampler(dataset)
        )
        return loader_class(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=self._collate(),
            # An idle persistent pool stalled about 5 s per worker at garbage collection
            # (torchdata 0.11); re-forking the workers at every epoch costs far less.
            persistent_workers=False,
        )

    def train_dataloader(self) -> DataLoader[Any]:
        """Loader of the training split, shuffled (seeded) unless ``shuffle=False``."""
        return self._loader(self.train_dataset, shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader[Any]:
        """Loader of the validation split, in id order."""
        return self._loader(self.val_dataset, shuffle=False)

    def test_dataloader(self) -> DataLoader[Any]:
        """Loader of the test split, in id order."""
        return self._loader(self.test_dataset, shuffle=False)

    def predict_dataloader(self) -> DataLoader[Any]:
        """Loader of the test split, in id order (batches keep their labels)."""
        return self._loader(self.test_dataset, shuffle=False)


class EvaluatedModule(LightningModule):
    """A demo model whose validation and test steps both log through ``_evaluate``."""

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        """Compute and log ``val_loss`` and ``val_acc`` on one batch."""
        return self._evaluate(batch, "val")

    def test_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        """Compute and log ``test_loss`` and ``test_acc`` on one batch."""
        return self._evaluate(batch, "test")

    def _evaluate(self, batch: Mapping[str, Tensor], prefix: str) -> Tensor:
        raise NotImplementedError
