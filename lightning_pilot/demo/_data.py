"""Shared helpers of the demo tasks: argument checks, the shuffling sampler, the DataLoader factory.

The checks build one message format for every demo class, so a bad argument always reads like
``InstructionDataModule(batch_size=0) is invalid: batch_size must be a positive integer.``: it
names the class, the argument and the value, and says what would be accepted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, TypeVar

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Sampler, SequentialSampler, Subset

STATEFUL_INSTALL_HINT = "pip install 'lightning-pilot[stateful]'"
"""The command that installs the optional dependency behind ``stateful=True``."""

_T = TypeVar("_T")


def invalid_message(owner: str, name: str, value: object, requirement: str) -> str:
    """Return the message of a rejected constructor argument.

    Args:
        owner: The class (or function) that received the argument.
        name: The argument's name.
        value: The rejected value; echoed with ``repr``.
        requirement: What a valid value is, phrased to follow "``name`` must be".

    Returns:
        The full message, e.g. ``"Foo(size=0) is invalid: size must be a positive integer."``.
    """
    return f"{owner}({name}={value!r}) is invalid: {name} must be {requirement}."


def check_int(owner: str, name: str, value: object, *, minimum: int) -> int:
    """Check that ``value`` is an ``int`` (not a ``bool``) of at least ``minimum``.

    Args:
        owner: The class that received the argument, for the message.
        name: The argument's name, for the message.
        value: The value to check.
        minimum: The smallest accepted value.

    Returns:
        ``value``, typed as ``int``.

    Raises:
        TypeError: ``value`` is not an integer.
        ValueError: ``value`` is below ``minimum``.
    """
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
    """Check that ``value`` is a finite real number inside an interval.

    Args:
        owner: The class that received the argument, for the message.
        name: The argument's name, for the message.
        value: The value to check; ``int`` is accepted, ``bool`` is not.
        low: The lower end of the interval.
        high: The upper end of the interval (``math.inf`` for none).
        low_inclusive: Whether ``low`` itself is accepted.
        high_inclusive: Whether ``high`` itself is accepted.

    Returns:
        ``value`` as a ``float``.

    Raises:
        TypeError: ``value`` is not a real number.
        ValueError: ``value`` is not finite or is outside the interval.
    """
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
    """Check that ``value`` is a ``bool``.

    Args:
        owner: The class that received the argument, for the message.
        name: The argument's name, for the message.
        value: The value to check.

    Returns:
        ``value``, typed as ``bool``.

    Raises:
        TypeError: ``value`` is not ``True`` or ``False``.
    """
    # 0/1 or strings like "false" are rejected: "false" would be truthy.
    if not isinstance(value, bool):
        raise TypeError(invalid_message(owner, name, value, "True or False"))
    return value


def check_choice(owner: str, name: str, value: object, choices: Collection[_T]) -> _T:
    """Check that ``value`` is one of ``choices``.

    Args:
        owner: The class that received the argument, for the message.
        name: The argument's name, for the message.
        value: The value to check.
        choices: The accepted values.

    Returns:
        ``value``, typed like the choices.

    Raises:
        ValueError: ``value`` is not among ``choices``.
    """
    for choice in choices:
        if type(value) is type(choice) and value == choice:
            return choice
    listed = ", ".join(repr(choice) for choice in choices)
    raise ValueError(invalid_message(owner, name, value, f"one of {listed}"))


def check_split_fractions(owner: str, val_size: object, test_size: object) -> tuple[float, float]:
    """Check the validation and test fractions of a data module.

    Args:
        owner: The class that received the arguments, for the message.
        val_size: The fraction of the data held out for validation.
        test_size: The fraction of the data held out for testing.

    Returns:
        ``(val_size, test_size)`` as floats.

    Raises:
        TypeError: A fraction is not a real number.
        ValueError: A fraction is outside ``(0, 1)`` or both leave nothing to train on.
    """
    val = check_float(owner, "val_size", val_size, low=0.0, high=1.0, low_inclusive=False)
    test = check_float(owner, "test_size", test_size, low=0.0, high=1.0, low_inclusive=False)
    if val + test >= 1.0:
        raise ValueError(
            f"{owner}(val_size={val_size!r}, test_size={test_size!r}) is invalid: "
            "val_size + test_size must be below 1 so that some data is left to train on."
        )
    return val, test


def split_counts(total: int, val_size: float, test_size: float) -> tuple[int, int, int] | None:
    """Divide ``total`` units (examples or groups) into train, validation and test counts.

    Each held-out split gets at least one unit, so small pilot datasets still validate.

    Args:
        total: How many units there are.
        val_size: The fraction for validation, in ``(0, 1)``.
        test_size: The fraction for testing, in ``(0, 1)``.

    Returns:
        ``(train, val, test)`` counts that add up to ``total``, or ``None`` when ``total`` is too
        small to leave at least one unit for training.
    """
    val = max(1, round(val_size * total))
    test = max(1, round(test_size * total))
    train = total - val - test
    if train < 1:
        return None
    return train, val, test


def stateful_dataloader_class(owner: str) -> type[DataLoader[Any]]:
    """Return torchdata's ``StatefulDataLoader``, which can save and restore its position.

    Args:
        owner: The class that asked for it, for the message.

    Returns:
        The ``StatefulDataLoader`` class (a subclass of ``torch.utils.data.DataLoader``).

    Raises:
        ImportError: torchdata is not installed; the message gives the command that installs it.
    """
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as error:
        raise ImportError(
            f"{owner}(stateful=True) needs torchdata's StatefulDataLoader, which is not "
            f"installed. Install the optional extra with: {STATEFUL_INSTALL_HINT}"
        ) from error
    loader_class: type[DataLoader[Any]] = StatefulDataLoader
    return loader_class


class SeededShuffleSampler(Sampler[int]):
    """Shuffle with an order that depends only on ``(seed, epoch)``, and can resume mid-epoch.

    Epoch ``e`` visits ``torch.randperm(size)`` drawn from a generator seeded with ``seed + e``
    (the convention of PyTorch's ``DistributedSampler``). Lightning calls :meth:`set_epoch` at
    the start of every training epoch, so a run resumed from a checkpoint replays the same
    orders as the uninterrupted run, with a plain or a stateful DataLoader. Without Lightning,
    the epoch advances by itself after each complete pass.

    ``state_dict`` / ``load_state_dict`` make it ``Stateful`` for torchdata's
    ``StatefulDataLoader``: the state is the epoch and how many indices were drawn from it.

    Args:
        size: Number of examples.
        seed: Base seed of the orders.

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


def build_dataloader(
    dataset: Subset[Any],
    *,
    owner: str,
    batch_size: int,
    shuffle: bool,
    seed: int,
    num_workers: int,
    stateful: bool,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader[Any]:
    """Build the DataLoader of one split, plain or stateful.

    Shuffling uses a fresh :class:`SeededShuffleSampler` on every call, so two loaders built
    with the same arguments (plain or stateful alike) yield the same batches in the same order,
    without touching the global random state.

    Args:
        dataset: The split.
        owner: The class that builds the loader, for error messages.
        batch_size: Examples per batch; the last batch may be smaller.
        shuffle: Whether to visit the examples in a seeded random order (else in index order).
        seed: The seed of the shuffling order.
        num_workers: Worker processes; 0 loads in the main process.
        stateful: Whether to return a torchdata ``StatefulDataLoader``.
        collate_fn: How to merge examples into a batch; ``None`` uses PyTorch's default.

    Returns:
        The loader.
    """
    loader_class: type[DataLoader[Any]] = (
        stateful_dataloader_class(owner) if stateful else DataLoader
    )
    sampler: Sampler[int] = (
        SeededShuffleSampler(len(dataset), seed) if shuffle else SequentialSampler(dataset)
    )
    return loader_class(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_fn,
        # Not persistent: an idle persistent pool is only shut down when the garbage collector
        # reaches its iterator, which stalled about 5 s per worker in tests (torchdata 0.11).
        # Re-forking the workers at every epoch costs a fraction of a second instead.
        persistent_workers=False,
    )


class SplitDataModule(LightningDataModule):
    """What both demo DataModules share: three splits and their loaders.

    Subclasses fill ``self._splits`` in ``setup`` and set ``batch_size``, ``seed``,
    ``num_workers``, ``stateful`` and ``shuffle``; :meth:`_collate` gives their collate function.
    """

    batch_size: int
    seed: int
    num_workers: int
    stateful: bool
    shuffle: bool

    def __init__(self) -> None:
        super().__init__()
        self._splits: dict[str, Subset[dict[str, Any]]] = {}

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
        return build_dataloader(
            dataset,
            owner=type(self).__name__,
            batch_size=self.batch_size,
            shuffle=shuffle,
            seed=self.seed,
            num_workers=self.num_workers,
            stateful=self.stateful,
            collate_fn=self._collate(),
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
