"""Worker process for the fault drills: one small real fit with every pilot callback, and a fault.

Usage: python fault_fit.py OUT_DIR --variant NAME [--seed N] [--task classifier|lm]
       [--steps N] [--resume-at N] [--artifact] [--fault FAULT] [--full-after N]

The fit: ``pilot_callbacks(OUT_DIR / "pilot", ...)`` (PhaseMemoryMonitor with a 2-update pilot
window, BatchInspector, EffectiveBatchAccountant, ResumeVerifier checkpointing at update
``--resume-at`` (3) and comparing 1 update, with the artifact round trip only with
``--artifact``, DivergenceLedger with a heartbeat after every update) on the demo classifier or
LM with stateful loaders, validation after every 3 updates, no sanity check, ``--steps`` (6)
updates. Its schedule, update by update:

    update 1   start record before it; heartbeat 1 after it
    update 2   the pilot window's phase rows are flushed (a phase snapshot), then heartbeat 2
    update 3   ResumeVerifier saves its checkpoint, then heartbeat 3; validation follows
    update 4   ResumeVerifier's verification process (a new Python process), then heartbeat 4

Faults (``--fault``):
    none             train to ``--steps``.
    setup            SIGKILL itself in ``setup`` (before any record is written).
    first_batch      SIGKILL itself at the first batch (after the start record).
    mid_training     SIGKILL itself at the batch of update 3 (after heartbeats 1 and 2).
    checkpoint_save  SIGKILL itself inside ResumeVerifier's checkpoint save at update 3.
    validation       SIGKILL itself at the first validation batch (after update 3).
    publish_ledger_before_link   SIGKILL itself in the 3rd ledger publish (heartbeat 2) once
                     its hidden temporary file is written and fsynced, before it is published.
    publish_ledger_after_link    the same, after the record is published under its name and
                     before the temporary file is removed.
    publish_phases_before_link   SIGKILL itself in the 2nd phase-table publish (the pilot
                     window's snapshot) before it is published.
    disk_full        from the end of update ``--full-after`` (3) on, every fsync of a file
                     fails with ENOSPC (a publish fsyncs its temporary file before publishing
                     it; a full disk often surfaces there).
    (The verification-process kill comes from the test: it SIGKILLs the process group while
    the verification process runs.)

Before killing itself the worker writes ``OUT_DIR/killed-<variant>.json`` (run id, step,
fault); a worker that returns from ``fit`` writes ``OUT_DIR/result-<variant>.json`` (run id,
steps done, the exception ``fit`` raised and the warnings it emitted).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import stat
import traceback
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_pilot.core.ledger_records import Heartbeat
from lightning_pilot.demo import (
    ClassificationDataModule,
    InstructionDataModule,
    TinyCausalLM,
    TinyClassifier,
)
from lightning_pilot.pilot import pilot_callbacks
from lightning_pilot.run import PilotRun

FAULTS = (
    "none",
    "setup",
    "first_batch",
    "mid_training",
    "checkpoint_save",
    "validation",
    "publish_ledger_before_link",
    "publish_ledger_after_link",
    "publish_phases_before_link",
    "disk_full",
)


class Fault(Callback):
    """Puts the fault at its point of the fit (placed after the pilot callbacks)."""

    def __init__(self, fault: str, out: Path, variant: str, full_after: int) -> None:
        self.fault, self.out, self.variant = fault, out, variant
        self.full_after = full_after
        self.trainer: pl.Trainer | None = None
        self.disk_full = False

    def kill(self, where: str) -> None:
        run = PilotRun.last(self.trainer) if self.trainer is not None else None
        note = {
            "fault": self.fault,
            "where": where,
            "run_id": None if run is None else run.run_id,
            "step": None if self.trainer is None else self.trainer.global_step,
        }
        (self.out / f"killed-{self.variant}.json").write_text(json.dumps(note))
        os.kill(os.getpid(), signal.SIGKILL)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.trainer = trainer
        if self.fault == "setup":
            self.kill("setup")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.fault == "first_batch" and trainer.global_step == 0:
            self.kill("first batch")
        if self.fault == "mid_training" and trainer.global_step == 2:
            self.kill("batch of update 3")

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.fault == "disk_full" and trainer.global_step == self.full_after:
            self.disk_full = True

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # The fit's only saves are ResumeVerifier's (enable_checkpointing=False); this hook
        # runs while the checkpoint is assembled, before the file is written.
        if self.fault == "checkpoint_save":
            self.kill("checkpoint save")

    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.fault == "validation" and not trainer.sanity_checking:
            self.kill("validation")


def install_publish_kill(fault: Fault) -> None:
    """SIGKILL the process in the middle of the n-th publish into one folder.

    ``storage.publish_file`` writes and fsyncs a hidden temporary file, publishes it with
    ``os.link`` and then removes the temporary name: the kill lands just before or just after
    the link.
    """
    _, folder, when = fault.fault.split("_", 2)
    # Phase-table publish 1 is the train-start snapshot, 2 the pilot window's.
    target, nth = ("ledger", 3) if folder == "ledger" else ("phases.parquet", 2)
    real_link = os.link
    seen = [0]

    def link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        mine = Path(dst).parent.name == target
        if mine:
            seen[0] += 1
        if mine and seen[0] == nth and when == "before_link":
            fault.kill(f"publish {nth} into {target}, before the link")
        real_link(src, dst, *args, **kwargs)
        if mine and seen[0] == nth and when == "after_link":
            fault.kill(f"publish {nth} into {target}, after the link")

    os.link = link


def install_disk_full(fault: Fault) -> None:
    """Once ``fault.disk_full`` is set, fsync of any regular file fails with ENOSPC."""
    real_fsync = os.fsync

    def fsync(fd: Any) -> None:
        if fault.disk_full and stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    os.fsync = fsync


def ledger_options() -> dict[str, Any]:
    """A heartbeat after every update and rules after every update: deterministic, not timed."""
    return {"heartbeat": Heartbeat(seconds=3600.0, updates=1), "check_every": 1}


def model_and_data(task: str, seed: int) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    if task == "lm":
        data = InstructionDataModule(
            dataset_size=160, seed=seed, batch_size=4, max_length=16, max_symbols=4, stateful=True
        )
        return TinyCausalLM(d_model=16, n_heads=2, n_layers=1, max_length=16), data
    data_module = ClassificationDataModule(dataset_size=160, seed=seed, batch_size=8, stateful=True)
    return TinyClassifier(hidden=16), data_module


def describe(error: BaseException) -> dict[str, Any]:
    """The exception ``fit`` raised, and the first lightning_pilot frame it came from."""
    frames = traceback.extract_tb(error.__traceback__)
    # The first pilot frame past the hook guard (run.py's ``guarded`` wraps every hook).
    ours = [
        f for f in frames if "lightning_pilot" in Path(f.filename).parts and f.name != "guarded"
    ]
    return {
        "type": type(error).__name__,
        "errno": getattr(error, "errno", None),
        "message": str(error),
        "raised_in": [Path(ours[0].filename).name, ours[0].name] if ours else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--variant", default="v")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", choices=["classifier", "lm"], default="classifier")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--resume-at", type=int, default=3)
    parser.add_argument("--artifact", action="store_true")
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--full-after", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # several workers share two cores
    pl.seed_everything(args.seed, verbose=False)
    args.out.mkdir(parents=True, exist_ok=True)
    fault = Fault(args.fault, args.out, args.variant, args.full_after)
    if args.fault.startswith("publish_"):
        install_publish_kill(fault)
    if args.fault == "disk_full":
        install_disk_full(fault)
    callbacks = pilot_callbacks(
        args.out / "pilot",
        experiment="drills",
        variant=args.variant,
        seed=args.seed,
        phase_memory={"pilot_updates": 2},
        resume={"at_step": args.resume_at, "compare_steps": 1, "check_artifact": args.artifact},
        ledger=ledger_options() | {"params": {"task": args.task}},
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        val_check_interval=3,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out / "root",
        callbacks=[*callbacks, fault],
    )
    module, data = model_and_data(args.task, args.seed)
    error: BaseException | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, datamodule=data)
        except Exception as err:  # the drill reports it; the test decides
            error = err
            traceback.print_exc()
    run = PilotRun.last(trainer)
    result = {
        "run_id": None if run is None else run.run_id,
        "global_step": trainer.global_step,
        "exception": None if error is None else describe(error),
        "warnings": [
            {"category": w.category.__name__, "message": str(w.message)}
            for w in caught
            if "lightning-pilot" in str(w.message) or "lightning_pilot" in w.filename
        ],
    }
    (args.out / f"result-{args.variant}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
