"""Worker for the DDP smoke test of every pilot callback: a 2-process gloo fit on CPU.

Usage: python ddp_pilot.py OUT_DIR

Lightning's ``strategy="ddp"`` starts rank 1 by running this same command again. Each rank fits
the demo LM with ``pilot_callbacks()`` (phase monitor, batch inspector, accountant, resume
verifier, ledger) for a few updates, then writes ``OUT_DIR/rank<global rank>.json`` with the run
id it used, so the test can check that both ranks wrote into one run.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl

from lightning_pilot import pilot_callbacks
from lightning_pilot.demo import InstructionDataModule, TinyCausalLM


def main() -> None:
    out = Path(sys.argv[1])
    warnings.simplefilter("ignore")
    callbacks = pilot_callbacks(
        out_dir=out / "pilot",
        experiment="ddp",
        variant="control",
        seed=0,
        resume={"at_step": 2, "compare_steps": 2, "check_artifact": False},
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=5,
        limit_val_batches=2,
        val_check_interval=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=callbacks,
    )
    data = InstructionDataModule(dataset_size=128, batch_size=4, max_length=32, stateful=True)
    trainer.fit(TinyCausalLM(max_length=32, d_model=16, n_layers=1), datamodule=data)
    run = callbacks[0].run  # type: ignore[attr-defined]
    (out / f"rank{trainer.global_rank}.json").write_text(
        json.dumps({"run_id": run.run_id, "rank": run.rank, "world_size": run.world_size})
    )


if __name__ == "__main__":
    main()
