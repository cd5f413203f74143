"""PilotRun and PilotCallback in real Trainer fits: one run per fit, one folder, every exit path."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pandas as pd
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_pilot import PilotCallback, PilotRun, read_phase_table, storage


class StepRecorder(PilotCallback):
    """A minimal pilot callback: one phase row per update, counted as it goes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.updates = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.updates += 1
        self.run.put_phase_row(
            {
                "phase": "optimizer_step",
                "first": self.updates == 1,
                "occurrences": 1 if self.updates == 1 else self.updates - 1,
                "step_last": trainer.global_step,
                "counter": "none",
                "verdict": "not_checked",
                "reason": "test recorder measures nothing",
            },
            source="StepRecorder",
        )


class OtherRecorder(PilotCallback):
    """A second pilot callback class, contributing a verdict to the same phase row."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run.put_phase_row(
            {
                "phase": "optimizer_step",
                "first": True,
                "verdict": "pass",
                "checks": [{"name": "step_counted", "verdict": "pass", "detail": "ok"}],
            },
            source="OtherRecorder",
        )


class FailingModel(BoringModel):
    """Raises the user's own error at a given step."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step == self.fail_at:
            raise ArithmeticError(f"user bug at step {self.fail_at}")
        return super().training_step(batch, batch_idx)


def test_callbacks_of_one_trainer_share_one_run(make_trainer: Any, tmp_path: Path) -> None:
    first, second = StepRecorder(), OtherRecorder()
    trainer = make_trainer(callbacks=[first, second])
    trainer.fit(BoringModel())

    assert first.run is second.run
    run = first.run
    assert run.closed
    assert run.out_dir == (tmp_path / "pilot").resolve()
    assert run.run_dir == run.out_dir / "runs" / run.run_id
    frame = read_phase_table(run.out_dir)
    assert len(frame) == 2  # first update and later updates, one row each
    first_row = frame[frame["first"]].iloc[0]
    assert first_row["run_id"] == run.run_id
    assert first_row["attempt"] == 1
    assert first_row["rank"] == 0
    assert first_row["verdict"] == "pass"  # merged from OtherRecorder
    assert first_row["source"] == "StepRecorder,OtherRecorder"
    assert first_row["reason"] == "test recorder measures nothing"
    later = frame[~frame["first"]].iloc[0]
    assert later["occurrences"] == 3
    assert later["step_last"] == 4
    assert pd.isna(later["peak_allocated_bytes"])  # never measured: null, not 0


def test_second_fit_is_a_new_run(make_trainer: Any) -> None:
    recorder = StepRecorder()
    trainer = make_trainer(callbacks=[recorder], max_steps=2)
    trainer.fit(BoringModel())
    first_run = recorder.run
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(BoringModel())
    assert recorder.run is not first_run
    assert recorder.run.run_id > first_run.run_id  # time-sortable
    assert PilotRun.last(trainer) is recorder.run
    runs = read_phase_table(first_run.out_dir)["run_id"].unique()
    assert set(runs) == {first_run.run_id, recorder.run.run_id}


def test_different_out_dirs_raise_naming_both(make_trainer: Any, tmp_path: Path) -> None:
    trainer = make_trainer(
        callbacks=[StepRecorder(out_dir=tmp_path / "a"), OtherRecorder(out_dir=tmp_path / "b")]
    )
    with pytest.raises(
        ValueError, match=r"StepRecorder\(out_dir='.*/a'\) and OtherRecorder\(out_dir='.*/b'\)"
    ):
        trainer.fit(BoringModel())


def test_one_explicit_out_dir_is_used_by_all(make_trainer: Any, tmp_path: Path) -> None:
    first, second = StepRecorder(), OtherRecorder(out_dir=tmp_path / "chosen")
    make_trainer(callbacks=[first, second]).fit(BoringModel())
    assert first.run.out_dir == (tmp_path / "chosen").resolve()
    assert not (tmp_path / "pilot").exists()
    assert len(read_phase_table(tmp_path / "chosen")) == 2


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (3, TypeError, r"StepRecorder\(out_dir=3\) is invalid: expected a folder path \(str or os"),
        (
            "",
            ValueError,
            r"StepRecorder\(out_dir=''\) is invalid: expected a non-empty folder path",
        ),
        ("a\x00b", ValueError, r"StepRecorder\(out_dir='a\\x00b'\) is invalid"),
    ],
)
def test_bad_out_dir_is_rejected_at_construction(value: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        StepRecorder(out_dir=value)


def test_run_before_setup_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"StepRecorder has no run yet"):
        _ = StepRecorder().run


def test_user_exception_propagates_and_rows_are_flushed(make_trainer: Any) -> None:
    recorder = StepRecorder()
    trainer = make_trainer(callbacks=[recorder], max_steps=10)
    with pytest.raises(ArithmeticError, match=r"^user bug at step 3$"):
        trainer.fit(FailingModel(fail_at=3))
    run = recorder.run
    assert run.closed
    assert isinstance(run.exception, ArithmeticError)
    frame = read_phase_table(run.run_dir)
    assert frame.set_index("first").loc[False, "step_last"] == 3  # rows up to the crash


def test_failed_write_during_a_crash_never_hides_the_user_error(
    make_trainer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(*args: Any, **kwargs: Any) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage, "write_snapshot", disk_full)
    trainer = make_trainer(callbacks=[StepRecorder()], max_steps=10)
    with (
        pytest.warns(RuntimeWarning, match=r"could not write run .* No space left"),
        pytest.raises(ArithmeticError, match=r"user bug at step 2"),
    ):
        trainer.fit(FailingModel(fail_at=2))


def test_explicit_flush_is_superseded_by_the_final_snapshot(make_trainer: Any) -> None:
    class FlushingRecorder(StepRecorder):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            super().on_train_batch_end(trainer, *args)
            if self.updates == 2:
                self.flushed = self.run.flush()
                # Readable mid-run, while the fit is still going.
                self.mid_run = read_phase_table(self.run.run_dir)

    recorder = FlushingRecorder()
    make_trainer(callbacks=[recorder]).fit(BoringModel())
    assert len(recorder.flushed) == 1
    assert recorder.mid_run.set_index("first").loc[False, "occurrences"] == 1
    files = list((recorder.run.run_dir / "phases.parquet").iterdir())
    assert [f.name.endswith("-00000002.parquet") for f in files] == [True]
    assert read_phase_table(recorder.run.run_dir).set_index("first").loc[False, "occurrences"] == 3


def test_resume_continues_the_run_as_the_next_attempt(make_trainer: Any, tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    first = StepRecorder()
    make_trainer(callbacks=[first, checkpoint], enable_checkpointing=True).fit(BoringModel())
    path = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"

    # The identity in the checkpoint loads with weights_only=True (no pickled objects).
    state = torch.load(path, weights_only=True)
    saved = [v for k, v in state["callbacks"].items() if k.startswith("StepRecorder")]
    assert saved == [{"version": 1, "pilot_run": {"run_id": first.run.run_id, "attempt": 1}}]

    second = StepRecorder()
    make_trainer(callbacks=[second], max_steps=4).fit(BoringModel(), ckpt_path=path)
    assert second.run.run_id == first.run.run_id
    assert second.run.attempt == 2
    assert second.run.resumed
    assert second.run.attempt_id != first.run.attempt_id
    frame = read_phase_table(first.run.run_dir)
    assert sorted(frame["attempt"].unique().tolist()) == [1, 2]
    assert frame.groupby("attempt")["attempt_id"].nunique().tolist() == [1, 1]


def test_adopt_rejects_a_crafted_run_id(tmp_path: Path) -> None:
    run = PilotRun(default_out_dir=tmp_path)
    with pytest.raises(ValueError, match=r"checkpoint pilot run_id='../../etc' is not a run id"):
        run.adopt({"run_id": "../../etc", "attempt": 1})
    with pytest.raises(ValueError, match=r"checkpoint pilot attempt=0 is invalid"):
        run.adopt({"run_id": run.run_id, "attempt": 0})


def test_detail_tables_and_bad_names(tmp_path: Path) -> None:
    run = PilotRun(default_out_dir=tmp_path)
    with pytest.raises(ValueError, match=r"table name='../x' is not a safe name"):
        run.register_table("../x")
    with pytest.raises(ValueError, match=r"table 'updates' is not registered"):
        run.append_rows("updates", [{"step": 1}])
    run.register_table("updates")
    run.append_rows("updates", [{"step": 1, "examples": 16}, {"step": 2, "examples": 16}])
    (path,) = run.flush()
    assert path.parent == run.run_dir / "updates.parquet"
    table = storage.read_snapshot_table(path.parent)
    assert table.column("examples").to_pylist() == [16, 16]
    assert set(table.column("run_id").to_pylist()) == {run.run_id}
    assert run.flush() == []  # nothing changed: nothing written


def test_bad_phase_rows_are_refused(tmp_path: Path) -> None:
    run = PilotRun(default_out_dir=tmp_path)
    with pytest.raises(ValueError, match=r"row\['phase'\]='warmup' is invalid"):
        run.put_phase_row({"phase": "warmup"}, source="t")
    with pytest.raises(ValueError, match=r"row\['verdict'\]='ok' is invalid"):
        run.put_phase_row({"phase": "forward", "verdict": "ok"}, source="t")


@pytest.mark.parametrize(
    "options",
    [
        {"fast_dev_run": 3},
        {"overfit_batches": 2, "max_steps": 3},
        {"accumulate_grad_batches": 2, "max_steps": 3},
        {"val_check_interval": 2, "max_steps": 5},
        {"logger": False, "max_steps": 2},
    ],
    ids=["fast_dev_run", "overfit_batches", "accumulate", "val_every_2", "no_logger"],
)
def test_composes_with_trainer_options(
    make_trainer: Any, tmp_path: Path, options: dict[str, Any]
) -> None:
    first, second = StepRecorder(), OtherRecorder()
    trainer = make_trainer(callbacks=[first, second], **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(BoringModel())
    assert first.run is second.run
    assert first.run.closed
    frame = read_phase_table(tmp_path / "pilot")
    assert frame["run_id"].nunique() == 1
    assert frame["first"].sum() == 1


def test_pilot_run_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"PilotRun\(rank=-1\) is invalid"):
        PilotRun(default_out_dir=tmp_path, rank=-1)
    with pytest.raises(
        ValueError,
        match=r"PilotRun\(world_size=2\) is invalid: expected an integer >= 3 \(> rank\)",
    ):
        PilotRun(default_out_dir=tmp_path, rank=2, world_size=2)


def test_ledger_fields_are_shared_and_checked(tmp_path: Path) -> None:
    run = PilotRun(default_out_dir=tmp_path)
    run.set_ledger_fields(micro_batch_size=2, accumulate_grad_batches=8)
    run.set_ledger_fields(effective_batch_size=16)
    assert run.ledger_fields == {
        "micro_batch_size": 2,
        "accumulate_grad_batches": 8,
        "effective_batch_size": 16,
    }
    with pytest.raises(ValueError, match=r"unknown ledger field\(s\) \['batch'\]"):
        run.set_ledger_fields(batch=3)


class _Counting(pl.Callback):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.calls.append("start")

    def on_train_batch_end(self, *args: Any) -> None:
        self.calls.append("end")


def test_lightning_skips_a_hook_that_is_not_callable(make_trainer: Any) -> None:
    # PilotCallback._mute relies on this dispatch rule of Lightning: if an upgrade calls
    # non-callable hooks, this test fails before any user's fit does.
    muted = _Counting()
    muted.on_train_batch_end = None  # type: ignore[assignment,method-assign]
    make_trainer(max_steps=3, limit_val_batches=0, callbacks=[muted]).fit(BoringModel())
    assert muted.calls == ["start"] * 3


class _Ends(PilotCallback):
    def __init__(self) -> None:
        super().__init__()
        self.ends = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends += 1
        if self.ends == 2:
            self._mute("on_train_batch_end")


class _LiveHooks(pl.Callback):
    """Which hooks of ``watched`` Lightning would call, seen at every batch end."""

    def __init__(self, watched: pl.Callback) -> None:
        self.watched = watched
        self.seen: list[dict[str, bool]] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.seen.append(
            {hook: callable(getattr(self.watched, hook)) for hook in PilotCallback.PER_UPDATE_HOOKS}
        )


def test_pilot_callbacks_mute_the_hooks_they_do_not_need_during_a_fit(
    make_trainer: Any,
) -> None:
    callback = _Ends()
    spy = _LiveHooks(callback)
    make_trainer(max_steps=5, limit_val_batches=0, callbacks=[callback, spy]).fit(BoringModel())
    assert callback.ends == 2  # muted by itself after its second call
    # During the fit, Lightning's no-ops are not even dispatched.
    assert all(not seen["on_before_backward"] for seen in spy.seen)
    assert [seen["on_train_batch_end"] for seen in spy.seen] == [True, False, False, False, False]
    # Outside a fit every hook is a plain method again, and a new fit starts with all of them.
    for hook in PilotCallback.PER_UPDATE_HOOKS:
        assert callable(getattr(callback, hook)), hook
    make_trainer(max_steps=3, limit_val_batches=0, callbacks=[callback]).fit(BoringModel())
    assert callback.ends == 5  # all three of its updates


class _Boom(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == 3:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_hooks_are_given_back_after_an_exception(make_trainer: Any) -> None:
    callback = _Ends()
    with pytest.raises(RuntimeError, match="boom"):
        make_trainer(max_steps=6, limit_val_batches=0, callbacks=[callback]).fit(_Boom())
    assert callback.ends == 2
    for hook in PilotCallback.PER_UPDATE_HOOKS:
        assert callable(getattr(callback, hook)), hook


def test_hooks_set_on_the_instance_are_respected(make_trainer: Any) -> None:
    calls: list[str] = []
    callback = _Ends()
    # On a hook the class does not override: called, not muted.
    callback.on_before_optimizer_step = lambda *a: calls.append("opt")  # type: ignore[method-assign]
    make_trainer(max_steps=3, limit_val_batches=0, callbacks=[callback]).fit(BoringModel())
    assert calls == ["opt"] * 3

    # A wrapper of a hook the callback mutes itself: kept aside while muted, given back after.
    def first(*args: Any) -> None:
        calls.append("first")
        _Ends.on_train_batch_end(callback, *args)

    callback.on_train_batch_end = first  # type: ignore[method-assign]
    make_trainer(max_steps=3, limit_val_batches=0, callbacks=[callback]).fit(BoringModel())
    assert callback.on_train_batch_end is first
    # A replacement set between fits is the one used next, not an older one.
    second_calls: list[int] = []
    callback.on_train_batch_end = lambda *a: second_calls.append(1)  # type: ignore[method-assign]
    make_trainer(max_steps=2, limit_val_batches=0, callbacks=[callback]).fit(BoringModel())
    assert second_calls == [1, 1]
    # A patch that ends while the hook is muted leaves no stale hook behind.
    from unittest import mock

    fresh = _Ends()
    with mock.patch.object(fresh, "on_train_batch_end", wraps=fresh.on_train_batch_end) as spy:
        make_trainer(max_steps=4, limit_val_batches=0, callbacks=[fresh]).fit(BoringModel())
    assert spy.call_count == 2
    assert "on_train_batch_end" not in vars(fresh)
    make_trainer(max_steps=3, limit_val_batches=0, callbacks=[fresh]).fit(BoringModel())
    assert spy.call_count == 2


@pytest.mark.parametrize("component", ["ledger", "runs"])
def test_a_symlinked_folder_inside_out_dir_stops_the_fit_at_setup(
    make_trainer: Any, tmp_path: Path, component: str
) -> None:
    """One policy for ledger/ and runs/: a link inside out_dir is refused before training,
    and nothing is written through it."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_pilot import pilot_callbacks
    from lightning_pilot.storage import UnsafePathError

    out_dir, elsewhere = tmp_path / "pilot", tmp_path / "elsewhere"
    out_dir.mkdir()
    elsewhere.mkdir()
    (out_dir / component).symlink_to(elsewhere, target_is_directory=True)
    trainer = make_trainer(callbacks=pilot_callbacks(out_dir, resume=False))
    with pytest.raises(UnsafePathError, match=rf"{component} is a symbolic link"):
        trainer.fit(BoringModel())
    assert trainer.global_step == 0
    assert list(elsewhere.iterdir()) == []


class _RaisesEveryUpdate(PilotCallback):
    """A pilot callback whose per-update hook raises at every update (the guard catches it)."""

    def on_train_batch_end(self, *args: Any) -> None:
        raise RuntimeError("no such head")


def test_a_hook_failing_at_every_update_leaves_one_reason_and_a_count(
    make_trainer: Any, tmp_path: Path
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(max_steps=40, callbacks=[_RaisesEveryUpdate(out_dir=tmp_path / "pilot")]).fit(
            BoringModel()
        )
    row = read_phase_table(tmp_path / "pilot").set_index("phase").loc["pilot"]
    (check,) = row["checks"]
    assert check["verdict"] == "not_checked"
    assert "raised RuntimeError: no such head (40 time(s))" in check["detail"]
    # One reason however many updates failed (it grew by a sentence per update before).
    assert row["reason"].count("no such head") == 1, row["reason"]
    assert len(row["reason"]) < 300, row["reason"]
