"""The training process's side without a Trainer: launching, reading answers, the artifact."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader

from lightning_pilot.resume import child
from lightning_pilot.resume.parent import (
    ArtifactProbe,
    as_built,
    judge_artifact,
    launch,
    pickle_loaders,
    read_result,
)
from lightning_pilot.resume.protocol import ArtifactTask, ProtocolError, TaskResult

pytestmark = pytest.mark.timeout(300)


def _artifact_task(folder: Path, model: BoringModel, batches: list[Any]) -> ArtifactTask:
    """A final artifact of BoringModel (importable by a new process, no constructor arguments)."""
    checkpoint = folder / "final-attempt-1.ckpt"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": {}}, checkpoint)
    torch.save(batches, folder / "control.pt")
    return ArtifactTask(
        checkpoint=str(checkpoint),
        artifact=str(checkpoint),
        control=str(folder / "control.pt"),
        call="forward(batch)",
        outputs=str(folder / "control-outputs.pt"),
        module_class="lightning.pytorch.demos.boring_classes:BoringModel",
    )


def test_the_artifact_round_trip_in_a_new_process(tmp_path: Path) -> None:
    model = BoringModel().eval()
    batches = [torch.randn(2, 32)]
    task = _artifact_task(tmp_path, model, batches)
    (result,) = launch([task], tmp_path, timeout_s=240)
    assert result.crash is None, result.traceback
    assert result.outputs == task.outputs
    assert result.file_bytes
    assert result.load_seconds is not None
    with torch.no_grad():
        live = [model(b) for b in batches]
    probe = ArtifactProbe(tmp_path / "final-attempt-1.ckpt", "0" * 64, task=task, live=live)
    assert judge_artifact(probe, result, atol=0, rtol=0).verdict == "pass"
    shifted = [t + 1 for t in live]
    probe = ArtifactProbe(tmp_path / "final-attempt-1.ckpt", "0" * 64, task=task, live=shifted)
    assert judge_artifact(probe, result, atol=0, rtol=0).verdict == "fail"
    request = json.loads((tmp_path / "spec-tasks.json").read_text())
    assert request["tasks"][0]["kind"] == "artifact"


def test_a_stale_answer_of_an_earlier_attempt_is_never_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new process that dies before it answers reads as a crash, whatever an earlier attempt
    left in the folder."""
    task = _artifact_task(tmp_path, BoringModel(), [torch.randn(2, 32)])
    (tmp_path / "result-tasks.json").write_text(
        json.dumps({"tasks": [{"kind": "artifact", "outputs": task.outputs}]})
    )
    # A thread count the new process refuses: it exits before it writes any answer.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 0)
    (result,) = launch([task], tmp_path, timeout_s=240)
    assert result.crash is not None
    assert result.crash.startswith("the new process exited with 1:")
    assert "set_num_threads expects a positive integer" in result.crash


TASK = ArtifactTask(
    checkpoint="final-attempt-1.ckpt",
    artifact="final-attempt-1.ckpt",
    control="control.pt",
    call="predict_step",
    outputs="control-outputs.pt",
    module_class="pkg.models:Net",
)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"{not json", "the new process's answer is unusable: Expecting property name"),
        (b'{"tasks": [{"kind": "artifact", "steps": 3}]}', "Result.tasks[0].steps is 3"),
        (b'{"tasks": [], "shell": "rm -rf /"}', "unknown key(s) ['shell']"),
        (b'{"tasks": []}', "the new process answered other tasks than it was given"),
        (b'{"tasks": [{"kind": "resume"}]}', "the new process answered other tasks than"),
        (b"[" * 100_000 + b"]" * 100_000, "the new process's answer is unusable"),
        (b" " * (65 << 20), "is larger than"),
    ],
    ids=["not-json", "wrong-type", "unknown-key", "too-few", "other-kind", "deep", "huge"],
)
def test_an_unusable_answer_is_a_crash_of_every_task(
    tmp_path: Path, content: bytes, why: str
) -> None:
    path = tmp_path / "result-tasks.json"
    path.write_bytes(content)
    results = read_result(path, [TASK, TASK])
    assert len(results) == 2
    assert all(r.crash is not None and why in r.crash for r in results), results


def test_a_missing_answer_is_a_crash(tmp_path: Path) -> None:
    (result,) = read_result(tmp_path / "result-tasks.json", [TASK])
    assert result.crash is not None
    assert result.crash.startswith("the new process's answer is unusable: [Errno 2]")


def test_the_child_refuses_a_hostile_request(tmp_path: Path) -> None:
    path = tmp_path / "spec-tasks.json"
    path.write_text(json.dumps({"tasks": [{"kind": "shell", "command": "x"}], "result": "r"}))
    with pytest.raises(ProtocolError, match="Request lacks the key"):
        child.main([str(path)])
    path.unlink()
    request = {"tasks": [{"kind": "shell"}], "result": "r", "num_threads": 1}
    path.write_text(json.dumps(request))
    with pytest.raises(ProtocolError, match=r"Request.tasks\[0\] is"):
        child.main([str(path)])


def test_loaders_are_copied_as_built_and_pickled_for_the_new_process() -> None:
    loader = DataLoader(range(8), batch_size=2, persistent_workers=False)
    loader._iterator = iter(loader)
    assert [copy._iterator for copy in as_built([loader])] == [None]
    assert loader._iterator is not None
    payload, why = pickle_loaders(DataLoader(range(8), batch_size=2, shuffle=True))
    assert payload
    assert why is None
    payload, why = pickle_loaders(DataLoader(range(8), collate_fn=lambda batch: batch))
    assert payload is None
    assert str(why).startswith("the loader is not picklable (")
    assert "Can't pickle" in str(why)


def test_the_child_unpickles_the_loaders_or_says_why_not() -> None:
    result = TaskResult(kind="resume")
    assert child.unpickle_loaders(pickle.dumps([1, 2]), result) == [1, 2]
    assert child.unpickle_loaders(b"", result) is None
    assert result.loader_error == "no loaders came on stdin"
