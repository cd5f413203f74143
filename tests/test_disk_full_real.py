"""A real full disk at the end of a fit: the stored status says what happened.

A small tmpfs is mounted for the test (root can, on Linux; elsewhere the test is skipped and
says why) and filled to its last byte after training. The run held disk space since its first
write (``PilotRun.reserve_space``) and releases it just before its tables and the ledger's end
record are written, so a finished run does not read ``running`` or ``interrupted``.
"""

from __future__ import annotations

import errno
import os
import subprocess
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_pilot import Ledger, pilot_callbacks, read_phase_table
from lightning_pilot.storage import read_snapshot_table

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


class FillDisk(pl.Callback):
    """After the last update, write to the disk until it refuses a single byte more."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.filled = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = self.folder / f"filler-{uuid.uuid4().hex}"
        fd = os.open(path, os.O_CREAT | os.O_WRONLY)
        errors = []
        try:
            for size in (65536, 4096, 1):  # whole chunks, then what is left
                while True:
                    try:
                        os.write(fd, b"\0" * size)
                    except OSError as err:
                        errors.append(err.errno)
                        break
        finally:
            os.close(fd)
        self.filled = errors == [errno.ENOSPC] * 3


def _fit(disk: Path, **options: Any) -> tuple[pl.Trainer, FillDisk, BaseException | None]:
    fill = FillDisk(disk)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=6,
        limit_val_batches=2,
        val_check_interval=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=disk,
        callbacks=[*pilot_callbacks(disk / "pilot", seed=0, **options), fill],
    )
    raised = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer.fit(BoringModel())
        except OSError as err:
            raised = err
    return trainer, fill, raised


def test_a_disk_that_fills_after_training_still_gets_the_tables_and_a_true_end(
    small_disk: Path,
) -> None:
    _, fill, raised = _fit(small_disk, resume=False)
    assert fill.filled
    assert raised is None  # the reserved space took the tables and the end record
    runs = Ledger(small_disk / "pilot").runs()
    assert runs[["status", "stop_cause", "updates_done"]].values.tolist() == [
        ["completed", "max_steps", 6]
    ]
    run_dir = next((small_disk / "pilot" / "runs").iterdir())
    updates = read_snapshot_table(run_dir / "updates.parquet").to_pylist()
    assert [row["update"] for row in updates] == [1, 2, 3, 4, 5, 6]
    phases = read_phase_table(small_disk / "pilot")
    assert "optimizer_step" in set(phases["phase"])
    assert not list((small_disk / "pilot").glob(".reserve-*"))  # released


def test_a_check_that_cannot_write_fails_the_fit_and_the_run_reads_failed(
    small_disk: Path,
) -> None:
    """The resume check's final checkpoint cannot be written: the fit raises ENOSPC, and the
    ledger says so (before the reservation it read ``running`` with ``updates_done=0``)."""
    _, fill, raised = _fit(small_disk, resume={"at_step": 2, "compare_steps": 1})
    assert fill.filled
    assert isinstance(raised, OSError)
    assert raised.errno == errno.ENOSPC
    runs = Ledger(small_disk / "pilot").runs()
    run = runs.iloc[0]
    assert (run["status"], run["stop_cause"], run["updates_done"]) == (
        "failed",
        "exception:OSError",
        6,
    )


def test_tables_that_cannot_be_written_at_the_end_are_not_a_completed_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the tables fail (the ledger still writes): the end record, written after the final
    flush, says the run failed and why, instead of ``completed`` beside a missing table."""
    from lightning_pilot import run as run_module

    real = run_module.storage.write_snapshot

    class BreakTablesAfterTraining(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            def refuse(*args: Any, **kwargs: Any) -> Path:
                raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

            monkeypatch.setattr(run_module.storage, "write_snapshot", refuse)

    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[
            *pilot_callbacks(tmp_path / "pilot", seed=0, resume=False),
            BreakTablesAfterTraining(),
        ],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(OSError, match="Disk quota exceeded"):
            trainer.fit(BoringModel())
    monkeypatch.setattr(run_module.storage, "write_snapshot", real)
    run = Ledger(tmp_path / "pilot").runs().iloc[0]
    assert (run["status"], run["stop_cause"], run["updates_done"]) == (
        "failed",
        "exception:OSError",
        4,
    )
    assert run["stop_detail"].startswith(
        "training ended (completed: max_steps) after 4 update(s); then the run's tables could"
        " not be written: [Errno 122] Disk quota exceeded"
    )
