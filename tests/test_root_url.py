"""A Trainer's ``default_root_dir`` in every spelling fsspec and Lightning accept: the pilot
folder is ``<where Lightning puts its checkpoints>/pilot``, never a folder named ``file:`` in
the working directory (docs/storage.md, "A Trainer's root")."""

from __future__ import annotations

import os
import uuid
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest

from lightning_pilot import DivergenceLedger, Ledger, PhaseMemoryMonitor, read_phase_table, storage
from lightning_pilot.demo import ClassificationDataModule, TinyClassifier
from lightning_pilot.run import PilotRun


def fit(root: str) -> tuple[pl.Trainer, list[str]]:
    """One tiny real fit with a checkpoint, DivergenceLedger and PhaseMemoryMonitor, neither
    naming an out_dir; no logger (Lightning's TensorBoard logger has spellings of its own).
    Returns the Trainer and lightning-pilot's warnings."""
    pl.seed_everything(0, verbose=False)
    callbacks = [
        DivergenceLedger(experiment="root", variant="url", seed=0),
        PhaseMemoryMonitor(),
    ]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        max_steps=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(
            TinyClassifier(hidden=4),
            datamodule=ClassificationDataModule(dataset_size=64, batch_size=4, seed=0),
        )
    return trainer, [str(w.message) for w in caught if "lightning-pilot" in str(w.message)]


def checkpoints(folder: Path) -> list[Path]:
    return sorted((folder / "checkpoints").glob("*.ckpt"))


def assert_pilot_in(folder: Path) -> None:
    """The ledger and the phase table under ``folder/pilot``, beside Lightning's checkpoint."""
    assert checkpoints(folder), sorted(folder.rglob("*")) if folder.exists() else folder
    runs = Ledger(folder / "pilot").runs()
    assert list(runs["variant"]) == ["url"]
    assert list(runs["status"]) == ["completed"]
    (run_dir,) = (folder / "pilot" / "runs").iterdir()
    assert "forward" in set(read_phase_table(run_dir)["phase"])


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cwd"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return folder


@pytest.mark.parametrize(
    ("form", "where"),
    [
        ("file:///{tmp}/abs", "{tmp}/abs"),  # file:///abs: Lightning normalises to file:/abs
        ("file:/{tmp}/single", "{tmp}/single"),  # file:/abs
        ("local:///{tmp}/loc", "{tmp}/loc"),
        ("file:rel", "{cwd}/rel"),  # relative to the working directory
        ("local://rel", "{cwd}/rel"),
        ("~/tilde", "{home}/tilde"),
        ("file:~/ftilde", "{home}/ftilde"),
    ],
)
def test_each_local_form_lands_where_lightning_checkpoints(
    form: str, where: str, cwd: Path, tmp_path: Path
) -> None:
    names = {"tmp": str(tmp_path).lstrip("/"), "cwd": str(cwd), "home": str(tmp_path / "home")}
    expected = Path("/" + where.format(**names).lstrip("/"))
    trainer, said = fit(form.format(**names))
    assert not [m for m in said if "default_root_dir" in m], said
    run = PilotRun.last(trainer)
    assert run is not None
    assert run.out_dir == expected / "pilot"
    assert_pilot_in(expected)
    # Nothing in the working directory but the folder a relative root names.
    inside = sorted(p.name for p in cwd.iterdir())
    assert inside == (["rel"] if where.startswith("{cwd}") else []), inside
    assert not list(cwd.rglob("file:*"))


def test_a_file_url_lightning_moves_is_followed_and_said(cwd: Path, tmp_path: Path) -> None:
    # file://tmp/... (two slashes) is "tmp/..." under the working directory for fsspec, but
    # Lightning normalises it to file:/tmp/...: its checkpoints go to /tmp/..., and the pilot
    # follows them there, with a warning naming both.
    relative = str(tmp_path / "moved").lstrip("/")
    trainer, said = fit(f"file://{relative}")
    moved = [m for m in said if "is read by Lightning as" in m]
    assert moved == [
        f"lightning-pilot: Trainer(default_root_dir='file://{relative}') is read by Lightning"
        f" as '{tmp_path / 'moved'}', not '{cwd / relative}': its checkpoints go there, and so"
        " does the pilot folder. Write file:///absolute/path (three slashes) or a plain path"
        " for the folder you mean."
    ]
    run = PilotRun.last(trainer)
    assert run is not None
    assert run.out_dir == tmp_path / "moved" / "pilot"
    assert_pilot_in(tmp_path / "moved")
    assert list(cwd.iterdir()) == []


def test_a_file_url_with_a_tilde_follows_lightning_without_a_fit(cwd: Path) -> None:
    # file://~/x: Lightning normalises to file:/~/x, a folder "~" at the file system's root
    # (its checkpoints would go there). Checked without a fit: nothing is written at "/".
    trainer = pl.Trainer(default_root_dir="file://~/runs", logger=False)
    assert trainer.default_root_dir == "file:/~/runs"
    with pytest.warns(RuntimeWarning, match=r"'/~/runs'"):
        run = PilotRun.of(trainer)
    assert run.out_dir == Path("/~/runs/pilot")
    assert not Path("/~").exists()


def test_a_memory_root_is_remote_with_the_checkpoints(cwd: Path) -> None:
    root = f"memory://root-{uuid.uuid4().hex[:8]}/exp"
    trainer, _ = fit(root)
    run = PilotRun.last(trainer)
    assert run is not None
    assert isinstance(run.out_dir, storage.RemotePath)
    assert str(run.out_dir) == root.replace("memory://", "memory:///") + "/pilot"
    fs = run.out_dir.fs
    assert fs.glob(f"{run.out_dir.parent.path}/checkpoints/*.ckpt")
    assert list(Ledger(run.out_dir).runs()["status"]) == ["completed"]
    assert list(cwd.iterdir()) == []


def test_location_reads_local_urls_as_fsspec_does(cwd: Path, tmp_path: Path) -> None:
    from fsspec.core import url_to_fs

    home = os.environ["HOME"]
    forms = {
        f"file://{tmp_path}/a": tmp_path / "a",
        f"file:{tmp_path}/a": tmp_path / "a",
        f"local://{tmp_path}/a": tmp_path / "a",
        f"local:{tmp_path}/a": tmp_path / "a",
        "file:rel": cwd / "rel",
        "local:rel": cwd / "rel",
        "file://rel": cwd / "rel",
        "file:~/x": Path(home) / "x",
    }
    for form, expected in forms.items():
        assert storage.location(form) == expected, form
        assert Path(url_to_fs(form)[1]) == expected, form
        assert not storage.is_remote(form)
    # A plain path is left as written (made absolute where it is used).
    assert storage.location("runs/file:x") == Path("runs/file:x")
