"""pilot_callbacks(): every pilot callback in one call, one run, bad options refused."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from lightning_pilot import (
    BatchAdapter,
    BatchInspector,
    DivergenceLedger,
    EffectiveBatchAccountant,
    Ledger,
    OverfitTinySubset,
    PhaseMemoryMonitor,
    ResumeVerifier,
    read_phase_table,
)
from lightning_pilot.demo import InstructionDataModule, TinyCausalLM
from lightning_pilot.pilot import PILOT_OPTION_KEYS, pilot_callbacks


def test_fast_dev_run_still_saves_and_loads_a_checkpoint(make_trainer: Any, tmp_path: Path) -> None:
    # Also every callback of the set composing in one fast_dev_run fit (test_composition.py
    # fits them with accumulation and validation).
    out = tmp_path / "out"
    callbacks = pilot_callbacks(out, experiment="fdr", variant="control", seed=3)
    trainer = make_trainer(callbacks=callbacks, fast_dev_run=4)
    data = InstructionDataModule(dataset_size=256, batch_size=4, max_length=20, stateful=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyCausalLM(max_length=20, d_model=32, n_heads=2, n_layers=1), datamodule=data)

    run_ids = {callback.run.run_id for callback in callbacks}
    assert len(run_ids) == 1
    table = read_phase_table(out)
    assert set(table["run_id"]) == run_ids
    phases = set(table["phase"])
    assert {"checkpoint_save", "checkpoint_load", "resume", "forward", "backward"} <= phases
    assert {"data", "optimizer_step"} <= phases
    resume = table[table["phase"] == "resume"].iloc[0]
    assert resume["verdict"] == "pass", resume["reason"]
    assert "fail" not in set(table["verdict"]), table[table["verdict"] == "fail"]["reason"]
    data_row = table[(table["phase"] == "data") & table["first"]].iloc[0]
    assert set(data_row["source"].split(",")) == {"PhaseMemoryMonitor", "BatchInspector"}
    runs = Ledger(out).runs()
    assert runs["run_id"].tolist() == sorted(run_ids)
    assert runs[["experiment", "variant", "seed"]].values.tolist() == [["fdr", "control", 3]]
    assert runs["status"].tolist() == ["completed"]
    assert runs["updates_done"].tolist() == [4] == [trainer.global_step]
    # The accountant's counts reached the ledger through the shared run.
    assert runs[["micro_batch_size", "effective_batch_size"]].values.tolist() == [[4, 4]]


def test_default_set_order_and_shared_settings(tmp_path: Path) -> None:
    adapter = BatchAdapter(ids="ids")
    callbacks = pilot_callbacks(
        tmp_path,
        experiment="e",
        variant="v",
        seed=1,
        adapter=adapter,
        phase_memory={"pilot_updates": 5},
        resume={"at_step": 3, "compare_steps": 1},
        ledger={"params": {"lr": 0.1}},
    )
    assert [type(c) for c in callbacks] == [
        PhaseMemoryMonitor,
        BatchInspector,
        EffectiveBatchAccountant,
        ResumeVerifier,
        DivergenceLedger,
    ]
    assert all(Path(c.out_dir) == tmp_path for c in callbacks)  # type: ignore[arg-type]
    monitor, _, accountant, verifier, ledger = callbacks
    assert isinstance(monitor, PhaseMemoryMonitor)
    assert monitor.pilot_updates == 5
    assert isinstance(verifier, ResumeVerifier)
    assert verifier.at_step == 3
    assert isinstance(ledger, DivergenceLedger)
    assert (ledger.experiment, ledger.variant, ledger.seed, ledger.params) == (
        "e",
        "v",
        1,
        {"lr": 0.1},
    )
    assert isinstance(accountant, EffectiveBatchAccountant)
    assert accountant.adapter is adapter


def test_callbacks_can_be_left_out() -> None:
    callbacks = pilot_callbacks(resume=False, ledger=False)
    names = [type(c).__name__ for c in callbacks]
    assert names == ["PhaseMemoryMonitor", "BatchInspector", "EffectiveBatchAccountant"]
    assert OverfitTinySubset not in {type(c) for c in pilot_callbacks()}
    assert set(PILOT_OPTION_KEYS) == {
        "phase_memory",
        "batch_inspector",
        "effective_batch",
        "resume",
        "predictions",
        "ledger",
        "estimate",
    }


@pytest.mark.parametrize("value", [True, {}, {"max_steps": 30}])
def test_overfit_is_refused_it_needs_a_fit_of_its_own(value: object) -> None:
    # OverfitTinySubset replaces every batch of the fit: the other callbacks would measure,
    # resume and record an 8-example training instead of the campaign's.
    with pytest.raises(
        ValueError,
        match=r"pilot_callbacks\(overfit=.*\) is invalid: .*changes training.*its own fit"
        r".*OverfitTinySubset\(\.\.\.\).*separate Trainer",
    ):
        pilot_callbacks(overfit=value)


def test_overfit_false_is_accepted() -> None:
    # Nothing to leave out: the pilot set never holds OverfitTinySubset.
    # The opt-in ones (predictions, estimate) are left out by default.
    assert len(pilot_callbacks(overfit=False)) == len(PILOT_OPTION_KEYS) - 2


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        (
            {"resum": {}},
            ValueError,
            r"unknown option 'resum'; valid: phase_memory, batch_inspector",
        ),
        (
            {"resume": {"at_stpe": 2}},
            ValueError,
            r"ResumeVerifier has no option 'at_stpe'; valid: .*at_step",
        ),
        ({"ledger": {"out_dir": "x"}}, ValueError, r"out_dir are set for every callback"),
        ({"ledger": {"variant": "x"}}, ValueError, r"variant are set for every callback"),
        (
            {"phase_memory": 3},
            TypeError,
            r"pilot_callbacks\(phase_memory=3\) is invalid: expected a dict",
        ),
        ({"adapter": "ids"}, TypeError, r"pilot_callbacks\(adapter='ids'\) is invalid"),
        ({"resume": {"at_step": 0}}, ValueError, r"ResumeVerifier\(at_step=0\) is invalid"),
        ({"variant": ""}, ValueError, r"variant"),
    ],
)
def test_bad_options_are_rejected(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        pilot_callbacks(**options)
