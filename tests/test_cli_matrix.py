"""Every command against every failure class: exit 2 with one line on stderr, never a traceback.

Exit 1 means one thing only (a failed check, or a run in scope that diverged, ran out of memory
or failed); 0 means everything in scope was read and passed. Whatever else goes wrong (a missing
or corrupt path, a file where a folder is expected, a disk that refuses the write, a bad flag)
is exit 2 and exactly one ``lightning-pilot: ...`` line on stderr.

The folders are written with the library's own writers (no training), once per module; each
cell that damages files works on a fresh copy. The tests run as root, where a ``chmod 555``
folder does not stop a write: a read-only mount or a full disk is simulated by making the
publishing function raise the ``OSError`` the kernel would give.
"""

from __future__ import annotations

import errno
import os
import shutil
import struct
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from lightning_pilot import storage
from lightning_pilot.cli import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, main
from lightning_pilot.core.ids import new_run_id

# -- folders written with the library's writers -------------------------------------------------

_PHASES = ("setup", "data", "forward", "backward", "optimizer_step", "validation")


def write_run(
    out: Path,
    *,
    variant: str,
    seed: int = 0,
    status: str = "completed",
    fail_backward: bool = False,
    experiment: str = "matrix",
) -> Path:
    """One run: its phase table (one snapshot) and its start and end ledger records."""
    run_id = new_run_id()
    now = datetime.now(timezone.utc)
    rows: list[dict[str, Any]] = []
    for index, phase in enumerate(_PHASES):
        for first in (True,) if phase == "setup" else (True, False):
            verdict = "fail" if fail_backward and phase == "backward" else "pass"
            rows.append(
                {
                    "schema_version": storage.PHASE_SCHEMA_VERSION,
                    "written_at": now,
                    "run_id": run_id,
                    "attempt": 1,
                    "attempt_id": "a1",
                    "rank": 0,
                    "world_size": 1,
                    "device": "cpu",
                    "phase": phase,
                    "first": first,
                    "occurrences": 1 if first else 5,
                    "measured_occurrences": 1 if first else 5,
                    "batch_size": 8,
                    "counter": "cpu_tensor_tracker",
                    "peak_allocated_bytes": 1024 * (index + 1),
                    "device_capacity_bytes": 8 * 1024**3,
                    "duration_s": 0.01,
                    "duration_median_s": 0.01,
                    "verdict": verdict,
                    "checks": [
                        {"name": "grads_reach_params", "verdict": verdict, "detail": "planted"}
                    ],
                    "reason": "1 trainable parameter(s) received no gradient"
                    if verdict == "fail"
                    else None,
                }
            )
    run_dir = out / "runs" / run_id
    storage.write_snapshot(
        run_dir / "phases.parquet",
        storage.rows_to_table(rows, storage.PHASE_SCHEMA),
        writer="a0001-r00000-a1",
        seq=1,
    )
    common = {"run_id": run_id, "attempt": 1, "attempt_id": "a1"}
    storage.write_ledger_record(
        out / "ledger",
        common
        | {
            "event": "start",
            "status": "running",
            "experiment": experiment,
            "variant": variant,
            "seed": seed,
            "lr": 0.01,
            "micro_batch_size": 8,
            "accumulate_grad_batches": 2,
            "dp_replicas": 1,
            "effective_batch_size": 16,
            "planned_updates": 6,
        },
    )
    diverged = status == "diverged"
    storage.write_ledger_record(
        out / "ledger",
        common
        | {
            "event": "end",
            "status": status,
            "stop_cause": "loss_blowup" if diverged else "max_steps",
            "stop_step": 4 if diverged else 6,
            "updates_done": 4 if diverged else 6,
            "train_loss": [{"step": 1, "value": 1.0}, {"step": 6, "value": 0.5}],
            "val_points": [{"step": 6, "name": "val_loss", "value": 0.7}],
        },
    )
    return run_dir


@dataclass(frozen=True)
class Folders:
    clean: Path  # two completed runs, every check passed
    mixed: Path  # a clean run, a diverged run and a run with a failed check
    runs: dict[str, Path]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Folders:
    clean = tmp_path_factory.mktemp("clean")
    write_run(clean, variant="ctl", seed=0)
    write_run(clean, variant="ctl", seed=1)
    mixed = tmp_path_factory.mktemp("mixed")
    runs = {
        "ctl": write_run(mixed, variant="ctl"),
        "hot": write_run(mixed, variant="hot", status="diverged"),
        "broken": write_run(mixed, variant="broken", fail_backward=True),
    }
    return Folders(clean, mixed, runs)


@dataclass
class Env:
    """What a cell builds its command line from: fresh copies, a scratch folder, monkeypatch."""

    folders: Folders
    tmp: Path
    monkeypatch: pytest.MonkeyPatch
    demo_started: list[str]

    def clean(self) -> Path:
        """A fresh copy of the clean output folder, safe to damage."""
        copy = self.tmp / "clean"
        if not copy.exists():
            shutil.copytree(self.folders.clean, copy)
        return copy

    def clean_run(self) -> Path:
        return sorted((self.clean() / "runs").iterdir())[0]

    def mixed(self, name: str | None = None) -> Path:
        """A fresh copy of the mixed folder (or of one of its run folders)."""
        copy = self.tmp / "mixed"
        if not copy.exists():
            shutil.copytree(self.folders.mixed, copy)
        return copy if name is None else copy / "runs" / self.folders.runs[name].name

    def a_file(self) -> Path:
        file = self.tmp / "notes.txt"
        file.write_text("a plain file\n")
        return file

    def refuse_writes(self, code: int) -> None:
        """Every published file fails as on a read-only mount (EROFS) or a full disk (ENOSPC)."""

        def refuse(path: Any, write: Any) -> Path:
            raise OSError(code, os.strerror(code), str(path))

        for where in (storage, storage.publish):  # callers of storage.publish_file; publishers
            self.monkeypatch.setattr(where, "publish_file", refuse)


@pytest.fixture
def env(folders: Folders, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Env:
    started: list[str] = []

    def run_demo(out_dir: Path, **_: Any) -> dict[str, Any]:
        started.append(str(out_dir))  # the demo trained: a failure cell must stop before this
        raise SystemExit("the demo started training")

    # `demo` must refuse a bad flag or an unwritable --out before it trains (or imports torch).
    monkeypatch.setitem(
        sys.modules, "lightning_pilot.demo.pilot", types.SimpleNamespace(run_demo=run_demo)
    )
    return Env(folders, tmp_path, monkeypatch, started)


# -- ways to damage a file ----------------------------------------------------------------------


def garbage(file: Path) -> None:
    file.write_bytes(b"not parquet at all")


def truncated(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def empty(file: Path) -> None:
    file.write_bytes(b"")


def oversized_claim(file: Path) -> None:
    """A footer that claims 4 GiB of metadata in a file of a few hundred bytes."""
    data = file.read_bytes()
    file.write_bytes(data[:-8] + struct.pack("<I", 0xFFFFFFF0) + b"PAR1")


def folder_instead(file: Path) -> None:
    """A folder where a Parquet file is expected."""
    file.unlink()
    file.mkdir()


DAMAGE: dict[str, Callable[[Path], None]] = {
    "garbage": garbage,
    "truncated": truncated,
    "empty": empty,
    "oversized_claim": oversized_claim,
    "folder_instead": folder_instead,
}


def ledger_files(out: Path) -> list[Path]:
    return sorted((out / "ledger").glob("*.parquet"))


def phase_files(out: Path) -> list[Path]:
    return sorted((out / "runs").glob("*/phases.parquet/*.parquet"))


TARGETS: dict[str, Callable[[Path], list[Path]]] = {
    "ledger": ledger_files,  # every ledger record
    "phases": phase_files,  # every phase-table file
    "both": lambda out: ledger_files(out) + phase_files(out),
    "one_record": lambda out: ledger_files(out)[-1:],  # some but not all: a partial read
}

READERS: dict[str, Callable[[Env], list[str]]] = {
    "show_out": lambda env: ["show", str(env.clean())],
    "show_run": lambda env: ["show", str(env.clean_run())],
    "show_ledger": lambda env: ["show", str(env.clean() / "ledger")],
    "compare": lambda env: ["compare", str(env.clean()), "--metric", "val_loss"],
    "sheet": lambda env: ["sheet", str(env.clean_run())],
}


# -- the checks every cell makes ----------------------------------------------------------------


def run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out, captured.err


def usage_error(code: int, err: str) -> str:
    """Exit 2 and exactly one line on stderr, ``lightning-pilot: ...``; returns that line."""
    assert code == EXIT_USAGE, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert err.endswith("\n")
    assert lines[0].startswith("lightning-pilot: ")
    return lines[0]


def result(out: str) -> str:
    return next(line for line in reversed(out.splitlines()) if line.startswith("Result: "))


# -- unreadable, corrupt or misplaced files -----------------------------------------------------


def check_unreadable(
    reader: str, target: str, damage: str, env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    out = env.clean()
    files = TARGETS[target](out)
    assert files
    for file in files:
        DAMAGE[damage](file)
    code, stdout, err = run(capsys, READERS[reader](env))
    if reader == "show_ledger" and target == "phases":
        # The ledger folder alone: no phase table is in scope, and the ledger reads fine.
        assert code == EXIT_OK, err
        assert err == ""
        return
    line = usage_error(code, err)
    # The line names what could not be read.
    assert any(str(file) in line or file.name in line for file in files), line
    if "Result: " in stdout:  # what was read was printed: its summary never reads as clean
        assert "skipped (unreadable)" in stdout
        assert "no failed check, no diverged or failed run (" not in result(stdout)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("reader", READERS)
def test_unreadable_files(
    reader: str, target: str, env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every command, every kind of file in scope: all of them corrupt, or one of them."""
    check_unreadable(reader, target, "garbage", env, capsys)


@pytest.mark.parametrize("target", ["ledger", "phases"])
@pytest.mark.parametrize("damage", DAMAGE)
def test_every_kind_of_damage(
    damage: str, target: str, env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """Truncated, empty, a footer claiming 4 GiB, a folder named like a file: each is caught."""
    check_unreadable("show_out", target, damage, env, capsys)


@pytest.mark.parametrize("reader", ["show_out", "show_run", "compare", "sheet"])
def test_phase_table_replaced_by_a_plain_file(
    reader: str, env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    table = env.clean_run() / "phases.parquet"
    shutil.rmtree(table)
    table.write_text("not a folder\n")
    code, _, err = run(capsys, READERS[reader](env))
    assert str(table) in usage_error(code, err)


def test_partial_ledger_read_is_stated_and_never_clean(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    out = env.clean()
    (lost,) = ledger_files(out)[-1:]
    garbage(lost)
    code, stdout, err = run(capsys, ["show", str(out)])
    line = usage_error(code, err)
    assert str(lost) in line
    assert "Ledger (2 run(s))" in stdout  # the rest was read and shown
    summary = stdout[stdout.rindex("Result: ") :]
    assert summary.startswith("Result: 1 file(s) skipped (unreadable)")
    assert str(lost) in summary


@pytest.mark.parametrize("reader", ["show_out", "show_ledger", "compare"])
def test_empty_ledger_and_no_phase_table_is_nothing_to_check(
    reader: str, env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    out = env.clean()
    shutil.rmtree(out / "runs")
    for file in ledger_files(out):
        file.unlink()
    (out / "ledger" / "README.txt").write_text("not a record\n")  # the folder is not empty
    code, _, err = run(capsys, READERS[reader](env))
    usage_error(code, err)


# -- missing paths and the wrong kind of path ---------------------------------------------------

PATH_CASES: dict[str, Callable[[Env], list[str]]] = {
    "show_missing": lambda env: ["show", str(env.tmp / "nope")],
    "show_missing_parent": lambda env: ["show", str(env.tmp / "nope" / "child")],
    "show_file": lambda env: ["show", str(env.a_file())],
    "show_empty_folder": lambda env: ["show", str(env.tmp)],
    "compare_missing": lambda env: ["compare", str(env.tmp / "nope"), "--metric", "val_loss"],
    "compare_file": lambda env: ["compare", str(env.a_file()), "--metric", "val_loss"],
    "compare_empty_folder": lambda env: ["compare", str(env.tmp), "--metric", "val_loss"],
    "sheet_missing": lambda env: ["sheet", str(env.tmp / "nope")],
    "sheet_missing_parent": lambda env: ["sheet", str(env.tmp / "nope" / "runs" / "x")],
    "sheet_file": lambda env: ["sheet", str(env.a_file())],
    "sheet_output_folder": lambda env: ["sheet", str(env.clean())],
    "sheet_ledger_folder": lambda env: ["sheet", str(env.clean() / "ledger")],
    "demo_out_is_a_file": lambda env: ["demo", "--quick", "--out", str(env.a_file())],
    "demo_out_under_a_file": lambda env: ["demo", "--quick", "--out", str(env.a_file() / "d")],
}


@pytest.mark.parametrize("case", PATH_CASES)
def test_bad_paths(case: str, env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    argv = PATH_CASES[case](env)
    code, stdout, err = run(capsys, argv)
    line = usage_error(code, err)
    named = next(arg for arg in argv if arg.startswith(str(env.tmp)))
    assert named in line, line
    assert stdout == ""
    assert env.demo_started == []


# -- a disk that refuses the write --------------------------------------------------------------

WRITE_ERRORS = (errno.EROFS, errno.ENOSPC, errno.EACCES, errno.EIO)
WRITE_CASES: dict[str, Callable[[Env], list[str]]] = {
    "sheet": lambda env: ["sheet", str(env.clean_run()), "--gpu-memory", "80GiB"],
    "demo": lambda env: ["demo", "--quick", "--out", str(env.tmp / "demo")],
    "demo_existing_out": lambda env: ["demo", "--quick", "--out", str(env.tmp)],
}


@pytest.mark.parametrize(
    ("case", "code_"),
    [
        ("sheet", errno.EROFS),
        ("sheet", errno.ENOSPC),
        *((case, code) for case in WRITE_CASES if case != "sheet" for code in WRITE_ERRORS),
    ],
)
def test_refused_writes(
    case: str, code_: int, env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = WRITE_CASES[case](env)
    env.refuse_writes(code_)
    code, stdout, err = run(capsys, argv)
    line = usage_error(code, err)
    assert os.strerror(code_) in line
    assert errno.errorcode[code_] in line
    assert str(Path(argv[-1] if case != "sheet" else argv[1])) in line
    assert stdout == "" or "Choice sheet written" not in stdout
    assert env.demo_started == []
    if case == "sheet":
        assert not list(Path(argv[1]).glob("sheet*.md"))


# -- bad flags ----------------------------------------------------------------------------------

HUGE = "9" * 400
PLAN = ["plan", "--dataset-size", "100", "--micro-batch", "2", "--accumulate", "8"]

FLAG_CASES: dict[str, Callable[[Env], list[str]]] = {
    "no_command_unknown": lambda env: ["frobnicate"],
    "top_unknown_flag": lambda env: ["--frobnicate"],
    "show_unknown_flag": lambda env: ["show", str(env.clean()), "--frobnicate"],
    "show_no_path": lambda env: ["show"],
    "compare_unknown_flag": lambda env: ["compare", str(env.clean()), "--metric", "x", "--zz"],
    "compare_no_metric": lambda env: ["compare", str(env.clean())],
    "compare_bad_mode": lambda env: ["compare", str(env.clean()), "--metric", "x", "--mode", "up"],
    "compare_bad_metric": lambda env: ["compare", str(env.clean()), "--metric", "val_nothing"],
    "compare_bad_control": lambda env: [
        *("compare", str(env.clean()), "--metric", "val_loss", "--control", "zz")
    ],
    "plan_unknown_flag": lambda env: [*PLAN, "--epochs", "1", "--zz"],
    "plan_no_budget": lambda env: PLAN,
    "plan_both_budgets": lambda env: [*PLAN, "--epochs", "1", "--max-steps", "3"],
    "plan_zero": lambda env: [*PLAN[:4], "0", "--epochs", "1"],
    "plan_negative": lambda env: [*PLAN[:4], "-2", "--epochs", "1"],
    "plan_negative_epochs": lambda env: [*PLAN, "--epochs=-1"],
    "plan_not_a_number": lambda env: [*PLAN[:4], "two", "--epochs", "1"],
    "plan_nan": lambda env: [*PLAN[:4], "nan", "--epochs", "1"],
    "plan_float": lambda env: [*PLAN[:4], "1.5", "--epochs", "1"],
    "plan_huge_dataset": lambda env: [
        *("plan", "--dataset-size", HUGE, "--micro-batch", "2", "--epochs", "1")
    ],
    "plan_huge_steps": lambda env: [*PLAN, "--max-steps", HUGE],
    "plan_huge_dataset_accumulated": lambda env: [
        *("plan", "--dataset-size", HUGE, "--micro-batch", "2", "--accumulate", "8"),
        *("--epochs", "1"),
    ],
    "sheet_unknown_flag": lambda env: ["sheet", str(env.clean_run()), "--zz"],
    "sheet_size_unit": lambda env: ["sheet", str(env.clean_run()), "--gpu-memory", "12XB"],
    "sheet_size_huge": lambda env: ["sheet", str(env.clean_run()), "--gpu-memory", HUGE],
    "sheet_size_huge_unit": lambda env: [
        *("sheet", str(env.clean_run()), "--gpu-memory", HUGE + "TiB")
    ],
    "sheet_size_negative": lambda env: ["sheet", str(env.clean_run()), "--gpu-memory=-5GiB"],
    "sheet_size_zero": lambda env: ["sheet", str(env.clean_run()), "--gpu-memory", "0"],
    "sheet_size_fraction_of_a_byte": lambda env: [
        *("sheet", str(env.clean_run()), "--gpu-memory", "0.4")
    ],
    "sheet_size_nan": lambda env: ["sheet", str(env.clean_run()), "--gpu-memory", "nan"],
    "sheet_size_inf": lambda env: ["sheet", str(env.clean_run()), "--gpu-memory", "inf"],
    "sheet_reserve_nan": lambda env: ["sheet", str(env.clean_run()), "--reserve", "nan"],
    "sheet_reserve_negative": lambda env: ["sheet", str(env.clean_run()), "--reserve=-0.5"],
    "sheet_reserve_one": lambda env: ["sheet", str(env.clean_run()), "--reserve", "1"],
    "sheet_reserve_huge": lambda env: ["sheet", str(env.clean_run()), "--reserve", HUGE],
    "demo_unknown_flag": lambda env: ["demo", "--out", str(env.tmp / "d"), "--zz"],
    "demo_size_unit": lambda env: ["demo", "--out", str(env.tmp / "d"), "--gpu-memory", "12XB"],
    "demo_size_huge": lambda env: ["demo", "--out", str(env.tmp / "d"), "--gpu-memory", HUGE],
    "demo_size_nan": lambda env: ["demo", "--out", str(env.tmp / "d"), "--gpu-memory", "nan"],
    "demo_size_negative": lambda env: ["demo", "--out", str(env.tmp / "d"), "--gpu-memory=-1G"],
}


@pytest.mark.parametrize("case", FLAG_CASES)
def test_bad_flags(case: str, env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, err = run(capsys, FLAG_CASES[case](env))
    usage_error(code, err)
    assert stdout == ""
    assert env.demo_started == []
    assert not list(env.tmp.glob("**/sheet*.md"))


# -- exit 1 and 0: only the checks and the runs decide ------------------------------------------

RESULT_CASES: dict[str, tuple[Callable[[Env], list[str]], int]] = {
    "show_mixed": (lambda env: ["show", str(env.mixed())], EXIT_CHECK_FAILED),
    "show_mixed_ledger": (lambda env: ["show", str(env.mixed() / "ledger")], EXIT_CHECK_FAILED),
    "show_hot": (lambda env: ["show", str(env.mixed("hot"))], EXIT_CHECK_FAILED),
    "show_broken": (lambda env: ["show", str(env.mixed("broken"))], EXIT_CHECK_FAILED),
    "show_ctl": (lambda env: ["show", str(env.mixed("ctl"))], EXIT_OK),
    "compare_mixed": (
        lambda env: ["compare", str(env.mixed()), "--metric", "val_loss"],
        EXIT_CHECK_FAILED,
    ),
    "sheet_hot": (lambda env: ["sheet", str(env.mixed("hot"))], EXIT_CHECK_FAILED),
    "sheet_broken": (lambda env: ["sheet", str(env.mixed("broken"))], EXIT_CHECK_FAILED),
    "sheet_ctl": (lambda env: ["sheet", str(env.mixed("ctl")), "--gpu-memory", "80GB"], EXIT_OK),
    "show_clean": (lambda env: ["show", str(env.clean())], EXIT_OK),
    "show_clean_run": (lambda env: ["show", str(env.clean_run())], EXIT_OK),
    "compare_clean": (lambda env: ["compare", str(env.clean()), "--metric", "val_loss"], EXIT_OK),
    "plan": (lambda env: [*PLAN, "--epochs", "1"], EXIT_OK),
    "version": (lambda env: ["--version"], EXIT_OK),
}


@pytest.mark.parametrize("case", RESULT_CASES)
def test_exit_1_only_for_failed_checks_and_runs(
    case: str, env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    build, expected = RESULT_CASES[case]
    code, stdout, err = run(capsys, build(env))
    assert code == expected, stdout + err
    assert err == ""
    if case.startswith(("show", "compare", "sheet")):
        summary = result(stdout)
        if expected == EXIT_OK:
            assert summary.startswith("Result: no failed check, no diverged or failed run")
        else:
            assert summary.endswith("(exit 1):")


def test_a_failure_in_what_was_read_still_exits_1_and_names_the_skipped_files(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    out = env.mixed()
    ctl = env.folders.runs["ctl"].name
    (lost,) = [f for f in ledger_files(out) if f"-{ctl}-end-" in f.name]
    truncated(lost)
    code, stdout, err = run(capsys, ["show", str(out)])
    assert code == EXIT_CHECK_FAILED  # the diverged and the broken runs were read: they gate
    summary = stdout[stdout.rindex("Result: ") :].splitlines()
    assert summary[0].endswith("(exit 1):")
    assert "  and 1 file(s) skipped (unreadable), not checked:" in summary
    assert any(str(lost) in line for line in summary)
    # Not a usage error: the skipped file is a warning line, nothing else is on stderr.
    lines = err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"lightning-pilot: warning: skipped unreadable file {lost}")
