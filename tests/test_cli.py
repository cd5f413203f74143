"""Tests of the ``lightning-pilot`` command against runs written by real fits."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.demos.boring_classes import BoringModel
from test_report import pilot  # noqa: F401  (the module-scoped fixture of real fits)

from lightning_pilot import (
    DivergenceLedger,
    Ledger,
    PhaseMemoryMonitor,
    plan_updates,
    read_phase_table,
)
from lightning_pilot.cli import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, main
from lightning_pilot.report import format_bytes


def run_cli(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert lines, "expected a message on stderr"
    assert "Traceback" not in err
    assert all(line.startswith("lightning-pilot: ") for line in lines)
    return lines[-1]


def result_lines(out: str) -> list[str]:
    """The ``Result:`` summary: its last block, from the ``Result:`` line on."""
    lines = out.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("Result: "))
    return lines[start:]


def copy_runs(fits: dict[str, Any], names: list[str], dest: Path) -> Path:
    """An output folder holding only these runs of the fixture: run folders and ledger records."""
    (dest / "ledger").mkdir(parents=True)
    for name in names:
        run = fits[name]
        shutil.copytree(run, dest / "runs" / run.name)
        for record in (fits["out"] / "ledger").glob(f"*-{run.name}-*.parquet"):
            shutil.copy2(record, dest / "ledger" / record.name)
    assert len(Ledger(dest).runs()) == len(names)
    return dest


def diverged_line(fits: dict[str, Any]) -> str:
    hot = Ledger(fits["out"]).runs().set_index("run_id").loc[fits["hot"].name]
    assert hot["status"] == "diverged"
    return (
        f"  run {fits['hot'].name}  variant hot  seed 0  status diverged  stop cause"
        f" {hot['stop_cause']} at step {int(hot['stop_step'])}"
    )


CLEAN = "Result: no failed check, no diverged or failed run (1 ledger run(s) checked)."


# -- show -----------------------------------------------------------------------------------


def test_show_clean_run_exits_0(pilot: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    code, out, err = run_cli(capsys, "show", pilot["ctl"])
    assert code == EXIT_OK, err
    frame = read_phase_table(pilot["ctl"])
    assert f"Phase table ({len(frame)} rows)" in out
    backward = frame[(frame["phase"] == "backward") & frame["first"]].iloc[0]
    line = next(row for row in out.splitlines() if row.startswith("backward        first"))
    assert format_bytes(backward["peak_allocated_bytes"]) in line
    assert "Ledger (1 run(s))" in out  # the run's own ledger row only
    assert pilot["ctl"].name in out
    assert pilot["hot"].name not in out
    assert "Not passed" not in out
    assert result_lines(out) == [CLEAN]


def test_show_diverged_run_exits_1_and_names_it(
    pilot: dict[str, Any],  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Every phase check of the diverged run passed: only its ledger status gates.
    assert "fail" not in set(read_phase_table(pilot["hot"])["verdict"])
    code, out, _ = run_cli(capsys, "show", pilot["hot"])
    assert code == EXIT_CHECK_FAILED
    assert "no failed check" not in out
    assert result_lines(out) == [
        "Result: 1 run(s) diverged or failed (exit 1):",
        diverged_line(pilot),
    ]


def test_show_output_folder_with_a_failed_check_exits_1(
    pilot: dict[str, Any],  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(capsys, "show", pilot["out"])
    assert code == EXIT_CHECK_FAILED
    for run in ("ctl", "hot", "broken"):
        assert f"run {pilot[run].name}  attempt 1  rank 0" in out
    assert "  fail: backward (first): grads_reach_params" in out
    assert "Ledger (3 run(s))" in out
    assert re.search(rf"^{pilot['hot'].name}\s+cli\s+hot\s+0\s+diverged", out, re.MULTILINE)
    assert result_lines(out) == [
        "Result: a check failed (verdict fail) in 1 run(s) and 1 run(s) diverged or failed"
        " (exit 1):",
        f"  run {pilot['broken'].name}  variant broken  check failed: backward (first):"
        " grads_reach_params; backward (later): grads_reach_params; optimizer_step (first):"
        " trainable_params_changed; optimizer_step (later): trainable_params_changed",
        diverged_line(pilot),
    ]


def test_show_ledger_folder_only(pilot: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    code, out, _ = run_cli(capsys, "show", pilot["out"] / "ledger")
    assert code == EXIT_CHECK_FAILED  # the ledger holds a diverged run
    assert "Phase table" not in out
    assert "Ledger (3 run(s))" in out
    assert result_lines(out) == [
        "Result: 1 run(s) diverged or failed (exit 1):",
        diverged_line(pilot),
    ]


@pytest.fixture
def boring_pilot(make_trainer: Any, tmp_path: Path) -> Path:
    """A clean Lightning BoringModel fit: two epochs, each ending with a full validation."""
    out = tmp_path / "pilot"
    monitor = PhaseMemoryMonitor(out_dir=out)
    ledger = DivergenceLedger(experiment="boring", variant="ctl", seed=0, out_dir=out)
    trainer = make_trainer(
        callbacks=[monitor, ledger],
        max_steps=-1,
        max_epochs=2,
        limit_train_batches=4,
        limit_val_batches=1.0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(BoringModel())
    return monitor.run.run_dir


def test_show_clean_boring_model_run_lists_nothing_as_not_passed(
    boring_pilot: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The second validation happened after the pilot window and was not sampled: its row keeps
    # the count and the nulls (honest), but it is no problem to list under "Not passed".
    later = read_phase_table(boring_pilot).set_index(["phase", "first"]).loc[("validation", False)]
    assert (later["occurrences"], later["measured_occurrences"]) == (1, 0)
    assert later["verdict"] == "not_checked"
    code, out, err = run_cli(capsys, "show", boring_pilot)
    assert code == EXIT_OK, err
    assert "Not passed" not in out
    assert "not_checked:" not in out
    assert re.search(r"^validation\s+later\s+1\s.*\sn/m\s+not_checked$", out, re.MULTILINE)
    assert (
        "Not measured by design (outside the pilot window and the sampled updates):"
        " validation (later, 1 occurrence(s))" in out
    )
    assert result_lines(out) == [CLEAN]
    # The whole output folder, and the comparison of its one run, pass the gate too.
    code, out, _ = run_cli(capsys, "show", boring_pilot.parent.parent)
    assert code == EXIT_OK
    assert "Not passed" not in out
    code, out, _ = run_cli(capsys, "compare", boring_pilot.parent.parent, "--metric", "train_loss")
    assert code == EXIT_OK
    assert result_lines(out) == [CLEAN]


def test_show_bad_paths_exit_2(
    pilot: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_cli(capsys, "show", tmp_path / "nope")
    assert (code, out) == (EXIT_USAGE, "")
    assert one_line_error(err) == f"lightning-pilot: {tmp_path / 'nope'} does not exist."

    code, _, err = run_cli(capsys, "show", tmp_path)
    assert code == EXIT_USAGE
    assert "holds neither a phase table" in one_line_error(err)

    # A corrupt phase-table file: skipped, then nothing readable is left. One line says both.
    run = shutil.copytree(pilot["ctl"], tmp_path / "runs" / pilot["ctl"].name)
    parts = list((run / "phases.parquet").iterdir())
    for part in parts:
        part.write_bytes(b"not parquet at all")
    code, out, err = run_cli(capsys, "show", run)
    assert (code, out) == (EXIT_USAGE, "")
    assert len(err.splitlines()) == 1
    line = one_line_error(err)
    assert "nothing to check: the phase table has no readable rows" in line
    assert f"{len(parts)} file(s) skipped (unreadable): unreadable file " in line
    assert any(str(part) in line for part in parts)


# -- compare --------------------------------------------------------------------------------


def test_compare_counts_every_run_and_ranks_diverged_worst(
    pilot: dict[str, Any],  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(
        capsys, "compare", pilot["out"], "--metric", "train_loss", "--control", "ctl"
    )
    # The diverged run ranks worst, and it gates: a CI job comparing variants sees it.
    assert code == EXIT_CHECK_FAILED
    assert result_lines(out)[0] == (
        "Result: a check failed (verdict fail) in 1 run(s) and 1 run(s) diverged or failed"
        " (exit 1):"
    )
    assert result_lines(out)[-1] == diverged_line(pilot)
    expected = Ledger(pilot["out"]).compare("train_loss", control="ctl").summary
    ctl = expected[expected["variant"] == "ctl"].iloc[0]
    assert re.search(rf"^ctl\s+1\s+1 completed\s+1\s+{ctl['median']:.4g}", out, re.MULTILINE)
    assert re.search(r"^hot\s+1\s+1 diverged\s+1\s+inf", out, re.MULTILINE)
    runs_part, costs_part = out.split("Runs, best first")[1].split("Cost per variant")
    ranked = runs_part.strip().splitlines()[3:]
    assert len(ranked) == 3
    assert ranked[-1].split()[1:5] == [pilot["hot"].name, "hot", "0", "diverged"]
    # Next to the quality: what each variant cost, from its phase table.
    assert re.search(r"^ctl\s+1\s+[\d.]+ KiB \(\w+\)", costs_part, re.MULTILINE)


def test_compare_gates_on_the_runs_it_compares(
    pilot: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    both = copy_runs(pilot, ["ctl", "hot"], tmp_path / "both")
    code, out, _ = run_cli(capsys, "compare", both, "--metric", "train_loss", "--control", "ctl")
    assert code == EXIT_CHECK_FAILED
    assert result_lines(out) == [
        "Result: 1 run(s) diverged or failed (exit 1):",
        diverged_line(pilot),
    ]
    alone = copy_runs(pilot, ["ctl"], tmp_path / "alone")
    code, out, _ = run_cli(capsys, "compare", alone, "--metric", "train_loss")
    assert code == EXIT_OK
    assert result_lines(out) == [CLEAN]


def test_compare_bad_usage_exits_2(
    pilot: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run_cli(capsys, "compare", pilot["out"], "--metric", "val_nothing")
    assert code == EXIT_USAGE
    assert "val_nothing" in one_line_error(err)
    code, _, err = run_cli(
        capsys, "compare", pilot["out"], "--metric", "train_loss", "--control", "zz"
    )
    assert code == EXIT_USAGE
    assert "control='zz' is not a variant" in one_line_error(err)
    code, _, err = run_cli(capsys, "compare", tmp_path, "--metric", "train_loss")
    assert code == EXIT_USAGE
    assert "holds no readable ledger records" in one_line_error(err)
    code, _, err = run_cli(capsys, "compare", tmp_path / "x", "--metric", "train_loss")
    assert code == EXIT_USAGE
    assert "does not exist" in one_line_error(err)
    code, _, err = run_cli(capsys, "compare", pilot["out"])  # --metric is required
    assert code == EXIT_USAGE
    assert "--metric" in err


# -- plan -----------------------------------------------------------------------------------


def test_plan_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys,
        *("plan", "--dataset-size", 1000, "--micro-batch", 4, "--accumulate", 8),
        *("--replicas", 2, "--max-steps", 40),
    )
    assert code == EXIT_OK
    plan = plan_updates(1000, 4, 8, 2, max_steps=40)
    assert out.splitlines()[0] == plan.describe()
    assert re.search(rf"total updates\s+{plan.total_updates:,}$", out, re.MULTILINE)
    assert re.search(r"examples per update\s+64$", out, re.MULTILINE)
    assert re.search(rf"examples seen\s+{plan.examples_seen:,}$", out, re.MULTILINE)


def test_plan_bad_usage_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    base = ("plan", "--dataset-size", "100", "--micro-batch")
    code, _, err = run_cli(capsys, *base, "0", "--epochs", "1")
    assert code == EXIT_USAGE
    assert "micro_batch_size=0" in one_line_error(err)
    code, _, err = run_cli(capsys, *base, "2")
    assert code == EXIT_USAGE
    assert "needs --epochs or --max-steps" in one_line_error(err)
    code, _, err = run_cli(capsys, *base, "2", "--epochs", "1", "--max-steps", "3")
    assert code == EXIT_USAGE
    assert "not allowed with argument" in err
    code, _, err = run_cli(capsys, *base, "two", "--epochs", "1")
    assert code == EXIT_USAGE
    assert "invalid int value: 'two'" in err


# -- sheet ----------------------------------------------------------------------------------


def test_sheet_writes_and_prints(
    pilot: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = shutil.copytree(pilot["ctl"], tmp_path / "runs" / pilot["ctl"].name)
    code, out, _ = run_cli(capsys, "sheet", run, "--gpu-memory", "80GB")
    assert code == EXIT_OK
    peak = int(read_phase_table(run)["peak_allocated_bytes"].max())
    left = 80_000_000_000 - peak
    assert f"GPU: {format_bytes(left)} ({left:,} bytes," in out
    # Copied without the ledger: the run's status cannot be checked, and the summary says so.
    clean = (
        "Result: no failed check, no diverged or failed run"
        " (no ledger read: run statuses not checked)."
    )
    assert f"Choice sheet written to {run / 'sheet.md'}\n\n{clean}\n" in out
    assert (run / "sheet.md").read_text() in out
    code, out, _ = run_cli(capsys, "sheet", run)
    assert code == EXIT_OK
    assert f"Choice sheet written to {run / 'sheet-2.md'}\n\n{clean}\n" in out
    assert "Target GPU: not given" in (run / "sheet-2.md").read_text()


def test_sheet_failed_check_exits_1(
    pilot: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = shutil.copytree(pilot["broken"], tmp_path / "runs" / pilot["broken"].name)
    code, out, _ = run_cli(capsys, "sheet", run, "--gpu-memory", "141G")
    assert code == EXIT_CHECK_FAILED
    assert "blocking failure(s)" in out
    assert "Headroom on a 141.0 GiB" in out
    assert result_lines(out)[0] == "Result: a check failed (verdict fail) in 1 run(s) (exit 1):"


def test_sheet_of_a_diverged_run_exits_1(
    pilot: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out_dir = copy_runs(pilot, ["ctl", "hot"], tmp_path / "both")
    code, out, _ = run_cli(capsys, "sheet", out_dir / "runs" / pilot["hot"].name)
    assert code == EXIT_CHECK_FAILED
    assert "- Status: diverged" in out
    assert result_lines(out) == [
        "Result: 1 run(s) diverged or failed (exit 1):",
        diverged_line(pilot),
    ]
    # The sheet of the control lists the diverged variant (never packaged) but does not gate on
    # it: its scope is its own run; `compare` gates on the experiment's variants.
    code, out, _ = run_cli(capsys, "sheet", out_dir / "runs" / pilot["ctl"].name)
    assert code == EXIT_OK
    assert "| hot | diverged |" in out
    assert result_lines(out) == [CLEAN]


def test_sheet_bad_usage_exits_2(
    pilot: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run_cli(capsys, "sheet", pilot["ctl"], "--gpu-memory", "80 parsecs")
    assert code == EXIT_USAGE
    assert "--gpu-memory='80 parsecs' is not a size" in one_line_error(err)
    code, _, err = run_cli(capsys, "sheet", pilot["out"])
    assert code == EXIT_USAGE
    assert "is not a run folder" in one_line_error(err)
    code, _, err = run_cli(capsys, "sheet", tmp_path / "gone")
    assert code == EXIT_USAGE
    assert "does not exist" in one_line_error(err)
    assert not list(tmp_path.iterdir())


# -- the rest -------------------------------------------------------------------------------


def test_version_help_and_demo_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--version")
    assert (code, out) == (EXIT_OK, "lightning-pilot 0.4.0\n")
    code, out, _ = run_cli(capsys)
    assert code == EXIT_OK
    for command in ("demo", "show", "compare", "plan", "sheet"):
        assert command in out
    code, out, _ = run_cli(capsys, "demo", "--help")
    assert code == EXIT_OK
    assert "--out" in out
    assert "--quick" in out
    code, _, err = run_cli(capsys, "frobnicate")
    assert code == EXIT_USAGE
    assert "invalid choice: 'frobnicate'" in err


def test_python_m_subprocess(pilot: dict[str, Any], tmp_path: Path) -> None:  # noqa: F811
    done = subprocess.run(
        [sys.executable, "-m", "lightning_pilot", "show", str(pilot["out"])],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == EXIT_CHECK_FAILED, done.stderr
    assert "  fail: backward (first): grads_reach_params" in done.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "lightning_pilot", "sheet", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert missing.returncode == EXIT_USAGE
    assert missing.stdout == ""
    assert missing.stderr == f"lightning-pilot: {tmp_path / 'none'} does not exist.\n"


# The `demo` command (the quick demo, its sheet and its gate) is tested on the demo tests' shared
# run: tests/demo/test_pilot_demo.py.


# -- what files hold never drives the terminal ----------------------------------------------

FORGED = "ctl\x1b[2J\x1b]0;pwned\x07\rFAKE LINE\nFAKE: row\x9b31m\u202eevil\x00"
UNKNOWN_STATUS = "succeeded\x1b[32m"


def is_terminal_safe(text: str) -> bool:
    """No C0 or C1 control character but the newlines between lines, no bidi override."""
    unsafe = r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
    return not re.search(unsafe, text)


@pytest.fixture
def forged(tmp_path: Path) -> Path:
    """An output folder whose files carry escape sequences, newlines and a made-up status."""
    import pyarrow.parquet as pq

    from lightning_pilot import storage
    from lightning_pilot.core.ids import new_run_id

    out = tmp_path / "forged"
    run_id = new_run_id()
    phase = {
        "run_id": run_id,
        "attempt": 1,
        "rank": 0,
        "device": "cpu\x1b[2J",
        "counter": "cpu_tensor_tracker",
        "occurrences": 1,
        "measured_occurrences": 1,
        "duration_s": 0.01,
        "duration_median_s": 0.01,
    }
    rows = [
        phase | {"phase": name, "first": first, "verdict": "pass"}
        for name in ("data", "forward", "optimizer_step")
        for first in (True, False)
    ]
    rows += [
        phase | {"phase": "backward", "first": False, "verdict": "pass"},
        phase
        | {
            "phase": "backward",
            "first": True,
            "verdict": "warn",
            "reason": "slow\x1b[2J\nFAKE: backward passed\r",
            "checks": [{"name": "speed\x1b[5m", "verdict": "warn", "detail": "x"}],
        },
    ]
    storage.write_snapshot(
        out / "runs" / run_id / "phases.parquet",
        storage.rows_to_table(rows, storage.PHASE_SCHEMA),
        writer="a0001-r00000-x",
        seq=1,
    )
    ledger = out / "ledger"
    base = {"run_id": run_id, "attempt": 1, "experiment": "exp\x1b]0;t\x07", "seed": 0}
    storage.write_ledger_record(
        ledger,
        base
        | {"event": "start", "status": "running", "variant": FORGED, "lr": 0.1}
        | {"planned_updates": 100, "accumulate_grad_batches": 1},
    )
    # The real writer refuses a status outside the vocabulary: forge it with pyarrow.
    end = base | {
        "event": "end",
        "status": UNKNOWN_STATUS,
        "stop_cause": "max_steps\x1b[1A\n",
        "stop_step": 3,
        "record_id": new_run_id(),
        "written_at": datetime.now(timezone.utc),
        "schema_version": 2,
        "val_points": [{"step": 3, "name": "val_loss", "value": 0.5}],
    }
    pq.write_table(
        storage.rows_to_table([end], storage.LEDGER_SCHEMA),
        ledger / f"29991231T000000000000Z-{run_id}-end-x.parquet",
    )
    return out


def test_show_escapes_control_characters_and_never_passes_an_unknown_status(
    forged: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "show", forged)
    assert is_terminal_safe(out), out
    assert is_terminal_safe(err), err
    assert "\\x1b[2J" in out  # shown, as a visible escape
    assert not [line for line in out.splitlines() if line.startswith("FAKE")]
    ledger_block = out[out.index("Ledger (1 run(s))") :].splitlines()
    assert len(ledger_block[3].split("  ")) > 3  # the run's row stays one row of the table
    assert "succeeded\\x1b[32m" in ledger_block[3]
    assert "completed" not in out
    # An unknown status is not a pass: the summary names it and the gate fails.
    assert code == EXIT_CHECK_FAILED
    summary = result_lines(out)
    assert "unknown status" in summary[0]
    assert "no failed check" not in summary[0]
    assert any("status succeeded\\x1b[32m" in line for line in summary[1:])


def test_compare_and_sheet_escape_control_characters(
    forged: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "compare", forged, "--metric", "val_loss")
    assert code == EXIT_CHECK_FAILED  # the unknown status gates
    assert is_terminal_safe(out + err), out + err
    assert not [line for line in out.splitlines() if line.startswith("FAKE")]
    assert "1 unknown" in out  # counted as what it is, never as completed
    run = next((forged / "runs").iterdir())
    code, out, err = run_cli(capsys, "sheet", run)
    assert code == EXIT_CHECK_FAILED
    assert is_terminal_safe(out + err), out + err
    sheet = (run / "sheet.md").read_text()
    assert is_terminal_safe(sheet)
    assert not [line for line in sheet.splitlines() if line.startswith("FAKE")]
    assert "not packaged" in sheet  # an unknown status is never priced as a finished run


def test_file_names_with_control_characters_stay_on_one_line(
    forged: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for record in (forged / "ledger").glob("*.parquet"):
        record.unlink()
    (forged / "ledger" / "x\x1b[2J\nFAKE.parquet").write_bytes(b"garbage")
    code, _, err = run_cli(capsys, "show", forged / "ledger")
    assert code == EXIT_USAGE
    assert is_terminal_safe(err)
    assert len(err.splitlines()) == 1
    assert "x\\x1b[2J\\nFAKE.parquet" in err


def test_terminal_safe_escapes_and_caps() -> None:
    from lightning_pilot.report import terminal_safe

    assert terminal_safe("a\x1b[2Jb\nc\td\x9b\x7f") == "a\\x1b[2Jb\\nc\\td\\x9b\\x7f"
    assert terminal_safe("a\nb", keep_newlines=True) == "a\nb"
    assert terminal_safe("\u202eevil\u2028") == "\\u202eevil\\u2028"
    assert terminal_safe("plain text, é and 日本") == "plain text, é and 日本"
    capped = terminal_safe("x" * 10_000, limit=100)
    assert len(capped) <= 100
    assert capped.endswith("more chars]")
    assert terminal_safe(capped, limit=100) == capped  # idempotent
    assert terminal_safe("\udcff") == "\\udcff"  # an undecodable byte from a file name


def test_reading_a_pilot_folder_never_imports_torch(pilot: dict[str, Any]) -> None:  # noqa: F811
    """`show`, `compare` and the report (plots included) stay light: no torch, no Lightning."""
    out = str(pilot["out"])
    code = (
        "import sys\n"
        "from lightning_pilot import cli, report, ledger, storage\n"
        "import lightning_pilot.report.plots\n"
        f"codes = [cli.main(['show', {out!r}]), cli.main(['compare', {out!r}, '--metric',"
        " 'val_loss'])]\n"
        "heavy = [m for m in ('torch', 'lightning', 'torchmetrics', 'matplotlib') if m in"
        " sys.modules]\n"
        "print('codes:', codes, 'heavy:', heavy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert "codes: [1, 1] heavy: []" in done.stdout, done.stdout[-2000:] + done.stderr
