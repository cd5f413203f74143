"""A pilot callback never breaks the user's fit.

Every hook a pilot callback overrides is guarded: an exception inside the pilot's own work
becomes a ``not_checked`` check on the phase-table row ``pilot`` and a warning, and the fit goes
on. Probes that run the user's code (predict_step, export, predictions) turn its exceptions
into verdicts with the reason and the remedy. The user's own training errors still propagate.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pandas as pd
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_pilot import (
    BatchInspector,
    DivergenceLedger,
    EffectiveBatchAccountant,
    Ledger,
    OverfitTinySubset,
    PhaseMemoryMonitor,
    ResumeVerifier,
    ValidationPredictionWriter,
    read_phase_table,
)
from lightning_pilot.run import GUARDED_HOOKS, PilotCallback

pytestmark = pytest.mark.timeout(300)


def _broken(base: type[PilotCallback], hook: str) -> type[PilotCallback]:
    """A subclass of ``base`` whose ``hook`` raises (a bug in the pilot's own work)."""

    def raising(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"planted in {hook}")

    return type(f"Broken{base.__name__}", (base,), {hook: raising})


_CASES = [
    (PhaseMemoryMonitor, "on_train_batch_end", {}),
    (PhaseMemoryMonitor, "on_validation_end", {}),
    (BatchInspector, "on_train_start", {}),
    (BatchInspector, "on_train_batch_start", {}),
    (EffectiveBatchAccountant, "on_train_batch_end", {}),
    (EffectiveBatchAccountant, "on_fit_end", {}),
    (ResumeVerifier, "on_train_batch_end", {"check_artifact": False}),
    (ResumeVerifier, "on_fit_end", {}),
    (DivergenceLedger, "on_train_batch_end", {"experiment": "e", "variant": "v"}),
    (DivergenceLedger, "on_validation_end", {"experiment": "e", "variant": "v"}),
    (OverfitTinySubset, "on_train_batch_end", {"max_steps": 4}),
    (PhaseMemoryMonitor, "teardown", {}),
]


@pytest.mark.parametrize(("base", "hook", "options"), _CASES)
def test_a_hook_that_raises_leaves_the_fit_and_a_readable_row(
    make_trainer: Any, tmp_path: Path, base: type[PilotCallback], hook: str, options: Any
) -> None:
    assert hook in GUARDED_HOOKS
    callback = _broken(base, hook)(out_dir=tmp_path / "pilot", **options)
    trainer = make_trainer(
        max_steps=3, callbacks=[callback], val_check_interval=2, limit_val_batches=1
    )
    with pytest.warns(RuntimeWarning, match=rf"Broken{base.__name__}\.{hook} raised RuntimeError"):
        trainer.fit(BoringModel())
    assert trainer.global_step == 3  # the fit ran to its end
    table = read_phase_table(tmp_path / "pilot")
    row = table[table["phase"] == "pilot"].iloc[0]
    assert row["verdict"] == "not_checked"
    (check,) = [c for c in row["checks"] if c["name"] == f"Broken{base.__name__}.{hook}"]
    assert "planted in" in check["detail"]
    assert "the fit went on" in check["detail"]
    if base is DivergenceLedger:  # the ledger still closes the run with its end record
        assert Ledger(tmp_path / "pilot").runs()["status"].tolist() == ["completed"]


def test_the_users_own_training_error_still_propagates(make_trainer: Any, tmp_path: Path) -> None:
    class Failing(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if batch_idx == 1:
                raise ValueError("the user's own bug")
            return super().training_step(batch, batch_idx)

    callbacks = [PhaseMemoryMonitor(), BatchInspector(), EffectiveBatchAccountant()]
    trainer = make_trainer(callbacks=callbacks, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="the user's own bug"):
        trainer.fit(Failing())
    table = read_phase_table(tmp_path / "pilot")
    assert "pilot" not in set(table["phase"])  # nothing of ours failed


# ---------------------------------------------------------------------------------------------
# Probes that run the user's code
# ---------------------------------------------------------------------------------------------


class PairClassifier(pl.LightningModule):
    """A torchvision-style classifier: ``(x, y)`` batches, ``forward(x)``, no predict_step."""

    def __init__(self, width: int = 8, broken_predict: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(width, 16), nn.Dropout(0.1), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def train_dataloader(self) -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(48, self.hparams["width"], generator=generator)
        y = torch.randint(0, 3, (48,), generator=generator)
        return StatefulDataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return self.train_dataloader()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class BrokenPredict(PairClassifier):
    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        raise KeyError("pixel_values")


def _resume_row(folder: Path) -> tuple[pd.Series, dict[str, Any]]:
    table = read_phase_table(folder)
    row = table[table["phase"] == "resume"].iloc[0]
    return row, {c["name"]: c for c in row["checks"]}


def test_artifact_check_runs_a_forward_that_takes_unpacked_inputs(
    make_trainer: Any, tmp_path: Path
) -> None:
    """Lightning's default predict_step is self(batch): forward(x) refuses (x, y)."""
    verifier = ResumeVerifier(at_step=2, compare_steps=1, epoch_boundary=False)
    trainer = make_trainer(max_steps=4, callbacks=[verifier], default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no pilot error along the way
        trainer.fit(PairClassifier())
    row, checks = _resume_row(tmp_path / "pilot")
    artifact = checks["artifact_roundtrip"]
    assert artifact["verdict"] == "pass", artifact
    assert "forward(batch[0])" in artifact["detail"]
    # (x, y) batches carry no ids: the data position is compared by content, and proven.
    assert checks["data_position"]["verdict"] == "pass"
    assert "no id field" in checks["data_position"]["detail"]
    assert row["verdict"] == "pass", row["reason"]


def test_a_predict_step_that_raises_is_a_verdict_not_a_crash(
    make_trainer: Any, tmp_path: Path
) -> None:
    verifier = ResumeVerifier(at_step=2, compare_steps=1, epoch_boundary=False)
    trainer = make_trainer(max_steps=4, callbacks=[verifier], default_root_dir=tmp_path)
    trainer.fit(BrokenPredict())
    row, checks = _resume_row(tmp_path / "pilot")
    artifact = checks["artifact_roundtrip"]
    assert artifact["verdict"] == "not_checked"
    assert "predict_step raised KeyError" in artifact["detail"]
    assert "define predict_step" in artifact["detail"]  # the remedy
    assert checks["loss_trajectory"]["verdict"] == "pass"  # the resume itself was compared
    assert row["verdict"] == "pass"  # the artifact is not essential to the resume claim
    assert "not proven: artifact_roundtrip" in row["reason"]


def test_an_export_that_raises_fails_the_artifact_check_and_the_fit_ends(
    make_trainer: Any, tmp_path: Path
) -> None:
    def export(module: pl.LightningModule, folder: Path) -> Path:
        raise RuntimeError("disk layout unknown")

    verifier = ResumeVerifier(at_step=2, compare_steps=1, epoch_boundary=False, export=export)
    trainer = make_trainer(max_steps=4, callbacks=[verifier], default_root_dir=tmp_path)
    trainer.fit(PairClassifier())
    row, checks = _resume_row(tmp_path / "pilot")
    assert checks["artifact_roundtrip"]["verdict"] == "fail"
    assert (
        "export(pl_module, directory) raised RuntimeError: disk layout unknown"
        in (checks["artifact_roundtrip"]["detail"])
    )
    assert row["verdict"] == "fail"


def test_a_predictions_fn_that_raises_is_a_verdict(make_trainer: Any, tmp_path: Path) -> None:
    def predictions(module: Any, batch: Any, outputs: Any) -> Any:
        raise IndexError("no logits here")

    ledger = DivergenceLedger(experiment="e", variant="v")
    writer = ValidationPredictionWriter(predictions_fn=predictions)
    trainer = make_trainer(max_steps=4, callbacks=[ledger, writer], default_root_dir=tmp_path)
    with pytest.warns(RuntimeWarning, match="predictions not kept"):
        trainer.fit(PairClassifier())
    table = read_phase_table(tmp_path / "pilot")
    row = table[(table["phase"] == "validation") & table["first"]].iloc[0]
    (check,) = [c for c in row["checks"] if c["name"] == "predictions"]
    assert check["verdict"] == "not_checked"
    assert "IndexError: no logits here" in check["detail"]
    assert Ledger(tmp_path / "pilot").runs()["status"].tolist() == ["completed"]


@pytest.mark.parametrize("failure", ["permission", "missing"])
def test_an_export_that_fails_with_an_os_error_is_a_verdict_too(
    make_trainer: Any, tmp_path: Path, failure: str
) -> None:
    """An OSError from the user's export is the user's code failing, not the pilot's disk."""

    def export(module: pl.LightningModule, folder: Path) -> Path:
        if failure == "permission":
            raise PermissionError("read-only volume")
        return folder / "never-written.pt"

    verifier = ResumeVerifier(at_step=2, compare_steps=1, epoch_boundary=False, export=export)
    trainer = make_trainer(max_steps=4, callbacks=[verifier], default_root_dir=tmp_path)
    trainer.fit(PairClassifier())
    _, checks = _resume_row(tmp_path / "pilot")
    artifact = checks["artifact_roundtrip"]
    assert artifact["verdict"] == "fail"
    expected = (
        "raised PermissionError: read-only volume"
        if failure == "permission"
        else "names no file or folder"
    )
    assert expected in artifact["detail"]
    assert checks["loss_trajectory"]["verdict"] == "pass"  # the probe was still compared


def test_a_callback_alone_leaves_no_reserved_space_behind(
    make_trainer: Any, tmp_path: Path
) -> None:
    trainer = make_trainer(callbacks=[BatchInspector()], default_root_dir=tmp_path)
    trainer.fit(BoringModel())
    assert read_phase_table(tmp_path / "pilot") is not None
    assert list((tmp_path / "pilot").glob(".reserve-*")) == []
