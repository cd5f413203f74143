"""``lightning-pilot plot`` and lightning_pilot.report.plots on pilot folders written by real
fits: the PNG files, where they go, the sheet's links, and the data drawn (marks, memory
categories, every seed and the control)."""

from __future__ import annotations

import math
import re
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pandas as pd
import pytest

from lightning_pilot import (
    DivergenceLedger,
    EffectiveBatchAccountant,
    Ledger,
    PhaseMemoryMonitor,
    read_phase_table,
    storage,
)
from lightning_pilot.cli import main
from lightning_pilot.core.compare import compare_runs
from lightning_pilot.demo import ClassificationDataModule, TinyClassifier
from lightning_pilot.report import plots
from lightning_pilot.report.plot_data import (
    comparison_plot,
    comparison_points,
    curve_marks,
    loss_curves,
    memory_stack,
)
from lightning_pilot.report.plots import COMPARISON, LOSS_CURVES, MATPLOTLIB_MISSING, PHASE_MEMORY

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DOCS = Path(__file__).parent.parent.parent / "docs" / "plots.md"


class FailsAtUpdate3(TinyClassifier):
    """Raises in its training step once three updates are done: a run that fails."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step >= 3:
            raise RuntimeError("failed on purpose at update 3")
        return super().training_step(batch, batch_idx)


def fit(
    out: Path,
    variant: str,
    *,
    seed: int = 0,
    lr: float = 1e-2,
    action: str = "stop",
    monitor: bool = True,
    ledger: bool = True,
    model: pl.LightningModule | None = None,
) -> str | None:
    """One tiny real fit (8 updates of 2 micro-batches, validation every 3 batches)."""
    pl.seed_everything(seed, verbose=False)
    callbacks: list[pl.Callback] = []
    if ledger:
        callbacks.append(
            DivergenceLedger(
                experiment="cli", variant=variant, seed=seed, out_dir=out, action=action,
                check_every=1,
            )
        )  # fmt: skip
    if monitor:
        callbacks += [PhaseMemoryMonitor(out_dir=out), EffectiveBatchAccountant(out_dir=out)]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        max_steps=8, val_check_interval=3, accumulate_grad_batches=2, callbacks=callbacks,
    )  # fmt: skip
    data = ClassificationDataModule(dataset_size=256, batch_size=8, seed=seed)
    model = model or TinyClassifier(hidden=8, lr=lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if isinstance(model, FailsAtUpdate3):
            with pytest.raises(RuntimeError, match="on purpose"):
                trainer.fit(model, datamodule=data)
        else:
            trainer.fit(model, datamodule=data)
    return callbacks[0].run.run_id if ledger else None  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two control seeds, a variant that diverges at both seeds (one stopped there, one that
    went on: ``action="record"``, ledger only), a run that fails, and a run with no ledger."""
    out = tmp_path_factory.mktemp("pilot")
    ids = {
        "ctl0": fit(out, "ctl", seed=0),
        "ctl1": fit(out, "ctl", seed=1),
        "hot0": fit(out, "hot", seed=0, lr=1e3),
        "hot1": fit(out, "hot", seed=1, lr=1e3, action="record", monitor=False),
        "boom": fit(out, "boom", model=FailsAtUpdate3(hidden=8)),
    }
    lone = tmp_path_factory.mktemp("lone")
    fit(lone, "alone", ledger=False)
    (alone,) = (lone / "runs").iterdir()
    return {"out": out, "ids": ids, "alone": alone}


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG file's header, after checking its signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def assert_png(path: Path) -> None:
    import matplotlib.image

    width, height = png_size(path)
    assert 600 <= width <= 2000, (path, width)
    assert 300 <= height <= 1200, (path, height)
    assert path.stat().st_size > 10_000  # drawn, not an empty canvas
    pixels = matplotlib.image.imread(path)  # decodes: a whole file
    assert pixels.shape[:2] == (height, width)
    assert pixels.std() > 0.05  # more than one colour


# -- the command --------------------------------------------------------------------------


def test_plot_draws_every_run_of_an_output_folder(
    folder: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    out, ids = folder["out"], folder["ids"]
    assert main(["plot", str(out), "--control", "ctl"]) == 0
    text = capsys.readouterr().out
    for key, run_id in ids.items():
        run = out / "runs" / run_id
        names = {LOSS_CURVES, COMPARISON} | ({PHASE_MEMORY} if key != "hot1" else set())
        assert {p.name for p in run.glob("*.png")} == names, key
        for name in names:
            assert_png(run / name)
    # The ledger-only run has no phase table: said, not drawn empty.
    assert f"{PHASE_MEMORY}: not drawn: no readable phase table" in text
    assert "14 plot(s) written" in text
    # The experiment's plots are drawn once and are the same in every run folder.
    first, second = (out / "runs" / ids[k] / LOSS_CURVES for k in ("ctl0", "boom"))
    assert first.read_bytes() == second.read_bytes()
    # Drawn again on every call: replaced, never refused as an existing file.
    assert main(["plot", str(out / "runs" / ids["ctl0"])]) == 0
    assert "3 plot(s) written" in capsys.readouterr().out
    assert not list((out / "runs" / ids["ctl0"]).glob(".*"))  # no temporary file left


def test_plot_of_a_ledger_alone_writes_into_plots_folder(
    folder: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(folder["out"] / "ledger", tmp_path / "ledger")
    assert main(["plot", str(tmp_path / "ledger")]) == 0
    assert f"Plots in {tmp_path / 'plots' / 'cli'}:" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "plots" / "cli").iterdir()) == [
        COMPARISON,
        LOSS_CURVES,
    ]
    assert_png(tmp_path / "plots" / "cli" / LOSS_CURVES)


def test_plot_of_a_run_without_ledger_draws_its_memory_only(
    folder: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    alone = folder["alone"]
    assert main(["plot", str(alone)]) == 0
    text = capsys.readouterr().out
    assert [p.name for p in alone.glob("*.png")] == [PHASE_MEMORY]
    assert f"{LOSS_CURVES}: not drawn: no ledger record for this run" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plot", "/nonexistent/pilot"], "/nonexistent/pilot does not exist."),
        (["plot", "{out}", "--experiment", "nope"], "experiment='nope' is not in the ledger"),
        (["plot", "{empty}"], "holds neither a run folder"),
    ],
)
def test_plot_refuses_bad_input_with_one_line(
    folder: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    args = [a.format(out=folder["out"], empty=tmp_path) for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_without_matplotlib_plot_exits_2_with_the_message(
    folder: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    shutil.copytree(
        folder["alone"], tmp_path / "runs" / folder["alone"].name,
        ignore=shutil.ignore_patterns("*.png"),
    )  # fmt: skip
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"lightning-pilot: {MATPLOTLIB_MISSING}\n"
    assert not list(tmp_path.rglob("*.png"))
    with pytest.raises(ModuleNotFoundError, match=re.escape(MATPLOTLIB_MISSING)):
        plots.plot_folder(tmp_path)


def test_plot_never_imports_torch_or_lightning(folder: dict[str, Any]) -> None:
    code = (
        "import sys\n"
        "from lightning_pilot import cli\n"
        f"code = cli.main(['plot', {str(folder['out'])!r}, '--control', 'ctl'])\n"
        "heavy = [m for m in ('torch', 'lightning', 'torchmetrics') if m in sys.modules]\n"
        "print('code:', code, 'heavy:', heavy, 'matplotlib' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert "code: 0 heavy: [] True" in done.stdout, done.stdout[-2000:] + done.stderr


def test_the_sheet_links_the_plots_that_exist(
    folder: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    alone = folder["alone"]
    for png in alone.glob("*.png"):
        png.unlink()
    assert main(["sheet", str(alone)]) == 0
    before = (alone / "sheet.md").read_text()
    assert "## Plots\n\n- None drawn yet: `lightning-pilot plot <run folder>`" in before
    assert main(["plot", str(alone)]) == 0
    assert main(["sheet", str(alone)]) == 0
    capsys.readouterr()
    after = (alone / "sheet-2.md").read_text().split("## Plots")[1]
    # A relative link to the one file drawn (this run has no ledger: no curves, no comparison).
    assert re.findall(r"!\[[^]]+\]\(([^)]+)\)", after) == [PHASE_MEMORY]

    run = folder["out"] / "runs" / folder["ids"]["ctl0"]
    assert main(["plot", str(run), "--control", "ctl"]) == 0
    assert main(["sheet", str(run), "--control", "ctl"]) == 0
    capsys.readouterr()
    links = re.findall(r"!\[[^]]+\]\(([^)]+)\)", (run / "sheet.md").read_text())
    assert links == [LOSS_CURVES, PHASE_MEMORY, COMPARISON]
    assert all((run / link).is_file() for link in links)


# -- the data drawn -------------------------------------------------------------------------


def test_marks_sit_where_runs_diverged_stopped_and_failed(folder: dict[str, Any]) -> None:
    out, ids = folder["out"], folder["ids"]
    ledger = Ledger(out)
    runs, curves = ledger.runs(), ledger.curves()
    marks = curve_marks(runs, curves).set_index(["run_id", "kind"])
    # The divergence rule fired at the update its event names; that run stopped there.
    events = storage.read_snapshot_table(out / "runs" / ids["hot0"] / "divergence.parquet")
    (fired,) = events.to_pandas()["step"].tolist()
    assert marks.loc[(ids["hot0"], "diverged"), "step"] == fired == 4
    assert (ids["hot0"], "stopped") not in marks.index
    # action="record": marked where it diverged and, apart, where training stopped.
    hot1 = runs.set_index("run_id").loc[ids["hot1"]]
    assert marks.loc[(ids["hot1"], "diverged"), "step"] == hot1["stop_step"] == 4
    assert marks.loc[(ids["hot1"], "stopped"), "step"] == hot1["updates_done"] == 8
    # The failed run, at the update it raised in; the controls carry no mark.
    assert marks.loc[(ids["boom"], "failed"), "step"] == 3
    assert "RuntimeError" in marks.loc[(ids["boom"], "failed"), "label"]
    assert not {ids["ctl0"], ids["ctl1"]} & set(marks.index.get_level_values(0))
    # Each mark sits on the run's last finite training loss at or before its update.
    for (run_id, _), mark in marks.iterrows():
        own = curves[(curves["run_id"] == run_id) & (curves["curve"] == "train_loss")]
        own = own[(own["step"] <= mark["step"]) & own["value"].map(math.isfinite)]
        assert mark["value"] == own.sort_values("step")["value"].iloc[-1]


def test_loss_curves_hold_every_run_and_only_points_that_can_be_drawn(
    folder: dict[str, Any],
) -> None:
    ledger = Ledger(folder["out"])
    runs, curves = ledger.runs(), ledger.curves()
    data = loss_curves(curves, runs, "val_loss")
    assert [run.run_id for run in data.runs] == runs["run_id"].tolist()  # none dropped
    train = curves[curves["curve"] == "train_loss"]["value"]
    assert data.log == bool((train[train.map(math.isfinite)] > 0).all())
    for run in data.runs:
        points = [*run.train["value"], *run.val["value"]]
        assert all(math.isfinite(v) and (v > 0 or not data.log) for v in points), run.run_id
        assert run.train["step"].is_monotonic_increasing
        assert run.recorded  # every fit of this folder logged a training loss
    assert data.validated
    assert data.statuses.to_dict() == {"completed": 2, "diverged": 2, "failed": 1}
    assert data.marks.equals(curve_marks(runs, curves))


def test_runs_without_validation_or_loss_points_are_drawn_and_marked(
    folder: dict[str, Any], tmp_path: Path
) -> None:
    # A fit that never validated has no val_loss points; one that failed before its first
    # logged loss has no training points either: both are drawn (and marked), never an error.
    ledger = Ledger(folder["out"])
    runs, curves = ledger.runs(), ledger.curves()
    boom = folder["ids"]["boom"]
    bare = curves[(curves["curve"] == "train_loss") & (curves["run_id"] != boom)]
    path = plots.plot_loss_curves(bare, runs, tmp_path / LOSS_CURVES)
    assert_png(path)
    marks = curve_marks(runs, bare)
    failed = marks[marks["run_id"] == boom].iloc[0]
    assert (failed["kind"], failed["step"]) == ("failed", 3)
    assert math.isnan(failed["value"])  # no loss to sit on: NaN, never 0


def test_memory_categories_sum_to_each_measured_peak(folder: dict[str, Any]) -> None:
    run = folder["out"] / "runs" / folder["ids"]["ctl0"]
    phases = read_phase_table(run)
    placement = storage.read_snapshot_table(run / "placement.parquet").to_pandas()
    stack = memory_stack(phases, placement).set_index("phase")
    measured = stack[stack["measured"]]
    assert {"forward", "backward", "optimizer_step", "validation"} <= set(measured.index)
    categories = ["weights", "gradients", "optimizer_state", "activations_other"]
    for phase, row in measured.iterrows():
        rows = phases[phases["phase"] == phase]
        top = rows.loc[rows["peak_allocated_bytes"].astype("float64").idxmax()]
        assert row["peak_bytes"] == top["peak_allocated_bytes"]
        assert row[categories].sum() == row["peak_bytes"]
        assert row["weights"] == top["param_bytes"] + top["buffer_bytes"]
        assert row["optimizer_state"] == top["optimizer_state_bytes"]
    # TinyClassifier(hidden=8) holds 688 bytes of float32 parameters; AdamW's two moments
    # are 2 x 688, plus a 4-byte step for each of its 4 parameter tensors.
    assert measured.loc["optimizer_step", "weights"] == 688
    assert measured.loc["optimizer_step", "optimizer_state"] == 2 * 688 + 4 * 4
    # Not measured (no tracker while fetching data; the setup has no peak): null, never 0.
    for phase in ("setup", "data"):
        assert not stack.loc[phase, "measured"]
        assert stack.loc[phase, [*categories, "peak_bytes"]].isna().all()


def test_memory_counts_only_the_state_on_the_measured_device() -> None:
    """An optimizer offloaded to the CPU: its state is not part of the GPU's peak."""
    phases = pd.DataFrame(
        {
            "phase": ["optimizer_step"], "device": ["cuda:0 NVIDIA H200"], "rank": [0],
            "attempt": [1], "peak_allocated_bytes": [10 * 2**20], "param_bytes": [2**20],
            "buffer_bytes": [0], "grad_bytes": [2**20], "optimizer_state_bytes": [4 * 2**20],
        }
    )  # fmt: skip
    placement = pd.DataFrame(
        {
            "device": ["cuda:0", "cuda:0", "cuda:0", "cpu"], "rank": [0] * 4, "attempt": [1] * 4,
            "kind": ["param", "grad", "optimizer_state", "optimizer_state"],
            "bytes": [2**20, 2**20, 2**20, 3 * 2**20], "moment": ["fit_end"] * 4,
        }
    )  # fmt: skip
    row = memory_stack(phases, placement).iloc[0]
    assert row["optimizer_state"] == 2**20  # the quarter on cuda:0
    assert row["activations_other"] == 10 * 2**20 - 3 * 2**20
    assert row["note"] == "3.0 MiB of optimizer_state on cpu, not in this peak"
    # State read at the phase end larger than the peak: nothing invented, the note says so.
    small = phases.assign(peak_allocated_bytes=[2**20])
    row = memory_stack(small).iloc[0]
    assert row["activations_other"] == 0
    assert "exceeds this peak by 5.0 MiB" in row["note"]


def test_comparison_points_hold_every_seed_and_mark_the_control(folder: dict[str, Any]) -> None:
    ledger = Ledger(folder["out"])
    comparison = ledger.compare("val_loss", experiment="cli", control="ctl")
    points = comparison_points(comparison)
    runs = ledger.runs()
    assert sorted(points["run_id"]) == sorted(runs["run_id"])  # every run, none dropped
    by_run = points.set_index("run_id")
    ids = folder["ids"]
    assert by_run.loc[[ids["ctl0"], ids["ctl1"]], "control"].all()
    assert not by_run.drop(index=[ids["ctl0"], ids["ctl1"]])["control"].any()
    assert sorted(by_run.loc[[ids["ctl0"], ids["ctl1"]], "seed"]) == [0, 1]
    # Measured: drawn at the last val_loss; diverged and failed: the worst strip, not drawn.
    curves = ledger.curves()
    for key in ("ctl0", "ctl1"):
        val = curves[(curves["run_id"] == ids[key]) & (curves["name"] == "val_loss")]
        assert by_run.loc[ids[key], "y"] == val.sort_values("step")["value"].iloc[-1]
        assert by_run.loc[ids[key], "place"] == "measured"
    for key in ("hot0", "hot1", "boom"):
        assert by_run.loc[ids[key], "place"] == "worst"
        assert math.isnan(by_run.loc[ids[key], "y"])
    # Seeds of one group sit apart around the group's position.
    ctl = points[points["group"] == "ctl"]["x"].tolist()
    assert ctl[0] < 0 < ctl[1]
    # A control that is not given marks nothing.
    assert not comparison_points(ledger.compare("val_loss", experiment="cli"))["control"].any()


# -- docs/plots.md runs -------------------------------------------------------------------


def test_docs_python_blocks_run(folder: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    assert blocks
    for block in blocks:
        exec(block.replace('"pilot_out"', repr(str(folder["out"]))), {})
    assert "loss_curves.png" in capsys.readouterr().out


def test_plot_files_name_what_each_plot_shows() -> None:
    assert [f"{name}: {shows}" for name, shows in plots.PLOT_FILES.items()] == [
        "loss_curves.png: training loss per run; where runs diverged, stopped or failed",
        "phase_memory.png: peak memory per phase, stacked by category",
        "comparison.png: the variant comparison: every seed's value, the control marked",
    ]


def test_scope_of_a_run_folder_is_its_output_folder_and_itself() -> None:
    run = Path("out/runs/20261130T092309763Z-a1fe91cb433ec8b4")
    assert plots.scope(run) == (Path("out"), [run])


def test_drawn_and_existing_plots_start_empty(tmp_path: Path) -> None:
    assert plots.Drawn(Path("runs/r1")).skipped == {}
    assert plots.existing_plots(tmp_path) == []


def test_comparison_plot_marks_the_control_given_and_holds_each_median() -> None:
    runs = pd.DataFrame(
        {"variant": ["a", "b"], "seed": [0, 0], "value": [2.0, 1.0], "status": ["completed"] * 2}
    )
    data = comparison_plot(compare_runs(runs), control="b")
    assert data.by == "variant"
    assert data.medians.to_dict() == {"a": 2.0, "b": 1.0}
    assert data.points["control"].tolist() == [False, True]
