"""Factories for `lightning-pilot estimate` in the tests (named by import path)."""

from __future__ import annotations

from typing import Any

from lightning_pilot.demo import InstructionDataModule, TinyCausalLM


def build() -> tuple[Any, Any]:
    """The demo LM and one real batch of its data."""
    data = InstructionDataModule(dataset_size=32, batch_size=4, max_length=32)
    data.setup("fit")
    module = TinyCausalLM(d_model=16, n_heads=2, n_layers=1, max_length=32)
    return module, next(iter(data.train_dataloader()))


def not_a_pair() -> Any:
    return TinyCausalLM(d_model=16, n_heads=2, n_layers=1)
