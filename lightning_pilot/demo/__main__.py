"""``python -m lightning_pilot.demo``: a pilot of the bundled tiny LM, measured phase by phase.

Trains :class:`~lightning_pilot.demo.TinyCausalLM` on the synthetic instruction task on CPU with
:class:`~lightning_pilot.PhaseMemoryMonitor` and a checkpoint every ``--checkpoint-every``
updates, then prints the phase table and where the files are. Takes a few seconds on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import pandas as pd
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pilot import PhaseMemoryMonitor, read_phase_table
from lightning_pilot.demo import InstructionDataModule, TinyCausalLM

_COLUMNS = [
    "phase",
    "first",
    "occurrences",
    "batch_size",
    "seq_len",
    "peak_allocated_bytes",
    "param_bytes",
    "grad_bytes",
    "optimizer_state_bytes",
    "duration_median_s",
    "verdict",
]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo pilot; returns 0 when every phase passed, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="python -m lightning_pilot.demo", description=__doc__)
    parser.add_argument("--out", default="pilot_out", help="output folder (default: pilot_out)")
    parser.add_argument("--steps", type=int, default=60, help="updates to train (default: 60)")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="updates per checkpoint")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.checkpoint_every < 1:
        parser.error("--steps must be at least 2 and --checkpoint-every at least 1")

    out = Path(args.out)
    monitor = PhaseMemoryMonitor(out_dir=out)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        val_check_interval=args.checkpoint_every,
        limit_val_batches=1.0,
        logger=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=[
            monitor,
            ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=args.checkpoint_every),
        ],
    )
    data = InstructionDataModule(dataset_size=2048, seed=0, batch_size=16, max_length=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyCausalLM(max_length=32), datamodule=data)

    table = read_phase_table(monitor.run.run_dir)
    with pd.option_context("display.width", 200, "display.max_columns", None):
        sys.stdout.write(table[_COLUMNS].to_string(index=False) + "\n\n")
    problems = table[table["verdict"].isin(["fail", "warn"])]
    for row in problems.itertuples():
        sys.stdout.write(f"{row.phase}: {row.verdict}: {row.reason}\n")
    sys.stdout.write(
        f"run {monitor.run.run_id}\n"
        f"phase table: {monitor.run.run_dir / 'phases.parquet'}\n"
        f"read it with: lightning_pilot.read_phase_table({str(out)!r})\n"
    )
    return 1 if (table["verdict"] == "fail").any() else 0


if __name__ == "__main__":
    raise SystemExit(main())
