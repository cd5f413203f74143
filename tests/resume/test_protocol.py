"""The request and result that cross the process boundary: JSON round trips, hostile input."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from lightning_pilot.core.resume import StepRecord
from lightning_pilot.resume.protocol import (
    ArtifactTask,
    ProtocolError,
    Request,
    Result,
    ResumeTask,
    State,
    TaskResult,
)

RESUME = ResumeTask(
    checkpoint="/runs/r/resume/mid_epoch-step-2.ckpt",
    state_key="ResumeVerifier{'at_step': 2, 'compare_steps': 2}",
    module_class="pkg.models:Net",
    workdir="/runs/r/resume/child",
    trainer={"max_steps": 4, "precision": "32-true", "gradient_clip_val": None},
    datamodule_class="pkg.data:Data",
    dataset_fingerprint="0123456789abcdef",
    adapter={"ids": "ids", "ignore_index": -100},
    ddp={"process_group_backend": "gloo", "static_graph": False},
)
ARTIFACT = ArtifactTask(
    checkpoint="/runs/r/resume/final-attempt-1.ckpt",
    artifact="/runs/r/export/weights.pt",
    control="/runs/r/resume/control.pt",
    call="forward(batch[0])",
    outputs="/runs/r/resume/control-outputs.pt",
    module_class="pkg.models:Net",
    factory="pkg.build:make",
    dtype="bfloat16",
)
STATE = State(
    global_step=2,
    epoch=0,
    lrs=[0.1, 0.01],
    optimizer_state="a" * 16,
    scheduler_state="b" * 16,
    grad_scaler=None,
    weights="c" * 16,
    rng="d" * 16,
)
STEP = {"step": 1, "batch_idx": 1, "epoch": 0, "ids": None, "loss": None}


def _through_json(value: dict[str, Any]) -> Any:
    """What the other process reads: strict JSON (no NaN literals) written, then parsed."""
    return json.loads(json.dumps(value, allow_nan=False))


def test_a_request_round_trips_through_json() -> None:
    request = Request(tasks=(RESUME, ARTIFACT), result="/runs/r/resume/result.json", num_threads=3)
    again = Request.from_dict(_through_json(request.to_dict()))
    assert again == request
    assert isinstance(again.tasks[0], ResumeTask)
    assert isinstance(again.tasks[1], ArtifactTask)


def test_a_result_round_trips_with_non_finite_losses() -> None:
    steps = [
        StepRecord(step=2, batch_idx=2, epoch=0, ids=(4, "content:ab", 1.5), loss=0.5, lrs=(0.1,)),
        StepRecord(step=3, batch_idx=3, epoch=0, ids=None, loss=math.nan, lrs=(math.inf,)),
        StepRecord(step=4, batch_idx=0, epoch=1, ids=(True,), loss=None),
    ]
    result = Result(
        tasks=(
            TaskResult(
                kind="resume",
                load_seconds=0.25,
                load_rss_bytes=1 << 30,
                file_bytes=4096,
                build_order="the DataModule before the module",
                dataset_fingerprint="0123456789abcdef",
                restored=STATE,
                steps=steps,
                global_step_end=4,
            ),
            TaskResult(kind="artifact", load_error="UnpicklingError: no", unsafe_globals=["a.B"]),
        )
    )
    again = Result.from_dict(_through_json(result.to_dict()))
    first = again.tasks[0]
    assert first.restored == STATE
    assert first.steps[0] == steps[0]
    assert math.isnan(first.steps[1].loss or 0.0)
    assert first.steps[1].lrs == (math.inf,)
    assert first.steps[2] == steps[2]
    assert again.tasks[1] == result.tasks[1]


def test_integers_are_read_as_floats_where_floats_are_expected() -> None:
    state = State.from_dict(STATE.to_dict() | {"lrs": [1, 0.5]})
    assert state.lrs == [1.0, 0.5]
    assert all(isinstance(lr, float) for lr in state.lrs)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "Result is [], expected an object (Result)"),
        ({}, "Result lacks the key(s) ['tasks']"),
        ({"tasks": {}}, "Result.tasks is {}, expected tuple"),
        ({"tasks": [], "extra": 1}, "Result has unknown key(s) ['extra']"),
        ({"tasks": [{"kind": "resume", "crash": 3}]}, "Result.tasks[0].crash is 3, expected str"),
        ({"tasks": [{"kind": "restart"}]}, "Result.tasks[0].kind is 'restart'"),
        ({"tasks": [{"crash": "x"}]}, "Result.tasks[0] lacks the key(s) ['kind']"),
        ({"tasks": [{"kind": "resume", "global_step_end": "4"}]}, "global_step_end is '4'"),
        ({"tasks": [{"kind": "resume", "global_step_end": True}]}, "global_step_end is True"),
        ({"tasks": [{"kind": "resume", "global_step_end": 4.0}]}, "global_step_end is 4.0"),
        ({"tasks": [{"kind": "resume", "load_seconds": "fast"}]}, "load_seconds is 'fast'"),
        ({"tasks": [{"kind": "resume", "unsafe_globals": [1]}]}, "unsafe_globals[0] is 1"),
        ({"tasks": [{"kind": "resume", "restored": {"epoch": 0}}]}, "restored lacks the key(s)"),
        (
            {"tasks": [{"kind": "resume", "steps": [{"step": 1}]}]},
            "Result.tasks[0].steps[0] lacks the key(s) ['batch_idx', 'epoch', 'ids', 'loss']",
        ),
        (
            {"tasks": [{"kind": "resume", "steps": [STEP | {"ids": [[1, 2]]}]}]},
            "Result.tasks[0].steps[0].ids[0] is [1, 2]",
        ),
    ],
)
def test_a_hostile_result_is_refused_with_the_key_named(data: Any, message: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        Result.from_dict(data)
    assert message in str(caught.value)


def test_a_request_with_an_unknown_task_kind_is_refused() -> None:
    data = Request(tasks=(RESUME,), result="r.json", num_threads=1).to_dict()
    data["tasks"][0]["kind"] = "shell"
    with pytest.raises(ProtocolError, match=r"Request.tasks\[0\] is .*expected ResumeTask"):
        Request.from_dict(data)


def test_a_task_dict_with_non_string_keys_is_refused() -> None:
    data = RESUME.to_dict() | {"trainer": {1: 2}}
    with pytest.raises(ProtocolError, match=r"ResumeTask.trainer is \{1: 2\}"):
        ResumeTask.from_dict(data)


def test_protocol_errors_are_value_errors() -> None:
    # The parent catches ValueError around reading a result (JSON errors are ValueErrors too).
    assert issubclass(ProtocolError, ValueError)


def test_messages_encode_as_plain_json_values_with_their_defaults() -> None:
    assert Request(tasks=(), result="result-tasks.json", num_threads=4).to_dict() == {
        "tasks": [],
        "result": "result-tasks.json",
        "num_threads": 4,
    }
    assert (
        ArtifactTask(
            checkpoint="a.ckpt",
            artifact="w.pt",
            control="c.pt",
            call="forward(batch)",
            outputs="o.pt",
            module_class="m:Net",
        ).kind
        == "artifact"
    )
    state = State(
        global_step=2,
        epoch=0,
        lrs=[0.1],
        optimizer_state="a",
        scheduler_state="b",
        grad_scaler=None,
        weights="c",
    )
    assert state.rng is None
    assert TaskResult(kind="resume", crash="the new process exited with 1").where == "a new process"
