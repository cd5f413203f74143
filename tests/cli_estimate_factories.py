"""Factories for `lightning-pilot estimate` in tests/test_cli_estimate.py (named by import
path): one with no sequence dimension, and ones whose own code raises."""

from __future__ import annotations

from typing import Any

from lightning_pilot.demo import ClassificationDataModule, TinyClassifier


def classifier() -> tuple[Any, Any]:
    """A classifier and one real batch of its data: features, no sequence dimension."""
    data = ClassificationDataModule(dataset_size=64, batch_size=8, seed=0)
    data.setup("fit")
    return TinyClassifier(hidden=8), next(iter(data.train_dataloader()))


class TokenizerMissingError(RuntimeError):
    """The user's own exception type."""


def _load_tokenizer(path: str) -> Any:
    raise TokenizerMissingError(f"no tokenizer at {path}")


def raises() -> tuple[Any, Any]:
    """A factory whose own code raises, two frames down."""
    return _load_tokenizer("data/tokenizer.json"), None


def data_too_small() -> tuple[Any, Any]:
    """A factory that calls lightning-pilot's demo data wrongly: the error is still theirs."""
    data = ClassificationDataModule(dataset_size=4, batch_size=8)
    data.setup("fit")
    return TinyClassifier(hidden=8), None
