"""core/phase_rows.py without a Trainer: the phase rows of a fit in the making, the setup,
checkpoint and export checks, and the model and placement rows."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_pilot.core.memory import NoCounter
from lightning_pilot.core.phase_rows import (
    PhaseRows,
    checkpoint_file,
    export_written,
    file_bytes,
    model_row,
    params_on_device,
    placement_rows,
)
from lightning_pilot.core.phases import CheckResult, Occurrence

FLOAT = 4


def _forward(rows: PhaseRows, step: int, verdict: str) -> str | None:
    rows.count("forward", step)
    occurrence = Occurrence("forward", step, 0.5, values={"notes": None})
    return rows.add(occurrence, [CheckResult("loss_finite", verdict, f"at {step}")])


def test_a_failed_check_stops_only_when_asked() -> None:
    recording, raising = PhaseRows(), PhaseRows(stop_on_fail=True)
    for rows in (recording, raising):
        assert _forward(rows, 0, "pass") is None
    assert _forward(recording, 1, "fail") is None
    assert _forward(raising, 1, "fail") == "forward failed at step 1: loss_finite: at 1"
    for rows in (recording, raising):  # the failure is on the later row either way
        assert [(r["first"], r["verdict"]) for r in rows.rows()] == [
            (True, "pass"),
            (False, "fail"),
        ]
    assert recording.add(None, [CheckResult("x", "fail")]) is None  # nothing measured


def test_deferred_checks_join_the_rows_once_settled() -> None:
    rows = PhaseRows(stop_on_fail=True)
    rows.count("backward", 0)
    assert rows.add(Occurrence("backward", 0), [CheckResult("grads_finite", "pass")]) is None
    rows.evidence.backward(["body.weight"])
    assert rows.defer(("backward", True, "grads_reach_params"), ["head.weight"]) is None
    assert rows.rows()[0]["verdict"] == "pass"  # not settled: the evidence may still come
    failed = rows.settle(may_fail=True)
    assert failed is not None
    assert failed.endswith("detached): head.weight")
    assert rows.settle(may_fail=True) is None  # settled once
    row = rows.rows()[0]
    assert row["verdict"] == "fail"
    assert [c["name"] for c in row["checks"]] == ["grads_finite", "grads_reach_params"]
    # Settled: a new name never reached fails at once.
    failed = rows.defer(("backward", True, "grads_reach_params"), ["tail.weight"])
    assert failed is not None
    assert "head.weight, tail.weight" in failed


def test_settling_at_the_fit_end_never_stops() -> None:
    rows = PhaseRows(stop_on_fail=True)
    rows.defer(("backward", True, "grads_reach_params"), ["head.weight"])
    assert rows.settle(may_fail=False) is None
    assert rows.evidence.settled


def test_rows_carry_device_precision_counter_and_its_note() -> None:
    rows = PhaseRows()
    _forward(rows, 0, "pass")
    rows.count("checkpoint_save", 0)
    rows.add(Occurrence("checkpoint_save", 0, values={"notes": "bytes not measured here"}))
    counter = NoCounter("memory not measured: track_cpu=False")
    found = {
        r["phase"]: r for r in rows.rows(device="cpu", precision="bf16-mixed", counter=counter)
    }
    assert {(r["device"], r["precision"], r["counter"]) for r in found.values()} == {
        ("cpu", "bf16-mixed", "none")
    }
    assert found["forward"]["notes"] == "memory not measured: track_cpu=False"
    assert found["checkpoint_save"]["notes"] == "bytes not measured here"  # its own kept
    assert rows.rows()[0]["counter"] == "none"  # no counter yet


def test_quiet_counts_are_folded_into_the_rows() -> None:
    rows = PhaseRows()
    rows.count("data", 0)
    rows.quiet.step_now = 1
    for step in (2, 3, 4):
        rows.quiet.batch_end({"loss": 1.0}, step)
    data = [r for r in rows.rows() if r["phase"] == "data"]
    assert [(r["first"], r["occurrences"], r["step_last"]) for r in data] == [
        (True, 1, 0),
        (False, 3, 3),
    ]


def test_file_sizes_and_the_checkpoint_and_export_checks(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "a.bin").write_bytes(b"x" * 300)
    (tmp_path / "model" / "b.bin").write_bytes(b"x" * 12)
    (tmp_path / "empty.ckpt").write_bytes(b"")
    assert file_bytes(tmp_path / "model") == 312
    assert file_bytes(str(tmp_path / "model" / "a.bin")) == 300
    assert file_bytes(tmp_path / "absent") is None
    assert file_bytes(object()) is None
    saved = Occurrence("checkpoint_save", 3)
    assert checkpoint_file(saved, tmp_path / "model" / "a.bin") == [
        CheckResult("checkpoint_file", "pass", "300 bytes")
    ]
    assert saved.values["file_bytes"] == 300
    empty = Occurrence("checkpoint_save", 3)
    [result] = checkpoint_file(empty, tmp_path / "empty.ckpt")
    assert (result.verdict, empty.values["file_bytes"]) == ("fail", 0)
    exported = Occurrence("export", 9)
    assert export_written(exported, tmp_path / "model", None) == []
    assert exported.values["file_bytes"] == 312


def test_a_missing_checkpoint_fails_with_its_remedy_and_a_raising_export_fails() -> None:
    rows = PhaseRows()
    rows.count("checkpoint_save", 4)
    occurrence = Occurrence("checkpoint_save", 4, duration_s=0.25)
    rows.add(occurrence, checkpoint_file(occurrence, "/nowhere/last.ckpt"))
    assert [(r["phase"], r["verdict"], r["reason"]) for r in rows.rows(device="cpu")] == [
        (
            "checkpoint_save",
            "fail",
            "checkpoint_file: no file with bytes at /nowhere/last.ckpt. If the check fails:"
            " free memory or disk before saving, or save less state",
        )
    ]
    export = Occurrence("export", 9)
    assert export_written(export, None, "export raised ValueError: no head") == [
        CheckResult("export_written", "fail", "export raised ValueError: no head")
    ]
    assert export.values == {"file_bytes": None}


def test_params_on_device() -> None:
    model = torch.nn.Linear(2, 2)
    assert params_on_device(model.named_parameters(), torch.device("cpu")) == CheckResult(
        "params_on_device", "pass", "cpu"
    )
    many = torch.nn.Sequential(*(torch.nn.Linear(1, 1) for _ in range(5)))
    result = params_on_device(many.named_parameters(), torch.device("meta"))
    assert result.verdict == "warn"
    assert result.detail.startswith("10 parameter(s) not on meta: ['0.weight', '0.bias',")
    assert result.detail.endswith("'3.weight', '3.bias']")  # the first 8 named


def test_model_row_counts_trainable_parameters_and_names_optimizers() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 1))
    model[0].requires_grad_(False)
    groupless = torch.optim.SGD(model[0].parameters(), lr=1.0)
    groupless.param_groups.clear()  # named by its class alone
    optimizers = [torch.optim.AdamW(model[1].parameters(), lr=3e-4), groupless]
    row = model_row(model, optimizers, precision="16-mixed", device="cuda:0 NVIDIA H200")
    assert row == {
        "model_class": "torch.nn.modules.container.Sequential",
        "parameters": 110 + 11,
        "trainable_parameters": 11,
        "param_bytes": (110 + 11) * FLOAT,
        "optimizers": "AdamW(lr=0.0003), SGD",
        "precision": "16-mixed",
        "device": "cuda:0 NVIDIA H200",
    }
    assert model_row(model, [], precision=None, device="cpu")["optimizers"] is None


def test_placement_rows_per_kind_after_an_update() -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    rows = placement_rows(model, [optimizer], "after_first_update")
    weights = (4 * 2 + 2) * FLOAT
    assert [(r["device"], r["kind"], r["bytes"]) for r in rows] == [
        ("cpu", "grad", weights),
        ("cpu", "optimizer_state", 2 * weights + 2 * FLOAT),
        ("cpu", "param", weights),
    ]
    assert {r["moment"] for r in rows} == {"after_first_update"}
