"""Worker for the DDP test of EffectiveBatchAccountant: a 2-process gloo fit on CPU.

Usage: python ddp_accountant.py OUT_DIR DATASET_SIZE MICRO_BATCH_SIZE K [FAIL_AT]

Lightning's ``strategy="ddp"`` starts rank 1 by running this same command again. Each rank
fits a linear model on DATASET_SIZE examples for one epoch with an EffectiveBatchAccountant,
saving a checkpoint every 2 updates into OUT_DIR/ckpt, then writes its summary, the run's
ledger fields and the accountant's state key to OUT_DIR/rank<global rank>.json. With FAIL_AT,
every rank raises ArithmeticError in the training step at that global step; the summary is
written before the error propagates.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_pilot.callbacks import EffectiveBatchAccountant


class Regression(pl.LightningModule):
    def __init__(self, fail_at: int | None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.fail_at = fail_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.fail_at:
            raise ArithmeticError(f"user bug at step {self.fail_at}")
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    out_dir, size, micro_batch, k = sys.argv[1], *map(int, sys.argv[2:5])
    fail_at = int(sys.argv[5]) if len(sys.argv) > 5 else None
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(size, 2, generator=generator), torch.randn(size, generator=generator)
    )
    accountant = EffectiveBatchAccountant()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        accumulate_grad_batches=k,
        # A checkpoint every 2 updates: the counts saved must be those of both ranks.
        callbacks=[
            accountant,
            ModelCheckpoint(dirpath=Path(out_dir, "ckpt"), every_n_train_steps=2, save_top_k=-1),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out_dir,
    )
    try:
        trainer.fit(Regression(fail_at), DataLoader(data, batch_size=micro_batch))
    finally:
        summary = accountant.summary
        summary["ledger_fields"] = accountant.run.ledger_fields
        summary["state_key"] = accountant.state_key
        Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
