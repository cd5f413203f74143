"""ValidationPredictionWriter: alone, and beside DivergenceLedger through the shared run."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_pilot import (
    BatchAdapter,
    DivergenceLedger,
    Ledger,
    ValidationPredictionWriter,
    pilot_callbacks,
    read_phase_table,
)
from lightning_pilot.demo import InstructionDataModule, TinyCausalLM
from lightning_pilot.run import PilotRun
from lightning_pilot.schemas import PREDICTIONS_SCHEMA
from lightning_pilot.storage import read_parquet_files


def logits(module: Any, batch: Any, outputs: Any) -> Any:
    return module(batch)


def ledger() -> DivergenceLedger:
    return DivergenceLedger(experiment="tests", variant="v", seed=0)


def read(path: Path) -> Any:
    return read_parquet_files([path], PREDICTIONS_SCHEMA).to_pandas()


def test_predictions_are_saved_and_referenced_by_the_end_record(
    make_trainer: Any, tmp_path: Path
) -> None:
    # The writer after the ledger in the list: the end record still carries its file.
    writer = ValidationPredictionWriter(
        predictions_fn=lambda m, b, o: m(b["input_ids"], b["attention_mask"]).argmax(-1)
    )
    trainer = make_trainer(
        max_steps=4, val_check_interval=2, limit_val_batches=2, callbacks=[ledger(), writer]
    )
    datamodule = InstructionDataModule(dataset_size=100, batch_size=4)  # 10 validation examples
    trainer.fit(TinyCausalLM(d_model=16, n_heads=2, n_layers=1), datamodule)
    read_back = Ledger(tmp_path / "pilot")
    run = read_back.runs().iloc[0]
    assert run["status"] == "completed"
    assert run["predictions_uri"] == str(writer.run.run_dir / "predictions.parquet")
    predictions = read_back.predictions(run["run_id"])
    # Two validations (steps 2 and 4) x 2 batches x 4 examples; ids are the validation split's.
    assert len(predictions) == 16
    assert sorted(set(predictions["step"])) == [2, 4]
    val_ids = {str(datamodule.val_dataset[i]["ids"]) for i in range(8)}
    assert set(predictions["example_id"]) == val_ids
    assert set(predictions["run_id"]) == {run["run_id"]}
    first = predictions.iloc[0]
    assert len(first["prediction"]) == len(first["target"]) == first["prediction_shape"][0]
    Path(run["predictions_uri"]).chmod(0o644)
    with open(run["predictions_uri"], "ab") as handle:
        handle.write(b"tampered")
    with pytest.raises(ValueError, match="but the ledger recorded"):
        read_back.predictions(run["run_id"])


def test_the_writer_works_alone(make_trainer: Any, tmp_path: Path) -> None:
    writer = ValidationPredictionWriter(predictions_fn=logits, out_dir=tmp_path / "out")
    trainer = make_trainer(max_steps=2, val_check_interval=2, callbacks=[writer])
    trainer.fit(BoringModel())
    frame = read(writer.run.run_dir / "predictions.parquet")
    # BoringModel: validation batches of one example, limit_val_batches=2, one validation.
    assert frame[["step", "batch_idx", "row"]].values.tolist() == [[2, 0, 0], [2, 1, 0]]
    assert frame["prediction_shape"].map(list).tolist() == [[2], [2]]
    assert frame["example_id"].isna().all()  # BoringModel's batches carry no ids
    assert not (tmp_path / "out" / "ledger").exists()  # no ledger record without the ledger


def test_an_exception_still_publishes_and_the_end_record_names_the_file(
    make_trainer: Any, tmp_path: Path
) -> None:
    class FailsAtUpdate3(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if self.global_step == 2:
                raise ArithmeticError("user bug at update 3")
            return super().training_step(batch, batch_idx)

    writer = ValidationPredictionWriter(predictions_fn=logits)
    trainer = make_trainer(max_steps=6, val_check_interval=2, callbacks=[ledger(), writer])
    with pytest.raises(ArithmeticError, match="user bug"):
        trainer.fit(FailsAtUpdate3())
    run = Ledger(tmp_path / "pilot").runs().iloc[0]
    assert (run["status"], run["stop_cause"]) == ("failed", "exception:ArithmeticError")
    assert run["predictions_uri"] == str(writer.run.run_dir / "predictions.parquet")
    assert read(Path(run["predictions_uri"]))["step"].tolist() == [2, 2]


def test_an_earlier_attempts_file_is_never_replaced(make_trainer: Any, tmp_path: Path) -> None:
    class Occupy(pl.Callback):
        """Publish a file where the writer would, as an earlier attempt of the run would."""

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            run = PilotRun.of(trainer)
            run.run_dir.mkdir(parents=True, exist_ok=True)
            (run.run_dir / "predictions.parquet").write_bytes(b"an earlier attempt")

    writer = ValidationPredictionWriter(predictions_fn=logits)
    trainer = make_trainer(
        max_steps=2, val_check_interval=2, callbacks=[writer, Occupy(), ledger()]
    )
    trainer.fit(BoringModel())
    run = writer.run
    assert (run.run_dir / "predictions.parquet").read_bytes() == b"an earlier attempt"
    expected = run.run_dir / f"predictions-{run.attempt_id}.parquet"
    assert len(read(expected)) == 2
    assert Ledger(tmp_path / "pilot").runs().iloc[0]["predictions_uri"] == str(expected)


def test_missing_predictions_say_the_contract_and_leave_the_fit_whole(
    make_trainer: Any, tmp_path: Path
) -> None:
    writer = ValidationPredictionWriter()
    trainer = make_trainer(max_steps=2, callbacks=[writer, ledger()])
    with pytest.warns(RuntimeWarning, match=r"predictions not kept"):
        trainer.fit(BoringModel())
    assert trainer.global_step == 2  # the fit went on
    table = read_phase_table(writer.run.run_dir)
    row = table[(table["phase"] == "validation") & table["first"]].iloc[0]
    assert row["source"] == "ValidationPredictionWriter"
    checks = {c["name"]: c for c in row["checks"]}
    assert checks["predictions"]["verdict"] == "not_checked"
    assert re.search(
        r"the key 'preds', it returned a dict without it \(keys: \['x'\]\)",
        checks["predictions"]["detail"],
    )
    runs = Ledger(writer.run.out_dir).runs()
    assert runs["status"].tolist() == ["completed"]
    assert runs["predictions_uri"].isna().all()
    assert not (writer.run.run_dir / "predictions.parquet").exists()


def test_validate_alone_keeps_nothing(make_trainer: Any, tmp_path: Path) -> None:
    writer = ValidationPredictionWriter(predictions_fn=logits)
    trainer = make_trainer(callbacks=[writer])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.validate(BoringModel())
    assert not list(writer.run.run_dir.glob("predictions*"))


def test_pilot_callbacks_adds_it_when_asked_before_the_ledger() -> None:
    adapter = BatchAdapter(ids="ids")
    names = [type(c).__name__ for c in pilot_callbacks()]
    assert "ValidationPredictionWriter" not in names  # left out unless asked for
    callbacks = pilot_callbacks(adapter=adapter, predictions={"predictions_key": "logits"})
    writer, last = callbacks[-2:]
    assert isinstance(writer, ValidationPredictionWriter)
    assert isinstance(last, DivergenceLedger)
    assert (writer.predictions_key, writer.adapter) == ("logits", adapter)
    assert [type(c).__name__ for c in pilot_callbacks(predictions=True)][-2:] == [
        "ValidationPredictionWriter",
        "DivergenceLedger",
    ]
    with pytest.raises(ValueError, match=r"DivergenceLedger has no option 'batch_adapter'"):
        pilot_callbacks(ledger={"batch_adapter": adapter})


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"predictions_fn": 3}, TypeError, r"predictions_fn=3\) is invalid: expected a callable"),
        ({"predictions_key": ""}, ValueError, r"predictions_key=''\) is invalid: expected a non"),
        ({"adapter": "ids"}, TypeError, r"adapter='ids'\) is invalid: expected a Batch"),
        ({"out_dir": ""}, ValueError, r"out_dir=''\) is invalid"),
    ],
)
def test_bad_arguments_are_refused(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=rf"ValidationPredictionWriter\({match}"):
        ValidationPredictionWriter(**kwargs)


def test_a_scalar_prediction_is_refused() -> None:
    from lightning_pilot.callbacks.prediction_writer import prediction_rows

    with pytest.raises(ValueError, match="must have a batch dimension, got a scalar 3"):
        prediction_rows(torch.tensor(3), ids=None, targets=None)
