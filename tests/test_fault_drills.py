"""Fault drills: real fits with every pilot callback, killed, out of disk, eight at once, damaged.

Each drill runs ``tests/workers/fault_fit.py`` (the demo classifier or LM with
``pilot_callbacks(...)``) in its own process, then reads what the process left the way a user
would, with :class:`~lightning_pilot.Ledger` and :func:`~lightning_pilot.read_phase_table`:

* SIGKILL anywhere: every visible file reads; the run reads ``running`` while fresh and
  ``interrupted`` / ``heartbeat_lost`` once stale; the curves are the undisturbed run's, up to
  the last heartbeat; the phase table holds the rows of its last flush; a publish cut short
  leaves only a hidden temporary file, which readers skip without counting it.
* A full disk: nothing partial becomes visible, the failure is reported, the records written
  before it stay intact.
* Eight fits at once into one output folder: eight complete runs, nothing lost or doubled.
* A damaged record file or index segment: skipped with a warning naming it, the rest read.

Every drill runs at the same time, each in a process of its own forked by one process that
imported torch, Lightning and lightning_pilot once (``tests/workers/fault_fork.py``: the imports
are most of what a drill costs on a CPU); each drill's ResumeVerifier still starts its
verification as a new Python process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import pytest

from lightning_pilot.core.ids import new_run_id
from lightning_pilot.ledger import Ledger
from lightning_pilot.storage import PHASE_SCHEMA, read_phase_table

pytestmark = pytest.mark.skipif(
    sys.platform == "win32", reason="SIGKILL and process groups are POSIX"
)

SERVER = Path(__file__).parent / "workers" / "fault_fork.py"
TIMEOUT_S = 300.0
# "Much later" for staleness: a run whose last record is older than stale_after is lost.
STALE_AFTER_S = 60.0
LATER = timedelta(hours=1)
# The phases the worker's 2-update pilot window measures before its first flush.
WINDOW_PHASES = {"setup", "data", "forward", "backward", "optimizer_step"}
HAS_PROC = Path("/proc/self/stat").exists()
NO_SPACE = re.escape(os.strerror(28))  # errno.ENOSPC


@dataclass
class Drill:
    """What one worker process left: its folder, exit status and output."""

    out: Path
    variant: str
    returncode: int
    log: str
    killed_by_test: bool = False

    @property
    def pilot(self) -> Path:
        return self.out / "pilot"

    def note(self, kind: str) -> dict[str, Any]:
        path = self.out / f"{kind}-{self.variant}.json"
        assert path.exists(), f"{path.name} missing; worker output:\n{self.log}"
        found: dict[str, Any] = json.loads(path.read_text())
        return found


def launch(spec: Path, drills: list[tuple[Path, str, list[str]]]) -> subprocess.Popen[bytes]:
    """Start every drill at once (``fault_fork.py``: one import, one forked process each, each
    drill in a process group of its own, whose killing takes its children)."""
    spec.write_text(
        json.dumps([{"out": str(out), "variant": name, "args": args} for out, name, args in drills])
    )
    with open(spec.with_suffix(".log"), "wb") as log:
        return subprocess.Popen(
            [sys.executable, str(SERVER), str(spec)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            start_new_session=True,
        )


def drill_pid(server: subprocess.Popen[bytes], out: Path, variant: str) -> int | None:
    """The pid of a drill's process (its process group), once it has published it."""
    path = out / f"{variant}.pid"
    deadline = time.monotonic() + TIMEOUT_S
    while not path.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            return None
        time.sleep(0.02)
    return int(path.read_text())


def finish(
    server: subprocess.Popen[bytes], spec: Path, drills: list[tuple[Path, str, list[str]]]
) -> dict[str, Drill]:
    try:
        server.wait(timeout=TIMEOUT_S)
    finally:
        # Drills still running when the wait ran out, and their verification processes.
        for out, name, _ in drills:
            if (out / f"{name}.pid").exists() and not (out / f"{name}.status").exists():
                with suppress(ProcessLookupError):
                    os.killpg(int((out / f"{name}.pid").read_text()), signal.SIGKILL)
        with suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert server.returncode == 0, spec.with_suffix(".log").read_text(errors="replace")
    return {
        name: Drill(
            out,
            name,
            int((out / f"{name}.status").read_text()),
            (out / f"{name}.log").read_text(errors="replace"),
        )
        for out, name, _ in drills
    }


def group_processes(pgid: int) -> dict[int, bytes]:
    """The processes of a process group (from /proc): pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # state, ppid, pgrp
                found[int(entry.name)] = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # it ended while we looked
    return found


def kill_during_verification(server: subprocess.Popen[bytes], out: Path, variant: str) -> bool:
    """SIGKILL the drill's group once ResumeVerifier's verification process runs in it."""
    pgid = drill_pid(server, out, variant)
    deadline = time.monotonic() + TIMEOUT_S
    while pgid is not None and not (out / f"{variant}.status").exists():
        members = group_processes(pgid)
        if any(b"lightning_pilot.resume.child" in cmd for cmd in members.values()):
            os.killpg(pgid, signal.SIGKILL)
            return True
        if time.monotonic() > deadline:
            break
        # The verification process imports torch and Lightning first: seconds, polled at 0.1 s.
        time.sleep(0.1)
    return False


def hidden_files(pilot: Path) -> list[Path]:
    """Hidden (temporary) files in the ledger and the run tables."""
    folders = [pilot / "ledger", *pilot.glob("runs/*/*.parquet")]
    return sorted(p for folder in folders if folder.is_dir() for p in folder.glob(".*"))


def visible_parquet(pilot: Path) -> list[Path]:
    folders = [pilot / "ledger", *pilot.glob("runs/*/*.parquet")]
    return sorted(p for folder in folders if folder.is_dir() for p in folder.glob("[!._]*.parquet"))


@contextmanager
def no_pilot_warnings() -> Iterator[None]:
    """Readers must skip hidden temporary files silently (a warning means a file was bad)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    ours = [str(w.message) for w in caught if "lightning-pilot" in str(w.message)]
    assert ours == []


def read_warned(read: Callable[[], Any]) -> tuple[Any, list[str]]:
    """Call a reader, returning its result and the lightning-pilot warnings it emitted."""
    with pytest.warns(RuntimeWarning) as caught:
        value = read()
    return value, [str(w.message) for w in caught if "lightning-pilot" in str(w.message)]


def train_curves(ledger: Ledger) -> dict[str, dict[str, list[Any]]]:
    """variant -> {"steps", "loss", "lr"} of each update, assembled by Ledger.curves()."""
    curves = ledger.curves()
    out: dict[str, dict[str, list[Any]]] = {}
    for variant, rows in curves.groupby("variant"):
        loss = rows[rows["curve"] == "train_loss"]
        lr = rows[rows["curve"] == "lr"]
        out[str(variant)] = {
            "steps": [int(s) for s in loss["step"]],
            "loss": loss["value"].tolist(),
            "lr": lr["value"].tolist(),
        }
    return out


def phase_window_rows(table: pd.DataFrame, run_id: str) -> None:
    """The phase table holds exactly the pilot window's snapshot: two measured updates."""
    assert set(table["run_id"]) == {run_id}
    assert set(table["phase"]) == WINDOW_PHASES
    steps = table.loc[table["phase"] == "optimizer_step", "occurrences"]
    assert int(steps.sum()) == 2
    assert set(table["verdict"]) == {"pass"}, table[["phase", "verdict", "reason"]]


# ---------------------------------------------------------------------------------------------
# Eight fits at once into one output folder (also the undisturbed reference for the others)
# ---------------------------------------------------------------------------------------------

# name, seed, task; c0 (classifier, seed 0) is the configuration every fault drill runs.
EIGHT = [(f"c{i}", i, "classifier" if i % 2 == 0 else "lm") for i in range(8)]
# c0 and c1 run the resume verification and the artifact round trip in new processes; the
# others take the verifier's checkpoint at their last update (nothing left to compare: no new
# process), which keeps eight fits on two cores short.
VERIFIED = {"c0", "c1"}


@pytest.fixture(scope="module")
def drills(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Drill]:
    """Every drill of this module, all at once: the eight fits into one folder, each kill and
    each full disk into a folder of its own. The verification kill comes from here."""
    base = tmp_path_factory.mktemp("drills")
    planned = [
        (
            base / "eight",
            name,
            ["--seed", str(seed), "--task", task]
            + (["--artifact"] if name in VERIFIED else ["--resume-at", "6"]),
        )
        for name, seed, task in EIGHT
    ]
    planned += [
        (base / "kills" / fault, fault, ["--fault", fault])
        for fault in ["setup", *(f for f in KILLS if f != "verification")]
    ]
    planned += [
        (base / f"full-{n}", f"full{n}", ["--fault", "disk_full", "--full-after", str(n)])
        for n in (1, 3)
    ]
    if HAS_PROC:
        planned.append((base / "kills" / "verification", "verification", []))
    server = launch(base / "drills.json", planned)
    caught = False
    try:
        if HAS_PROC:
            caught = kill_during_verification(
                server, base / "kills" / "verification", "verification"
            )
    finally:
        done = finish(server, base / "drills.json", planned)
    if caught:
        done["verification"].killed_by_test = True
    return done


@pytest.fixture(scope="module")
def eight(drills: dict[str, Drill]) -> tuple[Path, dict[str, Drill]]:
    return drills["c0"].out, {name: drills[name] for name, _, _ in EIGHT}


@pytest.fixture(scope="module")
def reference(eight: tuple[Path, dict[str, Drill]]) -> dict[str, list[Any]]:
    """The undisturbed curves of the drills' configuration (c0: classifier, seed 0)."""
    shared, _ = eight
    return train_curves(Ledger(shared / "pilot"))["c0"]


def test_eight_concurrent_fits_each_leave_one_complete_run(
    eight: tuple[Path, dict[str, Drill]],
) -> None:
    shared, drills = eight
    results = {}
    for name, drill in drills.items():
        assert drill.returncode == 0, drill.log
        results[name] = drill.note("result")
        assert results[name]["exception"] is None, drill.log
        assert results[name]["global_step"] == 6
    run_ids = {name: result["run_id"] for name, result in results.items()}
    assert len(set(run_ids.values())) == 8

    ledger = Ledger(shared / "pilot")
    with no_pilot_warnings():
        records = ledger.records()
        runs = ledger.runs().set_index("variant")
        curves = train_curves(ledger)
    # Eight starts, 6 heartbeats each (one per update) and eight ends: none lost, none twice.
    assert len(records) == len(list((shared / "pilot" / "ledger").glob("*.parquet"))) == 64
    assert records["record_id"].is_unique
    events = records.groupby("variant")["event"].agg(list).to_dict()
    assert events == {name: ["start", *["heartbeat"] * 6, "end"] for name in run_ids}
    assert runs["run_id"].to_dict() == run_ids
    assert runs["seed"].to_dict() == {name: seed for name, seed, _ in EIGHT}
    outcome = runs[["status", "stop_cause", "stop_step", "updates_done"]]
    assert set(map(tuple, outcome.astype(object).values.tolist())) == {
        ("completed", "max_steps", 6, 6)
    }
    for name in run_ids:
        assert curves[name]["steps"] == [1, 2, 3, 4, 5, 6]
        assert all(0 < loss < 10 for loss in curves[name]["loss"])
    assert hidden_files(shared / "pilot") == []


def test_eight_concurrent_fits_leave_eight_readable_phase_tables(
    eight: tuple[Path, dict[str, Drill]],
) -> None:
    shared, drills = eight
    run_ids = {name: drill.note("result")["run_id"] for name, drill in drills.items()}
    for path in visible_parquet(shared / "pilot"):
        pq.read_table(path)  # every published file is whole
    with no_pilot_warnings():
        table = read_phase_table(shared / "pilot")
    assert set(table["run_id"]) == set(run_ids.values())
    assert "fail" not in set(table["verdict"]), table[table["verdict"] == "fail"]["reason"]
    for name, run_id in run_ids.items():
        rows = table[table["run_id"] == run_id]
        phases = set(rows["phase"])
        assert WINDOW_PHASES | {"validation", "checkpoint_save", "resume"} <= phases, name
        resume = rows[rows["phase"] == "resume"].iloc[0]
        if name in VERIFIED:  # resumed in a new process, artifact reloaded in another
            assert resume["verdict"] == "pass", resume["reason"]
            checks = {check["name"]: check["verdict"] for check in resume["checks"]}
            assert checks["artifact_roundtrip"] == "pass"
            assert checks["loss_trajectory"] == "pass"
            assert "checkpoint_load" in phases
        else:  # the checkpoint at the last update leaves nothing to compare
            assert resume["verdict"] == "not_checked"


# ---------------------------------------------------------------------------------------------
# SIGKILL at several points of a fit
# ---------------------------------------------------------------------------------------------

# fault -> (the ledger's events, updates the ledger knows of, phase table, hidden temp folder).
# Phase table: "start" = the train-start snapshot (setup rows, no update yet), "window" = the
# pilot window's snapshot (after 2 updates).
KILLS: dict[str, tuple[list[str], int, str, str | None]] = {
    "first_batch": (["start"], 0, "start", None),
    "mid_training": (["start", "heartbeat", "heartbeat"], 2, "window", None),
    # ResumeVerifier (4th callback) saves at update 3 before DivergenceLedger (5th) beats.
    "checkpoint_save": (["start", "heartbeat", "heartbeat"], 2, "window", None),
    "validation": (["start", *["heartbeat"] * 3], 3, "window", None),
    # The verification process runs once the fit has ended: every update's heartbeat is in.
    "verification": (["start", *["heartbeat"] * 6], 6, "window", None),
    # The 3rd ledger publish is heartbeat 2: lost before its link, whole after it.
    "publish_ledger_before_link": (["start", "heartbeat"], 1, "window", "ledger"),
    "publish_ledger_after_link": (["start", "heartbeat", "heartbeat"], 2, "window", "ledger"),
    # PhaseMemoryMonitor (1st callback) flushes the window before heartbeat 2: cut short, the
    # train-start snapshot is what stays readable.
    "publish_phases_before_link": (["start", "heartbeat"], 1, "start", "phases.parquet"),
}


@pytest.fixture(scope="module")
def kills(drills: dict[str, Drill]) -> dict[str, Drill]:
    return {fault: drills[fault] for fault in ["setup", *KILLS] if fault in drills}


def test_sigkill_in_setup_leaves_nothing_and_readers_say_so(kills: dict[str, Drill]) -> None:
    drill = kills["setup"]
    assert drill.returncode == -signal.SIGKILL, drill.log
    assert drill.note("killed")["where"] == "setup"
    # Killed before the start record: the run wrote no file at all, so a user sees no trace of
    # it. In a fresh output folder both readers say the folder does not exist; in a folder
    # shared with other runs, this run is simply absent.
    assert not drill.pilot.exists()
    with pytest.raises(FileNotFoundError, match=r"pilot' does not exist"):
        Ledger(drill.pilot)
    with pytest.raises(FileNotFoundError, match=r"pilot' does not exist"):
        read_phase_table(drill.pilot)


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(
            fault,
            marks=pytest.mark.skipif(fault == "verification" and not HAS_PROC, reason="/proc"),
        )
        for fault in KILLS
    ],
)
def test_sigkill_leaves_readable_files_and_an_interrupted_run(
    kills: dict[str, Drill], reference: dict[str, list[Any]], fault: str
) -> None:
    events, updates, phases, hidden_in = KILLS[fault]
    drill = kills[fault]
    assert drill.returncode == -signal.SIGKILL, drill.log
    if fault == "verification":
        assert drill.killed_by_test, drill.log  # SIGKILLed while the new process ran
        (run_dir,) = (drill.pilot / "runs").iterdir()
        run_id = run_dir.name
    else:
        run_id = drill.note("killed")["run_id"]
        run_dir = drill.pilot / "runs" / run_id

    # Whatever was published is whole; the only leftover is the temp file of a cut publish.
    for path in visible_parquet(drill.pilot):
        pq.read_table(path)
    hidden = hidden_files(drill.pilot)
    assert [p.parent.name for p in hidden] == ([hidden_in] if hidden_in else [])
    assert all(p.name.endswith(".tmp") for p in hidden)
    ledger_files = list((drill.pilot / "ledger").glob("[!.]*.parquet"))

    fresh = Ledger(drill.pilot)
    stale = Ledger(drill.pilot, stale_after=STALE_AFTER_S)
    with no_pilot_warnings():  # hidden files are skipped, silently and uncounted
        records = fresh.records()
        now_runs = fresh.runs()
        later = stale.runs(now=datetime.now(timezone.utc) + LATER)
        curves = train_curves(stale)
    assert records["event"].tolist() == events
    assert len(records) == len(ledger_files)
    assert records["record_id"].is_unique
    # A run without an end record is "running" until its last record is stale_after old.
    assert now_runs[["run_id", "status"]].values.tolist() == [[run_id, "running"]]
    run = later.iloc[0]
    assert (run["run_id"], run["status"], run["stop_cause"]) == (
        run_id,
        "interrupted",
        "heartbeat_lost",
    )
    assert (run["updates_done"], run["last_event"], run["records"]) == (
        updates,
        events[-1],
        len(events),
    )
    # The curves up to the last heartbeat are the undisturbed run's, point for point.
    got = curves.get(fault, {"steps": [], "loss": [], "lr": []})  # no points: no curve rows
    assert got["steps"] == list(range(1, updates + 1))
    assert got["loss"] == reference["loss"][:updates]
    assert got["lr"] == reference["lr"][:updates]

    with no_pilot_warnings():  # a cut publish's temp file is not a snapshot: ignored
        table = read_phase_table(drill.pilot)
    if phases == "start":
        assert set(table["run_id"]) == {run_id}
        assert "setup" in set(table["phase"])
        assert "optimizer_step" not in set(table["phase"])
        assert list(table.columns) == PHASE_SCHEMA.names
    else:
        phase_window_rows(table, run_id)

    if fault == "publish_ledger_after_link":  # the temp and the record are the same file
        assert hidden[0].name.startswith(f".{sorted(ledger_files)[-1].name}.")
        assert os.path.samefile(hidden[0], sorted(ledger_files)[-1])
    if fault == "checkpoint_save":  # killed inside the save, before the file was written
        assert list((run_dir / "resume").glob("*.ckpt")) == []
    if fault in ("validation", "verification"):
        assert (run_dir / "resume" / "mid_epoch-step-3.ckpt").is_file()
    if fault == "verification":  # the verification process died with it: no answer
        assert (run_dir / "resume" / "spec-tasks.json").is_file()
        assert not (run_dir / "resume" / "result-tasks.json").exists()

    # Indexing skips the temp file too, and reading through the index gives the same records.
    with no_pilot_warnings():
        segment = fresh.index()
        indexed = fresh.records()
    assert segment is not None
    assert indexed["record_id"].tolist() == records["record_id"].tolist()


# ---------------------------------------------------------------------------------------------
# A full disk during publishes
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def disk(drills: dict[str, Drill]) -> dict[int, Drill]:
    """Every fsync of a file fails with ENOSPC from the end of update 1, or of update 3."""
    return {n: drills[f"full{n}"] for n in (1, 3)}


def check_full_disk_files(drill: Drill, run_id: str, events: list[str]) -> Ledger:
    """No partial file anywhere, no temp file left, the earlier records whole."""
    for path in visible_parquet(drill.pilot):
        pq.read_table(path)
    assert hidden_files(drill.pilot) == []  # each failed publish removed its temp file
    ledger = Ledger(drill.pilot, stale_after=STALE_AFTER_S)
    with no_pilot_warnings():
        records = ledger.records()
        now_runs = ledger.runs()
        later = ledger.runs(now=datetime.now(timezone.utc) + LATER)
    assert records["event"].tolist() == events
    assert set(records["run_id"]) == {run_id}
    assert now_runs["status"].tolist() == ["running"]
    run = later.iloc[0]
    # The end record never made it to disk: the ledger can only say the run went silent.
    assert (run["status"], run["stop_cause"], run["updates_done"]) == (
        "interrupted",
        "heartbeat_lost",
        len(events) - 1,
    )
    return ledger


def ended_by_a_full_disk(drill: Drill) -> tuple[str, list[str]]:
    """The fit trained its 6 updates and then raised ENOSPC when the run closed (its tables
    could not be flushed, nor then the end record); returns the run id and the warnings."""
    assert drill.returncode == 0, drill.log  # the worker returns after fit raised
    result = drill.note("result")
    assert result["global_step"] == 6
    assert result["exception"]["type"] == "OSError"
    assert result["exception"]["errno"] == 28
    assert result["exception"]["raised_in"] == ["run.py", "teardown"]
    messages = [w["message"] for w in result["warnings"] if w["category"] == "RuntimeWarning"]
    return result["run_id"], messages


def test_disk_full_mid_run_warns_per_record_then_fails_the_fit_at_its_end(
    disk: dict[int, Drill], reference: dict[str, list[Any]]
) -> None:
    drill = disk[3]
    # Heartbeats 4 to 6 could not be written: one RuntimeWarning each, naming the ledger
    # folder, and training went on to the planned 6 updates. When the run closed its tables
    # could not be flushed: that OSError is what trainer.fit raised; the end record, written
    # after the flush to say so, could not be written either (a warning naming it).
    run_id, messages = ended_by_a_full_disk(drill)
    ledger_dir = re.escape(str(drill.pilot / "ledger"))
    assert len(messages) == 4, messages
    for message in messages[:3]:
        assert re.fullmatch(
            rf"lightning-pilot: could not write the heartbeat record of run {run_id} to"
            rf" {ledger_dir}: \[Errno 28\] {NO_SPACE}",
            message,
        )
    assert re.fullmatch(
        rf"lightning-pilot: could not write the end record of run {run_id} to {ledger_dir}:"
        rf" \[Errno 28\] {NO_SPACE}",
        messages[3],
    )
    ledger = check_full_disk_files(drill, run_id, ["start", *["heartbeat"] * 3])
    curves = train_curves(ledger)["full3"]
    assert curves["steps"] == [1, 2, 3]
    assert curves["loss"] == reference["loss"][:3]
    # The phase table is the pilot window's snapshot (update 2); later rows were never written.
    with no_pilot_warnings():
        phase_window_rows(read_phase_table(drill.pilot), run_id)


def test_disk_full_before_the_pilot_window_flush_warns_and_training_goes_on(
    disk: dict[int, Drill], reference: dict[str, list[Any]]
) -> None:
    drill = disk[1]
    # The pilot-window flush (end of update 2) could not be written: a warning, and training
    # went on to the planned 6 updates (heartbeats 2 to 6 warn too). The final flush could not
    # be written: that OSError is what trainer.fit raised; nor could the end record after it.
    run_id, messages = ended_by_a_full_disk(drill)
    pilot = re.escape(str(drill.pilot))
    assert re.fullmatch(
        rf"lightning-pilot: could not write the phase table of run {run_id} to {pilot} after"
        rf" the pilot window: \[Errno 28\] {NO_SPACE}; the rows stay buffered",
        messages[0],
    )
    heartbeats = [m for m in messages if "could not write the heartbeat record" in m]
    assert len(heartbeats) == 5, messages
    ledger = check_full_disk_files(drill, run_id, ["start", "heartbeat"])
    curves = train_curves(ledger)["full1"]
    assert (curves["steps"], curves["loss"]) == ([1], reference["loss"][:1])
    # The train-start snapshot (written before the disk filled) is what the table holds.
    with no_pilot_warnings():
        table = read_phase_table(drill.pilot)
    assert set(table["run_id"]) == {run_id}
    assert "optimizer_step" not in set(table["phase"])


# ---------------------------------------------------------------------------------------------
# Damaged files in a ledger
# ---------------------------------------------------------------------------------------------


def copy_ledger(eight: tuple[Path, dict[str, Drill]], tmp_path: Path) -> Path:
    shared, _ = eight
    pilot = tmp_path / "pilot"
    shutil.copytree(shared / "pilot" / "ledger", pilot / "ledger")
    return pilot


def record_file(pilot: Path, run_id: str, event: str, nth: int = 0) -> Path:
    return sorted((pilot / "ledger").glob(f"*-{run_id}-{event}-*.parquet"))[nth]


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_damaged_record_files_are_skipped_with_a_warning_naming_each(
    eight: tuple[Path, dict[str, Drill]], tmp_path: Path
) -> None:
    pilot = copy_ledger(eight, tmp_path)
    before = Ledger(pilot).records()
    ids = before.drop_duplicates("variant").set_index("variant")["run_id"].to_dict()
    heartbeat = record_file(pilot, ids["c2"], "heartbeat", 2)  # c2's third heartbeat
    end = record_file(pilot, ids["c3"], "end")
    truncate(heartbeat)
    truncate(end)
    # Not Parquet at all, named like an end record of c4.
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    garbage = pilot / "ledger" / f"{stamp}-{ids['c4']}-end-{new_run_id()}.parquet"
    garbage.write_bytes(b"PAR1 not a parquet file PAR1")

    ledger = Ledger(pilot, stale_after=STALE_AFTER_S)
    with pytest.warns(
        RuntimeWarning, match=r"^lightning-pilot: skipped unreadable file "
    ) as caught:
        records = ledger.records()
    # One warning per damaged file, each naming it.
    assert len(caught) == 3
    messages = [str(w.message) for w in caught]
    for path in (heartbeat, end, garbage):
        assert sum(str(path) in message for message in messages) == 1, messages
    # Every other record is read: the 64 less the two damaged ones.
    lost = {
        f.name.rsplit(f"-{event}-", 1)[1][: -len(".parquet")]
        for f, event in ((heartbeat, "heartbeat"), (end, "end"))
    }
    assert set(records["record_id"]) == set(before["record_id"]) - lost
    assert len(records) == 62

    runs, messages = read_warned(lambda: ledger.runs(now=datetime.now(timezone.utc) + LATER))
    assert len(messages) == 3
    outcome = runs.set_index("variant")[["status", "stop_cause"]].astype(object)
    # c2 lost a heartbeat only; c4's impostor end record is not a record. c3 lost its end
    # record: all that is left says it went silent after update 6.
    expected = {name: ("completed", "max_steps") for name, _, _ in EIGHT}
    expected["c3"] = ("interrupted", "heartbeat_lost")
    assert {k: tuple(v) for k, v in outcome.iterrows()} == expected
    # The curves are whole all the same: the end record carries them whole, and without it
    # the heartbeats still hold every point.
    curves, _ = read_warned(lambda: train_curves(ledger))
    complete = train_curves(Ledger(eight[0] / "pilot"))
    for name in ("c2", "c3"):
        assert curves[name]["steps"] == [1, 2, 3, 4, 5, 6]
        assert curves[name]["loss"] == complete[name]["loss"]


def test_a_damaged_index_segment_falls_back_to_the_record_files(
    eight: tuple[Path, dict[str, Drill]], tmp_path: Path
) -> None:
    pilot = copy_ledger(eight, tmp_path)
    ledger = Ledger(pilot, stale_after=STALE_AFTER_S)
    before = ledger.records()
    segment = ledger.index()
    assert segment is not None
    assert segment.parent.name == "_index"
    ids = before.drop_duplicates("variant").set_index("variant")["run_id"].to_dict()

    # A record already copied into the index is read from the segment: its file's damage is
    # not even seen.
    end = record_file(pilot, ids["c5"], "end")
    truncate(end)
    with no_pilot_warnings():
        through_index = ledger.records()
    assert through_index["record_id"].tolist() == before["record_id"].tolist()

    # A damaged segment is skipped with a warning naming it; its records are read from their
    # files one by one, and the damaged one among them is skipped with its own warning.
    truncate(segment)
    records, messages = read_warned(ledger.records)
    assert len(messages) == 2
    assert segment.name in messages[0]
    assert "ledger index" in messages[0]
    assert end.name in messages[1]
    assert len(records) == 63
    assert ids["c5"] in set(records["run_id"])

    # A new segment copies every readable record; readers still name what stays unreadable.
    fresh, _ = read_warned(ledger.index)
    assert fresh is not None
    assert fresh != segment
    runs, messages = read_warned(lambda: ledger.runs(now=datetime.now(timezone.utc) + LATER))
    assert any(segment.name in m for m in messages)
    assert any(end.name in m for m in messages)
    statuses = runs.set_index("variant")["status"].to_dict()
    assert statuses.pop("c5") == "interrupted"  # its end record is gone
    assert set(statuses.values()) == {"completed"}
