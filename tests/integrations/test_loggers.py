"""The run's summary reaches the Trainer's own loggers, read back from what they wrote."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

from lightning_pilot import Ledger, read_phase_table
from lightning_pilot.core.summary import VERDICT_CODES
from lightning_pilot.demo import InstructionDataModule, TinyCausalLM
from lightning_pilot.pilot import pilot_callbacks


def _fit(make_trainer: Any, out: Path, logger: Any, resume: bool = True) -> list[Any]:
    """A short pilot; returns the callbacks (the warnings it gave in ``fit_warnings``);
    ``resume=False`` leaves out the resume check (its new process is the slow part)."""
    callbacks = pilot_callbacks(out, experiment="logs", variant="control", seed=1, resume=resume)
    trainer = make_trainer(
        callbacks=callbacks, logger=logger, max_steps=6, val_check_interval=3, log_every_n_steps=1
    )
    data = InstructionDataModule(dataset_size=96, batch_size=4, max_length=16, stateful=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyCausalLM(max_length=16, d_model=16, n_heads=2, n_layers=1), datamodule=data)
    fit_warnings[:] = [str(w.message) for w in caught]
    return callbacks


fit_warnings: list[str] = []


def _last_values(metrics_csv: Path) -> dict[str, float]:
    """Each column's last non-empty value in CSVLogger's metrics.csv."""
    values: dict[str, float] = {}
    with metrics_csv.open(newline="") as handle:
        for row in csv.DictReader(handle):
            values.update({k: float(v) for k, v in row.items() if v not in ("", None)})
    return values


def _expected(out: Path) -> tuple[Any, dict[str, Any]]:
    table = read_phase_table(out)
    (run,) = Ledger(out).runs().to_dict("records")
    return table, run


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CSVLogger, TensorBoardLogger]:
    """One pilot (the resume check included) whose Trainer has two loggers, CSV and
    TensorBoard: each gets the whole summary. Its output folder and both loggers."""
    import lightning.pytorch as pl

    tmp_path = tmp_path_factory.mktemp("loggers")
    csv_logger = CSVLogger(tmp_path / "logs", name="run")
    tb_logger = TensorBoardLogger(tmp_path / "tb", name="run")

    def make(**options: Any) -> pl.Trainer:
        return pl.Trainer(
            accelerator="cpu", devices=1, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=tmp_path, limit_val_batches=2, **options,
        )  # fmt: skip

    _fit(make, tmp_path / "pilot", [csv_logger, tb_logger])
    return tmp_path / "pilot", csv_logger, tb_logger


def test_csv_logger_receives_the_summary(
    logged: tuple[Path, CSVLogger, TensorBoardLogger],
) -> None:
    out, logger, _ = logged
    table, run = _expected(out)
    metrics = _last_values(Path(logger.log_dir) / "metrics.csv")
    hparams = yaml.safe_load((Path(logger.log_dir) / "hparams.yaml").read_text())

    # Phase peaks and durations, as the phase table has them.
    forward = table[(table["phase"] == "forward") & table["first"]].iloc[0]
    assert metrics["pilot/forward_first/peak_allocated_bytes"] == forward["peak_allocated_bytes"]
    assert metrics["pilot/forward_first/duration_s"] == pytest.approx(forward["duration_s"])
    # Verdict counts and each phase's verdict (word and code).
    for verdict in ("pass", "warn", "fail", "not_checked"):
        assert metrics[f"pilot/verdicts/{verdict}"] == (table["verdict"] == verdict).sum()
    resume = table[table["phase"] == "resume"].iloc[0]["verdict"]
    assert hparams["pilot/verdict/resume"] == resume == "pass"
    assert metrics["pilot/verdict_code/resume"] == VERDICT_CODES["pass"]
    # The effective batch, as the ledger has it.
    for key in ("effective_batch_size", "examples_seen", "tokens_seen", "updates_done"):
        assert metrics[f"pilot/batch/{key}"] == run[key], key
    assert run["tokens_seen"] > run["examples_seen"] > 0
    # How the run ended, as the ledger's end record says.
    assert hparams["pilot/ledger/status"] == run["status"] == "completed"
    assert hparams["pilot/ledger/stop_cause"] == run["stop_cause"] == "max_steps"
    assert metrics["pilot/ledger/stop_step"] == run["stop_step"] == 6


def test_tensorboard_logger_receives_the_summary(
    logged: tuple[Path, CSVLogger, TensorBoardLogger],
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, logger = logged
    table, run = _expected(out)
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    scalars = {tag: events.Scalars(tag)[-1].value for tag in events.Tags()["scalars"]}
    forward = table[(table["phase"] == "forward") & table["first"]].iloc[0]
    assert scalars["pilot/forward_first/peak_allocated_bytes"] == pytest.approx(
        forward["peak_allocated_bytes"]
    )
    assert scalars["pilot/batch/tokens_seen"] == run["tokens_seen"]
    assert scalars["pilot/verdicts/fail"] == (table["verdict"] == "fail").sum()
    # The texts: TensorBoard's hparams plugin, whose last session start holds ours.
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    starts = [
        value.metadata.plugin_data.content
        for file in sorted(Path(logger.log_dir).glob("events.out.tfevents.*"))
        for event in EventFileLoader(str(file)).Load()
        for value in event.summary.value
        if value.tag == "_hparams_/session_start_info"
    ]
    data = plugin_data_pb2.HParamsPluginData.FromString(starts[-1])
    texts = {k: v.string_value for k, v in data.session_start_info.hparams.items()}
    assert texts["pilot/ledger/stop_cause"] == run["stop_cause"] == "max_steps"
    assert texts["pilot/verdict/resume"] == "pass"


class _Recording(Logger):
    """A logger that records every call (or refuses them all)."""

    def __init__(self, refuse: bool = False) -> None:
        super().__init__()
        self.calls: list[tuple[str, Any]] = []
        self.refuse = refuse

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self.refuse and any(k.startswith("pilot/") for k in metrics):
            raise RuntimeError("this backend refuses the key")
        self.calls.append(("metrics", dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("hparams", dict(params)))


def test_nothing_is_logged_without_a_logger_and_a_refusing_logger_only_warns(
    make_trainer: Any, tmp_path: Path
) -> None:
    callbacks = _fit(make_trainer, tmp_path / "none", False, resume=False)
    assert callbacks[0].run.closed
    assert not (tmp_path / "lightning_logs").exists()

    _fit(make_trainer, tmp_path / "refused", _Recording(refuse=True), resume=False)
    refused = [w for w in fit_warnings if "summary to _Recording" in w]
    assert len(refused) == 1, fit_warnings
    assert "this backend refuses the key" in refused[0]
    assert Ledger(tmp_path / "refused").runs()["status"].tolist() == ["completed"]

    recording = _Recording()
    _fit(make_trainer, tmp_path / "recorded", recording, resume=False)
    pilot = [c for c in recording.calls if any(k.startswith("pilot/") for k in c[1])]
    assert [kind for kind, _ in pilot] == ["metrics", "hparams"]  # once, at the run's close
    assert all(isinstance(v, float) for v in pilot[0][1].values())


def test_the_guide_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/loggers.md's example runs and its hparams file holds the summary's words."""
    import re

    guide = Path(__file__).parents[2] / "docs" / "loggers.md"
    (code,) = re.findall(r"```python\n(.*?)```", guide.read_text(), re.S)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, str(guide), "exec"), namespace)
    hparams = yaml.safe_load((Path(namespace["logger"].log_dir) / "hparams.yaml").read_text())
    assert hparams["pilot/verdict/resume"] == "pass"
    assert hparams["pilot/ledger/stop_cause"] == "max_steps"
