"""The quick demo (run_demo): the pilot, the overfit, the learning-rate comparison and the
plots, run once for the module through ``lightning-pilot demo --quick``, which then writes and
gates on the choice sheet; ``python -m lightning_pilot.demo`` on the same demo."""

from __future__ import annotations

import contextlib
import io
import math
import re
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

import lightning_pilot.demo.__main__ as demo_main_module
import lightning_pilot.demo.pilot as demo_pilot_module
from lightning_pilot import Ledger, read_phase_table
from lightning_pilot.cli import EXIT_CHECK_FAILED
from lightning_pilot.cli import main as cli_main
from lightning_pilot.demo.pilot import EXPERIMENT, DemoSize, lr_variants, run_demo, write_plots
from lightning_pilot.report.plots import MATPLOTLIB_MISSING, require_matplotlib

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CLEAN = "Result: no failed check, no diverged or failed run (1 ledger run(s) checked)."


@pytest.fixture(scope="module")
def demo_command(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], str, str]:
    """``lightning-pilot demo --out OUT --quick``, once for every test of the demo: its exit
    code, what its run_demo returned, what run_demo printed and what the command printed."""
    out = tmp_path_factory.mktemp("demo")
    stream = io.StringIO()
    returned: list[tuple[dict[str, Any], str]] = []

    def kept(*args: Any, **kwargs: Any) -> dict[str, Any]:
        start = stream.tell()
        result = run_demo(*args, **kwargs)
        returned.append((result, stream.getvalue()[start:]))
        return result

    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stream):
        patch.setattr(demo_pilot_module, "run_demo", kept)
        code = cli_main(["demo", "--out", str(out), "--quick"])
    ((result, printed),) = returned
    assert result["out_dir"] == out
    return code, result, printed, stream.getvalue()


@pytest.fixture
def demo(demo_command: tuple[int, dict[str, Any], str, str]) -> tuple[dict[str, Any], str]:
    _, result, printed, _ = demo_command
    return result, printed


def result_lines(out: str) -> list[str]:
    """The ``Result:`` summary: its last block, from the ``Result:`` line on."""
    lines = out.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("Result: "))
    return lines[start:]


def test_quick_demo_passes_and_writes_its_files(demo: tuple[dict[str, Any], str]) -> None:
    result, out = demo
    table = read_phase_table(result["out_dir"])
    assert {"setup", "forward", "optimizer_step", "validation", "checkpoint_save"} <= set(
        table["phase"]
    )
    assert "fail" not in set(table["verdict"])
    assert len(Ledger(result["out_dir"]).runs()) == 5  # the pilot and four comparison fits
    assert "Phase table of the pilot run" in out
    assert f"ledger:      {result['out_dir'] / 'ledger'}" in out


def test_python_m_demo_runs_the_demo_and_exits_0_when_no_pilot_phase_failed(
    demo: tuple[dict[str, Any], str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # ``python -m lightning_pilot.demo``'s main on the shared demo: it passes --out and
    # --quick to run_demo, then reads the pilot run's phase table for its exit code.
    result, _ = demo
    calls: list[tuple[Path, bool]] = []

    def recorded(out_dir: Path, *, quick: bool = False) -> dict[str, Any]:
        calls.append((out_dir, quick))
        return result

    monkeypatch.setattr(demo_main_module, "run_demo", recorded)
    assert demo_main_module.main(["--out", str(tmp_path / "out"), "--quick"]) == 0
    assert calls == [(tmp_path / "out", True)]


def test_result_points_to_the_files(demo: tuple[dict[str, Any], str]) -> None:
    result, _ = demo
    out = result["out_dir"]
    assert result["pilot_run_dir"] == out / "runs" / result["pilot_run_id"]
    assert (result["pilot_run_dir"] / "phases.parquet").is_dir()
    assert result["ledger"] == out / "ledger"
    assert result["overfit_verdict"] == "pass"
    assert (result["overfit_run_dir"] / "overfit.parquet").is_dir()
    assert set(result["seconds"]) >= {"pilot", "overfit", "total"}


def test_pilot_run_measured_every_phase_and_proved_resume(
    demo: tuple[dict[str, Any], str],
) -> None:
    result, _ = demo
    table = read_phase_table(result["pilot_run_dir"])
    assert set(table["run_id"]) == {result["pilot_run_id"]}
    expected = {
        "setup", "data", "forward", "backward", "optimizer_step", "validation",
        "checkpoint_save", "checkpoint_load", "resume",
    }  # fmt: skip
    assert expected <= set(table["phase"])
    resume = table[table["phase"] == "resume"].iloc[0]
    assert resume["verdict"] == "pass", resume["reason"]
    assert "fail" not in set(table["verdict"])
    run_dir = result["pilot_run_dir"]
    for detail in ("examples", "resume", "updates"):
        assert list((run_dir / f"{detail}.parquet").glob("*.parquet")), detail
    updates = pd.read_parquet(run_dir / "updates.parquet")
    assert (updates["examples"] == 2 * 8).all()
    assert len(updates) == DemoSize.of(True).pilot_updates


def test_ledger_keeps_control_variants_and_the_diverged_run(
    demo: tuple[dict[str, Any], str],
) -> None:
    result, _ = demo
    runs = Ledger(result["ledger"]).runs()
    comparison = runs[runs["experiment"] == EXPERIMENT].set_index("variant")
    names = [variant.name for variant in lr_variants()]
    assert sorted(comparison.index) == sorted(names)
    assert set(result["comparison_run_ids"]) == set(names)
    control, half, double, unstable = names
    updates = DemoSize.of(True).updates
    for name in (control, half, double):
        row = comparison.loc[name]
        assert (row["status"], row["stop_cause"], row["updates_done"]) == (
            "completed", "max_steps", updates,
        )  # fmt: skip
        assert (row["micro_batch_size"], row["accumulate_grad_batches"]) == (2, 8)
    bad = comparison.loc[unstable]
    assert bad["status"] == "diverged"
    assert bad["stop_cause"] in {"loss_blowup", "nonfinite_loss", "nonfinite_grad"}
    assert bad["stop_step"] < updates
    assert isinstance(bad["stop_detail"], str)
    assert "consecutive updates" in bad["stop_detail"] or "non-finite" in bad["stop_detail"]
    lrs = {name: comparison.loc[name, "lr"] for name in names}
    assert lrs[half] == pytest.approx(lrs[control] / 2)
    assert lrs[double] == pytest.approx(lrs[control] * 2)

    summary = result["comparison"].summary.set_index("variant")
    assert summary.loc[unstable, "n_diverged"] == 1
    assert math.isinf(summary.loc[unstable, "median"])
    assert math.isfinite(summary.loc[control, "median"])
    assert result["control"] == control


def test_output_shows_progress_tables_and_files(demo: tuple[dict[str, Any], str]) -> None:
    result, text = demo
    lines = text.splitlines()
    progress = [line for line in lines if line.startswith("[")]
    assert [line.split("]")[0] for line in progress] == [f"[{i}/6" for i in range(1, 7)]
    assert "diverged (" in progress[-1]
    assert "Phase table of the pilot run" in text
    assert "scaled x30" in text
    assert f"ledger:      {result['ledger']}" in text
    assert str(result["pilot_run_dir"]) in text
    for path in result["plots"]:
        assert f"plot:        {path}" in text


def test_plots_are_png_files(demo: tuple[dict[str, Any], str]) -> None:
    result, _ = demo
    names = sorted(path.name for path in result["plots"])
    assert names == ["loss_curves.png", "phase_memory.png"]
    for path in result["plots"]:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC)
        assert len(data) > 5000


def test_without_matplotlib_plots_are_skipped_with_a_message(
    demo: tuple[dict[str, Any], str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    result, _ = demo
    ledger = Ledger(result["ledger"])
    table = read_phase_table(result["pilot_run_dir"])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(ModuleNotFoundError, match=r"pip install matplotlib"):
        require_matplotlib()
    written: list[str] = []
    plots = write_plots(tmp_path, ledger.curves(), ledger.runs(), table, written.append)
    assert plots == []
    assert MATPLOTLIB_MISSING in "".join(written)
    assert not list(tmp_path.iterdir())


def test_demo_estimates_and_its_sheet_prices_the_campaign_on_the_catalogue(
    demo: tuple[dict[str, Any], str],
) -> None:
    """The demo estimates its own model (the sheet prices the campaign on the GPUs it fits)
    and its architecture at a billion parameters on every GPU of the catalogue."""
    from lightning_pilot.estimate import TARGETS
    from lightning_pilot.report.sheet import choice_sheet

    result, text = demo
    assert "The demo LM's architecture at 1.01B parameters" in text
    frame = result["large_estimate"].frame()
    assert set(frame["status"]) == {"ok"}
    assert set(frame["target"]) == set(TARGETS)
    # A billion parameters with AdamW: one 24 GB GPU is too small, an 80 GB one is not.
    forward = frame[(frame.phase == "forward") & (frame.strategy == "single")].set_index(
        ["target", "checkpointing"]
    )
    assert not forward.loc[("L4-24GB", False), "fits"]
    assert forward.loc[("H100-SXM-80GB", True), "fits"]
    assert "H100-SXM-80GB" in text
    assert "fsdp:8" in text
    sheet = choice_sheet(
        result["pilot_run_dir"], experiment=result["experiment"], control=result["control"]
    )
    assert "Not estimated" not in sheet
    assert "Campaign package on the target" in sheet
    assert "H100-SXM-80GB x1 bf16-mixed micro-batch 2: all variants" in sheet


def test_demo_command_writes_the_sheet_and_gates_on_the_pilot_run(
    demo_command: tuple[int, dict[str, Any], str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, result, _, out = demo_command
    assert code == 0  # a demonstration: its deliberately diverged lr=5 run does not gate it
    assert result_lines(out) == [CLEAN]
    sheets = list((result["out_dir"] / "runs").glob("*/sheet.md"))
    assert len(sheets) == 1
    assert "Choice sheet written to" in out
    assert (result["out_dir"] / "ledger").is_dir()
    sheet = sheets[0].read_text()
    assert "- Module: `lightning_pilot.demo.lm.TinyCausalLM`" in sheet
    assert re.search(r"- Parameters: [\d,]+ \([\d,]+ trainable\)", sheet)
    assert "- Optimizer: AdamW(lr=0.003)" in sheet
    assert re.search(
        r"- One update: [\d.]+ (ms|s|min) \(8 x \(data", sheet
    )  # K = 8 from the ledger
    # The comparison is priced at the pilot's speed; the diverged variant is never packaged.
    assert re.search(r"\| lr=5 \(unstable\) \| diverged \| .* \| not packaged \|", sheet)
    # Where each variant stands on the agreed metric, the control marked, the diverged one worst.
    assert "- lr=3e-3 (control) [the control]: " in sheet
    assert "- lr=5 (unstable): inf (1 diverged)" in sheet
    package = next(line for line in sheet.splitlines() if line.startswith("- 3-day package"))
    assert "lr=3e-3 (control)" in package
    assert "unstable" not in package
    # `show` on the demo's folder is a gate: the diverged comparison run is in its scope.
    capsys.readouterr()
    code = cli_main(["show", str(result["out_dir"])])
    out = capsys.readouterr().out
    assert code == EXIT_CHECK_FAILED
    assert result_lines(out)[0] == "Result: 1 run(s) diverged or failed (exit 1):"
    assert re.search(r"^  run \S+  variant lr=5 \(unstable\)  seed \d+  status diverged", out, re.M)
