"""The whole pilot on the bundled tiny LM, then a learning-rate comparison, on CPU.

What :func:`run_demo` runs and prints: docs/demo.md."""

from __future__ import annotations

import logging
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import lightning.pytorch as pl
import pandas as pd
import torch

from lightning_pilot.callbacks.divergence_ledger import DivergenceLedger
from lightning_pilot.callbacks.overfit_tiny_subset import OverfitTinySubset
from lightning_pilot.core.ledger_records import Heartbeat
from lightning_pilot.core.per_target import checkpointing_name
from lightning_pilot.core.progress import BarReporter, Reporter, is_terminal, tqdm_available
from lightning_pilot.demo.lm import PAD_ID, VOCAB_SIZE, InstructionDataModule, TinyCausalLM, decode
from lightning_pilot.estimate import TARGETS, Estimate, estimate
from lightning_pilot.ledger import Ledger
from lightning_pilot.pilot import pilot_callbacks
from lightning_pilot.run import PilotRun
from lightning_pilot.storage import read_phase_table

#: The comparison's experiment name in the ledger.
EXPERIMENT = "lr-comparison"

_PHASE_COLUMNS = [
    "phase",
    "first",
    "occurrences",
    "batch_size",
    "seq_len",
    "peak_allocated_bytes",
    "duration_median_s",
    "verdict",
]
_QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning_pilot")


@dataclass(frozen=True)
class LrVariant:
    """One learning rate of the comparison: the ledger's variant ``name``, the ``lr`` used on
    the tiny model and the fine-tuning ``seed_lr`` it stands for (``None``: the unstable one)."""

    name: str
    lr: float
    seed_lr: float | None


def lr_variants() -> list[LrVariant]:
    """The comparison: control, half, double, and one absurd learning rate that must diverge.
    The fine-tuning values (1e-4, 5e-5, 2e-4) are scaled by 30: from scratch, the tiny model
    learns slowly at 1e-4 (val_loss 2.56 after 200 updates against 1.66 at 3e-3, from 3.14).
    """
    return [
        LrVariant("lr=3e-3 (control)", 3e-3, 1e-4),
        LrVariant("lr=1.5e-3 (half)", 1.5e-3, 5e-5),
        LrVariant("lr=6e-3 (double)", 6e-3, 2e-4),
        LrVariant("lr=5 (unstable)", 5.0, None),
    ]


@dataclass(frozen=True)
class DemoSize:
    """How much the demo trains: ``updates`` per comparison fit, validating every ``val_every``
    updates on ``val_batches`` batches, ``pilot_updates``, ``overfit_steps`` and the examples
    generated (``dataset_size``)."""

    updates: int
    val_every: int
    val_batches: int
    pilot_updates: int
    overfit_steps: int
    dataset_size: int

    @classmethod
    def of(cls, quick: bool) -> DemoSize:
        """The quick size (for tests, seconds) or the full one (under a minute)."""
        # updates, val_every, val_batches, pilot_updates, overfit_steps, dataset_size
        return cls(6, 3, 2, 5, 60, 512) if quick else cls(200, 50, 8, 8, 150, 4096)


MICRO_BATCH = 2
ACCUMULATE = 8
MAX_LENGTH = 20
_MODEL: dict[str, Any] = {"d_model": 32, "n_heads": 2, "n_layers": 1, "max_length": MAX_LENGTH}
#: The demo LM's architecture at about a billion parameters (1.01e9): the shape the demo
#: estimates on the catalogue's GPUs, at micro-batch 8 x 2048 tokens, bf16-mixed.
LARGE_MODEL: dict[str, Any] = {"d_model": 2048, "n_heads": 16, "n_layers": 20, "max_length": 2048}
LARGE_MICRO_BATCH = 8


class FitMeter(pl.Callback):
    """Times one demo fit's training loop (from train start to train end, its validations
    included) and counts its updates; with ``bar``, moves it at every update."""

    def __init__(self, bar: Reporter | None = None) -> None:
        self.bar = bar if bar is not None else Reporter()
        self.updates = 0
        self.seconds: float | None = None
        self._start: tuple[float, int] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = (time.perf_counter(), trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._start is not None and trainer.global_step - self._start[1] != self.updates:
            self.updates = trainer.global_step - self._start[1]
            self.bar.update("", done=self.updates)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._start is not None:
            self.seconds = time.perf_counter() - self._start[0]
            self.updates = trainer.global_step - self._start[1]
        self.bar.close(done=self.updates)

    def on_exception(self, *args: Any) -> None:
        self.bar.close()

    def rate_text(self) -> str:
        """``"48.1 updates/s"``, or why the rate is not known."""
        if self.seconds is None or self.updates == 0:
            return "updates/s not measured (no update ran)"
        return f"{self.updates / self.seconds:.1f} updates/s"


def fit_meter(stream: TextIO, label: str, updates: int) -> FitMeter:
    """A demo fit's meter; on a terminal (and with ``tqdm``), with a bar of its ``updates`` on
    ``stream``, removed when the fit ends."""
    if not (is_terminal(stream) and tqdm_available()):
        return FitMeter()
    return FitMeter(
        BarReporter(label, total=updates, file=stream, leave=False, unit="update", rate=True)
    )


def _fit(
    out_dir: Path, callbacks: list[Any], lr: float, size: DemoSize, meter: FitMeter, **options: Any
) -> float:
    """Fit the tiny LM at ``lr`` from seed 0 on CPU; the seconds the whole fit took."""
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out_dir,
        callbacks=[*callbacks, meter],
        **options,
    )
    pl.seed_everything(0, verbose=False)
    start = time.perf_counter()
    data = InstructionDataModule(
        dataset_size=size.dataset_size,
        seed=0,
        batch_size=MICRO_BATCH,
        max_length=MAX_LENGTH,
        stateful=True,
    )
    trainer.fit(TinyCausalLM(lr=lr, **_MODEL), datamodule=data)
    return time.perf_counter() - start


def _updates(updates: int, val_every: int, size: DemoSize) -> dict[str, Any]:
    """The Trainer options of ``updates`` updates of :data:`ACCUMULATE` micro-batches each,
    validating every ``val_every`` updates."""
    return {
        "max_steps": updates,
        "accumulate_grad_batches": ACCUMULATE,
        "val_check_interval": ACCUMULATE * val_every,
        "limit_val_batches": size.val_batches,
    }


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence Lightning's banners and the expected warnings of the demo's fits."""
    levels = {logging.getLogger(name): logging.getLogger(name).level for name in _QUIET_LOGGERS}
    for logger in levels:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in levels.items():
            logger.setLevel(level)


def _pilot_fit(out_dir: Path, size: DemoSize, meter: FitMeter) -> tuple[PilotRun, float]:
    callbacks = pilot_callbacks(
        out_dir,
        experiment="demo-pilot",
        variant="lr=3e-3 (control)",
        seed=0,
        batch_inspector={
            "decode": decode,
            "vocab_size": VOCAB_SIZE,
            "max_length": MAX_LENGTH,
            "pad_token_id": PAD_ID,
        },
        resume={"at_step": 2, "compare_steps": 2},
        ledger={"params": {"lr": 3e-3}},
        # On every GPU of the catalogue: the choice sheet prices the campaign where it fits.
        estimate={
            "targets": list(TARGETS),
            "precisions": ["bf16-mixed"],
            "micro_batches": [MICRO_BATCH],
            "largest": False,
            "options": {"workers": 1},
        },
    )
    took = _fit(out_dir, callbacks, 3e-3, size, meter, **_updates(size.pilot_updates, 4, size))
    return callbacks[0].run, took


def large_estimate(batch: Any) -> Estimate:
    """The demo LM at :data:`LARGE_MODEL` estimated on fake tensors on every GPU of the
    catalogue at micro-batch :data:`LARGE_MICRO_BATCH` x 2048 tokens, bf16-mixed, activation
    checkpointing off and on, on one GPU and sharded over 8 with FSDP."""
    from lightning_pilot.demo.lm import _Block

    return estimate(
        factory=lambda: TinyCausalLM(**LARGE_MODEL),
        batch=batch,
        targets=list(TARGETS),
        precisions=["bf16-mixed"],
        micro_batches=[LARGE_MICRO_BATCH],
        seq_lens=[LARGE_MODEL["max_length"]],
        checkpointing=[False, True],
        checkpoint_classes=[_Block],
        wrap_classes=[_Block],
        strategies=["single", "fsdp:8"],
        largest=False,
        workers=1,
    )


def large_table(result: Estimate) -> str:
    """One line per target, checkpointing and strategy: memory per GPU (the reserved bytes of
    the phase that peaks), the phase, fits, and the step-time band."""
    frame = result.frame()
    keys = ["target", "checkpointing", "strategy", "devices"]
    rows = []
    for key, group in frame[frame["status"] == "ok"].groupby(keys, sort=False):
        peak = group.loc[group["peak_reserved_bytes"].idxmax()]
        rows.append(
            {
                "target": key[0],
                "act. ckpt": checkpointing_name(key[1]),
                "strategy": key[2] if key[2] == "single" else f"{key[2]}:{key[3]}",
                "memory per GPU": _fmt_bytes(peak["peak_reserved_bytes"]),
                "peak phase": peak["phase"],
                "fits": "yes" if bool(peak["fits"]) and bool(group["fits"].all()) else "no",
                "update": f"{peak['step_time_low_s']:.2f}-{peak['step_time_high_s']:.2f} s",
            }
        )
    text = _table(pd.DataFrame(rows)) if rows else "(nothing estimated)"
    for row in frame[frame["status"] != "ok"].itertuples():
        text += f"\n  {row.target}: {row.status}: {row.reason}"
    return text


def _comparison_fit(
    out_dir: Path, variant: LrVariant, size: DemoSize, meter: FitMeter
) -> tuple[str, float]:
    ledger = DivergenceLedger(
        experiment=EXPERIMENT,
        variant=variant.name,
        seed=0,
        params={"lr": variant.lr, "seed_lr": variant.seed_lr, "model": "TinyCausalLM-32x1"},
        heartbeat=Heartbeat(updates=50),
        out_dir=out_dir,
    )
    took = _fit(
        out_dir, [ledger], variant.lr, size, meter, **_updates(size.updates, size.val_every, size)
    )
    return ledger.run.run_id, took


def _table(frame: pd.DataFrame) -> str:
    with pd.option_context("display.width", 200, "display.max_columns", None):
        return frame.to_string(index=False)


def _fmt_bytes(value: Any) -> str:
    return "null" if value is None or pd.isna(value) else f"{float(value) / 2**20:.2f} MiB"


def write_plots(
    folder: Path,
    curves: pd.DataFrame,
    runs: pd.DataFrame,
    table: pd.DataFrame,
    write: Callable[[str], object],
) -> list[Path]:
    """Write ``loss_curves.png`` (the ledger's ``curves`` of ``runs``) and ``phase_memory.png``
    (the pilot's phase ``table``) into ``folder``; without matplotlib, ``write`` why, and
    return ``[]``."""
    try:
        from lightning_pilot.report import plots

        plots.require_matplotlib()
    except ModuleNotFoundError as error:
        write(f"\n{error}\n")
        return []
    return [
        plots.plot_loss_curves(
            curves,
            runs,
            folder / "loss_curves.png",
            title="learning-rate comparison: training loss and val_loss per variant",
        ),
        plots.plot_phase_memory(table, folder / "phase_memory.png"),
    ]


def run_demo(out_dir: Path, *, quick: bool = False, stream: TextIO | None = None) -> dict[str, Any]:
    """Run the demo pilot and the learning-rate comparison into ``out_dir`` (an existing ledger
    there is added to, never overwritten); print to ``stream`` (default ``sys.stdout``) as it
    goes. ``quick``: a few updates per fit. What it returns: docs/demo.md."""
    out = Path(out_dir)
    target = stream if stream is not None else sys.stdout

    def write(text: str) -> None:
        target.write(text)
        target.flush()  # progress shows while the demo runs, also through a pipe

    size = DemoSize.of(quick)
    variants = lr_variants()
    total_fits = 2 + len(variants)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    write(
        f"lightning-pilot demo ({'quick' if quick else 'full'}): TinyCausalLM (d_model 32, 1 layer)"
        f" on CPU, micro-batch {MICRO_BATCH} x accumulation {ACCUMULATE}; output in {out}\n"
    )

    def meter(stage: int, name: str, updates: int) -> FitMeter:
        return fit_meter(target, f"[{stage}/{total_fits}] {name}", updates)

    with _quiet():
        pilot_meter = meter(1, "pilot", size.pilot_updates)
        run, seconds["pilot"] = _pilot_fit(out, size, pilot_meter)
        write(
            f"[1/{total_fits}] pilot with every callback: {pilot_meter.updates} updates"
            f" ({pilot_meter.rate_text()}), run {run.run_id}, {seconds['pilot']:.1f} s"
            " (includes the resume and artifact checks in new processes)\n"
        )
        overfit_meter = meter(2, "overfit", size.overfit_steps)
        overfit = OverfitTinySubset(max_steps=size.overfit_steps, out_dir=out)
        seconds["overfit"] = _fit(
            out, [overfit], 3e-3, size, overfit_meter, max_steps=-1, max_epochs=1000
        )
        write(
            f"[2/{total_fits}] tiny-subset overfit: {overfit.verdict} after"
            f" {overfit_meter.updates} updates ({overfit_meter.rate_text()}), run"
            f" {overfit.run.run_id}, {seconds['overfit']:.1f} s\n"
        )
        run_ids: dict[str, str] = {}
        for i, variant in enumerate(variants, start=3):
            variant_meter = meter(i, variant.name, size.updates)
            run_id, took = _comparison_fit(out, variant, size, variant_meter)
            run_ids[variant.name], seconds[variant.name] = run_id, took
            done = dict(Ledger(out).runs().set_index("run_id").loc[run_id].items())
            write(
                f"[{i}/{total_fits}] {variant.name}: {done['status']} ({done['stop_cause']})"
                f" after {done['updates_done']} updates ({variant_meter.rate_text()}),"
                f" {took:.1f} s\n"
            )

    table = read_phase_table(run.run_dir)
    write(f"\nPhase table of the pilot run ({run.run_dir / 'phases.parquet'}):\n")
    shown = table[_PHASE_COLUMNS].assign(
        peak_allocated_bytes=table["peak_allocated_bytes"].map(_fmt_bytes)
    )
    write(_table(shown.rename(columns={"peak_allocated_bytes": "peak_allocated"})) + "\n")
    for row in table[table["verdict"].isin(["fail", "warn"])].itertuples():
        write(f"  {row.phase}: {row.verdict}: {row.reason}\n")

    ledger = Ledger(out)
    control = variants[0].name
    comparison = ledger.compare("val_loss", by="variant", control=control, experiment=EXPERIMENT)
    runs = ledger.runs()
    ours = runs[runs["run_id"].isin(list(run_ids.values()))]
    write(
        "\nLearning-rate comparison (fine-tuning 1e-4 / 5e-5 / 2e-4 scaled x30 to 3e-3 / 1.5e-3 /"
        f" 6e-3 for the tiny model; 2 x {ACCUMULATE} examples per update, {size.updates}"
        " updates each, seed 0):\n"
    )
    write(_table(ours[["variant", "status", "stop_cause", "stop_step", "updates_done"]]) + "\n")
    summary = comparison.summary[
        ["variant", "n_runs", "n_completed", "n_diverged", "median", "paired_mean_diff"]
    ]
    write(f"\nval_loss (last validation; lower is better; control {control}):\n")
    write(_table(summary) + "\n")
    write(
        "A diverged run keeps its row: it counts as the worst value (inf) and is ranked last,"
        " never dropped.\n"
    )

    plots = write_plots(out / "plots", ledger.curves(), ours, table, write)

    # Before renting: the same architecture at a billion parameters, on the catalogue's GPUs.
    started = time.perf_counter()
    data = InstructionDataModule(batch_size=MICRO_BATCH, max_length=MAX_LENGTH, seed=0)
    data.setup("fit")
    with _quiet():
        large = large_estimate(next(iter(data.train_dataloader())))
    seconds["estimate"] = time.perf_counter() - started
    with torch.device("meta"):
        params = sum(p.numel() for p in TinyCausalLM(**LARGE_MODEL).parameters())
    write(
        f"\nThe demo LM's architecture at {params / 1e9:.2f}B parameters (d_model"
        f" {LARGE_MODEL['d_model']}, {LARGE_MODEL['n_layers']} layers), micro-batch"
        f" {LARGE_MICRO_BATCH} x {LARGE_MODEL['max_length']} tokens, bf16-mixed, AdamW:"
        f" estimated on fake tensors in {seconds['estimate']:.1f} s (docs/estimate.md):\n"
    )
    write(large_table(large) + "\n")
    seconds["total"] = time.perf_counter() - start

    write(
        f"\nFiles:\n  pilot run:   {run.run_dir}\n  overfit run: {overfit.run.run_dir}\n"
        f"  ledger:      {ledger.path}\n"
    )
    for path in plots:
        write(f"  plot:        {path}\n")
    write(
        f"Read them with lightning_pilot.read_phase_table({str(run.run_dir)!r}) and"
        f" lightning_pilot.Ledger({str(out)!r}).\nDone in {seconds['total']:.1f} s.\n"
    )
    return {
        "experiment": EXPERIMENT,
        "out_dir": out,
        "pilot_run_dir": run.run_dir,
        "pilot_run_id": run.run_id,
        "overfit_run_dir": overfit.run.run_dir,
        "overfit_verdict": overfit.verdict,
        "ledger": ledger.path,
        "comparison_run_ids": run_ids,
        "control": control,
        "comparison": comparison,
        "plots": plots,
        "large_estimate": large,
        "seconds": seconds,
    }
