"""Callables and a factory that the LightningCLI tests name by import path in their YAML files.

This folder is on ``sys.path`` while the tests run (pytest's default import mode), and the resume
check's new process inherits ``sys.path``, so ``lightning_cli_hooks:build`` imports there too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_pilot.demo import InstructionDataModule, TinyCausalLM

#: The demo LM and its data as the test's YAML configures them: a fit of a few seconds on a CPU.
MODEL: dict[str, Any] = {"d_model": 32, "n_heads": 2, "n_layers": 1, "max_length": 24}
DATA: dict[str, Any] = {
    "dataset_size": 96,
    "seed": 3,
    "batch_size": 4,
    "max_length": 24,
    "stateful": True,  # a mid-epoch checkpoint resumes at the same batch
}

#: When this variable names a file, :func:`build` appends the id of the calling process to it.
FACTORY_LOG = "LIGHTNING_PILOT_TEST_FACTORY_LOG"


def build() -> tuple[TinyCausalLM, InstructionDataModule]:
    """A ``ResumeVerifier(factory=...)``: the model and data of the YAML, built afresh."""
    log = os.environ.get(FACTORY_LOG)
    if log:
        with open(log, "a", encoding="utf-8") as file:
            file.write(f"{os.getpid()}\n")
    return TinyCausalLM(**MODEL), InstructionDataModule(**DATA)


def export_weights(pl_module: pl.LightningModule, directory: Path) -> Path:
    """An ``export=``: the module's weights in ``directory/weights.pt``."""
    path = Path(directory) / "weights.pt"
    torch.save(pl_module.state_dict(), path)
    return path


def example_group(item: Mapping[str, Any]) -> int:
    """A ``group_fn=``: the example id modulo 4, so every group spans the three splits.

    Its return annotation matters: ``group_fn`` is hinted ``Callable[[Any], Hashable]``, and
    jsonargparse accepts an import path there only for a function declared to return a
    ``Hashable`` type (or ``Any``).
    """
    return int(item["ids"]) % 4


def greedy_tokens(pl_module: pl.LightningModule, batch: Any, outputs: Any) -> torch.Tensor:
    """A ``predictions_fn=``: the token the model predicts after every position."""
    logits: torch.Tensor = pl_module(batch["input_ids"], batch["attention_mask"])
    return logits.argmax(-1)


def aligned_logits(pl_module: pl.LightningModule, batch: Any) -> torch.Tensor:
    """A ``predict_fn=`` for ``shift_labels=False``: position ``t`` holds the logits that
    predict token ``t`` (those computed at ``t - 1``; position 0 repeats position 0's)."""
    logits: torch.Tensor = pl_module(batch["input_ids"], batch["attention_mask"])
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


def labels_of(batch: Mapping[str, Any]) -> Any:
    """A ``BatchAdapter(targets=...)`` given as a function (``lightning_cli_hooks:labels_of``)."""
    return batch["labels"]


class BatchField:
    """A ``BatchAdapter`` field as a callable object: ``batch -> batch[key]``.

    A callable class is one way a callable field reaches ``BatchAdapter`` from YAML
    (``{class_path: lightning_cli_hooks.BatchField, init_args: {key: ...}}``); a function by
    import path with a colon (``lightning_cli_hooks:labels_of``) is the other.
    """

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, batch: Mapping[str, Any]) -> Any:
        return batch[self.key]

    def __repr__(self) -> str:
        return f"BatchField({self.key!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchField) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)
