"""Shared helpers of the demo tasks: argument checks, the shuffling sampler, the split DataModule.

Every check raises with one message format that names the class, the argument and the value:
``InstructionDataModule(batch_size=0) is invalid: batch_size must be a positive integer.``
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, TypeVar

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Sampler, SequentialSampler, Subset

_T = TypeVar("_T")


def invalid_message(owner: str, name: str, value: object, requirement: str) -> str:
    """The message of a rejected argument; ``requirement`` follows "``name`` must be"."""
    return f"{owner}({name}={value!r}) is invalid: {name} must be {requirement}."


def check_int(owner: str, name: str, value: object, *, minimum: int) -> int:
    """``value`` if it is an ``int`` (never a ``bool``) of at least ``minimum``; else
    ``TypeError`` for the type, ``ValueError`` for the value."""
    if minimum == 1:
        requirement = "a positive integer"
    elif minimum == 0:
        requirement = "a non-negative integer"
    else:
        requirement = f"an integer >= {minimum}"
    # bool is a subclass of int; ``batch_size=True`` is a bug, not a batch size of 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(invalid_message(owner, name, value, requirement))
    if value < minimum:
        raise ValueError(invalid_message(owner, name, value, requirement))
    return value


def check_float(
    owner: str,
    name: str,
    value: object,
    *,
    low: float,
    high: float = math.inf,
    low_inclusive: bool = True,
    high_inclusive: bool = False,
) -> float:
    """``value`` as a ``float`` if it is a finite real number (not a ``bool``) in the interval
    from ``low`` to ``high``; else ``TypeError`` for the type, ``ValueError`` for the value."""
    if high == math.inf:
        requirement = f"a finite number {'>=' if low_inclusive else '>'} {low:g}"
    else:
        left = "[" if low_inclusive else "("
        right = "]" if high_inclusive else ")"
        requirement = f"a number in {left}{low:g}, {high:g}{right}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(invalid_message(owner, name, value, requirement))
    number = float(value)
    above_low = number >= low if low_inclusive else number > low
    below_high = number <= high if high_inclusive else number < high
    if not (math.isfinite(number) and above_low and below_high):
        raise ValueError(invalid_message(owner, name, value, requirement))
    return number


def check_bool(owner: str, name: str, value: object) -> bool:
    """``value`` if it is a ``bool``, else ``TypeError`` (``"false"`` would be truthy)."""
    if not isinstance(value, bool):
        raise TypeError(invalid_message(owner, name, value, "True or False"))
    return value


def check_choice(owner: str, name: str, value: object, choices: Collection[_T]) -> _T:
    """The one of ``choices`` that ``value`` is (same type and value), else ``ValueError``."""
    for choice in choices:
        if type(value) is type(choice) and value == choice:
            return choice
    listed = ", ".join(repr(choice) for choice in choices)
    raise ValueError(invalid_message(owner, name, value, f"one of {listed}"))


def check_split_fractions(owner: str, val_size: object, test_size: object) -> tuple[float, float]:
    """``(val_size, test_size)`` as floats, each in ``(0, 1)`` and leaving data to train on."""
    val = check_float(owner, "val_size", val_size, low=0.0, high=1.0, low_inclusive=False)
    test = check_float(owner, "test_size", test_size, low=0.0, high=1.0, low_inclusive=False)
    if val + test >= 1.0:
        raise ValueError(
            f"{owner}(val_size={val_size!r}, test_size={test_size!r}) is invalid: "
            "val_size + test_size must be below 1 so that some data is left to train on."
        )
    return val, test


def split_counts(
    owner: str, dataset_size: object, units: int, fractions: tuple[float, float], requirement: str
) -> tuple[int, int, int]:
    """Divide ``units`` (examples or groups) into train, validation and test counts, each
    held-out split at least one unit (so small pilot datasets still validate); ``ValueError``
    naming ``dataset_size`` when no unit is left for training."""
    val = max(1, round(fractions[0] * units))
    test = max(1, round(fractions[1] * units))
    if units - val - test < 1:
        raise ValueError(invalid_message(owner, "dataset_size", dataset_size, requirement))
    return units - val - test, val, test


def stateful_dataloader_class(owner: str) -> type[DataLoader[Any]]:
    """torchdata's ``StatefulDataLoader``, which saves and restores its position in an epoch;
    ``ImportError`` saying how to install it when torchdata is missing."""
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
    """Shuffle with an order that depends only on ``(seed, epoch)``, and can resume mid-epoch.

    Epoch ``e`` visits ``torch.randperm(size)`` drawn from a generator seeded with ``seed + e``
    (the convention of PyTorch's ``DistributedSampler``). Lightning calls :meth:`set_epoch` at
    the start of every training epoch, so a run resumed from a checkpoint replays the same
    orders as the uninterrupted run, with a plain or a stateful DataLoader. Without Lightning,
    the epoch advances by itself after each complete pass. ``state_dict`` / ``load_state_dict``
    (the epoch and how many of its indices were drawn) make it ``Stateful`` for torchdata.

    Example:
        >>> sampler = SeededShuffleSampler(size=5, seed=0)
        >>> first = list(sampler)
        >>> sorted(first)
        [0, 1, 2, 3, 4]
        >>> sampler.epoch  # advanced by the complete pass
        1
        >>> sampler.set_epoch(0)
        >>> list(sampler) == first
        True
    """

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.seed = seed
        self.epoch = 0
        self._yielded = 0
        self._resume_at = 0

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
        # The counters are reset here, not inside the generator below: a generator body only
        # starts at the first next(), and state_dict() must be right before that too.
        self._yielded = start
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
    """What both demo DataModules share: three splits and their loaders.

    Subclasses set ``batch_size``, ``seed``, ``num_workers``, ``stateful`` and ``shuffle``,
    return the splits from :meth:`_make_splits` and their collate function from :meth:`_collate`.
    """

    batch_size: int
    seed: int
    num_workers: int
    stateful: bool
    shuffle: bool

    def __init__(self) -> None:
        super().__init__()
        self._splits: dict[str, Subset[dict[str, Any]]] = {}

    def setup(self, stage: str | None = None) -> None:
        """Generate the examples and split them, for every stage (once; later calls reuse them)."""
        if not self._splits:
            self._splits = self._make_splits()

    def _make_splits(self) -> dict[str, Subset[dict[str, Any]]]:
        raise NotImplementedError

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
        """A fresh loader: a fresh seeded sampler each time, so two loaders built alike (plain
        or stateful) yield the same batches without touching the global random state."""
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
            # Not persistent: an idle persistent pool is only shut down when the garbage
            # collector reaches its iterator, which stalled about 5 s per worker in tests
            # (torchdata 0.11). Re-forking the workers at every epoch costs far less.
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
