"""ResumeVerifier on loaders passed straight to ``trainer.fit(model, train_loader, val_loader)``:
rebuilt in the new process from a private pickle, else compared in this process, said so; the
data position catches a plain loader's replay. Real fits, real new processes; each fit is shared
by the tests that read it (module-scoped fixtures)."""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pandas as pd
import pytest
import torch
from tiny_models import IdExamples
from torch import nn
from torch.utils.data import DataLoader, default_collate
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_pilot import read_phase_table
from lightning_pilot.resume import ResumeVerifier
from lightning_pilot.resume.parent import pickle_loaders

pytestmark = pytest.mark.timeout(300)


class LoaderNet(pl.LightningModule):
    """A classifier with no data of its own: the loaders come through ``fit``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self(batch["inputs"]), batch["labels"])

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.log("val_loss", nn.functional.cross_entropy(self(batch["inputs"]), batch["labels"]))

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self(batch["inputs"])

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        schedule = {"scheduler": scheduler, "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": schedule}


class _Fit:
    """One fit's resume checks and run folder."""

    def __init__(self, verifier: ResumeVerifier) -> None:
        frame = read_phase_table(verifier.run.run_dir)
        row = frame[frame["phase"] == "resume"].iloc[0]
        self.row = row
        self.checks = {c["name"]: (c["verdict"], c["detail"]) for c in row["checks"]}
        self.folder = verifier.run.run_dir / "resume"
        self.frame: pd.DataFrame = frame


def _fit(
    root: Path, train: Any, val: Any = None, *, artifact: bool = False, **verifier: Any
) -> _Fit:
    pl.seed_everything(0, verbose=False)
    pilot = ResumeVerifier(
        **({"at_step": 3, "compare_steps": 2} | verifier),
        epoch_boundary=False,
        check_artifact=artifact,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[pilot],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(LoaderNet(), train, val)
    return _Fit(pilot)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> _Fit:
    """A plain shuffled DataLoader passed to fit: one new process."""
    loader = DataLoader(IdExamples(64), batch_size=4, shuffle=True)
    return _fit(tmp_path_factory.mktemp("plain"), loader)


@pytest.fixture(scope="module")
def stateful(tmp_path_factory: pytest.TempPathFactory) -> _Fit:
    """A StatefulDataLoader and a validation loader passed to fit, the artifact checked on the
    validation loader's first batch: one new process for both tasks."""
    train = StatefulDataLoader(IdExamples(64), batch_size=4, shuffle=True)
    val = DataLoader(IdExamples(16), batch_size=4)
    return _fit(tmp_path_factory.mktemp("stateful"), train, val, artifact=True)


@pytest.fixture(scope="module")
def unpicklable(tmp_path_factory: pytest.TempPathFactory) -> _Fit:
    """A plain shuffled DataLoader whose collate_fn is a lambda: no new process at all."""
    loader = DataLoader(
        IdExamples(64), batch_size=4, shuffle=True, collate_fn=lambda b: default_collate(b)
    )
    return _fit(tmp_path_factory.mktemp("lambda"), loader)


def test_a_plain_shuffled_loader_passed_to_fit_replays_data(plain: _Fit) -> None:
    verdict, detail = plain.checks["data_position"]
    assert verdict == "fail"
    assert "the DataLoader cannot resume mid-epoch" in detail
    assert "StatefulDataLoader" in detail
    assert plain.row["verdict"] == "fail"
    # Only the data went wrong: step, LR schedule and optimizer state were restored.
    for name in ("global_step", "lrs", "optimizer_state", "weights", "rng", "data_rebuilt"):
        assert plain.checks[name][0] == "pass", (name, plain.checks[name])


def test_loaders_passed_to_fit_are_rebuilt_in_the_new_process(plain: _Fit) -> None:
    assert plain.checks["weights_only_load"] == ("pass", "loaded in a new process")
    verdict, detail = plain.checks["rebuild"]
    assert verdict == "pass"
    assert detail.startswith("loaders passed to fit: rebuilt in the new process from a private")
    assert "bytes, on its stdin)" in detail
    # Nothing of the loader was written beside the request: it went through the pipe.
    assert sorted(p.name for p in plain.folder.iterdir() if p.is_file()) == [
        "mid_epoch-step-3.ckpt",
        "result-tasks.json",
        "spec-tasks.json",
    ]


def test_a_stateful_loader_passed_to_fit_resumes_exactly(stateful: _Fit) -> None:
    for name in (
        "weights_only_load", "rebuild", "global_step", "epoch", "lrs", "optimizer_state",
        "scheduler_state", "weights", "rng", "data_rebuilt", "data_position",
        "loss_trajectory", "lr_trajectory", "updates_after_resume",
    ):  # fmt: skip
        assert stateful.checks[name][0] == "pass", (name, stateful.checks[name])
    assert stateful.checks["rebuild"][1].startswith("loaders passed to fit: rebuilt in the new")
    assert stateful.row["verdict"] == "pass"


def test_validation_loaders_passed_to_fit_give_the_control_batches(stateful: _Fit) -> None:
    verdict, detail = stateful.checks["artifact_roundtrip"]
    assert verdict == "pass", detail
    assert "reproduces the live outputs (predict_step) on 1 control batch(es)" in detail
    control = torch.load(stateful.folder / "control.pt", weights_only=True)
    assert control[0]["ids"].tolist() == [0, 1, 2, 3]  # the validation loader's first batch


def test_an_unpicklable_loader_is_compared_in_process_and_still_caught(unpicklable: _Fit) -> None:
    verdict, detail = unpicklable.checks["rebuild"]
    assert verdict == "pass"
    assert detail.startswith("loaders passed to fit: compared in-process: the loader is not")
    assert "(AttributeError: Can't pickle local object 'unpicklable.<locals>.<lambda>')" in detail
    assert unpicklable.checks["weights_only_load"] == (
        "pass",
        "loaded in this process (in-process comparison)",
    )
    assert not list(unpicklable.folder.glob("spec-*.json"))  # no new process started
    verdict, detail = unpicklable.checks["data_position"]
    assert verdict == "fail"
    assert "the DataLoader cannot resume mid-epoch" in detail


@pytest.fixture(scope="module")
def unimportable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Fit]:
    """A StatefulDataLoader over a Dataset of a module only this process has (built at run
    time): it pickles here, the new process cannot unpickle it. One new process."""
    ghost = types.ModuleType("pilot_ghost_data")
    ghost.GhostData = type("GhostData", (IdExamples,), {"__module__": ghost.__name__})  # type: ignore[attr-defined]
    sys.modules[ghost.__name__] = ghost
    try:
        loader = StatefulDataLoader(ghost.GhostData(64), batch_size=4, shuffle=True)
        yield _fit(tmp_path_factory.mktemp("ghost"), loader)
    finally:
        del sys.modules[ghost.__name__]


def test_a_loader_the_new_process_cannot_unpickle_is_compared_in_process(
    unimportable: _Fit,
) -> None:
    verdict, detail = unimportable.checks["rebuild"]
    assert verdict == "pass"
    assert detail == (
        "loaders passed to fit: compared in-process: the new process could not unpickle the"
        " loader (ModuleNotFoundError: No module named 'pilot_ghost_data')"
    )
    assert unimportable.checks["weights_only_load"][1] == (
        "loaded in this process (in-process comparison)"
    )
    # The in-process comparison copies a StatefulDataLoader without its live iterator.
    for name in ("global_step", "rng", "data_rebuilt", "data_position", "loss_trajectory"):
        assert unimportable.checks[name][0] == "pass", (name, unimportable.checks[name])


def test_a_loader_holding_a_class_of_the_main_script_stays_in_this_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A Dataset defined in the training script: it pickles here, but a new process, whose
    # __main__ is another module, could not find it.
    script = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", script)
    scripted = type("ScriptData", (IdExamples,), {"__module__": "__main__"})
    script.ScriptData = scripted  # type: ignore[attr-defined]
    payload, why = pickle_loaders(DataLoader(scripted(8), batch_size=4))
    assert payload is None
    assert why == (
        "the loader holds __main__.ScriptData, defined in __main__, which a new process cannot"
        " import"
    )
    payload, why = pickle_loaders(DataLoader(IdExamples(8), batch_size=4))
    assert why is None
    assert payload is not None
