"""Ledger: folding records into runs, curves, comparisons; without a Trainer."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from lightning_pilot.core.ids import new_run_id
from lightning_pilot.ledger import Ledger, find_failed_runs, fold_records
from lightning_pilot.storage import read_ledger_records, read_phase_table, write_ledger_record

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def write(folder: Path, run_id: str, event: str, minute: int, **fields: Any) -> None:
    record = {"run_id": run_id, "event": event, "written_at": T0 + timedelta(minutes=minute)}
    write_ledger_record(folder, record | fields)


def points(values: list[float], start: int = 1) -> list[dict[str, Any]]:
    return [{"step": start + i, "value": v} for i, v in enumerate(values)]


@pytest.fixture
def ledger_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "pilot" / "ledger"
    config = {"experiment": "lr", "params_json": '{"lr":0.1}', "variant_key": "k1", "lr": 0.1}
    done, lost, live, crashed = (new_run_id() for _ in range(4))
    write(folder, done, "start", 0, variant="ctl", seed=0, status="running", **config)
    write(folder, done, "heartbeat", 1, variant="ctl", seed=0, status="running",
          train_loss=points([3.0, 2.0]))  # fmt: skip
    write(folder, done, "end", 2, variant="ctl", seed=0, status="completed",
          stop_cause="max_steps", stop_step=3, train_loss=points([3.0, 2.0, 1.5]),
          val_points=[{"step": 3, "name": "val_loss", "value": 1.8}])  # fmt: skip
    write(folder, lost, "start", 3, variant="hot", seed=0, status="running", **config)
    write(folder, lost, "heartbeat", 4, variant="hot", seed=0, status="running",
          train_loss=points([3.0, 9.0]))  # fmt: skip
    write(folder, live, "start", 58, variant="hot", seed=1, status="running", **config)
    # A run that failed on its first attempt and was resumed: the second attempt completed.
    write(folder, crashed, "start", 5, variant="ctl", seed=1, status="running", attempt=1,
          attempt_id=crashed, **config)  # fmt: skip
    write(folder, crashed, "end", 6, variant="ctl", seed=1, status="failed", attempt=1,
          attempt_id=crashed, stop_cause="exception:ValueError", exception_type="ValueError",
          exception_message="boom", train_loss=points([3.0, 2.5]))  # fmt: skip
    resumed = new_run_id()
    write(folder, crashed, "start", 7, variant="ctl", seed=1, status="running", attempt=2,
          attempt_id=resumed)  # fmt: skip
    write(folder, crashed, "end", 8, variant="ctl", seed=1, status="completed", attempt=2,
          attempt_id=resumed, stop_cause="max_steps", stop_step=3,
          train_loss=points([3.0, 2.4, 1.6]),
          val_points=[{"step": 3, "name": "val_loss", "value": 1.7}])  # fmt: skip
    return folder


NOW = T0 + timedelta(minutes=60)


def test_runs_fold_one_row_per_run(ledger_dir: Path) -> None:
    runs = Ledger(ledger_dir.parent, stale_after=600).runs(now=NOW)
    assert len(runs) == 4
    by = runs.set_index(["variant", "seed"])
    done = by.loc[("ctl", 0)]
    assert (done["status"], done["stop_cause"], done["stop_step"]) == ("completed", "max_steps", 3)
    assert (done["records"], done["last_event"]) == (3, "end")
    # Configuration from the start record survives an end record that did not repeat it.
    assert (done["params_json"], done["lr"], done["variant_key"]) == ('{"lr":0.1}', 0.1, "k1")
    assert done["started_at"] == pd.Timestamp(T0)
    lost = by.loc[("hot", 0)]
    assert (lost["status"], lost["stop_cause"]) == ("interrupted", "heartbeat_lost")
    live = by.loc[("hot", 1)]
    assert live["status"] == "running"
    assert pd.isna(live["stop_cause"])


def test_latest_record_wins_for_the_outcome(ledger_dir: Path) -> None:
    run = Ledger(ledger_dir).runs(now=NOW).set_index(["variant", "seed"]).loc[("ctl", 1)]
    assert (run["status"], run["attempt"], run["attempts"]) == ("completed", 2, 2)
    # The first attempt's exception does not leak into the completed outcome.
    assert pd.isna(run["exception_type"])
    assert pd.isna(run["exception_message"])
    # ... while the configuration from attempt 1's start record is kept.
    assert run["variant_key"] == "k1"


def test_empty_ledger(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    assert ledger.runs().empty
    assert "status" in ledger.runs().columns
    assert ledger.curves().empty
    assert list(ledger.curves().columns)[-2:] == ["step", "value"]


def test_curves_long_format(ledger_dir: Path) -> None:
    curves = Ledger(ledger_dir).curves()
    train = curves[curves["curve"] == "train_loss"]
    # Latest record of each run: 3 + 2 + 0 + 3 points.
    assert len(train) == 8
    resumed = train[(train["variant"] == "ctl") & (train["seed"] == 1)]
    assert resumed["value"].tolist() == [3.0, 2.4, 1.6]
    val = curves[curves["curve"] == "val"]
    assert val[["name", "step", "value"]].values.tolist() == [
        ["val_loss", 3, 1.8],
        ["val_loss", 3, 1.7],
    ]
    every = Ledger(ledger_dir).curves(all_attempts=True)
    attempts = every[(every["curve"] == "train_loss") & (every["seed"] == 1)]
    assert attempts.groupby("attempt")["step"].max().to_dict() == {1: 2, 2: 3}


def test_compare_from_the_ledger(ledger_dir: Path) -> None:
    result = Ledger(ledger_dir, stale_after=600).compare("train_loss", reduce="min")
    summary = result.summary.set_index("variant")
    assert summary.loc["ctl", "n_completed"] == 2
    assert summary.loc["ctl", "median"] == pytest.approx(1.55)
    assert summary.loc["hot", "n_runs"] == 2
    # Runs from the live ledger: "hot" seed 0 lost its heartbeat, seed 1 is fresh or stale.
    assert summary.loc["hot", "n_in_statistics"] == 0
    by_column = Ledger(ledger_dir).compare("stop_step")
    assert by_column.summary.set_index("variant").loc["ctl", "mean"] == 3.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"metric": "val_acc"}, ValueError, r"metric='val_acc' is neither a validation metric"),
        ({"metric": "status"}, ValueError, r"metric='status' is a column of runs\(\) but is not"),
        ({"metric": "val_loss", "by": "arch"}, ValueError, r"by='arch' is not a column"),
        (
            {"metric": "val_loss", "reduce": "mean"},
            ValueError,
            r"Ledger.compare\(reduce='mean'\) is invalid: expected one of 'last'",
        ),
        ({"metric": "val_loss", "experiment": "x"}, ValueError, r"experiment='x' is not in"),
        ({"metric": "val_loss", "control": "y"}, ValueError, r"control='y' is not a variant"),
    ],
)
def test_compare_bad_arguments(
    ledger_dir: Path, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        Ledger(ledger_dir).compare(**kwargs)


def test_bad_ledger_arguments(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Ledger(tmp_path / "missing")
    with pytest.raises(
        ValueError, match=r"Ledger\(stale_after=-1\) is invalid: expected a number >= 0 \(seconds\)"
    ):
        Ledger(tmp_path, stale_after=-1)


@pytest.mark.parametrize("path", ["", " ", "\t\n"])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(path: str) -> None:
    expected = r"\(path=.*\) is invalid: expected a non-empty folder path"
    with pytest.raises(ValueError, match=rf"Ledger{expected} .*\(the ledger folder\)"):
        Ledger(path)
    with pytest.raises(ValueError, match=rf"read_ledger_records{expected}"):
        read_ledger_records(path)
    with pytest.raises(ValueError, match=rf"read_phase_table{expected}"):
        read_phase_table(path)


def test_an_unreadable_record_is_skipped_with_a_warning(ledger_dir: Path) -> None:
    (ledger_dir / "20260101T000000000000Z-broken-end-x.parquet").write_bytes(b"PAR1 truncated")
    with pytest.warns(RuntimeWarning, match="skipped unreadable file .*broken"):
        runs = Ledger(ledger_dir).runs(now=NOW)
    assert len(runs) == 4


def test_find_failed_runs_reads_end_records(tmp_path: Path) -> None:
    folder = tmp_path / "ledger"
    assert find_failed_runs(folder, "k").empty
    bad, good = new_run_id(), new_run_id()
    write(folder, bad, "end", 1, variant_key="k", status="diverged", stop_cause="loss_blowup",
          stop_step=7)  # fmt: skip
    write(folder, good, "end", 2, variant_key="k", status="completed")
    write(folder, new_run_id(), "end", 3, variant_key="other", status="failed")
    found = find_failed_runs(folder, "k")
    assert found.to_dict("records") == [
        {"run_id": bad, "status": "diverged", "stop_cause": "loss_blowup", "stop_step": 7}
    ]


def test_predictions_errors(ledger_dir: Path) -> None:
    ledger = Ledger(ledger_dir)
    with pytest.raises(KeyError, match="is not in"):
        ledger.predictions(new_run_id())
    run_id = ledger.runs(now=NOW)["run_id"].iloc[0]
    with pytest.raises(ValueError, match="recorded no predictions"):
        ledger.predictions(run_id)


def test_fold_is_vectorised_for_ten_thousand_runs() -> None:
    # The fold alone (reading the files is measured separately, see docs/ledger.md): 30,000
    # records of 10,000 runs, built in memory with the ledger's own dtypes.
    n = 10_000
    ids = [new_run_id() for _ in range(n)]
    base = pd.DataFrame(
        {
            "run_id": ids * 3,
            "event": ["start"] * n + ["heartbeat"] * n + ["end"] * n,
            "written_at": pd.to_datetime(
                [T0 + timedelta(seconds=i) for i in range(3 * n)], utc=True
            ),
            "status": ["running"] * (2 * n) + ["completed"] * n,
            "attempt": pd.array([1] * (3 * n), dtype="Int32"),
            "variant": [f"v{i % 7}" for i in range(3 * n)],
            "seed": pd.array([i % 5 for i in range(3 * n)], dtype="Int64"),
        }
    )
    runs = fold_records(base, now=T0 + timedelta(days=1))
    assert len(runs) == n
    assert set(runs["status"]) == {"completed"}
    assert (runs["records"] == 3).all()


def test_a_root_dir_instead_of_the_pilot_folder_says_where_the_ledger_is(tmp_path: Path) -> None:
    (tmp_path / "pilot" / "ledger").mkdir(parents=True)
    with pytest.warns(UserWarning, match=r"holds no ledger records; the ledger is in .*pilot"):
        Ledger(tmp_path)
