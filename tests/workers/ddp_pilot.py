"""Worker for the DDP tests of every pilot callback together: a 2-process gloo fit on CPU.

Usage: python ddp_pilot.py OUT_DIR [--dataset-size N] [--steps N] [--blowup-at STEP]
                              [--check-every N]

Lightning's ``strategy="ddp"`` starts rank 1 by running this same command again. Each rank fits
the demo LM with ``pilot_callbacks()`` (phase monitor, batch inspector, accountant, resume
verifier, ledger), then writes ``OUT_DIR/rank<global rank>.json`` with the run id it used and
the update it stopped at, so the test can check that both ranks wrote into one run and stopped
together. With ``--blowup-at``, rank 1's loss value reads 1000 higher from that update on (a
detached constant: the gradients do not change), so only rank 1 sees the blow-up.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_pilot import pilot_callbacks
from lightning_pilot.core.divergence import DivergenceRules
from lightning_pilot.demo import InstructionDataModule, TinyCausalLM


class BlowsUpOnRankOne(TinyCausalLM):
    def __init__(self, blowup_at: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.blowup_at = blowup_at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        update = self.global_step + 1  # the update this micro-batch belongs to
        if self.blowup_at and update >= self.blowup_at and self.global_rank == 1:
            loss = loss + (1000.0 - loss.detach())
        return loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--dataset-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--blowup-at", type=int, default=0)
    parser.add_argument("--check-every", type=int, default=1)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # two ranks, and later their two verification processes
    pl.seed_everything(0, verbose=False)
    callbacks = pilot_callbacks(
        out_dir=args.out / "pilot",
        experiment="ddp",
        variant="blowup" if args.blowup_at else "control",
        seed=0,
        resume={"at_step": 2, "compare_steps": 2, "check_artifact": False, "timeout_s": 90},
        ledger={"check_every": args.check_every, "rules": DivergenceRules(blowup_patience=2)},
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=args.steps,
        limit_val_batches=2,
        val_check_interval=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
        callbacks=callbacks,
    )
    data = InstructionDataModule(
        dataset_size=args.dataset_size, batch_size=4, max_length=32, stateful=True
    )
    # The control fit uses the demo class itself: its verification processes import it.
    options: dict[str, Any] = {"max_length": 32, "d_model": 16, "n_layers": 1}
    model = (
        BlowsUpOnRankOne(args.blowup_at, **options) if args.blowup_at else TinyCausalLM(**options)
    )
    trainer.fit(model, datamodule=data)
    run = callbacks[0].run  # type: ignore[attr-defined]
    (args.out / f"rank{trainer.global_rank}.json").write_text(
        json.dumps(
            {
                "run_id": run.run_id,
                "rank": run.rank,
                "world_size": run.world_size,
                "global_step": trainer.global_step,
            }
        )
    )


if __name__ == "__main__":
    main()
