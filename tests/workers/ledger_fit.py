"""Worker process for the DivergenceLedger subprocess tests: one small real fit.

Usage: python ledger_fit.py OUT_DIR MODE [--at STEP] [--variant NAME] [--steps N]

Modes:
    normal     train --steps updates (the concurrency test runs four at once).
    keyboard   raise KeyboardInterrupt in training_step at update --at (Lightning then calls
               sys.exit(1)).
    sigterm    send this process SIGTERM in training_step at update --at.
    hang       at update --at write OUT_DIR/ready-<variant> and sleep until killed (SIGKILL).
    ddp        two CPU processes (gloo); from update --at rank 1's loss value reads 1000 higher
               (a detached constant: the gradients do not change), so only rank 1 sees a
               blow-up. Each rank writes OUT_DIR/steps-r<rank>.txt with its final step.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset

from lightning_pilot.callbacks import DivergenceLedger
from lightning_pilot.core.divergence import DivergenceRules
from lightning_pilot.core.ledger_records import Heartbeat


class Scripted(BoringModel):
    def __init__(self, mode: str, at: int, out: Path, variant: str) -> None:
        super().__init__()
        self.mode, self.at, self.out, self.variant = mode, at, out, variant

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(RandomDataset(32, 64), batch_size=8)

    def configure_optimizers(self) -> Any:
        # BoringModel's own SGD(lr=0.1) blows up on its random data after ~15 updates.
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        output = super().training_step(batch, batch_idx)
        step = self.global_step + 1  # the update this micro-batch belongs to
        if step == self.at and self.mode == "keyboard":
            raise KeyboardInterrupt
        if step == self.at and self.mode == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        if step == self.at and self.mode == "hang":
            (self.out / f"ready-{self.variant}").write_text("ready")
            while True:
                time.sleep(0.05)
        if self.mode == "ddp" and step >= self.at and self.global_rank == 1:
            output["loss"] = output["loss"] + (1000.0 - output["loss"].detach())
        return output


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("mode", choices=["normal", "keyboard", "sigterm", "hang", "ddp"])
    parser.add_argument("--at", type=int, default=3)
    parser.add_argument("--variant", default="v")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)  # several workers share two cores
    pl.seed_everything(0, verbose=False)
    ledger = DivergenceLedger(
        experiment="workers",
        variant=args.variant,
        seed=0,
        params={"mode": args.mode},
        heartbeat=Heartbeat(updates=2),
        check_every=1,  # the tests assert the exact update each run stops at
        rules=DivergenceRules(blowup_patience=2),
        out_dir=args.out,
    )
    ddp = args.mode == "ddp"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2 if ddp else 1,
        strategy="ddp" if ddp else "auto",
        max_steps=args.steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
        callbacks=[ledger],
    )
    trainer.fit(Scripted(args.mode, args.at, args.out, args.variant))
    if ddp:
        rank = trainer.global_rank
        (args.out / f"steps-r{rank}.txt").write_text(f"{trainer.global_step} {ledger.run.run_id}")


if __name__ == "__main__":
    main()
