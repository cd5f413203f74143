"""DivergenceLedger in real fits: every exit path leaves its record, diverged runs are kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset

from lightning_pilot import storage
from lightning_pilot.callbacks import DivergenceLedger
from lightning_pilot.callbacks.divergence_ledger import RepeatedVariantError, RepeatedVariantWarning
from lightning_pilot.core.divergence import DivergenceRules
from lightning_pilot.core.ledger_records import Heartbeat
from lightning_pilot.demo import InstructionDataModule, TinyCausalLM
from lightning_pilot.ledger import Ledger

WORKER = Path(__file__).parents[1] / "workers" / "ledger_fit.py"


class Scripted(BoringModel):
    """BoringModel that misbehaves on purpose from a given update (1 = the first)."""

    def __init__(self, *, raise_at: int = 0, error: BaseException | None = None,
                 offset_from: int = 0, offset: float = 0.0, offset_until: int = 10**9,
                 nan_from: int = 0) -> None:  # fmt: skip
        # Seeded: BoringModel's random data with batch size 1 gives very noisy losses, and an
        # unlucky tiny first loss would make "10 x the first loss" a real blow-up threshold.
        torch.manual_seed(0)
        super().__init__()
        self.raise_at, self.error = raise_at, error
        self.offset_from, self.offset, self.offset_until = offset_from, offset, offset_until
        self.nan_from = nan_from
        self.micro_losses: list[float] = []

    def train_dataloader(self) -> Any:
        # Batches of 8 (BoringModel's default is 1): per-update losses steady enough that only
        # what a test injects looks like a spike.
        return torch.utils.data.DataLoader(RandomDataset(32, 64), batch_size=8)

    def configure_optimizers(self) -> Any:
        # BoringModel's SGD(lr=0.1) really blows up on its random data after ~15 updates.
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        output = super().training_step(batch, batch_idx)
        update = self.global_step + 1
        if update == self.raise_at and self.error is not None:
            raise self.error
        loss = output["loss"]
        if self.offset_from and self.offset_from <= update < self.offset_until:
            # A constant added to the value only: the gradients do not change.
            loss = loss + self.offset
        if self.nan_from and update >= self.nan_from:
            loss = loss * float("nan")
        self.micro_losses.append(float(loss.detach()))
        return {"loss": loss}


def ledger_cb(**kwargs: Any) -> DivergenceLedger:
    options: dict[str, Any] = {"experiment": "tests", "variant": "v", "seed": 0}
    return DivergenceLedger(**(options | kwargs))


def runs_of(tmp_path: Path, **kwargs: Any) -> Any:
    return Ledger(tmp_path / "pilot", **kwargs).runs().set_index("variant")


# ---------------------------------------------------------------------------------------------
# A fine-tuning learning-rate sweep (control, half, double), on the demo LM
# ---------------------------------------------------------------------------------------------


def test_lr_sweep_keeps_the_diverged_variant(make_trainer: Any, tmp_path: Path) -> None:
    lrs = {"lr=1e-3": 1e-3, "lr=3e-3": 3e-3, "lr=100": 100.0}
    for seed in (0, 1):
        for name, lr in lrs.items():
            pl.seed_everything(seed, verbose=False)
            callback = ledger_cb(
                variant=name,
                seed=seed,
                params={"lr": lr},
                heartbeat=Heartbeat(updates=4),
                check_every=2,
            )
            trainer = make_trainer(
                max_steps=10, val_check_interval=5, limit_val_batches=1, callbacks=[callback]
            )
            model = TinyCausalLM(d_model=16, n_heads=2, n_layers=1, lr=lr)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RepeatedVariantWarning)
                trainer.fit(model, InstructionDataModule(dataset_size=128, batch_size=8, seed=seed))
    ledger = Ledger(tmp_path / "pilot")
    runs = ledger.runs()
    assert len(runs) == 6
    assert runs.groupby("variant")["status"].agg(set).to_dict() == {
        "lr=1e-3": {"completed"},
        "lr=3e-3": {"completed"},
        "lr=100": {"diverged"},
    }
    diverged = runs[runs["variant"] == "lr=100"]
    assert set(diverged["stop_cause"]) <= {"nonfinite_loss", "nonfinite_grad", "loss_blowup"}
    assert (diverged["stop_step"] < 10).all()
    # Rules are evaluated every 2 updates: the fit stops at the evaluation after the rule fired.
    assert (diverged["updates_done"] % 2 == 0).all()
    assert (diverged["updates_done"] - diverged["stop_step"]).between(0, 1).all()
    assert diverged["stop_detail"].notna().all()
    assert (diverged["lr"] == 100.0).all()
    completed = runs[runs["variant"] != "lr=100"]
    assert (completed["stop_cause"] == "max_steps").all()
    assert (completed["stop_step"] == 10).all()
    assert (completed["planned_updates"] == 10).all()
    assert (completed["micro_batch_size"] == 8).all()
    # Curves: a point per update up to the stop; validation points at steps 5 and 10.
    curves = ledger.curves()
    train = curves[curves["curve"] == "train_loss"]
    per_run = train.groupby("run_id")["step"].agg(list)
    done = runs.set_index("run_id")["updates_done"]
    assert all(steps == list(range(1, done[rid] + 1)) for rid, steps in per_run.items())
    val = curves[(curves["curve"] == "val") & (curves["name"] == "val_loss")]
    completed_val = val[val["variant"] != "lr=100"]
    assert sorted(set(completed_val["step"])) == [5, 10]
    # Compared across seeds: every run counted, the diverged variant ranked worst.
    result = ledger.compare("val_loss", control="lr=1e-3", min_runs_for_ci=2)
    summary = result.summary.set_index("variant")
    assert summary["n_runs"].to_dict() == {"lr=1e-3": 2, "lr=3e-3": 2, "lr=100": 2}
    assert summary.loc["lr=100", "n_diverged"] == 2
    assert summary.loc["lr=100", "median"] == float("inf")
    assert summary.loc["lr=3e-3", "paired_n"] == 2
    assert summary.loc["lr=3e-3", "mean_ci_low"] <= summary.loc["lr=3e-3", "mean"]
    worst = result.runs.sort_values("rank").tail(2)
    assert set(worst["status"]) == {"diverged"}


# ---------------------------------------------------------------------------------------------
# Records and curves
# ---------------------------------------------------------------------------------------------


def test_records_carry_configuration_environment_and_undivided_loss(
    make_trainer: Any, tmp_path: Path
) -> None:
    callback = ledger_cb(
        params={"lr": 0.01, "width": 32}, heartbeat=Heartbeat(updates=2), check_every=1
    )
    trainer = make_trainer(max_steps=5, accumulate_grad_batches=3, callbacks=[callback])
    model = Scripted()
    trainer.fit(model)
    records = Ledger(tmp_path / "pilot").records()
    assert records["event"].tolist() == ["start", "heartbeat", "heartbeat", "end"]
    end = records.iloc[-1]
    assert (end["status"], end["stop_cause"], end["stop_step"]) == ("completed", "max_steps", 5)
    assert end["params_json"] == '{"lr":0.01,"width":32}'
    assert end["accumulate_grad_batches"] == 3
    assert end["micro_batch_size"] == 8
    assert end["effective_batch_size"] == 24
    assert end["dp_replicas"] == 1
    assert end["planned_updates"] == 5
    assert end["lr"] == 0.01
    assert end["precision"] == "32-true"
    assert end["strategy"] == "SingleDeviceStrategy"
    assert end["device_name"] == "cpu"
    assert end["torch_version"] == torch.__version__
    assert end["python_version"] == ".".join(map(str, sys.version_info[:3]))
    assert len(records["variant_key"].unique()) == 1
    assert len(records["run_id"].unique()) == 1
    # The train loss of each update is the mean of its micro-batch losses, not divided by K.
    # An epoch has 8 micro-batches: Lightning steps on its last one, so update 3 has only 2
    # (their losses were divided by K=3 all the same; the ledger undoes it).
    windows = [(0, 3), (3, 6), (6, 8), (8, 11), (11, 14)]
    losses = model.micro_losses
    assert len(losses) == 14
    expected = [sum(losses[a:b]) / (b - a) for a, b in windows]
    values = [p["value"] for p in end["train_loss"]]
    assert values == pytest.approx(expected, rel=1e-6)
    assert [p["step"] for p in end["train_loss"]] == [1, 2, 3, 4, 5]
    assert [p["value"] for p in end["lr_curve"]] == pytest.approx([0.01] * 5)
    # Heartbeats carry the points since the previous record; start and end the whole curve.
    assert [len(r) for r in records["train_loss"]] == [0, 2, 2, 5]
    assert records["curves_delta"].tolist() == [False, True, True, False]
    assert [p["step"] for p in records["train_loss"].iloc[2]] == [3, 4]


def test_nan_loss_stops_the_fit_and_is_recorded(make_trainer: Any, tmp_path: Path) -> None:
    trainer = make_trainer(max_steps=20, callbacks=[ledger_cb(check_every=1)])
    trainer.fit(Scripted(nan_from=4))
    assert trainer.global_step == 4
    run = runs_of(tmp_path).loc["v"]
    assert (run["status"], run["stop_cause"], run["stop_step"]) == ("diverged", "nonfinite_loss", 4)
    assert run["stop_detail"] == "training loss is nan"
    events = storage.read_snapshot_table(
        tmp_path / "pilot" / "runs" / run["run_id"] / "divergence.parquet"
    ).to_pandas()
    first = events.iloc[0]
    assert (first["event"], first["step"], first["action"]) == ("nonfinite_loss", 4, "stop")


def test_rules_read_every_loss_but_sync_every_check_every_updates(
    make_trainer: Any, tmp_path: Path
) -> None:
    # Default check_every=10: the losses stay on the device and are read at updates 10, 20...
    trainer = make_trainer(max_steps=30, callbacks=[ledger_cb()])
    trainer.fit(Scripted(nan_from=4))
    assert trainer.global_step == 10  # stopped at the first evaluation after the rule fired
    run = runs_of(tmp_path).loc["v"]
    assert (run["status"], run["stop_cause"]) == ("diverged", "nonfinite_loss")
    assert (run["stop_step"], run["updates_done"]) == (4, 10)  # where it fired, where it stopped
    curve = Ledger(tmp_path / "pilot").curves()
    train = curve[curve["curve"] == "train_loss"]
    assert train["step"].tolist() == list(range(1, 11))
    assert train["value"].iloc[:3].notna().all()
    assert train["value"].iloc[3:].isna().all()


def test_heartbeats_by_time_carry_only_new_points_and_the_ledger_joins_them(
    make_trainer: Any, tmp_path: Path
) -> None:
    # Heartbeat(seconds=0): a heartbeat at every evaluation (every 3 updates here).
    callback = ledger_cb(check_every=3, heartbeat=Heartbeat(seconds=0))
    make_trainer(max_steps=10, callbacks=[callback]).fit(Scripted())
    ledger = Ledger(tmp_path / "pilot")
    records = ledger.records()
    assert records["event"].tolist() == ["start", "heartbeat", "heartbeat", "heartbeat", "end"]
    assert [[p["step"] for p in r] for r in records["train_loss"]] == [
        [],
        [1, 2, 3],
        [4, 5, 6],
        [7, 8, 9],
        list(range(1, 11)),
    ]
    # Without the end record (a killed run), the heartbeats' points make the whole curve.
    (end,) = (tmp_path / "pilot" / "ledger").glob("*-end-*.parquet")
    end.unlink()
    curve = Ledger(tmp_path / "pilot").curves()
    assert curve[curve["curve"] == "train_loss"]["step"].tolist() == list(range(1, 10))
    assert curve[curve["curve"] == "lr"]["step"].tolist() == list(range(1, 10))


def test_record_action_trains_on_but_the_run_reads_diverged(
    make_trainer: Any, tmp_path: Path
) -> None:
    trainer = make_trainer(max_steps=8, callbacks=[ledger_cb(action="record")])
    trainer.fit(Scripted(nan_from=3))
    assert trainer.global_step == 8
    run = runs_of(tmp_path).loc["v"]
    assert (run["status"], run["stop_cause"], run["stop_step"]) == ("diverged", "nonfinite_loss", 3)
    assert "action='record'" in run["stop_detail"]
    assert run["updates_done"] == 8


def test_persistent_spike_stops_and_isolated_spike_does_not(
    make_trainer: Any, tmp_path: Path
) -> None:
    # A blow-up factor of 100 keeps the blow-up rule out of this test.
    rules = DivergenceRules(
        window=4, warmup=4, spike_factor=3.0, spike_patience=3, blowup_factor=100.0
    )
    # Isolated: +10 on updates 6 and 7 only.
    trainer = make_trainer(max_steps=12, callbacks=[ledger_cb(variant="iso", rules=rules)])
    trainer.fit(Scripted(offset_from=6, offset=10.0, offset_until=8))
    # Persistent: +10 from update 6 on -> fatal at the third spike update, 8.
    trainer = make_trainer(max_steps=12, callbacks=[ledger_cb(variant="per", rules=rules)])
    trainer.fit(Scripted(offset_from=6, offset=10.0))
    runs = runs_of(tmp_path)
    assert (runs.loc["iso", "status"], runs.loc["iso", "stop_step"]) == ("completed", 12)
    per = runs.loc["per"]
    assert (per["status"], per["stop_cause"], per["stop_step"]) == (
        "diverged",
        "loss_spike_persistent",
        8,
    )
    iso_events = storage.read_snapshot_table(
        tmp_path / "pilot" / "runs" / runs.loc["iso", "run_id"] / "divergence.parquet"
    ).to_pandas()
    assert iso_events[["step", "event"]].values.tolist() == [[6, "spike"], [8, "spike_end"]]


# ---------------------------------------------------------------------------------------------
# Exit paths in this process
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "status", "cause"),
    [
        (ArithmeticError("user bug at update 3"), "failed", "exception:ArithmeticError"),
        (
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
            "oom",
            "cuda_oom",
        ),
    ],
)
def test_exceptions_are_recorded_and_reach_the_caller(
    make_trainer: Any, tmp_path: Path, error: BaseException, status: str, cause: str
) -> None:
    trainer = make_trainer(max_steps=10, callbacks=[ledger_cb(heartbeat=Heartbeat(updates=1))])
    with pytest.raises(type(error)) as caught:
        trainer.fit(Scripted(raise_at=3, error=error))
    assert caught.value is error  # the user's own exception object, untouched
    run = runs_of(tmp_path).loc["v"]
    assert (run["status"], run["stop_cause"], run["stop_step"]) == (status, cause, 2)
    assert run["exception_type"] == type(error).__name__
    assert run["exception_message"] == str(error)
    curve = Ledger(tmp_path / "pilot").curves()
    assert curve[curve["curve"] == "train_loss"]["step"].tolist() == [1, 2]


def test_early_stopping_reason_is_recorded(make_trainer: Any, tmp_path: Path) -> None:
    stopper = EarlyStopping(monitor="val_loss", stopping_threshold=1e6)
    trainer = make_trainer(
        max_steps=30,
        val_check_interval=4,
        limit_val_batches=1,
        callbacks=[ledger_cb(), stopper],
    )
    trainer.fit(
        TinyCausalLM(d_model=16, n_heads=2, n_layers=1),
        InstructionDataModule(dataset_size=96, batch_size=8),
    )
    run = runs_of(tmp_path).loc["v"]
    assert (run["status"], run["stop_cause"]) == ("stopped", "early_stopping")
    assert run["stop_detail"].startswith("stopping_threshold: Stopping threshold reached")
    assert run["stop_step"] == trainer.global_step < 30


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def test_fewer_updates_than_planned_is_a_shortfall(make_trainer: Any, tmp_path: Path) -> None:
    trainer = make_trainer(max_steps=10, callbacks=[ledger_cb(), StopAt(4)])
    trainer.fit(Scripted())
    run = runs_of(tmp_path).loc["v"]
    assert (run["status"], run["stop_cause"], run["stop_step"]) == ("stopped", "step_shortfall", 4)
    assert run["stop_detail"] == "4 of 10 planned updates done"


@pytest.mark.parametrize(
    "options",
    [
        {"fast_dev_run": 2},
        {"overfit_batches": 2, "max_steps": 3},
        {"max_epochs": 1, "max_steps": -1},
    ],
)
def test_composes_with_trainer_modes(make_trainer: Any, tmp_path: Path, options: Any) -> None:
    trainer = make_trainer(callbacks=[ledger_cb()], **options)
    trainer.fit(Scripted())
    run = runs_of(tmp_path).loc["v"]
    assert run["status"] == "completed"
    assert run["stop_step"] == trainer.global_step == run["planned_updates"]


# ---------------------------------------------------------------------------------------------
# Repeats, relaunches and resume
# ---------------------------------------------------------------------------------------------


def test_repeating_a_diverged_variant_warns_and_can_refuse(
    make_trainer: Any, tmp_path: Path
) -> None:
    trainer = make_trainer(max_steps=6, callbacks=[ledger_cb(params={"lr": 9.0})])
    trainer.fit(Scripted(nan_from=2))
    failed_id = runs_of(tmp_path).loc["v", "run_id"]
    with pytest.warns(RepeatedVariantWarning, match=rf"{failed_id} \(diverged: nonfinite_loss"):
        make_trainer(max_steps=2, callbacks=[ledger_cb(params={"lr": 9.0})]).fit(Scripted())
    before = len(Ledger(tmp_path / "pilot").records())
    refusing = ledger_cb(params={"lr": 9.0}, on_repeat="error")
    with pytest.raises(RepeatedVariantError, match=failed_id):
        make_trainer(max_steps=2, callbacks=[refusing]).fit(Scripted())
    assert len(Ledger(tmp_path / "pilot").records()) == before  # nothing written
    # A relaunch naming the failed run, or with another batch size, does not warn.
    with warnings.catch_warnings():
        warnings.simplefilter("error", RepeatedVariantWarning)
        relaunch = ledger_cb(variant="v2", params={"lr": 9.0}, derived_from=failed_id)
        make_trainer(max_steps=2, callbacks=[relaunch]).fit(Scripted())
        other_batch = ledger_cb(variant="v3", params={"lr": 9.0})
        model = Scripted()
        model.train_dataloader = lambda: torch.utils.data.DataLoader(  # type: ignore[method-assign]
            __import__(
                "lightning.pytorch.demos.boring_classes", fromlist=["RandomDataset"]
            ).RandomDataset(32, 64),
            batch_size=4,
        )
        make_trainer(max_steps=2, callbacks=[other_batch]).fit(model)
    runs = runs_of(tmp_path)
    assert runs.loc["v2", "derived_from_run_id"] == failed_id
    assert runs.loc["v3", "micro_batch_size"] == 4
    assert runs.loc["v3", "variant_key"] != runs.loc["v", "variant_key"].iloc[0]
    assert len(runs.loc["v"]) == 2  # the diverged run and its warned repeat: both kept


# Lightning's own notes on this deliberate mid-epoch resume of a plain DataLoader.
@pytest.mark.filterwarnings("ignore:.*dataloader is not resumable", "ignore:Checkpoint directory")
def test_resume_keeps_the_run_id_as_a_new_attempt(make_trainer: Any, tmp_path: Path) -> None:
    checkpoints = tmp_path / "ckpt"
    saver = ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=4, save_top_k=-1)
    first = ledger_cb(heartbeat=Heartbeat(updates=1))
    trainer = make_trainer(max_steps=10, enable_checkpointing=True, callbacks=[first, saver])
    with pytest.raises(ArithmeticError):
        trainer.fit(Scripted(raise_at=6, error=ArithmeticError("crash")))
    run_id = first.run.run_id
    second = ledger_cb(heartbeat=Heartbeat(updates=1))
    trainer = make_trainer(max_steps=10, enable_checkpointing=True, callbacks=[second, saver])
    trainer.fit(Scripted(), ckpt_path=checkpoints / "epoch=0-step=4.ckpt")
    assert second.run.run_id == run_id
    assert second.run.attempt == 2
    ledger = Ledger(tmp_path / "pilot")
    runs = ledger.runs()
    assert len(runs) == 1
    run = runs.iloc[0]
    assert (run["status"], run["stop_step"], run["attempts"]) == ("completed", 10, 2)
    records = ledger.records()
    assert records.groupby("attempt")["event"].agg(list).to_dict()[1][-1] == "end"
    assert records[records["event"] == "end"]["status"].tolist() == ["failed", "completed"]
    # One continuous curve: steps 1-4 restored from the checkpoint, 5-10 trained again.
    train = ledger.curves().query("curve == 'train_loss'")
    assert train["step"].tolist() == list(range(1, 11))
    both = ledger.curves(all_attempts=True).query("curve == 'train_loss'")
    assert both.groupby("attempt")["step"].max().to_dict() == {1: 5, 2: 10}


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"experiment": ""}, ValueError, r"DivergenceLedger\(experiment=''\) is invalid"),
        ({"variant": None}, TypeError, r"variant=None\) is invalid: expected a string .*NoneType"),
        ({"variant": "a\nb"}, ValueError, r"variant='a\\nb'\) is invalid: expected 1 to 200"),
        (
            {"seed": -1},
            ValueError,
            r"DivergenceLedger\(seed=-1\) is invalid: expected an integer >= 0",
        ),
        ({"seed": 1.5}, TypeError, r"seed=1.5\) is invalid"),
        (
            {"params": {"lr": float("inf")}},
            ValueError,
            r"params=\{'lr': inf\}\) is invalid: .*params\['lr'\]=inf is not finite",
        ),
        ({"params": {"a": {1: 2}}}, TypeError, r"params\['a'\] has the key 1"),
        ({"params": {"f": print}}, TypeError, r"params\['f'\] is a builtin_function_or_method"),
        (
            {"derived_from": "../x"},
            ValueError,
            r"derived_from='../x'\) is invalid: expected a run id",
        ),
        ({"derived_from": 3}, TypeError, r"derived_from=3\) is invalid"),
        (
            {"action": "halt"},
            ValueError,
            r"action='halt'\) is invalid: expected one of 'stop', 'record'",
        ),
        ({"on_repeat": "raise"}, ValueError, r"on_repeat='raise'\) is invalid: expected one of"),
        ({"check_every": 0}, ValueError, r"check_every=0\) is invalid: expected an integer >= 1"),
        ({"check_every": None}, TypeError, r"check_every=None\) is invalid"),
        (
            {"heartbeat": {"updates": 2}},
            TypeError,
            r"heartbeat=\{'updates': 2\}\) is invalid: expected a Heartbeat",
        ),
        (
            {"val_metrics": "val_loss"},
            TypeError,
            r"val_metrics='val_loss'\) is invalid: expected a",
        ),
        ({"val_metrics": ["val", ""]}, ValueError, r"val_metrics=\['val', ''\]\) is invalid"),
        (
            {"rules": {"window": 3}},
            TypeError,
            r"rules=\{'window': 3\}\) is invalid: expected a Div",
        ),
    ],
)
def test_bad_arguments_are_refused(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ledger_cb(**kwargs)


def test_params_that_are_not_a_dict_are_named() -> None:
    with pytest.raises(TypeError) as caught:
        ledger_cb(params=[1, 2])
    assert str(caught.value).startswith(
        "DivergenceLedger(params=[1, 2]) is invalid: expected a dict of str -> scalar"
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"updates": 0},
            ValueError,
            r"Heartbeat\(updates=0\) is invalid: expected an integer >= 1 or None \(updates\)",
        ),
        (
            {"seconds": -1},
            ValueError,
            r"Heartbeat\(seconds=-1\) is invalid: expected a finite number >= 0 \(seconds\)",
        ),
        ({"seconds": float("nan")}, ValueError, r"Heartbeat\(seconds=nan\) is invalid: .*finite"),
        ({"seconds": float("inf")}, ValueError, r"Heartbeat\(seconds=inf\) is invalid: .*finite"),
        ({"seconds": 10**400}, ValueError, r"Heartbeat\(seconds=.*\) is invalid: .*finite"),
        ({"seconds": "60"}, TypeError, r"Heartbeat\(seconds='60'\) is invalid"),
    ],
)
def test_bad_heartbeats_are_refused(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        Heartbeat(**kwargs)


def test_state_keys_differ_per_variant() -> None:
    assert ledger_cb(variant="a").state_key != ledger_cb(variant="b").state_key


# ---------------------------------------------------------------------------------------------
# Processes: KeyboardInterrupt, SIGTERM, SIGKILL, concurrent writers, DDP
# ---------------------------------------------------------------------------------------------


def start(out: Path, mode: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(out), mode, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def finish(process: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str]:
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Four worker processes appending to one ledger at the same time, each ending its own way.

    One trains to the end, one raises KeyboardInterrupt, one gets SIGTERM and one is killed
    with SIGKILL once it is past its second heartbeat.
    """
    shared = tmp_path_factory.mktemp("ledger-processes")
    started = {
        "normal": start(shared, "normal", "--variant", "normal"),
        "keyboard": start(shared, "keyboard", "--variant", "keyboard", "--at", "3"),
        "sigterm": start(shared, "sigterm", "--variant", "sigterm", "--at", "3"),
        "hang": start(shared, "hang", "--variant", "hang", "--at", "6", "--steps", "20"),
    }
    ready = shared / "ready-hang"
    deadline = time.monotonic() + 180
    while not ready.exists() and started["hang"].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    started["hang"].send_signal(signal.SIGKILL)
    results = {name: finish(process) for name, process in started.items()}
    return {"shared": shared, "results": results, "ready": ready.exists()}


def test_four_concurrent_runs_lose_nothing(processes: dict[str, Any]) -> None:
    records = Ledger(processes["shared"]).records()
    # Heartbeats every 2 updates; every record of every run is there, none twice.
    assert records.groupby("variant")["event"].agg(list).to_dict() == {
        "normal": ["start", "heartbeat", "heartbeat", "heartbeat", "heartbeat", "end"],
        "keyboard": ["start", "heartbeat", "end"],
        "sigterm": ["start", "heartbeat", "end"],
        "hang": ["start", "heartbeat", "heartbeat"],
    }
    assert records["record_id"].is_unique
    assert records.groupby("variant")["run_id"].nunique().eq(1).all()
    assert not [p for p in (processes["shared"] / "ledger").iterdir() if p.name.startswith(".")]
    code, output = processes["results"]["normal"]
    assert code == 0, output
    run = Ledger(processes["shared"]).runs().set_index("variant").loc["normal"]
    assert (run["status"], run["stop_cause"], run["stop_step"]) == ("completed", "max_steps", 8)


def test_keyboard_interrupt_and_sigterm_end_as_interrupted(processes: dict[str, Any]) -> None:
    runs = Ledger(processes["shared"]).runs().set_index("variant")
    code, output = processes["results"]["keyboard"]
    assert code == 1, output  # Lightning's sys.exit(1) after a KeyboardInterrupt
    run = runs.loc["keyboard"]
    assert (run["status"], run["stop_cause"]) == ("interrupted", "keyboard_interrupt")
    assert (run["exception_type"], run["stop_step"]) == ("KeyboardInterrupt", 2)

    code, output = processes["results"]["sigterm"]
    # SIGTERMException is a SystemExit without a code: the process exits 0, on purpose.
    assert code == 0, output
    assert "Received SIGTERM" in output
    run = runs.loc["sigterm"]
    assert (run["status"], run["stop_cause"]) == ("interrupted", "sigterm")
    assert (run["exception_type"], run["stop_step"]) == ("SIGTERMException", 3)


def test_a_killed_run_reads_as_heartbeat_lost_with_its_curve(processes: dict[str, Any]) -> None:
    code, output = processes["results"]["hang"]
    assert processes["ready"], output
    assert code == -signal.SIGKILL
    ledger = Ledger(processes["shared"], stale_after=0)
    run = ledger.runs().set_index("variant").loc["hang"]
    assert (run["status"], run["stop_cause"], run["last_event"]) == (
        "interrupted",
        "heartbeat_lost",
        "heartbeat",
    )
    assert run["updates_done"] == 4
    curves = ledger.curves()
    curve = curves[(curves["variant"] == "hang") & (curves["curve"] == "train_loss")]
    assert curve["step"].tolist() == [1, 2, 3, 4]
    assert curve["value"].notna().all()
    # While fresh (the default 30 minutes), the same run reads as still running.
    fresh = Ledger(processes["shared"]).runs().set_index("variant")
    assert fresh.loc["hang", "status"] == "running"


@pytest.mark.distributed
def test_ddp_ranks_stop_together_on_one_ranks_blowup(tmp_path: Path) -> None:
    code, output = finish(start(tmp_path, "ddp", "--at", "3", "--steps", "12"), timeout=180)
    assert code == 0, output
    steps = {p.name: p.read_text().split() for p in tmp_path.glob("steps-r*.txt")}
    # Rank 1's loss blew up from update 3 (patience 2): both ranks stopped after update 4.
    assert steps["steps-r0.txt"] == steps["steps-r1.txt"]
    assert steps["steps-r0.txt"][0] == "4"
    ledger = Ledger(tmp_path)
    records = ledger.records()
    assert records["event"].tolist() == ["start", "heartbeat", "heartbeat", "end"]
    run = ledger.runs().iloc[0]
    assert (run["status"], run["stop_cause"], run["stop_step"]) == ("diverged", "loss_blowup", 4)
    assert run["stop_detail"] == "loss_blowup fired on another rank at step 4"
    assert (run["devices"], run["dp_replicas"], run["strategy"]) == (2, 2, "DDPStrategy")
    events = storage.read_snapshot_table(
        tmp_path / "runs" / run["run_id"] / "divergence.parquet"
    ).to_pandas()
    assert events[["rank", "step", "event"]].values.tolist() == [[1, 4, "loss_blowup"]]


def test_an_unreadable_device_at_the_exception_still_leaves_the_end_record(
    make_trainer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning_pilot.callbacks.divergence_ledger as module

    def unreadable(tensors: list[torch.Tensor]) -> list[float]:
        raise RuntimeError("device-side assert triggered")

    trainer = make_trainer(max_steps=20, callbacks=[ledger_cb(check_every=10)])
    monkeypatch.setattr(module, "read_scalars", unreadable)
    with pytest.raises(ValueError, match="user bug"):
        trainer.fit(Scripted(raise_at=4, error=ValueError("user bug")))
    run = runs_of(tmp_path).loc["v"]
    assert (run["status"], run["stop_cause"]) == ("failed", "exception:ValueError")
    assert run["stop_detail"] == (
        "the losses of the last 3 update(s) could not be read: device-side assert triggered"
    )
