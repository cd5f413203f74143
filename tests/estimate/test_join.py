"""A measured phase row and an estimated row name the same quantity by the same column and
join on ``("phase", "first")`` (lightning_pilot.vocabulary)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lightning_pilot import PhaseMemoryMonitor, read_phase_table
from lightning_pilot.demo import ClassificationDataModule, TinyClassifier
from lightning_pilot.estimate import estimate
from lightning_pilot.vocabulary import CATEGORY_COLUMNS, ESTIMATE_PHASES, MEASURED_CATEGORIES


def test_a_measured_and_an_estimated_row_join_on_phase_and_first(make_trainer: Any) -> None:
    data = ClassificationDataModule(batch_size=8)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    torch.manual_seed(0)
    model = TinyClassifier()
    monitor = PhaseMemoryMonitor()
    trainer = make_trainer(callbacks=[monitor], max_steps=3, limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=data)
    measured = read_phase_table(monitor.run.run_dir)

    torch.manual_seed(0)
    result = estimate(
        TinyClassifier(),
        batch,
        targets=["L4-24GB"],
        precisions=["32-true"],
        micro_batches=[8],
        largest=False,
        workers=1,
    )
    estimated = result.frame()
    assert set(estimated["status"]) == {"ok"}, estimated["reason"].tolist()
    assert list(zip(estimated["phase"], estimated["first"], strict=True)) == list(ESTIMATE_PHASES)

    joined = measured.merge(estimated, on=["phase", "first"], suffixes=("_measured", "_est"))
    # Three updates: the first optimizer step and the later ones, later forward and backward.
    keys = set(zip(joined["phase"], joined["first"], strict=True))
    assert {
        ("forward", False),
        ("backward", False),
        ("optimizer_step", True),
        ("optimizer_step", False),
    } <= keys
    # The same column names on both sides: the state the model holds.
    shared = {"peak_allocated_bytes", "peak_reserved_bytes"} | {
        CATEGORY_COLUMNS[name] for name in MEASURED_CATEGORIES
    }
    assert shared <= set(measured.columns) & set(estimated.columns)

    # fp32 on both sides: the same tensors, the estimate's in the blocks CUDA's caching
    # allocator gives them on the target (each rounded up to 512 bytes).
    def exact(tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    def on_gpu(tensors: Any) -> int:
        return sum(-(-t.numel() * t.element_size() // 512) * 512 for t in tensors)

    params, buffers = list(model.parameters()), list(model.buffers())
    for row in joined.itertuples():
        assert row.param_bytes_measured == exact(params), row.phase
        assert row.param_bytes_est == on_gpu(params), row.phase
        assert row.buffer_bytes_measured == exact(buffers), row.phase
        assert row.buffer_bytes_est == on_gpu(buffers), row.phase
        assert row.peak_allocated_bytes_est > 0
        assert row.peak_allocated_bytes_measured > 0
    later = joined[(joined["phase"] == "optimizer_step") & ~joined["first"].astype(bool)].iloc[0]
    assert later["grad_bytes_measured"] == exact(params)
    assert later["grad_bytes_est"] == on_gpu(params)
    assert later["optimizer_state_bytes_measured"] >= 2 * exact(params)  # AdamW's two moments
    assert later["optimizer_state_bytes_est"] >= 2 * on_gpu(params)
