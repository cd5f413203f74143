"""Shared helpers of the demo tasks: argument checks and the DataLoader factory.

The checks build one message format for every demo class, so a bad argument always reads like
``InstructionDataModule(batch_size=0) is invalid: batch_size must be a positive integer.``: it
names the class, the argument and the value, and says what would be accepted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset

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


def build_dataloader(
    dataset: Dataset[Any],
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

    Shuffling draws from a ``torch.Generator`` seeded with ``seed`` and created anew on every
    call, so two loaders built with the same arguments yield the same batches in the same order
    (and a fresh ``Trainer.fit`` sees the same order as the previous one), without touching the
    global random state.

    Args:
        dataset: The map-style dataset of the split.
        owner: The class that builds the loader, for error messages.
        batch_size: Examples per batch; the last batch may be smaller.
        shuffle: Whether to visit the examples in a seeded random order.
        seed: The seed of the shuffling generator.
        num_workers: Worker processes; 0 loads in the main process.
        stateful: Whether to return a torchdata ``StatefulDataLoader``.
        collate_fn: How to merge examples into a batch; ``None`` uses PyTorch's default.

    Returns:
        The loader.
    """
    loader_class: type[DataLoader[Any]] = (
        stateful_dataloader_class(owner) if stateful else DataLoader
    )
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return loader_class(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        generator=generator,
        num_workers=num_workers,
        collate_fn=collate_fn,
        # Keeping workers alive avoids re-forking them at every epoch and validation run.
        persistent_workers=num_workers > 0,
    )
