"""Every pilot callback together in one Trainer: one run, one folder, no interference."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_pilot import (
    BatchInspector,
    DivergenceLedger,
    EffectiveBatchAccountant,
    Ledger,
    PhaseMemoryMonitor,
    ResumeVerifier,
    read_phase_table,
)
from lightning_pilot.demo import InstructionDataModule, TinyCausalLM


def _callbacks(**ledger: Any) -> list[Any]:
    return [
        PhaseMemoryMonitor(),
        BatchInspector(),
        EffectiveBatchAccountant(),
        ResumeVerifier(at_step=2, compare_steps=2, check_artifact=False),
        DivergenceLedger(experiment="composition", variant="control", seed=0, **ledger),
    ]


def _fit(root: Path, callbacks: list[Any], dataset_size: int, **options: Any) -> pl.Trainer:
    """Fit the demo LM with ``callbacks`` on a quiet CPU Trainer rooted in ``root``."""
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        limit_val_batches=2,
        callbacks=callbacks,
        **options,
    )
    data = InstructionDataModule(
        dataset_size=dataset_size, batch_size=8, max_length=32, stateful=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyCausalLM(max_length=32, d_model=32, n_layers=1), datamodule=data)
    return trainer


@pytest.fixture(scope="module")
def first_fit(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every callback in one fit with accumulation and a mid-epoch validation, shared: its
    tables as they were right after it, then its callbacks for the copies' fits (the same
    folder). Every callback with ``fast_dev_run`` is test_pilot.py's fit."""
    root = tmp_path_factory.mktemp("composition")
    callbacks = _callbacks()
    trainer = _fit(
        root, callbacks, 256, max_steps=6, accumulate_grad_batches=2, val_check_interval=4
    )
    return {
        "root": root,
        "callbacks": callbacks,
        "trainer": trainer,
        "table": read_phase_table(root / "pilot"),
        "ledger": Ledger(root / "pilot").runs(),
    }


def test_all_callbacks_share_one_run(first_fit: dict[str, Any]) -> None:
    callbacks, trainer = first_fit["callbacks"], first_fit["trainer"]
    runs = {callback.run.run_id for callback in callbacks}
    assert len(runs) == 1
    table = first_fit["table"]
    assert set(table["run_id"]) == runs
    assert {"data", "forward", "backward", "optimizer_step", "resume"} <= set(table["phase"])
    assert "fail" not in set(table["verdict"]), table[table["verdict"] == "fail"]["reason"]
    data_row = table[(table["phase"] == "data") & table["first"]].iloc[0]
    assert set(data_row["source"].split(",")) == {"PhaseMemoryMonitor", "BatchInspector"}
    ledger = first_fit["ledger"]
    assert ledger["run_id"].tolist() == sorted(runs)
    row = ledger.iloc[0]
    assert row["status"] == "completed"
    # The accountant's counts reached the ledger through the shared run.
    assert row["micro_batch_size"] == 8
    assert row["effective_batch_size"] == 8 * trainer.accumulate_grad_batches == 16
    assert row["updates_done"] == trainer.global_step == 6


def test_callbacks_copied_after_a_fit_run_a_fit_of_their_own(first_fit: dict[str, Any]) -> None:
    # A sweep that copies its callbacks after a first fit: the run's lock is made anew and the
    # monitor's memory counter rebuilt, so the copies work; the originals keep their run.
    # Both ways of copying (deepcopy, pickle), each copy fitted into the first fit's folder.
    import copy
    import pickle

    root, first = first_fit["root"], first_fit["callbacks"]

    original = {c.run.run_id for c in first}
    copied: dict[str, set[str]] = {}
    for how in ("deepcopy", "pickle"):
        copies = copy.deepcopy(first) if how == "deepcopy" else pickle.loads(pickle.dumps(first))
        assert [c.run.run_id for c in copies] == [c.run.run_id for c in first], how
        _fit(root, copies, 64, max_steps=4)
        copied[how] = {c.run.run_id for c in copies}
        assert len(copied[how]) == 1, how
        assert copied[how] != original, how
        assert {c.run.run_id for c in first} == original, how  # the originals keep their run
    assert copied["deepcopy"] != copied["pickle"]
    table = read_phase_table(root / "pilot")
    assert set(table["run_id"]) == original | copied["deepcopy"] | copied["pickle"]
    for how, runs in copied.items():
        second = table[table["run_id"].isin(runs)]
        assert {"forward", "backward", "optimizer_step", "resume"} <= set(second["phase"]), how
        assert "fail" not in set(second["verdict"]), how
    assert set(Ledger(root / "pilot").runs()["status"]) == {"completed"}
