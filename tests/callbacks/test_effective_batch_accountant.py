"""EffectiveBatchAccountant in real fits: plans, per-update counts, flags, ranks and resumes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pandas as pd
import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from lightning_pilot import storage
from lightning_pilot.callbacks import EffectiveBatchAccountant
from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.demo import InstructionDataModule, TinyCausalLM
from lightning_pilot.schemas import UPDATES_SCHEMA

WORKER = Path(__file__).parents[1] / "workers" / "ddp_accountant.py"


class Regression(pl.LightningModule):
    """A linear model on ``(x, y)`` batches; optional non-finite losses and an early stop."""

    def __init__(self, inf_at: tuple[int, ...] = (), stop_at: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.inf_at = inf_at
        self.stop_at = stop_at
        self.seen_batches = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x).squeeze(-1).float(), y)
        if self.seen_batches in self.inf_at:
            loss = loss * float("inf")
        self.seen_batches += 1
        if self.stop_at is not None and self.global_step + 1 >= self.stop_at:
            self.trainer.should_stop = True
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Failing(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 3:
            raise ArithmeticError("user bug at step 3")
        return super().training_step(batch, batch_idx)


def loader(n: int, batch_size: int, **kwargs: Any) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(n, 2, generator=generator), torch.randn(n, generator=generator)
    )
    return DataLoader(data, batch_size=batch_size, **kwargs)


def updates_table(accountant: EffectiveBatchAccountant) -> pd.DataFrame:
    folder = accountant.run.run_dir / "updates.parquet"
    frame = storage.read_snapshot_table(folder, UPDATES_SCHEMA).to_pandas()
    return frame.sort_values(["update", "rank"]).reset_index(drop=True)


def ours(records: list[warnings.WarningMessage]) -> list[str]:
    """The messages of the accountant's warnings."""
    return [str(w.message) for w in records if "EffectiveBatchAccountant" in str(w.message)]


@pytest.fixture
def caught() -> Iterator[list[warnings.WarningMessage]]:
    """Every warning of the test, recorded as it is raised."""
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        yield records


# ---------------------------------------------------------------------------------------------
# The scenarios
# ---------------------------------------------------------------------------------------------


def test_the_seeds_example_end_to_end(make_trainer: Any, caplog: pytest.LogCaptureFixture) -> None:
    accountant = EffectiveBatchAccountant()
    trainer = make_trainer(
        max_steps=-1, max_epochs=1, accumulate_grad_batches=8, callbacks=[accountant]
    )
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        trainer.fit(Regression(), loader(3200, 2))

    assert ours(caught) == []
    plan = accountant.plan
    assert plan is not None
    assert (plan.examples_per_update, plan.total_updates, plan.examples_seen) == (16, 200, 3200)
    table = updates_table(accountant)
    assert len(table) == 200
    assert table["update"].tolist() == list(range(1, 201))
    assert set(table["micro_batches"]) == {8}
    assert set(table["examples"]) == set(table["examples_all_ranks"]) == {16}
    assert not table["window_partial"].any()
    assert table["tokens"].isna().all()  # float features: no tokens, null rather than 0
    assert table["optimizer_stepped"].all()  # the torch step hook saw every update
    assert (table["run_id"] == accountant.run.run_id).all()

    summary = accountant.summary
    assert summary["line"] == (
        "16 examples per update (2 x 8 x 1 replica); 200 updates; 3,200 examples; last window full"
    )
    assert summary["estimated_stepping_batches"] == 200
    assert summary["flags"] == []
    assert accountant.run.ledger_fields == {
        "micro_batch_size": 2,
        "accumulate_grad_batches": 8,
        "dp_replicas": 1,
        "effective_batch_size": 16,
        "planned_updates": 200,
        "updates_done": 200,
        "examples_seen": 3200,
        "tokens_seen": None,
    }
    plan_lines = [r.getMessage() for r in caplog.records if "plan:" in r.getMessage()]
    assert plan_lines == [
        "EffectiveBatchAccountant: plan: 16 examples per update (2 x 8 x 1 replica);"
        " 200 updates; 3,200 examples; last window full; Lightning's"
        " estimated_stepping_batches = 200"
    ]
    assert any(r.getMessage().endswith(summary["line"]) for r in caplog.records)


def test_five_micro_batches_with_k2_step_a_down_weighted_last_window(
    make_trainer: Any, caught: list[warnings.WarningMessage]
) -> None:
    accountant = EffectiveBatchAccountant()
    trainer = make_trainer(
        max_steps=-1, max_epochs=1, accumulate_grad_batches=2, callbacks=[accountant]
    )
    trainer.fit(Regression(), loader(5, 1))

    table = updates_table(accountant)
    assert table["micro_batches"].tolist() == [2, 2, 1]
    assert table["window_partial"].tolist() == [False, False, True]
    assert table["weight"].tolist() == [1.0, 1.0, 0.5]
    assert accountant.summary["partial_windows"] == 1
    assert accountant.summary["line"].endswith(
        "3 updates; 5 examples; last window partial (1 of 2 micro-batches, weight 0.50)"
    )
    [warning] = [m for m in ours(caught) if "incomplete accumulation window" in m]
    assert "1 of 2 micro-batches" in warning
    assert "weight 0.50 of a full update" in warning


def _optimizer_step_rows(accountant: EffectiveBatchAccountant) -> list[dict[str, Any]]:
    if not (accountant.run.run_dir / "phases.parquet").exists():
        return []  # no callback wrote a phase row
    table = storage.read_phase_table(accountant.run.run_dir)
    rows: list[dict[str, Any]] = table[table["phase"] == "optimizer_step"].to_dict("records")
    return rows


def test_k5_over_64_micro_batches_is_a_phase_table_warn_with_the_right_remedy(
    make_trainer: Any, caught: list[warnings.WarningMessage]
) -> None:
    # 256 examples in micro-batches of 4: 64 micro-batches per epoch and no partial batch, so
    # drop_last=True changes nothing; K=5 leaves 4 micro-batches in each epoch's last window.
    accountant = EffectiveBatchAccountant()
    trainer = make_trainer(
        max_steps=-1, max_epochs=2, accumulate_grad_batches=5, callbacks=[accountant]
    )
    trainer.fit(Regression(), loader(256, 4))

    table = updates_table(accountant)
    assert len(table) == 26
    assert table.loc[table["window_partial"], "update"].tolist() == [13, 26]
    assert table.loc[table["window_partial"], "weight"].tolist() == [0.8, 0.8]
    [row] = _optimizer_step_rows(accountant)
    assert (row["first"], row["verdict"], row["source"]) == (
        False,
        "warn",
        "EffectiveBatchAccountant",
    )
    [check] = row["checks"]
    assert (check["name"], check["verdict"]) == ("partial_accumulation_windows", "warn")
    assert check["detail"] == (
        "2 of 26 update(s) stepped an incomplete accumulation window (first: update 13, 4 of 5"
        " micro-batches); Lightning still divides the loss by K, so their examples got weight"
        " 0.80 of a full update; micro-batches per epoch (64) are not a multiple of"
        " accumulate_grad_batches (5): choose K dividing 64 (e.g. 4 or 8), or"
        " limit_train_batches to a multiple of K, or accept that each epoch's last update sees"
        " 4/5 of the examples"
    )
    assert row["reason"].startswith("partial_accumulation_windows: 2 of 26 update(s)")
    assert "If the check fails: inspect the optimizer and accumulation" in row["reason"]
    assert "drop_last" not in row["reason"]
    # The Python warning says the same.
    [warning] = [m for m in ours(caught) if "incomplete accumulation window" in m]
    assert "choose K dividing 64 (e.g. 4 or 8)" in warning


def test_a_partial_last_micro_batch_that_makes_the_window_partial_says_drop_last(
    make_trainer: Any,
) -> None:
    # 81 examples in micro-batches of 2: 41 micro-batches, the last of one example; K=5.
    accountant = EffectiveBatchAccountant()
    trainer = make_trainer(
        max_steps=-1, max_epochs=1, accumulate_grad_batches=5, callbacks=[accountant]
    )
    trainer.fit(Regression(), loader(81, 2))
    [row] = _optimizer_step_rows(accountant)
    assert row["verdict"] == "warn"
    detail = row["checks"][0]["detail"]
    assert detail.startswith("1 of 9 update(s) stepped an incomplete accumulation window")
    assert detail.endswith(
        "the loader's last micro-batch is partial (81 examples per replica are not a multiple"
        " of batch_size 2) and makes 41 micro-batches per epoch where 40 would fill every"
        " window of accumulate_grad_batches (5): use drop_last=True"
    )


def test_full_windows_pass_and_no_accumulation_writes_no_row(make_trainer: Any) -> None:
    accountant = EffectiveBatchAccountant()
    trainer = make_trainer(
        max_steps=-1, max_epochs=1, accumulate_grad_batches=8, callbacks=[accountant]
    )
    trainer.fit(Regression(), loader(64, 2))
    [row] = _optimizer_step_rows(accountant)
    assert (row["first"], row["verdict"]) == (False, "pass")
    assert row["checks"][0]["detail"] == (
        "all 4 update(s) counted stepped full windows of K=8 micro-batches"
    )

    plain = EffectiveBatchAccountant()
    make_trainer(max_steps=3, callbacks=[plain]).fit(Regression(), loader(64, 2))
    assert _optimizer_step_rows(plain) == []


def test_lightning_divides_the_last_lone_micro_batch_by_k(make_trainer: Any) -> None:
    """The fact behind the weight: the loss back-propagated is the training loss / K."""

    class Scaled(Regression):
        def __init__(self) -> None:
            super().__init__()
            self.raw: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.raw.append(float(loss.detach()))
            return loss

    class Backward(pl.Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_before_backward(self, trainer: pl.Trainer, pl_module: Any, loss: Any) -> None:
            self.values.append(float(loss))

    model, backward = Scaled(), Backward()
    trainer = make_trainer(
        max_steps=-1, max_epochs=1, accumulate_grad_batches=2, callbacks=[backward]
    )
    trainer.fit(model, loader(5, 1))
    assert backward.values == pytest.approx([raw / 2 for raw in model.raw])


def test_tokens_are_counted_from_attention_masks(make_trainer: Any) -> None:
    datamodule = InstructionDataModule(dataset_size=80, batch_size=4, seed=3)
    accountant = EffectiveBatchAccountant()
    trainer = make_trainer(
        max_steps=-1, max_epochs=1, accumulate_grad_batches=2, callbacks=[accountant]
    )
    trainer.fit(TinyCausalLM(d_model=16, n_heads=2, n_layers=1), datamodule=datamodule)

    # Independently: the same seeded loader, masks summed per window of 2 micro-batches.
    masks = [int(batch["attention_mask"].sum()) for batch in datamodule.train_dataloader()]
    padded = [int(batch["attention_mask"].numel()) for batch in datamodule.train_dataloader()]
    expected = [sum(masks[i : i + 2]) for i in range(0, len(masks), 2)]
    table = updates_table(accountant)
    assert table["tokens"].tolist() == table["tokens_all_ranks"].tolist() == expected
    assert set(table["tokens_source"]) == {"attention_mask"}
    assert sum(masks) < sum(padded)  # padding is really excluded
    summary = accountant.summary
    assert summary["tokens_seen"] == sum(masks)
    assert summary["examples_seen"] == len(datamodule.train_dataset)
    assert accountant.run.ledger_fields["tokens_seen"] == sum(masks)
    spread = summary["tokens_per_update"]
    full = expected if len(masks) % 2 == 0 else expected[:-1]
    assert (spread["min"], spread["max"]) == (min(full), max(full))
    assert f"{sum(masks):,} tokens" in summary["line"]


class PopsTheMask(TinyCausalLM):
    """A training step that takes the mask out of the batch (and crops the inputs)."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        mask = batch.pop("attention_mask")
        batch["input_ids"] = batch["input_ids"][:, :-1]
        batch["attention_mask"] = mask[:, :-1]
        batch["labels"] = batch["labels"][:, :-1]
        return super().training_step(batch, batch_idx)


class ZeroesTheMaskInPlace(TinyCausalLM):
    """A training step that changes the mask in place (the same tensor object)."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        batch["attention_mask"][:, -1] = 0
        return super().training_step(batch, batch_idx)


class _StartSpy(pl.Callback):
    def __init__(self, accountant: EffectiveBatchAccountant) -> None:
        self.accountant = accountant
        self.live: list[bool] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.live.append(callable(self.accountant.on_train_batch_start))


@pytest.mark.parametrize("module", [TinyCausalLM, PopsTheMask, ZeroesTheMaskInPlace])
def test_tokens_are_read_where_the_step_cannot_have_changed_them(
    make_trainer: Any, module: type[TinyCausalLM]
) -> None:
    # After three micro-batches whose fields the step left alone, the accountant reads them
    # at the batch end only (its start hook muted); a step that changes them keeps the
    # reading at the start, so the tokens are those the loader gave.
    datamodule = InstructionDataModule(dataset_size=48, batch_size=4, seed=3)
    accountant = EffectiveBatchAccountant()
    spy = _StartSpy(accountant)
    trainer = make_trainer(max_steps=-1, max_epochs=1, callbacks=[accountant, spy])
    trainer.fit(module(d_model=16, n_heads=2, n_layers=1), datamodule=datamodule)
    loader = list(datamodule.train_dataloader())
    masks = [int(batch["attention_mask"].sum()) for batch in loader]
    # The cropped mask would count fewer tokens: a reading at the end would be wrong.
    assert sum(int(batch["attention_mask"][:, -1].sum()) for batch in loader) > 0
    assert updates_table(accountant)["tokens"].tolist() == masks
    assert accountant.summary["tokens_seen"] == sum(masks)
    if module is TinyCausalLM:
        assert spy.live == [True, True, False] + [False] * (len(masks) - 3)
    else:
        assert spy.live == [True] * len(masks)


@pytest.mark.distributed
def test_two_process_ddp_counts_both_replicas(tmp_path: Path) -> None:
    # 21 examples on 2 replicas: 11 each (one padding duplicate), micro-batches of 2, K=2:
    # 6 micro-batches per replica -> 3 updates of up to 2 x 2 x 2 = 8 examples.
    result = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), "21", "2", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summaries = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for summary in summaries:
        assert summary["dp_replicas"] == 2
        assert summary["effective_batch_size"] == 8  # doubled by the second replica
        assert summary["planned_updates"] == summary["updates_done"] == 3
        assert summary["examples_seen"] == 22  # 21 examples + 1 padding duplicate
        assert summary["padding_duplicates"] == 1
        assert "padding_duplicates" in [flag["flag"] for flag in summary["flags"]]
    assert summaries[0]["line"] == summaries[1]["line"]
    assert summaries[0]["ledger_fields"]["examples_seen"] == 22
    assert "8 examples per update (2 x 2 x 2 replicas)" in summaries[0]["line"]

    folder = next((tmp_path / "pilot" / "runs").iterdir()) / "updates.parquet"
    table = storage.read_snapshot_table(folder, UPDATES_SCHEMA).to_pandas()
    assert sorted(table["rank"]) == [0, 0, 0, 1, 1, 1]
    per_update = table.groupby("update")
    assert per_update["examples"].sum().tolist() == [8, 8, 6]
    assert per_update["examples_all_ranks"].nunique().eq(1).all()
    assert per_update["examples_all_ranks"].first().tolist() == [8, 8, 6]
    # Rank 1's last sample is example 0 again: the duplicate is in the last update.
    duplicates = table.set_index(["update", "rank"])["padding_duplicates"]
    assert duplicates.to_dict() == {
        (1, 0): 0,
        (1, 1): 0,
        (2, 0): 0,
        (2, 1): 0,
        (3, 0): 0,
        (3, 1): 1,
    }
    assert (table["world_size"] == 2).all()
    assert (table["dp_replicas"] == 2).all()

    # The checkpoint of update 2 was saved mid-epoch; its counts cover both ranks (2 x 8),
    # not rank 0's 8, and load without unsafe globals.
    [checkpoint] = (tmp_path / "ckpt").glob("*step=2*.ckpt")
    saved = torch.load(checkpoint, weights_only=True)["callbacks"][summaries[0]["state_key"]]
    assert saved["counts"]["updates"] == 2
    assert saved["counts"]["examples"] == 16
    assert saved["counts"]["micro_batches"] == 8


@pytest.mark.distributed
def test_a_failing_ddp_fit_keeps_unsummed_rows_without_a_collective(tmp_path: Path) -> None:
    # 41 examples, micro-batches of 2, K=1: a checkpoint at update 2 sums updates 1-2 over
    # both ranks; every rank then fails at update 3, whose row was not summed yet.
    result = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), "41", "2", "1", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=False,
    )
    assert result.returncode != 0
    assert "ArithmeticError: user bug at step 3" in result.stderr
    summary = json.loads((tmp_path / "rank0.json").read_text())
    assert summary["updates_done"] == 3
    assert summary["examples_seen"] is None  # update 3 was never summed: unknown, not 8
    assert summary["ledger_fields"]["updates_done"] == 3
    assert summary["ledger_fields"]["examples_seen"] is None

    folder = next((tmp_path / "pilot" / "runs").iterdir()) / "updates.parquet"
    table = storage.read_snapshot_table(folder, UPDATES_SCHEMA).to_pandas()
    rank0 = table[table["rank"] == 0].sort_values("update")
    assert rank0["update"].tolist() == [1, 2, 3]
    assert rank0["examples"].tolist() == [2, 2, 2]
    assert rank0["examples_all_ranks"].tolist()[:2] == [4, 4]
    assert pd.isna(rank0["examples_all_ranks"].iloc[2])
    assert "not summed over ranks" in rank0["notes"].iloc[2]


# ---------------------------------------------------------------------------------------------
# Flags: GradScaler, K changing, shortfall
# ---------------------------------------------------------------------------------------------


def test_steps_skipped_by_a_grad_scaler_are_flagged(
    make_trainer: Any, caught: list[warnings.WarningMessage]
) -> None:
    accountant = EffectiveBatchAccountant()
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    trainer = make_trainer(
        max_steps=6,
        callbacks=[accountant],
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )
    trainer.fit(Regression(inf_at=(2, 4)), loader(40, 2))

    table = updates_table(accountant)
    assert trainer.global_step == 6  # Lightning counts the skipped steps anyway
    assert table["optimizer_stepped"].tolist() == [True, True, False, True, False, True]
    assert accountant.summary["skipped_updates"] == 2
    assert any("skipped 2 optimizer step(s) (first: update 3)" in m for m in ours(caught))


def test_k_changing_mid_run_is_planned_and_flagged(
    make_trainer: Any, caught: list[warnings.WarningMessage]
) -> None:
    accountant = EffectiveBatchAccountant(keep="epochs")
    trainer = make_trainer(
        max_steps=-1,
        max_epochs=2,
        callbacks=[accountant, GradientAccumulationScheduler({1: 2})],
    )
    trainer.fit(Regression(), loader(8, 2))

    table = updates_table(accountant)
    assert table["accumulate_grad_batches"].tolist() == [1, 1, 1, 1, 2, 2]
    assert table["examples"].tolist() == [2, 2, 2, 2, 4, 4]
    plan = accountant.plan
    assert plan is not None
    assert plan.total_updates == 6
    summary = accountant.summary
    assert summary["estimated_stepping_batches"] == 8  # Lightning ignores the schedule
    assert (summary["kept_planned"], summary["kept_done"]) == (2, 2)
    assert any("estimated_stepping_batches is 8 but the plan is 6" in m for m in ours(caught))
    assert any("changed during the run (1 -> 2 from update 5)" in m for m in ours(caught))


def test_a_run_stopped_early_falls_short_of_the_kept_updates(
    make_trainer: Any, caught: list[warnings.WarningMessage]
) -> None:
    accountant = EffectiveBatchAccountant(keep="updates")
    trainer = make_trainer(max_steps=-1, max_epochs=1, callbacks=[accountant])
    trainer.fit(Regression(stop_at=3), loader(20, 2))
    summary = accountant.summary
    assert (summary["planned_updates"], summary["updates_done"]) == (10, 3)
    assert "keeps updates: 3 of 10" in summary["line"]
    assert any("keeps updates: planned 10, done 3" in m for m in ours(caught))
    assert accountant.run.ledger_fields["updates_done"] == 3


# ---------------------------------------------------------------------------------------------
# Composability
# ---------------------------------------------------------------------------------------------


def test_fast_dev_run_with_accumulation(
    make_trainer: Any, caught: list[warnings.WarningMessage]
) -> None:
    accountant = EffectiveBatchAccountant()
    trainer = make_trainer(
        fast_dev_run=3, max_steps=-1, accumulate_grad_batches=2, callbacks=[accountant]
    )
    trainer.fit(Regression(), loader(64, 2))
    table = updates_table(accountant)
    assert table["micro_batches"].tolist() == [2, 1]
    plan = accountant.plan
    assert plan is not None
    assert plan.total_updates == 2
    assert accountant.summary["updates_done"] == 2
    assert accountant.summary["examples_seen"] == 6
    assert [m for m in ours(caught) if "1 of 2 update(s) stepped an incomplete" in m]


def test_overfit_batches_and_validation_interval(make_trainer: Any) -> None:
    accountant = EffectiveBatchAccountant()
    trainer = make_trainer(
        max_steps=-1,
        max_epochs=3,
        overfit_batches=2,
        accumulate_grad_batches=2,
        callbacks=[accountant],
    )
    trainer.fit(Regression(), loader(40, 4))
    assert accountant.summary["updates_done"] == 3
    assert accountant.summary["examples_seen"] == 3 * 2 * 4
    assert accountant.summary["flags"] == []

    again = EffectiveBatchAccountant()
    trainer = make_trainer(
        max_steps=-1, max_epochs=1, val_check_interval=3, callbacks=[again], logger=True
    )

    class WithValidation(Regression):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val", self.training_step(batch, batch_idx))

    trainer.fit(WithValidation(), loader(20, 2), loader(6, 2))
    assert again.summary["updates_done"] == 10
    assert again.summary["examples_seen"] == 20


def test_drop_last_loader_and_plan_agree(
    make_trainer: Any, caught: list[warnings.WarningMessage]
) -> None:
    accountant = EffectiveBatchAccountant()
    trainer = make_trainer(
        max_steps=-1, max_epochs=2, accumulate_grad_batches=2, callbacks=[accountant]
    )
    trainer.fit(Regression(), loader(11, 2, drop_last=True))
    plan = accountant.plan
    assert plan is not None
    assert (plan.total_updates, plan.examples_seen) == (6, 20)
    summary = accountant.summary
    assert (summary["updates_done"], summary["examples_seen"]) == (6, 20)
    # 5 full micro-batches per epoch with K=2: each epoch ends with a lone micro-batch.
    assert [m for m in ours(caught) if "2 of 6 update(s) stepped an incomplete" in m]


def test_the_first_batch_gives_the_micro_batch_when_the_loader_does_not(
    make_trainer: Any,
) -> None:
    data = TensorDataset(torch.randn(12, 2), torch.randn(12))
    batches = torch.utils.data.BatchSampler(
        torch.utils.data.SequentialSampler(data), batch_size=3, drop_last=False
    )
    accountant = EffectiveBatchAccountant()
    trainer = make_trainer(max_steps=-1, max_epochs=1, callbacks=[accountant])
    trainer.fit(Regression(), DataLoader(data, batch_sampler=batches))
    assert accountant.summary["micro_batch_size"] == 3
    assert accountant.run.ledger_fields["effective_batch_size"] == 3
    assert accountant.summary["updates_done"] == 4


class Stream(torch.utils.data.IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(10):
            yield torch.randn(2), torch.randn(())


def test_an_iterable_dataset_is_counted_without_a_plan(make_trainer: Any) -> None:
    accountant = EffectiveBatchAccountant()
    trainer = make_trainer(max_steps=3, callbacks=[accountant])
    trainer.fit(Regression(), DataLoader(Stream(), batch_size=2))
    assert accountant.plan is None
    summary = accountant.summary
    assert summary["planned_updates"] == 3  # Lightning's estimate: max_steps
    assert (summary["updates_done"], summary["examples_seen"]) == (3, 6)
    notes = [flag["detail"] for flag in summary["flags"] if flag["flag"] == "note"]
    assert notes == ["the training sampler has no length: no plan"]


def test_resume_continues_the_counts(make_trainer: Any, tmp_path: Path) -> None:
    first = EffectiveBatchAccountant()
    trainer = make_trainer(max_steps=3, accumulate_grad_batches=2, callbacks=[first])
    trainer.fit(Regression(), loader(20, 2))
    checkpoint = tmp_path / "step3.ckpt"
    trainer.save_checkpoint(checkpoint)

    second = EffectiveBatchAccountant()
    trainer = make_trainer(max_steps=8, accumulate_grad_batches=2, callbacks=[second])
    trainer.fit(Regression(), loader(20, 2), ckpt_path=checkpoint)

    assert second.run.run_id == first.run.run_id
    assert second.run.attempt == 2
    summary = second.summary
    assert (summary["updates_done"], summary["examples_seen"]) == (8, 32)
    assert summary["micro_batches"] == 16
    assert summary["flags"] == []
    table = updates_table(second)
    assert table["update"].tolist() == list(range(1, 9))
    assert table["attempt"].tolist() == [1, 1, 1, 2, 2, 2, 2, 2]
    assert second.run.ledger_fields["examples_seen"] == 32


def test_resume_from_a_checkpoint_without_counts_says_so(make_trainer: Any, tmp_path: Path) -> None:
    trainer = make_trainer(max_steps=3)
    trainer.fit(Regression(), loader(20, 2))
    checkpoint = tmp_path / "plain.ckpt"
    trainer.save_checkpoint(checkpoint)

    accountant = EffectiveBatchAccountant()
    trainer = make_trainer(max_steps=5, callbacks=[accountant])
    trainer.fit(Regression(), loader(20, 2), ckpt_path=checkpoint)
    summary = accountant.summary
    assert summary["updates_done"] == 5
    assert summary["examples_seen"] is None  # unknown before the resume: null, not 4
    notes = [flag["detail"] for flag in summary["flags"] if flag["flag"] == "note"]
    assert any(
        "resumed at update 3 from a checkpoint without accountant counts" in n for n in notes
    )
    assert updates_table(accountant)["update"].tolist() == [4, 5]


def test_the_users_exception_propagates_and_rows_are_kept(make_trainer: Any) -> None:
    accountant = EffectiveBatchAccountant()
    trainer = make_trainer(max_steps=10, callbacks=[accountant])
    with pytest.raises(ArithmeticError, match="user bug at step 3"):
        trainer.fit(Failing(), loader(40, 2))
    assert accountant.run.closed
    table = updates_table(accountant)
    assert table["update"].tolist() == [1, 2, 3]
    assert accountant.summary["updates_done"] == 3
    assert accountant.run.ledger_fields["examples_seen"] == 6


def test_a_custom_adapter_reads_other_batches(make_trainer: Any) -> None:
    class DictModel(Regression):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return super().training_step((batch["features"], batch["target"]), batch_idx)

    def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {
            "features": torch.stack([x for x, _ in items]),
            "target": torch.stack([y for _, y in items]),
        }

    data = TensorDataset(torch.randn(6, 2), torch.randn(6))
    accountant = EffectiveBatchAccountant(adapter=BatchAdapter(inputs="features"))
    trainer = make_trainer(max_steps=-1, max_epochs=1, callbacks=[accountant])
    trainer.fit(DictModel(), DataLoader(data, batch_size=2, collate_fn=collate))
    assert accountant.summary["examples_seen"] == 6


def test_state_keys_differ_per_configuration() -> None:
    assert EffectiveBatchAccountant().state_key != EffectiveBatchAccountant(keep="epochs").state_key


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"keep": "steps"}, ValueError, r"keep='steps'.*'updates', 'examples', 'epochs'"),
        ({"adapter": "ids"}, TypeError, r"adapter='ids'.*BatchAdapter"),
        ({"token_spread_ratio": 0.5}, ValueError, r"token_spread_ratio=0.5.*>= 1"),
        ({"token_spread_ratio": float("nan")}, ValueError, r"token_spread_ratio=nan"),
        ({"token_spread_ratio": "2"}, TypeError, r"token_spread_ratio='2'"),
        ({"keep": None}, TypeError, r"keep=None\) is invalid: expected one of"),
    ],
)
def test_bad_arguments_fail_at_construction(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        EffectiveBatchAccountant(**kwargs)


@pytest.mark.parametrize("value", [float("inf"), pytest.param(10**400, id="10**400")])
def test_token_spread_ratio_must_be_finite(value: float) -> None:
    with pytest.raises(ValueError, match=r"EffectiveBatchAccountant\(token_spread_ratio=.*finite"):
        EffectiveBatchAccountant(token_spread_ratio=value)


def test_a_loader_that_refills_one_mask_buffer_is_counted_batch_by_batch(
    make_trainer: Any,
) -> None:
    class Refilling:
        """Yields the same mask tensor every time, refilled in place (a ring-buffer loader)."""

        def __init__(self) -> None:
            self.mask = torch.zeros(2, 4, dtype=torch.long)
            self.x = torch.randn(2, 4)

        def __iter__(self) -> Any:
            for real in (1, 2, 3, 4):
                self.mask.zero_()
                self.mask[:, :real] = 1
                yield {"inputs": self.x, "attention_mask": self.mask, "y": torch.zeros(2)}

        def __len__(self) -> int:
            return 4

    class Model(Regression):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            out = self.layer(batch["inputs"]).squeeze(-1)
            return torch.nn.functional.mse_loss(out, batch["y"])

    accountant = EffectiveBatchAccountant()
    trainer = make_trainer(max_steps=-1, max_epochs=1, callbacks=[accountant])
    trainer.fit(Model(), Refilling())
    # 2 sequences x (1 + 2 + 3 + 4) real tokens, whatever the buffer holds at the flush.
    assert accountant.summary["tokens_seen"] == 20
    assert updates_table(accountant)["tokens"].tolist() == [2, 4, 6, 8]
