"""The new process's progress, read while it runs (real new processes): each phase reaches the
training process before the answer exists; timeouts, crashes and their messages are as before;
after a fit it is shown as the Trainer shows progress (a tqdm bar, plain lines, or nothing)."""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pilot.core.progress import MARKER, LineReporter, Reporter
from lightning_pilot.resume import ResumeVerifier
from lightning_pilot.resume.parent import launch
from lightning_pilot.resume.protocol import ArtifactTask

pytestmark = pytest.mark.timeout(300)


class Recorder(Reporter):
    """Every update with whether the answer existed and the new process was alive then."""

    def __init__(self, result: Path) -> None:
        self.result = result
        self.updates: list[tuple[str, int | None, bool, bool]] = []
        self.ticks = 0
        self.closed: list[tuple[str | None, int | None]] = []

    def update(self, message: str, *, done: int | None = None) -> None:
        alive = any(_children_running(self.result.parent))
        self.updates.append((message, done, self.result.exists(), alive))

    def tick(self) -> None:
        self.ticks += 1

    def close(self, message: str | None = None, *, done: int | None = None) -> None:
        self.closed.append((message, done))


def _children_running(folder: Path) -> list[int]:
    """The pids of the new processes started for requests in ``folder`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile
            continue
        if state != "Z" and any(str(folder).encode() in part for part in command):
            found.append(int(entry.name))
    return found


class SlowToBuild(BoringModel):
    """Sleeps in its constructor (``LP_TEST_SLEEP`` seconds), then may print and exit."""

    def __init__(self) -> None:
        super().__init__()
        time.sleep(float(os.environ.get("LP_TEST_SLEEP", "0")))
        code = os.environ.get("LP_TEST_EXIT")
        if code is not None:
            for i in range(40):
                print(f"user line {i}", file=sys.stderr, flush=True)
            print("user stdout line", flush=True)
            os._exit(int(code))


def _task(folder: Path, module_class: str) -> ArtifactTask:
    model = BoringModel().eval()
    checkpoint = folder / "final-attempt-1.ckpt"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": {}}, checkpoint)
    torch.save([torch.randn(2, 32)], folder / "control.pt")
    return ArtifactTask(
        checkpoint=str(checkpoint),
        artifact=str(checkpoint),
        control=str(folder / "control.pt"),
        call="forward(batch)",
        outputs=str(folder / "control-outputs.pt"),
        module_class=module_class,
    )


needs_proc = pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")


@needs_proc
def test_each_phase_arrives_while_the_new_process_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LP_TEST_SLEEP", "2")  # the build takes 2 s: several polls see it
    task = _task(tmp_path, f"{__name__}:SlowToBuild")
    recorder = Recorder(tmp_path / "result-tasks.json")
    (result,) = launch([task], tmp_path, timeout_s=240, progress=recorder)
    assert result.crash is None, result.traceback
    assert result.outputs == task.outputs  # the answer is the same as without progress
    messages = [message for message, *_ in recorder.updates]
    where = "task 1 of 1, artifact check of final-attempt-1.ckpt"
    assert messages == [
        "new process starting for 1 task(s)",
        f"new process: {where}: loading the checkpoint",
        f"new process: {where}: rebuilding the module",
        f"new process: {where}: loading the artifact into it",
        f"new process: {where}: running it on the control inputs",
        "new process: writing the answer",
    ]
    assert [done for _, done, *_ in recorder.updates] == [0, 0, 0, 0, 0, 1]
    # The phases before the 2 s build were shown while the process ran, before its answer.
    for message, _, answered, alive in recorder.updates[1:3]:
        assert (answered, alive) == (False, True), message
    assert recorder.ticks >= 2  # the 2 s build spans at least two 1 s polls
    assert recorder.closed[0] == ("new process done", 1)


def test_a_crash_keeps_the_last_lines_of_its_own_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exit status and the last 5 lines of stderr, as before: the marker lines the child
    printed in between are not part of it."""
    monkeypatch.setenv("LP_TEST_EXIT", "7")
    task = _task(tmp_path, f"{__name__}:SlowToBuild")
    out = _Stream()
    (result,) = launch([task], tmp_path, timeout_s=240, progress=LineReporter("T", stream=out))
    expected = " | ".join(f"user line {i}" for i in range(35, 40))
    assert result.crash == f"the new process exited with 7: {expected}"
    assert MARKER not in result.crash
    assert "T: new process starting for 1 task(s)" in out.getvalue()
    assert f"T: new process ended: {result.crash}" in out.getvalue()


class _Stream:
    """A text stream that is not a terminal, or one that says it is (``tty=True``)."""

    def __init__(self, tty: bool = False) -> None:
        self.parts: list[str] = []
        self.tty = tty

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return self.tty

    def getvalue(self) -> str:
        return "".join(self.parts)


class Small(pl.LightningModule):
    """A tiny regression that owns its data (a new process rebuilds it from its class)."""

    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def train_dataloader(self) -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(32, 4, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(tmp_path: Path, **options: Any) -> ResumeVerifier:
    verifier = ResumeVerifier(at_step=2, compare_steps=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        max_steps=5,
        callbacks=[verifier, *options.pop("callbacks", [])],
        **options,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Small())
    return verifier


def test_after_a_fit_with_lightnings_bar_a_tqdm_bar_shows_the_new_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fit(tmp_path, callbacks=[TQDMProgressBar()])  # Rich is Lightning's default when installed
    out, err = capsys.readouterr()
    assert "ResumeVerifier" not in err
    bar = [part for part in out.replace("\n", "\r").split("\r") if "ResumeVerifier:" in part]
    assert bar, out[-2000:]
    assert any("task 1 of 2, resume from mid_epoch-step-2.ckpt" in part for part in bar)
    assert any("task 2 of 2, artifact check of" in part for part in bar)
    assert "ResumeVerifier: 100%" in bar[-1], bar[-1]
    assert "2/2" in bar[-1], bar[-1]
    assert "new process done" in bar[-1]


def test_after_a_fit_with_a_rich_bar_plain_lines_show_it_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fit(tmp_path, callbacks=[RichProgressBar()])
    _, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("ResumeVerifier: ")]
    assert lines[0] == "ResumeVerifier: new process starting for 2 task(s) ... 0 s"
    assert lines[-1].startswith("ResumeVerifier: new process done ... ")
    assert len(lines) >= 2


def test_without_a_bar_it_shows_lines_on_a_terminal_and_nothing_otherwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    verifier = _fit(tmp_path / "quiet", enable_progress_bar=False)
    out, err = capsys.readouterr()
    assert "ResumeVerifier" not in out + err  # a log file or a test stays quiet
    row = verifier.run  # the check itself ran
    assert (row.run_dir / "resume" / "result-tasks.json").is_file()
    terminal = _Stream(tty=True)
    monkeypatch.setattr(sys, "stderr", terminal)
    _fit(tmp_path / "terminal", enable_progress_bar=False)
    lines = terminal.getvalue().splitlines()
    assert lines[0] == "ResumeVerifier: new process starting for 2 task(s) ... 0 s"
    assert lines[-1].startswith("ResumeVerifier: new process done ... ")


# The timeout test waits 25 s for a new process that never answers, the CPU idle meanwhile: its
# launch starts with the module, in a thread, and the tests above run while it waits; the test
# (last in the module) reads what the launch returned.
TIMEOUT_TEST = "test_the_timeout_kills_the_process_and_reads_as_before"


def _timeout_launch(folder: Path) -> tuple[Any, float, list[int], Recorder]:
    task = _task(folder, f"{__name__}:SlowToBuild")
    recorder = Recorder(folder / "result-tasks.json")
    started = time.monotonic()
    # Long enough for the new process to import torch and Lightning on a busy machine.
    (result,) = launch(
        [task], folder, timeout_s=25, env={"LP_TEST_SLEEP": "120"}, progress=recorder
    )
    took = time.monotonic() - started
    return result, took, _children_running(folder), recorder


@pytest.fixture(scope="module", autouse=True)
def timeout_launch(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Future[tuple[Any, float, list[int], Recorder]] | None]:
    """The timeout test's launch, started before the module's first test when that test runs."""
    selected = any(item.name == TIMEOUT_TEST for item in request.session.items)
    if not selected or not Path("/proc/self/cmdline").exists():
        yield None
        return
    folder = tmp_path_factory.mktemp("timeout")
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(_timeout_launch, folder)
        # Its environment is read when it starts: before any test here sets LP_TEST_*.
        while not _children_running(folder) and not future.done():
            time.sleep(0.05)
        yield future


@needs_proc
def test_the_timeout_kills_the_process_and_reads_as_before(
    timeout_launch: Future[tuple[Any, float, list[int], Recorder]] | None,
) -> None:
    assert timeout_launch is not None
    result, took, running, recorder = timeout_launch.result()
    assert result.crash == "the new process did not finish within 25 s"
    assert 25 <= took < 50  # killed at the timeout, not after the 120 s build
    assert running == []
    phases = [message.rsplit(": ", 1)[-1] for message, *_ in recorder.updates]
    assert phases[-1] == "rebuilding the module"  # where it was when it was stopped
    why = "the new process did not finish within 25 s"
    assert recorder.closed[0] == (f"new process ended: {why}", 1)
