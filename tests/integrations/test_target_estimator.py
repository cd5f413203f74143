"""TargetEstimator in a real pilot: the estimate table, the choice sheet and the loggers."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_pilot import TargetEstimator, read_phase_table
from lightning_pilot.demo import InstructionDataModule, TinyCausalLM
from lightning_pilot.estimate import TARGETS
from lightning_pilot.pilot import pilot_callbacks
from lightning_pilot.report import choice_sheet
from lightning_pilot.report.load import load_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pilot(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import lightning.pytorch as pl

    root = tmp_path_factory.mktemp("estimate")
    callbacks = pilot_callbacks(
        root / "pilot",
        experiment="lm",
        variant="control",
        seed=0,
        estimate={
            "targets": ["L4-24GB", "H100-SXM-80GB"],
            "precisions": ["bf16-mixed"],
            "micro_batches": [4, 4096],
            "seq_lens": [32],
            "options": {"seq_step": 8},
        },
    )
    logger = CSVLogger(root / "logs", name="run")
    trainer = pl.Trainer(
        max_steps=6, logger=logger, callbacks=callbacks, default_root_dir=root,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        limit_val_batches=2, val_check_interval=3,
    )  # fmt: skip
    module = TinyCausalLM(d_model=16, n_heads=2, n_layers=1, max_length=32)
    data = InstructionDataModule(dataset_size=64, batch_size=4, max_length=32, stateful=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
    (estimator,) = [c for c in callbacks if isinstance(c, TargetEstimator)]
    return {"estimator": estimator, "module": module, "logger": logger, "root": root}


def test_the_estimate_lands_in_the_run_folder(pilot: dict[str, Any]) -> None:
    estimator = pilot["estimator"]
    run = load_run(estimator.run.run_dir)
    assert run.estimate is not None
    table = run.estimate
    assert set(table["target"]) == {"L4-24GB", "H100-SXM-80GB"}
    assert set(table["micro_batch"]) == {4, 4096}
    assert set(table["status"]) == {"ok"}, table[["phase", "status", "reason"]]
    # The module's own self.log calls were silenced, not turned into failed rows, and the
    # module carries nothing of it afterwards.
    assert "log" not in vars(pilot["module"])
    assert "log_dict" not in vars(pilot["module"])
    # Micro-batch 4096 x 32 of the tiny LM: activations grow with it, weights do not.
    forward = table[table["phase"] == "forward"].set_index(["target", "micro_batch"])
    small, large = forward.loc[("L4-24GB", 4)], forward.loc[("L4-24GB", 4096)]
    assert large["activations_bytes"] > 100 * small["activations_bytes"]
    assert large["param_bytes"] == small["param_bytes"]
    assert large["buffer_bytes"] == small["buffer_bytes"]
    assert (table["peak_reserved_bytes"] >= table["peak_allocated_bytes"]).all()
    # No phase row of the pilot failed because of the estimator.
    phases = read_phase_table(estimator.run.run_dir)
    assert "pilot" not in set(phases["phase"]), phases[phases["phase"] == "pilot"]["reason"]


def test_the_choice_sheet_prices_the_package_on_the_target(pilot: dict[str, Any]) -> None:
    run_dir = pilot["estimator"].run.run_dir
    text = choice_sheet(run_dir, gpu_prices={"H100-SXM-80GB": 2.5})
    section = text.split("## On the target GPU (estimated)")[1]
    assert "| L4-24GB | bf16-mixed | 4 x 32 | off | single |" in section
    assert "fits" in section
    # 6 planned updates of the control variant: a small package, priced in money on the H100.
    h100 = [line for line in section.splitlines() if line.startswith("- H100-SXM-80GB x1")]
    assert h100, section
    assert "GPU-hours, " in h100[0]
    assert "at 2.5/GPU-hour" in h100[0]
    assert "3 days: control" in h100[0]
    # The largest sizes: the demo LM declares max_length=32, so that bounds the sequence.
    largest = [line for line in section.splitlines() if line.startswith("- L4-24GB bf16-mixed, ")]
    assert len(largest) == 1, section
    assert largest[0] == (
        "- L4-24GB bf16-mixed, act. ckpt off, single: micro-batch 1024 at seq 32 (fits at"
        " max_micro_batch=1024, the end of the search); seq 32 at micro-batch 4 (fits at the"
        " module's declared maximum (32 positions))"
    )


def test_the_loggers_get_each_configuration(pilot: dict[str, Any]) -> None:
    logger = pilot["logger"]
    with (Path(logger.log_dir) / "metrics.csv").open(newline="") as handle:
        header = next(csv.reader(handle))
    key = "pilot/estimate/L4-24GB/bf16-mixed/single/mb4"
    assert {f"{key}/reserved_bytes", f"{key}/fits", f"{key}/step_high_s"} <= set(header)


def test_bad_arguments_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"estimate\(targets='A100-1GB'\) is invalid"):
        TargetEstimator(targets=["A100-1GB"])
    with pytest.raises(ValueError, match=r"TargetEstimator\(precisions='fp8'\) is invalid"):
        TargetEstimator(precisions=["fp8"])
    with pytest.raises(ValueError, match=r"TargetEstimator\(options=.*keys among"):
        TargetEstimator(options={"not_an_option": 1})
    with pytest.raises(TypeError, match=r"TargetEstimator\(micro_batches=8\) is invalid"):
        TargetEstimator(micro_batches=8)  # type: ignore[arg-type]
    assert "H100-SXM-80GB" in TARGETS


def test_the_estimate_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_pilot.cli import main

    out = tmp_path / "estimate"
    code = main(
        ["estimate", "estimate_factory:build", "--target", "L4-24GB", "--micro-batch", "4",
         "--micro-batch", "64", "--seq-len", "32", "--checkpointing", "both",
         "--checkpoint-class", "lightning_pilot.demo.lm:_Block", "--no-largest",
         "--out", str(out)]
    )  # fmt: skip
    captured = capsys.readouterr()
    text = captured.out
    assert code == 0, text
    # Progress on stderr while the grid is traced, and its end.
    assert "lightning-pilot estimate: tracing bf16-mixed: 4 configuration(s) x 1 target(s)" in (
        captured.err
    )
    assert "lightning-pilot estimate: 24 row(s) in" in captured.err
    lines = [line for line in text.splitlines() if line.startswith("L4-24GB")]
    assert len(lines) == 4  # 2 micro-batches x checkpointing off and on
    assert all(" fits " in line and line.rstrip().endswith("ok") for line in lines)
    assert (out / "estimate.parquet").is_file()
    # Checkpointing without the classes to wrap: named, exit 1, never a crash or a zero.
    code = main(["estimate", "estimate_factory:build", "--checkpointing", "on", "--no-largest"])
    text = capsys.readouterr().out
    assert code == 1
    assert "not estimated: H100-SXM-80GB bf16-mixed micro-batch 1" in text
    assert "checkpoint_classes" in text
    # The largest micro-batch and sequence length: the demo LM declares max_length=32.
    code = main(["estimate", "estimate_factory:build", "--target", "L4-24GB", "--micro-batch",
                 "4", "--seq-len", "32", "--seq-step", "8"])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    line = next(line for line in text.splitlines() if line.startswith("largest on L4-24GB"))
    assert "(bf16-mixed, checkpointing off): micro-batch " in line
    assert line.endswith("; seq 32 (the model's maximum) at micro-batch 4 (ok)")
    # A factory that does not give (module, batch), or is not there: usage errors.
    assert main(["estimate", "estimate_factory:not_a_pair"]) == 2
    assert main(["estimate", "estimate_factory:missing"]) == 2
    assert "expected a tuple (LightningModule, batch)" in capsys.readouterr().err


def test_selective_checkpointing_in_a_pilot(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from lightning_pilot.demo.lm import _Block

    grid: dict[str, Any] = {
        "targets": ["L4-24GB"],
        "precisions": ["bf16-mixed"],
        "micro_batches": [4],
        "seq_lens": [32],
        "checkpointing": [True, "selective"],
        "largest": False,
        "options": {"checkpoint_classes": [_Block]},
    }
    # The phase table and the estimate only: the other pilot callbacks have their own tests.
    others = dict.fromkeys(("batch_inspector", "effective_batch", "resume", "ledger"), False)
    callbacks = pilot_callbacks(tmp_path / "pilot", experiment="lm", estimate=grid, **others)
    (estimator,) = [c for c in callbacks if isinstance(c, TargetEstimator)]
    assert estimator.checkpointing == [True, "selective"]
    logger = CSVLogger(tmp_path / "logs", name="run")
    trainer = pl.Trainer(
        max_steps=2, logger=logger, callbacks=callbacks, default_root_dir=tmp_path,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        limit_val_batches=0,
    )  # fmt: skip
    module = TinyCausalLM(d_model=16, n_heads=2, n_layers=1, max_length=32)
    data = InstructionDataModule(dataset_size=16, batch_size=4, max_length=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
    run = load_run(estimator.run.run_dir)
    assert run.estimate is not None
    assert set(run.estimate["status"]) == {"ok"}
    assert list(dict.fromkeys(run.estimate["checkpointing"])) == ["full", "selective"]
    sheet = choice_sheet(estimator.run.run_dir)
    assert "| L4-24GB | bf16-mixed | 4 x 32 | selective | single |" in sheet
    assert "| L4-24GB | bf16-mixed | 4 x 32 | full | single |" in sheet
    with (Path(logger.log_dir) / "metrics.csv").open(newline="") as handle:
        header = set(next(csv.reader(handle)))
    key = "pilot/estimate/L4-24GB/bf16-mixed/single/mb4"
    assert {f"{key}/ckpt/reserved_bytes", f"{key}/sac/reserved_bytes"} <= header
    with pytest.raises(ValueError, match=r"TargetEstimator\(checkpointing='some'\) is invalid"):
        TargetEstimator(checkpointing=["some"])
