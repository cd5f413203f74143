"""Every registered pilot callback through the same lifecycle, on the demo LM.

A callback added to ``lightning_pilot.callbacks.REGISTRY`` is picked up here with the arguments
of its entry: a fit followed by ``validate``, ``test`` and ``predict`` on the same Trainer and a
second fit; ``fast_dev_run`` with a deep copy and a pickled copy of the callback; and a fit that
raises. In each the user's exception (if any) comes through unchanged, the pilot's files read
back, and the callback has its plain methods again afterwards.
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_pilot import Ledger, PilotRun, read_phase_table
from lightning_pilot.callbacks import REGISTRY, Registered
from lightning_pilot.demo import InstructionDataModule, TinyCausalLM
from lightning_pilot.run import GUARDED_HOOKS, PilotCallback
from lightning_pilot.storage import read_snapshot_table

ENTRIES = {entry.name: entry for entry in REGISTRY}


def _callback(entry: Registered, out_dir: Path) -> PilotCallback:
    return entry.load()(**entry.example, out_dir=out_dir)


def _trainer(root: Path, callback: pl.Callback, **overrides: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 3,
        "limit_val_batches": 1,
        "val_check_interval": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": root,
        "callbacks": [callback],
    }
    options.update(overrides)
    return pl.Trainer(**options)


def _model() -> TinyCausalLM:
    torch.manual_seed(0)
    return TinyCausalLM(max_length=16)


def _data() -> InstructionDataModule:
    return InstructionDataModule(dataset_size=24, batch_size=4, max_length=16)


def _readable(out_dir: Path) -> int:
    """Read back every table and the ledger the pilot wrote; return how many were read."""
    read = 0
    for table in sorted(out_dir.glob("runs/*/*.parquet")):
        if table.name == "phases.parquet":
            skipped = read_phase_table(table.parent).attrs.get("skipped")
        else:
            skipped = []
            read_snapshot_table(table, skipped=skipped)
        assert not skipped, skipped
        read += 1
    if (out_dir / "ledger").exists():
        assert not Ledger(out_dir / "ledger").runs().empty
        read += 1
    return read


def _plain_methods_again(callback: PilotCallback) -> None:
    """No hook is left muted (``None``) or wrapped on the instance after the Trainer is done."""
    left = {
        name: value
        for name, value in vars(callback).items()
        if name in GUARDED_HOOKS  # every Lightning hook a callback may override
    }
    assert left == {}, f"{type(callback).__name__} left instance hooks {sorted(left)}"


@pytest.mark.parametrize("name", list(ENTRIES))
def test_fit_then_every_stage_then_a_second_fit(name: str, tmp_path: Path) -> None:
    entry = ENTRIES[name]
    out_dir = tmp_path / "pilot"
    callback = _callback(entry, out_dir)
    trainer = _trainer(tmp_path, callback)
    model, data = _model(), _data()
    trainer.fit(model, datamodule=data)
    first = PilotRun.last(trainer)
    assert first is not None
    assert first.closed
    assert _readable(out_dir) >= 1, f"{name} wrote nothing readable for a fit"
    _plain_methods_again(callback)

    trainer.validate(model, datamodule=data, verbose=False)
    trainer.test(model, datamodule=data, verbose=False)
    predictions = trainer.predict(model, datamodule=data)
    assert predictions, "predict returned nothing: the callback must not change predict"
    _plain_methods_again(callback)

    trainer.fit_loop.epoch_loop.max_steps = 5
    trainer.fit(model, datamodule=data)
    second = PilotRun.last(trainer)
    assert second is not None
    assert second.closed
    assert second.run_id != first.run_id
    if entry.option is not None:  # it does not change training (OverfitTinySubset does)
        assert trainer.global_step == 5
    _readable(out_dir)
    _plain_methods_again(callback)


@pytest.mark.parametrize("name", list(ENTRIES))
def test_fast_dev_run_with_copies(name: str, tmp_path: Path) -> None:
    entry = ENTRIES[name]
    original = _callback(entry, tmp_path / "pilot")
    for index, callback in enumerate(
        [copy.deepcopy(original), pickle.loads(pickle.dumps(original))]
    ):
        assert type(callback) is type(original)
        trainer = _trainer(tmp_path / f"copy-{index}", callback, fast_dev_run=2)
        trainer.fit(_model(), datamodule=_data())
        _plain_methods_again(callback)
    _readable(tmp_path / "pilot")


class _Broken(TinyCausalLM):
    """The user's own bug: training raises at the second micro-batch."""

    error = RuntimeError("the user's own bug at batch 1")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            raise self.error
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("name", list(ENTRIES))
def test_a_fit_that_raises_keeps_the_users_exception_and_the_files(
    name: str, tmp_path: Path
) -> None:
    entry = ENTRIES[name]
    out_dir = tmp_path / "pilot"
    callback = _callback(entry, out_dir)
    trainer = _trainer(tmp_path, callback)
    torch.manual_seed(0)
    model = _Broken(max_length=16)
    with pytest.raises(RuntimeError) as raised:
        trainer.fit(model, datamodule=_data())
    assert raised.value is _Broken.error
    run = PilotRun.last(trainer)
    assert run is not None
    assert run.closed
    _readable(out_dir)
    _plain_methods_again(callback)


def test_the_registry_and_the_exported_names_agree() -> None:
    import lightning_pilot
    import lightning_pilot.callbacks as callbacks
    from lightning_pilot.pilot import PILOT_OPTION_KEYS

    assert set(callbacks.__all__) == set(callbacks.LAZY)
    for entry in REGISTRY:
        cls = entry.load()
        assert issubclass(cls, PilotCallback)
        assert getattr(lightning_pilot, entry.name) is cls
        assert getattr(callbacks, entry.name) is cls
        assert "Example" in (cls.__doc__ or ""), f"{entry.name} has no example"
    options = [entry.option for entry in REGISTRY if entry.option]
    assert tuple(options) == PILOT_OPTION_KEYS
