"""The ledger's schedule, pending updates, outcomes, facts and records, without a Trainer."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lightning_pilot.core.divergence import FATAL_CAUSES, Curves, DivergenceDetector
from lightning_pilot.core.ledger_records import (
    MESSAGE_CHARS,
    OWN_FIELDS,
    Heartbeat,
    PendingUpdates,
    RecordSchedule,
    Stop,
    derived_from_id,
    failed_matches,
    failure_outcome,
    ledger_record,
    limit_reached,
    normal_end,
    repeat_message,
    run_facts,
    unwritten_outcome,
)


def test_evaluations_are_counted_by_distance_when_steps_jump() -> None:
    # Two optimizers: global_step moves by 2 per batch, so step % 3 would miss most of them.
    schedule = RecordSchedule(3, Heartbeat(updates=10))
    schedule.start(0)
    due = [step for step in range(2, 25, 2) if schedule.evaluation_due(step)]
    assert due == [4, 8, 12, 16, 20, 24]


def test_a_resumed_schedule_counts_from_the_resumed_step() -> None:
    schedule = RecordSchedule(5, Heartbeat(updates=10))
    schedule.start(40)
    assert [s for s in range(41, 61) if schedule.evaluation_due(s)] == [45, 50, 55, 60]
    assert [s for s in (45, 50, 55, 60) if schedule.take_heartbeat(s)] == [50, 60]


def test_heartbeats_by_time_count_from_the_last_record_of_any_kind() -> None:
    now = [1000.0]
    schedule = RecordSchedule(1, Heartbeat(seconds=60), clock=lambda: now[0])
    now[0] = 1059.0
    assert not schedule.take_heartbeat(3)
    now[0] = 1060.0
    assert schedule.take_heartbeat(4)
    schedule.recorded()  # the heartbeat was written at 1060
    now[0] = 1100.0
    assert not schedule.take_heartbeat(5)
    now[0] = 1120.5
    assert schedule.take_heartbeat(6)
    assert schedule.last_heartbeat == 6


def test_pending_updates_multiply_the_loss_back_and_join_the_norms() -> None:
    pending = PendingUpdates()
    pending.start(0, overflow=False, grad_norm_every=100, check_grad_norm=True)
    # Update 1: K = 4 micro-batches of loss 2.0, 2.4, 1.6, 2.0 (Lightning hands loss / 4),
    # learning rate 0.1 then 0.05 (the first is kept), a norm read in two parts (3 and 4).
    pending.add_lr(0.1)
    pending.add_lr(0.05)
    assert pending.norm_due(1)
    pending.add_grad_norm(torch.tensor(3.0))
    pending.add_grad_norm(torch.tensor(4.0))
    for loss in (2.0, 2.4, 1.6, 2.0):
        pending.add_loss(torch.tensor(loss / 4, requires_grad=True), factor=4)
        assert pending.close(0) is False  # no update finished yet
    assert pending.close(1) is True
    assert not pending.norm_due(2)  # the next norm is read at update 101
    assert pending.norm_due(101)
    assert not pending.norm_due(102)
    curves = Curves()
    decisions = list(pending.evaluate(DivergenceDetector(), curves))
    assert [d.step for d in decisions] == [1]
    assert curves.train_loss == [(1, pytest.approx(2.0))]
    assert curves.lr == [(1, 0.1)]
    assert pending.updates == []  # read once
    assert list(pending.evaluate(DivergenceDetector(), curves)) == []


def test_norms_are_read_every_update_under_a_scaler_and_never_when_unchecked() -> None:
    scaled = PendingUpdates()
    scaled.start(0, overflow=True, grad_norm_every=100, check_grad_norm=True)
    assert [s for s in range(1, 6) if scaled.norm_due(s)] == [1, 2, 3, 4, 5]
    unchecked = PendingUpdates()
    unchecked.start(0, overflow=False, grad_norm_every=1, check_grad_norm=False)
    assert not any(unchecked.norm_due(s) for s in range(1, 1000))


def test_a_non_finite_loss_stops_with_the_rules_detail() -> None:
    pending = PendingUpdates()
    pending.start(0, overflow=False, grad_norm_every=100, check_grad_norm=True)
    for step, loss in enumerate((2.3, 2.1, float("nan")), 1):
        pending.add_loss(torch.tensor(loss), factor=1)
        pending.close(step)
    reads: list[int] = []

    def read(tensors: list[torch.Tensor]) -> list[float]:
        reads.append(len(tensors))
        return [float(t) for t in tensors]

    decisions = list(pending.evaluate(DivergenceDetector(), Curves(), read=read))
    assert reads == [3]  # one host sync for the three updates
    stops = [Stop.of(d) for d in decisions]
    assert stops[:2] == [None, None]
    assert stops[2] == Stop("nonfinite_loss", 3, "training loss is nan")


def test_a_scaler_overflow_is_recorded_not_fatal() -> None:
    pending = PendingUpdates()
    pending.start(0, overflow=True, grad_norm_every=100, check_grad_norm=True)
    pending.add_loss(torch.tensor(2.0), factor=1)
    pending.add_grad_norm(torch.tensor(float("inf")))
    pending.close(1)
    (decision,) = pending.evaluate(DivergenceDetector(), Curves())
    assert decision.cause is None
    assert [e.event for e in decision.events] == ["grad_overflow"]


@pytest.mark.parametrize("cause", FATAL_CAUSES)
def test_a_stop_crosses_ranks_as_its_code(cause: str) -> None:
    stop = Stop(cause, 17, "seen here")
    assert 1 <= stop.code <= len(FATAL_CAUSES)
    assert Stop.from_code(stop.code, 12) == Stop(
        cause, 12, f"{cause} fired on another rank at step 12"
    )


def test_the_highest_code_is_the_highest_priority_cause() -> None:
    codes = [Stop(cause, 1, "").code for cause in FATAL_CAUSES]
    assert codes == sorted(codes, reverse=True)
    assert Stop.from_code(max(codes), 1).cause == "nonfinite_loss"


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ({"max_steps": 100, "global_step": 100, "max_epochs": 1, "current_epoch": 1}, "max_steps"),
        ({"max_steps": 100, "global_step": 60, "max_epochs": 3, "current_epoch": 3}, "max_epochs"),
        ({"max_steps": -1, "global_step": 60, "max_epochs": -1, "current_epoch": 9}, None),
        ({"max_steps": -1, "global_step": 60, "max_epochs": None, "current_epoch": 9}, None),
        ({"max_steps": 100, "global_step": 60, "max_epochs": 3, "current_epoch": 2}, None),
    ],
)
def test_the_limit_a_fit_reached(limits: dict[str, int | None], expected: str | None) -> None:
    assert limit_reached(**limits) == expected


def test_normal_ends_say_why() -> None:
    base = {
        "action": "stop",
        "stopped_early": [],
        "time_limit": False,
        "limit": "max_steps",
        "updates_done": 40,
        "planned_updates": 40,
    }
    assert normal_end(stop=None, **base) == ("completed", "max_steps", None)
    stop = Stop("loss_blowup", 31, "loss 84.2 above 10x the initial loss (8.4)")
    recorded = normal_end(stop=stop, **base | {"action": "record"})
    assert recorded == (
        "diverged",
        "loss_blowup",
        "loss 84.2 above 10x the initial loss (8.4) (action='record': training went on)",
    )
    early = normal_end(
        stop=None,
        **base | {"stopped_early": [("STOPPED_NO_IMPROVEMENT", "val_loss did not improve")]},
    )
    assert early == (
        "stopped",
        "early_stopping",
        "stopped_no_improvement: val_loss did not improve",
    )
    short = normal_end(stop=None, **base | {"updates_done": 25, "limit": "max_epochs"})
    assert short == ("stopped", "step_shortfall", "25 of 40 planned updates done")


def test_a_failure_keeps_its_message_cut() -> None:
    outcome = failure_outcome(ValueError("x" * 5000), 7, None)
    assert outcome["status"] == "failed"
    assert outcome["stop_cause"] == "exception:ValueError"
    assert outcome["stop_step"] == 7
    assert len(outcome["exception_message"]) == MESSAGE_CHARS
    assert failure_outcome(RuntimeError(""), 0, "unread")["exception_message"] is None


def test_a_run_whose_tables_failed_is_not_clean() -> None:
    outcome = unwritten_outcome("completed", "max_steps", 50, OSError(28, "No space left"))
    assert outcome["status"] == "failed"
    assert outcome["stop_cause"] == "exception:OSError"
    assert outcome["stop_detail"] == (
        "training ended (completed: max_steps) after 50 update(s); then the run's tables could"
        " not be written: [Errno 28] No space left"
    )


def test_repeats_leave_out_this_run_and_the_acknowledged_one() -> None:
    rows = [
        SimpleNamespace(run_id=run, status="diverged", stop_cause="loss_blowup", stop_step=40)
        for run in ("r1", "r2", "r3")
    ]
    matches = failed_matches(rows, exclude=("r2", None))
    assert matches == [
        "r1 (diverged: loss_blowup at step 40)",
        "r3 (diverged: loss_blowup at step 40)",
    ]
    message = repeat_message("exp", "lr-high", "abc123", matches)
    assert message.startswith("exp/lr-high (variant_key abc123) repeats a configuration")
    assert "r1 (diverged: loss_blowup at step 40), r3" in message
    assert message.endswith("pass derived_from=<run id> to relaunch it knowingly.")


def _facts(**changes: object) -> dict[str, object]:
    kwargs: dict[str, object] = {
        "experiment": "e",
        "params": {"lr": 3e-4, "width": 64},
        "seed": 1,
        "fields": {},
        "strategy": "DDPStrategy",
        "loader_size": 16,
        "accumulate": 4,
        "world_size": 8,
        "estimate": 1250.0,
        "precision": "bf16-mixed",
        "optimizer_lr": lambda: pytest.fail("read although params hold lr"),
        "device_name": "cuda:0 NVIDIA H100",
    }
    return run_facts(**kwargs | changes)


def test_run_facts_multiply_the_batch_and_plan_the_updates() -> None:
    facts = _facts()
    assert facts["effective_batch_size"] == 16 * 4 * 8
    assert facts["planned_updates"] == 1250
    assert facts["lr"] == 3e-4
    assert facts["dp_replicas"] == 8
    assert facts["devices"] == 8
    assert facts["variant_key"] != _facts(params={"lr": 1e-3, "width": 64})["variant_key"]
    # The seed is part of config_hash, not of variant_key.
    assert facts["variant_key"] == _facts(seed=2)["variant_key"]
    assert facts["config_hash"] != _facts(seed=2)["config_hash"]


def test_run_facts_model_parallel_unknowns_and_handed_over_fields() -> None:
    parallel = _facts(strategy="ModelParallelStrategy", estimate=math.inf, loader_size=None)
    assert parallel["dp_replicas"] is None
    assert parallel["effective_batch_size"] is None
    assert parallel["planned_updates"] is None
    handed = _facts(fields={"micro_batch_size": 4, "dp_replicas": 2, "planned_updates": 99})
    assert handed["effective_batch_size"] == 4 * 4 * 2
    assert handed["planned_updates"] == 99
    # A boolean is no learning rate: the optimizer's is read.
    assert _facts(params={"lr": True}, optimizer_lr=lambda: 0.02)["lr"] == 0.02


def test_a_record_keeps_its_own_columns_and_the_whole_curves_at_start() -> None:
    curves = Curves()
    curves.add_train(1, 2.5, lr=0.1)
    curves.add_val(1, "val_loss", 2.7)
    fields = {"run_id": "forged", "status": "forged", "gpu_hours": 1.5, "notes": None}
    assert {"run_id", "status"} <= OWN_FIELDS
    record = ledger_record(
        {"lr": 0.1, "precision": "32-true"},
        fields,
        {"run_id": "r1", "attempt": 0},
        event="start",
        updates_done=0,
        phase_table_uri=None,
        curves=curves,
        mark=curves.mark(),
        outcome={"status": "running"},
    )
    assert record["run_id"] == "r1"
    assert record["status"] == "running"
    assert record["gpu_hours"] == 1.5
    assert "notes" not in record
    assert record["curves_delta"] is False
    assert record["train_loss"] == [{"step": 1, "value": 2.5}]
    assert record["val_points"] == [{"step": 1, "name": "val_loss", "value": 2.7}]


def test_a_heartbeat_record_holds_the_curves_since_its_mark() -> None:
    curves = Curves()
    curves.add_train(1, 2.5, lr=0.1)
    mark = curves.mark()
    curves.add_train(2, 2.4, lr=0.1)
    record = ledger_record(
        {"lr": 0.1},
        {"status": "x", "gpu": "H100"},
        {"run_id": "r"},
        event="heartbeat",
        updates_done=2,
        phase_table_uri=None,
        curves=curves,
        mark=mark,
        outcome={"status": "running"},
    )
    assert (record["gpu"], record["status"], record["curves_delta"]) == ("H100", "running", True)
    assert record["train_loss"] == [{"step": 2, "value": 2.4}]


def test_derived_from_takes_none_or_a_run_id() -> None:
    run_id = "20261130T092309763Z-a1fe91cb433ec8b4"
    assert derived_from_id(run_id) == run_id
    assert derived_from_id(None) is None
    with pytest.raises(ValueError, match=r"DivergenceLedger\(derived_from='run-7'\) is invalid"):
        derived_from_id("run-7")
