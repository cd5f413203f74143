"""Tests of the ``lightning-pilot`` command against runs written by real fits."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_report import pilot  # noqa: F401  (the module-scoped fixture of real fits)

from lightning_pilot import Ledger, plan_updates, read_phase_table
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
    assert out.rstrip().endswith("Result: no failed check.")


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
    assert out.rstrip().endswith("Result: a check failed (verdict fail).")


def test_show_ledger_folder_only(pilot: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    code, out, _ = run_cli(capsys, "show", pilot["out"] / "ledger")
    assert code == EXIT_OK
    assert "Phase table" not in out
    assert "Ledger (3 run(s))" in out


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

    # A corrupt phase-table file: skipped with a warning, then nothing readable is left.
    run = shutil.copytree(pilot["ctl"], tmp_path / "runs" / pilot["ctl"].name)
    for part in (run / "phases.parquet").iterdir():
        part.write_bytes(b"not parquet at all")
    code, out, err = run_cli(capsys, "show", run)
    assert code == EXIT_USAGE
    assert "the phase table has no readable rows" in one_line_error(err)
    assert "lightning-pilot: warning: skipped unreadable" in err


# -- compare --------------------------------------------------------------------------------


def test_compare_counts_every_run_and_ranks_diverged_worst(
    pilot: dict[str, Any],  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(
        capsys, "compare", pilot["out"], "--metric", "train_loss", "--control", "ctl"
    )
    assert code == EXIT_OK  # a diverged run is a result, not a failed check
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
    assert out.rstrip().endswith(f"Choice sheet written to {run / 'sheet.md'}")
    assert (run / "sheet.md").read_text() in out
    code, out, _ = run_cli(capsys, "sheet", run)
    assert code == EXIT_OK
    assert out.rstrip().endswith(f"Choice sheet written to {run / 'sheet-2.md'}")
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
    assert (code, out) == (EXIT_OK, "lightning-pilot 0.1.0\n")
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


def test_demo_command_runs_the_quick_pilot_and_writes_the_sheet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["demo", "--out", str(tmp_path / "demo"), "--quick"])
    out = capsys.readouterr().out
    assert code == 0
    sheets = list((tmp_path / "demo" / "runs").glob("*/sheet.md"))
    assert len(sheets) == 1
    assert "Choice sheet written to" in out
    assert (tmp_path / "demo" / "ledger").is_dir()
    sheet = sheets[0].read_text()
    assert "- Module: `lightning_pilot.demo.lm.TinyCausalLM`" in sheet
    assert re.search(r"- Parameters: [\d,]+ \([\d,]+ trainable\)", sheet)
    assert "- Optimizer: AdamW(lr=0.003)" in sheet
    assert re.search(r"- One update: [\d.]+ ms \(8 x \(data", sheet)  # K = 8 from the ledger
    # The comparison is priced at the pilot's speed; the diverged variant is never packaged.
    assert re.search(r"\| lr=5 \(unstable\) \| diverged \| .* \| not packaged \|", sheet)
    # Where each variant stands on the agreed metric, the control marked, the diverged one worst.
    assert "- lr=3e-3 (control) [the control]: " in sheet
    assert "- lr=5 (unstable): inf (1 diverged)" in sheet
    package = next(line for line in sheet.splitlines() if line.startswith("- 3-day package"))
    assert "lr=3e-3 (control)" in package
    assert "unstable" not in package
