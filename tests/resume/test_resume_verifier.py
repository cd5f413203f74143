"""ResumeVerifier with real new processes: exact resumes pass, each resume trap is diagnosed."""

from __future__ import annotations

import pathlib
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import pytest
import torch
from tiny_models import IdExamples
from torch import nn
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_pilot import read_phase_table
from lightning_pilot.demo import InstructionDataModule, TinyCausalLM
from lightning_pilot.resume import ResumeVerifier

pytestmark = pytest.mark.timeout(300)


class Net(pl.LightningModule):
    """A small classifier that owns its data; options plant the resume traps."""

    def __init__(
        self,
        stateful: bool = True,
        steps_from_trainer: bool = False,
        reset_on_load: str = "",
        data_dir: Any = None,
        plateau: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.register_buffer("scale", torch.tensor(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self(batch["inputs"]), batch["labels"])
        if self.hparams.get("plateau"):  # a metric that never improves: every step lowers the rate
            self.log("rising", float(self.global_step))
        return loss

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self(batch["inputs"])

    def train_dataloader(self) -> DataLoader[Any]:
        loader = StatefulDataLoader if self.hparams["stateful"] else DataLoader
        return loader(IdExamples(64), batch_size=4, shuffle=True)

    def configure_optimizers(self) -> Any:
        if self.hparams["steps_from_trainer"]:
            _ = self.trainer.estimated_stepping_batches  # the Lightning #20550 pattern
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        if self.hparams["plateau"]:
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
            schedule = {"scheduler": plateau, "interval": "step", "monitor": "rising"}
            return {"optimizer": optimizer, "lr_scheduler": schedule}
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.hparams["reset_on_load"] == "lr":
            checkpoint["optimizer_states"][0]["param_groups"][0]["lr"] = 0.5
        elif self.hparams["reset_on_load"] == "optimizer":
            checkpoint["optimizer_states"][0]["state"] = {}


def _fit(
    tmp_path: Path, model: pl.LightningModule, verifier: ResumeVerifier, **options: Any
) -> pd.DataFrame:
    datamodule = options.pop("datamodule", None)
    extra = options.pop("callbacks", [])
    trainer = pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[verifier, *extra],
        **({"max_steps": 6, "enable_checkpointing": False} | options),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=datamodule)
    return read_phase_table(verifier.run.run_dir)


def _checks(frame: pd.DataFrame) -> dict[str, tuple[str, str]]:
    row = frame[frame["phase"] == "resume"].iloc[0]
    return {c["name"]: (c["verdict"], c["detail"]) for c in row["checks"]}


class _LastBatch(pl.Callback):
    """When the fit's last training batch ended, and whether the module was still training."""

    def __init__(self) -> None:
        self.at = 0.0

    def on_train_batch_end(self, *args: Any) -> None:
        self.at = time.time()


@pytest.fixture(scope="module")
def stateful_fit(tmp_path_factory: pytest.TempPathFactory) -> tuple[pd.DataFrame, Path, float]:
    """A StatefulDataLoader, probes at update 2 (3 updates compared) and at the end of the
    first epoch (update 16), the artifact checked: one fit and its one new process, read by
    the tests below. Its phase table, run folder and when its last training batch ended."""
    last = _LastBatch()
    verifier = ResumeVerifier(at_step=2, compare_steps=3)  # mid-epoch, epoch boundary, artifact
    root = tmp_path_factory.mktemp("stateful")
    frame = _fit(root, Net(stateful=True), verifier, max_steps=20, callbacks=[last])
    run_dir = verifier.run.run_dir
    assert isinstance(run_dir, Path)  # a local output folder
    return frame, run_dir, last.at


def test_verification_runs_once_after_the_fit_in_one_process(
    stateful_fit: tuple[pd.DataFrame, Path, float],
) -> None:
    """Training never waits for the verification, and the new process never shares the device
    with the fit: it starts after Lightning's teardown, one process for every checkpoint."""
    frame, run_dir, last_batch_at = stateful_fit
    checks = _checks(frame)
    assert checks["loss_trajectory"][0] == "pass"
    assert checks["epoch_boundary.loss_trajectory"][0] == "pass", checks
    # The epoch training continues in (the next one), read at the first micro-batch on both
    # sides: at train start the resumed loop has not moved past the closed epoch yet.
    assert checks["epoch_boundary.epoch"] == ("pass", ""), checks["epoch_boundary.epoch"]
    assert checks["artifact_roundtrip"][0] == "pass"
    folder = run_dir / "resume"
    specs = sorted(p.name for p in folder.glob("spec-*.json"))
    assert specs == ["spec-tasks.json"]  # one process for two probes and the artifact
    assert (folder / "spec-tasks.json").stat().st_mtime >= last_batch_at  # after the last batch


def test_stateful_loader_resumes_exactly_in_a_new_process(
    stateful_fit: tuple[pd.DataFrame, Path, float],
) -> None:
    frame, run_dir, _ = stateful_fit
    checks = _checks(frame)
    for name in (
        "weights_only_load", "global_step", "epoch", "lrs", "optimizer_state",
        "scheduler_state", "weights", "rng", "data_position", "loss_trajectory",
        "lr_trajectory", "updates_after_resume", "artifact_roundtrip",
    ):  # fmt: skip
        assert checks[name][0] == "pass", (name, checks[name])
    assert checks["weights_only_load"][1] == "loaded in a new process"
    assert checks["grad_scaler"] == ("pass", "none saved, none restored")
    assert "sha256" in checks["artifact_roundtrip"][1]
    load = frame[frame["phase"] == "checkpoint_load"].iloc[0]
    assert load["file_bytes"] > 0
    assert load["duration_s"] > 0
    detail = pd.read_parquet(run_dir / "resume.parquet")
    micro = detail[(detail["check"] == "micro_batch") & (detail["checkpoint_step"] == 2)]
    assert len(micro) == 3  # the 3 compared updates of the mid-epoch probe
    assert micro["equal"].all()


@pytest.fixture(scope="module")
def plain_checks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """A plain shuffled DataLoader, probes at update 3 (2 updates compared) and at the end of
    the first epoch (update 16): one fit and its one new process, read by the tests below."""
    verifier = ResumeVerifier(at_step=3, compare_steps=2, check_artifact=False)
    root = tmp_path_factory.mktemp("plain")
    return _checks(_fit(root, Net(stateful=False), verifier, max_steps=20))


def test_plain_shuffled_loader_replays_data_after_a_mid_epoch_resume(
    plain_checks: dict[str, tuple[str, str]],
) -> None:
    checks = plain_checks
    verdict, detail = checks["data_position"]
    assert verdict == "fail"
    assert "the DataLoader cannot resume mid-epoch" in detail
    assert "use torchdata's StatefulDataLoader (an end-of-epoch checkpoint does not help" in detail
    assert checks["loss_trajectory"][0] == "fail"
    # Step, LR schedule and optimizer state were restored: only the data went wrong.
    assert checks["global_step"][0] == checks["lrs"][0] == checks["optimizer_state"][0] == "pass"


def test_plain_loader_resumed_from_an_epoch_end_goes_back_into_the_finished_epoch(
    plain_checks: dict[str, tuple[str, str]],
) -> None:
    """Lightning 2.6.6 re-enters the finished epoch of an end-of-epoch checkpoint when the
    loader cannot save its position: the verdict says so, not "the counter was not restored"."""
    verdict, detail = plain_checks["epoch_boundary.epoch"]
    assert verdict == "fail"
    assert detail.startswith(
        "training continued in epoch 1, the resumed run went back into the finished epoch 0"
    )
    assert "StatefulDataLoader" in detail


def test_estimated_stepping_batches_drops_the_loader_state(tmp_path: Path) -> None:
    verifier = ResumeVerifier(at_step=3, compare_steps=2, check_artifact=False)
    # With max_steps alone Lightning estimates without loading data; a max_epochs makes it
    # load the training data early, which is what drops the loader state on resume.
    model = Net(stateful=True, steps_from_trainer=True)
    checks = _checks(_fit(tmp_path, model, verifier, max_epochs=3))
    verdict, detail = checks["data_position"]
    assert verdict == "fail"
    assert "#20550" in detail
    assert "estimated_stepping_batches" in detail


@pytest.mark.parametrize(("reset", "check"), [("lr", "lrs"), ("optimizer", "optimizer_state")])
def test_on_load_checkpoint_that_resets_state_fails(tmp_path: Path, reset: str, check: str) -> None:
    verifier = ResumeVerifier(at_step=2, compare_steps=2, check_artifact=False)
    checks = _checks(_fit(tmp_path, Net(reset_on_load=reset), verifier))
    verdict, detail = checks[check]
    assert verdict == "fail"
    assert "after resume" in detail
    assert checks["loss_trajectory"][0] == "fail"


@pytest.mark.parametrize(
    ("value", "global_name"),
    [(pathlib.Path("/data/set"), "pathlib.PosixPath"), (np.float64(0.5), "numpy")],
    ids=["pathlib", "numpy"],
)
def test_unsafe_hyperparameter_is_named_with_its_origin(
    tmp_path: Path, value: Any, global_name: str
) -> None:
    verifier = ResumeVerifier(at_step=2, compare_steps=1, check_artifact=False)
    checks = _checks(_fit(tmp_path, Net(data_dir=value), verifier))
    verdict, detail = checks["weights_only_load"]
    assert verdict == "fail"
    assert "torch.load(weights_only=True) refused the checkpoint" in detail
    assert global_name in detail
    assert "hyper_parameters.data_dir" in detail


def _export_without_buffer(module: pl.LightningModule, directory: Path) -> Path:
    path = directory / "weights.pt"
    state = {k: v for k, v in module.state_dict().items() if k != "scale"}
    torch.save(state, path)
    return path


def _export_all(module: pl.LightningModule, directory: Path) -> Path:
    path = directory / "weights.pt"
    torch.save(module.state_dict(), path)
    return path


def test_artifact_round_trip_catches_an_export_that_drops_a_buffer(tmp_path: Path) -> None:
    # at_step beyond the fit: only the artifact round trip runs a new process here.
    good = ResumeVerifier(at_step=10, compare_steps=1, export=_export_all)
    checks = _checks(_fit(tmp_path / "good", Net(), good, max_steps=3))
    assert checks["artifact_roundtrip"][0] == "pass"
    assert "weights.pt sha256" in checks["artifact_roundtrip"][1]
    assert good.run.ledger_fields["checkpoint_uri"].endswith("weights.pt")

    bad = ResumeVerifier(at_step=10, compare_steps=1, export=_export_without_buffer)
    checks = _checks(_fit(tmp_path / "bad", Net(), bad, max_steps=3))
    verdict, detail = checks["artifact_roundtrip"]
    assert verdict == "fail"
    assert "did not reload into a fresh module" in detail
    assert "scale" in detail


def test_demo_lm_with_a_stateful_datamodule_and_fast_dev_run(tmp_path: Path) -> None:
    data = InstructionDataModule(dataset_size=128, batch_size=8, max_length=32, stateful=True)
    verifier = ResumeVerifier(at_step=2, compare_steps=2, check_artifact=False)
    checks = _checks(
        _fit(tmp_path, TinyCausalLM(max_length=32), verifier, fast_dev_run=4, max_steps=-1,
             datamodule=data)
    )  # fmt: skip
    assert {name: v for name, (v, _) in checks.items() if v != "pass"} == {}


def test_unimportable_module_says_so_and_the_fallback_runs_in_process(tmp_path: Path) -> None:
    class LocalNet(Net):  # defined in a function: a new process cannot import it
        pass

    plain = ResumeVerifier(at_step=2, compare_steps=1, check_artifact=False)
    verdict, detail = _checks(_fit(tmp_path / "a", LocalNet(), plain))["rebuild"]
    assert verdict == "not_checked"  # resume could not be verified, and it says why
    assert "cannot be imported by a new process" in detail
    assert "fallback='in_process'" in detail

    fallback = ResumeVerifier(
        at_step=2, compare_steps=2, check_artifact=False, fallback="in_process"
    )
    checks = _checks(_fit(tmp_path / "b", LocalNet(), fallback))
    assert checks["weights_only_load"][1] == "loaded in the in-process fallback"
    assert checks["data_position"][0] == "pass"
    assert checks["loss_trajectory"][0] == "pass"


class _HookSpy(pl.Callback):
    """Whether Lightning would still call the verifier's batch hooks, after each batch."""

    def __init__(self, verifier: ResumeVerifier) -> None:
        self.verifier = verifier
        self.live: list[bool] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.live.append(callable(self.verifier.on_train_batch_start))


@pytest.fixture(scope="module")
def cut_epochs(tmp_path_factory: pytest.TempPathFactory) -> tuple[pd.DataFrame, Path, list[bool]]:
    """A StatefulDataLoader in epochs cut to 8 batches, probes at update 2 and at the end of
    the first epoch (update 8), 2 updates compared: one fit and its one new process, read by
    the tests below. Its phase table, run folder and the hook spy's record."""
    verifier = ResumeVerifier(at_step=2, compare_steps=2, check_artifact=False)
    spy = _HookSpy(verifier)
    root = tmp_path_factory.mktemp("cut")
    frame = _fit(
        root, Net(stateful=True), verifier, max_steps=14, limit_train_batches=8, callbacks=[spy]
    )
    run_dir = verifier.run.run_dir
    assert isinstance(run_dir, Path)  # a local output folder
    return frame, run_dir, spy.live


def test_epoch_boundary_checkpoint_is_checked_too(
    cut_epochs: tuple[pd.DataFrame, Path, list[bool]],
) -> None:
    frame, run_dir, _ = cut_epochs
    checks = _checks(frame)
    # Mid-epoch: the stateful loader resumes exactly.
    assert checks["data_position"][0] == "pass"
    assert checks["loss_trajectory"][0] == "pass"
    # At the end of the (cut) first epoch the loader resumes inside the old permutation.
    verdict, detail = checks["epoch_boundary.data_position"]
    assert verdict == "fail"
    assert "after an end-of-epoch checkpoint" in detail
    assert checks["epoch_boundary.global_step"][0] == "pass"
    assert checks["epoch_boundary.updates_after_resume"][0] == "pass"
    detail_rows = pd.read_parquet(run_dir / "resume.parquet")
    assert set(detail_rows["checkpoint_step"]) == {2, 8}


def test_batch_hooks_are_skipped_while_no_probe_needs_them(
    cut_epochs: tuple[pd.DataFrame, Path, list[bool]],
) -> None:
    frame, run_dir, live = cut_epochs
    # Epoch 1: ids kept up to the probe at update 2, updates 3-4 recorded and compared; from
    # batch 5 on Lightning skips the hooks. Epoch 2 starts them again for the epoch-boundary
    # probe taken at update 8 (updates 9-10), then they are skipped again.
    assert live == [True] * 4 + [False] * 4 + [True] * 2 + [False] * 4
    checks = _checks(frame)
    assert checks["global_step"][0] == checks["epoch_boundary.global_step"][0] == "pass"
    assert checks["loss_trajectory"][0] == "pass"
    detail_rows = pd.read_parquet(run_dir / "resume.parquet")
    assert set(detail_rows["checkpoint_step"]) == {2, 8}


def test_fit_shorter_than_the_checkpoint_step_is_not_checked(tmp_path: Path) -> None:
    verifier = ResumeVerifier(at_step=5, compare_steps=1, check_artifact=False)
    checks = _checks(_fit(tmp_path, Net(), verifier, max_steps=3))
    verdict, detail = checks["resume"]
    assert verdict == "not_checked"
    assert "before update 5" in detail


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"at_step": 0},
            ValueError,
            r"ResumeVerifier\(at_step=0\) is invalid: expected an integer >= 1",
        ),
        ({"compare_steps": "2"}, TypeError, r"compare_steps='2'\) is invalid"),
        ({"factory": "module.function"}, ValueError, r"expected 'package.module:function'"),
        ({"factory": "pkg.mod:"}, ValueError, r"factory='pkg.mod:'\) is invalid"),
        ({"factory": "a b:c"}, ValueError, r"factory='a b:c'\) is invalid"),
        ({"factory": 3}, TypeError, r"factory=3\) is invalid"),
        ({"timeout_s": 0}, ValueError, r"timeout_s=0\) is invalid: expected a finite number > 0"),
        ({"fallback": "thread"}, ValueError, r"fallback='thread'\) is invalid"),
        ({"atol": -1.0}, ValueError, r"atol=-1.0\) is invalid: expected a finite number >= 0"),
        ({"rtol": "0"}, TypeError, r"rtol='0'\) is invalid: expected a finite number >= 0"),
        ({"export": "weights.pt"}, TypeError, r"export='weights.pt'\) is invalid"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ResumeVerifier(**kwargs)


@pytest.mark.parametrize("name", ["epoch_boundary", "check_artifact"])
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None])
def test_boolean_options_take_only_a_bool(name: str, value: object) -> None:
    # A truthy string such as "no" must not switch the check on.
    with pytest.raises(TypeError, match=rf"ResumeVerifier\({name}=.*expected True or False"):
        ResumeVerifier(**{name: value})


@pytest.mark.parametrize("name", ["atol", "rtol", "timeout_s"])
@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), -float("inf"), pytest.param(10**400, id="10**400")]
)
def test_float_options_must_be_finite(name: str, value: float) -> None:
    # A NaN timeout never times out; a NaN tolerance makes every comparison fail.
    with pytest.raises(ValueError, match=rf"ResumeVerifier\({name}=.*finite"):
        ResumeVerifier(**{name: value})


class Unsaved(Net):
    """Takes a constructor argument but never calls save_hyperparameters()."""

    def __init__(self, hidden: int = 16) -> None:
        pl.LightningModule.__init__(self)
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 2))
        self.register_buffer("scale", torch.tensor(3.0))

    def train_dataloader(self) -> DataLoader[Any]:
        return StatefulDataLoader(IdExamples(64), batch_size=4, shuffle=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        return None


def test_unsaved_constructor_arguments_are_not_rebuilt_silently(tmp_path: Path) -> None:
    verifier = ResumeVerifier(at_step=2, compare_steps=1, check_artifact=False)
    frame = _fit(tmp_path, Unsaved(hidden=32), verifier, max_steps=3)
    verdict, detail = _checks(frame)["rebuild"]
    assert verdict == "not_checked"
    assert "did not call save_hyperparameters()" in detail
    row = frame[frame["phase"] == "resume"].iloc[0]
    assert row["verdict"] == "not_checked"  # never "pass" when resume was not verified
    assert row["reason"].startswith("resume not verified")


def test_checkpoint_on_the_last_batch_of_an_epoch_expects_the_next_epoch(tmp_path: Path) -> None:
    verifier = ResumeVerifier(at_step=2, compare_steps=2, check_artifact=False)
    checks = _checks(_fit(tmp_path, Net(), verifier, max_steps=4, limit_train_batches=2))
    assert checks["epoch"] == ("pass", "")
    assert checks["global_step"][0] == "pass"


def test_a_resumed_fit_writes_and_checks_its_own_final_artifact(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    first = ResumeVerifier(at_step=10, compare_steps=1)
    _fit(tmp_path, Net(), first, max_steps=4, enable_checkpointing=True, callbacks=[checkpoints])
    second = ResumeVerifier(at_step=10, compare_steps=1)
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[second], max_steps=6,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Net(), ckpt_path=tmp_path / "ckpt" / "epoch=0-step=4.ckpt")
    assert second.run.attempt == 2
    resume_dir = second.run.run_dir / "resume"
    assert (resume_dir / "final-attempt-1.ckpt").exists()
    assert (resume_dir / "final-attempt-2.ckpt").exists()
    frame = read_phase_table(second.run.run_dir)
    checks = _checks(frame[frame["attempt"] == 2])
    assert checks["artifact_roundtrip"][0] == "pass"


@pytest.mark.parametrize("datamodule_first", [False, True])
def test_data_drawn_after_the_seed_is_rebuilt_in_the_scripts_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, datamodule_first: bool
) -> None:
    """A seeded script builds the DataModule before or after the module; its random data
    depend on which. The new process rebuilds in the order that gives the fit's data."""
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    pl.seed_everything(0, verbose=False)
    if datamodule_first:
        data, model = BoringDataModule(), BoringModel()
    else:
        model, data = BoringModel(), BoringDataModule()
    verifier = ResumeVerifier(
        at_step=1, compare_steps=1, epoch_boundary=False, check_artifact=False
    )
    checks = _checks(_fit(tmp_path, model, verifier, max_steps=3, datamodule=data))
    verdict, detail = checks["data_rebuilt"]
    assert verdict == "pass", detail
    assert ("DataModule before the module" in detail) is datamodule_first


class _Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Examples with ids and no length: Lightning counts the epoch's batches as infinite."""

    def __iter__(self) -> Any:
        generator = torch.Generator().manual_seed(0)
        for index in range(64):
            yield {
                "id": index,
                "inputs": torch.randn(8, generator=generator),
                "labels": torch.tensor(index % 2),
            }


class _StreamNet(Net):
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_Stream(), batch_size=4)


def test_a_loader_without_length_keeps_every_hook_working(tmp_path: Path) -> None:
    frame = _fit(tmp_path, _StreamNet(), ResumeVerifier(at_step=2, compare_steps=2))
    pilot = frame[frame["phase"] == "pilot"]
    reasons = " ".join(str(reason) for reason in pilot["reason"])
    assert "on_train_epoch_start" not in reasons, reasons
    # The stream starts over on resume: the examples after the checkpoint come again.
    verdict, detail = _checks(frame)["data_position"]
    assert verdict == "fail", detail
    assert "starts its order (a permutation, or a stream) over" in detail


def test_plateau_scheduler_on_step_fails_and_names_its_cause(tmp_path: Path) -> None:
    """Lightning steps a ReduceLROnPlateau with interval='step' after on_train_batch_end, where
    the checkpoint is saved: the resumed fit misses that update's step, and the check says so."""
    verifier = ResumeVerifier(at_step=2, compare_steps=3, check_artifact=False)
    checks = _checks(_fit(tmp_path, Net(plateau=True), verifier))
    assert checks["scheduler_state"][0] == "pass"  # restored exactly as saved
    verdict, detail = checks["lr_trajectory"]
    assert verdict == "fail"
    assert detail.startswith("learning rates first differ at micro-batch 0 (step 2)"), detail
    assert "ReduceLROnPlateau with interval='step' is stepped by Lightning after" in detail
    assert "use interval='epoch'" in detail
