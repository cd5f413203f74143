"""Every pilot callback together in one Trainer: one run, one folder, no interference."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

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


@pytest.mark.parametrize(
    "options",
    [
        {"max_steps": 6, "accumulate_grad_batches": 2, "val_check_interval": 4},
        {"fast_dev_run": 4},
    ],
    ids=["accumulate_validate", "fast_dev_run"],
)
def test_all_callbacks_share_one_run(make_trainer: Any, tmp_path: Path, options: Any) -> None:
    callbacks = _callbacks()
    trainer = make_trainer(callbacks=callbacks, **options)
    data = InstructionDataModule(dataset_size=256, batch_size=8, max_length=32, stateful=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyCausalLM(max_length=32, d_model=32, n_layers=1), datamodule=data)

    runs = {callback.run.run_id for callback in callbacks}
    assert len(runs) == 1
    table = read_phase_table(tmp_path / "pilot")
    assert set(table["run_id"]) == runs
    assert {"data", "forward", "backward", "optimizer_step", "resume"} <= set(table["phase"])
    assert "fail" not in set(table["verdict"]), table[table["verdict"] == "fail"]["reason"]
    data_row = table[(table["phase"] == "data") & table["first"]].iloc[0]
    assert set(data_row["source"].split(",")) == {"PhaseMemoryMonitor", "BatchInspector"}
    ledger = Ledger(tmp_path / "pilot").runs()
    assert ledger["run_id"].tolist() == sorted(runs)
    row = ledger.iloc[0]
    assert row["status"] == "completed"
    # The accountant's counts reached the ledger through the shared run.
    assert row["micro_batch_size"] == 8
    assert row["effective_batch_size"] == 8 * trainer.accumulate_grad_batches
    assert row["updates_done"] == trainer.global_step


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_callbacks_copied_after_a_fit_run_a_fit_of_their_own(
    make_trainer: Any, tmp_path: Path, how: str
) -> None:
    # A sweep that copies its callbacks after a first fit: the run's lock is made anew and the
    # monitor's memory counter rebuilt, so the copies work; the originals keep their run.
    import copy
    import pickle

    def fit(callbacks: list[Any]) -> None:
        data = InstructionDataModule(dataset_size=64, batch_size=8, max_length=32, stateful=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make_trainer(callbacks=callbacks, max_steps=4).fit(
                TinyCausalLM(max_length=32, d_model=32, n_layers=1), datamodule=data
            )

    first = _callbacks()
    fit(first)
    copies = copy.deepcopy(first) if how == "deepcopy" else pickle.loads(pickle.dumps(first))
    assert [c.run.run_id for c in copies] == [c.run.run_id for c in first]
    fit(copies)
    runs = {c.run.run_id for c in copies}
    assert len(runs) == 1
    assert runs != {c.run.run_id for c in first}
    table = read_phase_table(tmp_path / "pilot")
    assert set(table["run_id"]) == runs | {first[0].run.run_id}
    second = table[table["run_id"].isin(runs)]
    assert {"forward", "backward", "optimizer_step", "resume"} <= set(second["phase"])
    assert "fail" not in set(second["verdict"])
    assert set(Ledger(tmp_path / "pilot").runs()["status"]) == {"completed"}
