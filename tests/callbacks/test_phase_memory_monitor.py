"""PhaseMemoryMonitor in real CPU fits: rows per phase, real byte counts, checks that catch bugs."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pandas as pd
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_pilot import PhaseCheckError, PhaseMemoryMonitor, read_phase_table
from lightning_pilot.storage import PHASE_SCHEMA

VOCAB = 50


class TokenData(Dataset[dict[str, torch.Tensor]]):
    """Token sequences of one fixed length, with ids; made from a seed."""

    def __init__(self, size: int, seq_len: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(1, VOCAB, (size, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.tokens[index]
        return {"ids": torch.tensor(index), "input_ids": row, "labels": row.roll(-1)}


class TokenModel(pl.LightningModule):
    """A tiny next-token model whose activations grow with the sequence length."""

    def __init__(
        self,
        *,
        train_len: int = 8,
        val_len: int = 8,
        val_size: int = 8,
        val_drop_last: bool = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.hidden = nn.Linear(32, 64)
        self.head = nn.Linear(64, VOCAB)
        self.train_len, self.val_len = train_len, val_len
        self.val_size, self.val_drop_last = val_size, val_drop_last

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.embed(tokens))))

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self(batch["input_ids"])
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch["input_ids"]).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TokenData(64, self.train_len), batch_size=4)

    def val_dataloader(self) -> DataLoader[Any]:
        data = TokenData(self.val_size, self.val_len, seed=1)
        return DataLoader(data, batch_size=4, drop_last=self.val_drop_last)

    def test_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TokenData(8, self.train_len, seed=2), batch_size=4)

    def predict_dataloader(self) -> DataLoader[Any]:
        return self.test_dataloader()


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def _fit(make_trainer: Any, model: pl.LightningModule, **options: Any) -> pd.DataFrame:
    monitor = options.pop("monitor", None) or PhaseMemoryMonitor()
    callbacks = [monitor, *options.pop("extra_callbacks", [])]
    ckpt_path = options.pop("ckpt_path", None)
    trainer = make_trainer(callbacks=callbacks, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, ckpt_path=ckpt_path)
    return read_phase_table(monitor.run.run_dir)


def _row(frame: pd.DataFrame, phase: str, first: bool = True) -> pd.Series:
    rows = frame[(frame["phase"] == phase) & (frame["first"] == first)]
    assert len(rows) == 1, f"expected one {phase} row with first={first}, got {len(rows)}"
    return rows.iloc[0]


def _check(row: pd.Series, name: str) -> dict[str, str]:
    found = [c for c in row["checks"] if c["name"] == name]
    assert found, f"no check {name!r} in {row['checks']}"
    return dict(found[0])


def test_adamw_first_step_allocates_two_moments(make_trainer: Any) -> None:
    model = TokenModel()
    frame = _fit(make_trainer, model, max_steps=4, limit_val_batches=0)
    trainable = _param_bytes(model)
    n_tensors = len(list(model.parameters()))
    first = _row(frame, "optimizer_step")
    later = _row(frame, "optimizer_step", first=False)
    # AdamW keeps exp_avg and exp_avg_sq (2 x the parameter bytes) and one float32 step each.
    assert first["optimizer_state_bytes"] == 2 * trainable + 4 * n_tensors
    assert later["optimizer_state_bytes"] == first["optimizer_state_bytes"]
    assert _row(frame, "setup")["optimizer_state_bytes"] == 0  # a measured zero: no state yet
    assert _row(frame, "setup")["param_bytes"] == trainable
    assert first["grad_bytes"] == trainable
    # The first update's peak holds the weights, the gradients and the new moments at once.
    assert first["peak_allocated_bytes"] >= 4 * trainable
    assert first["peak_allocated_bytes"] > _row(frame, "forward")["peak_allocated_bytes"]
    assert first["counter"] == "cpu_tensor_tracker"
    assert first["device"] == "cpu"
    assert pd.isna(first["peak_reserved_bytes"])  # no caching allocator on CPU: null, not 0
    assert first["host_rss_bytes"] > 0
    assert set(frame["verdict"]) == {"pass"}


def test_longer_validation_sequences_show_a_larger_peak(make_trainer: Any) -> None:
    frame = _fit(
        make_trainer,
        TokenModel(train_len=8, val_len=256),
        max_steps=3,
        val_check_interval=2,
        limit_val_batches=1.0,
    )
    validation = _row(frame, "validation")
    forward = _row(frame, "forward", first=False)
    assert validation["seq_len"] == 256
    assert forward["seq_len"] == 8
    activations_val = validation["peak_allocated_bytes"] - validation["baseline_allocated_bytes"]
    activations_fwd = forward["peak_allocated_bytes"] - forward["baseline_allocated_bytes"]
    assert activations_val > 10 * activations_fwd
    assert (
        validation["peak_allocated_bytes"] > _row(frame, "optimizer_step")["peak_allocated_bytes"]
    )
    assert _check(validation, "outputs_complete")["verdict"] == "pass"


class FrozenBeforeTheFit(TokenModel):
    """A whole layer frozen before the fit, yet still handed to the optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden.requires_grad_(False)


def test_layer_frozen_before_the_fit_in_the_optimizer_warns_naming_it(make_trainer: Any) -> None:
    # torch's optimizers skip a parameter whose .grad is None: the run trains what is
    # trainable, so a frozen layer in the optimizer is named (it may be a mistake), not failed.
    frame = _fit(make_trainer, FrozenBeforeTheFit(), max_steps=3, limit_val_batches=0)
    for first in (True, False):
        backward = _row(frame, "backward", first=first)
        assert backward["verdict"] == "warn"
        check = _check(backward, "trainable_params_require_grad")
        # hidden: 2,112 of the 6,962 optimized elements (embed 1,600, head 3,250).
        assert check == {
            "name": "trainable_params_require_grad",
            "verdict": "warn",
            "detail": "2 parameter(s) frozen before the fit (requires_grad=False, 30.3% of the"
            " optimized elements) are in the optimizer, in 1 frozen submodule(s): hidden; torch"
            " skips them; if intended (adapter training, a frozen tower) nothing to do; otherwise"
            " set requires_grad=True before the fit",
        }
    # Frozen parameters must not move: they did not, so that check passes.
    assert _check(_row(frame, "optimizer_step"), "frozen_params_unchanged")["verdict"] == "pass"


class FreezesMidFit(TokenModel):
    """A layer trainable when training starts is switched off after the first batch, and stays
    in the optimizer: it stops learning mid-fit."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.hidden.requires_grad_(False)


def test_layer_frozen_mid_fit_fails_backward(make_trainer: Any) -> None:
    frame = _fit(make_trainer, FreezesMidFit(), max_steps=3, limit_val_batches=0)
    assert _check(_row(frame, "backward"), "trainable_params_require_grad")["verdict"] == "pass"
    later = _row(frame, "backward", first=False)
    assert later["verdict"] == "fail"
    assert _check(later, "trainable_params_require_grad")["detail"] == (
        "2 parameter(s) were trainable at the first backward of the fit, are in the optimizer and"
        " now have requires_grad=False, so they stopped learning mid-fit: hidden.weight,"
        " hidden.bias; find the hook or callback that froze them, or, if freezing them was"
        " meant, take them out of the optimizer"
    )


class OptimizesOnlyTheFrozenLayer(FrozenBeforeTheFit):
    """The optimizer is given the frozen layer only: nothing it updates can learn."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.hidden.parameters(), lr=1e-2)


def test_optimizer_with_nothing_that_learns_fails_backward(make_trainer: Any) -> None:
    frame = _fit(make_trainer, OptimizesOnlyTheFrozenLayer(), max_steps=2, limit_val_batches=0)
    backward = _row(frame, "backward")
    assert backward["verdict"] == "fail"
    detail = _check(backward, "trainable_params_require_grad")["detail"]
    assert detail.startswith(
        "every parameter of the optimizer has requires_grad=False: nothing it updates can learn;"
        " set requires_grad=True on what should train before the fit (or give the optimizer the"
        " parameters that train); 2 parameter(s) frozen before the fit (requires_grad=False,"
        " 100.0% of the optimized elements)"
    )
    # What does learn has no optimizer: said too.
    stray = _check(backward, "grads_without_optimizer")
    assert stray["detail"].endswith(": embed.weight, head.weight, head.bias")


class DetachedHead(TokenModel):
    """The loss is computed on detached hidden features: the lower layers never learn."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.embed(tokens))).detach())


def test_detached_layers_get_no_gradient_and_do_not_change(make_trainer: Any) -> None:
    frame = _fit(make_trainer, DetachedHead(), max_steps=3, limit_val_batches=0)
    missing = _check(_row(frame, "backward"), "grads_reach_params")
    assert missing["verdict"] == "fail"
    assert "embed.weight" in missing["detail"]
    assert "head.weight" not in missing["detail"]
    # AdamW with weight decay still moves them; plain SGD would not: the update check sees it.


class TrainModeInValidation(TokenModel):
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.train()  # the planted bug: dropout/batch-norm would behave as in training
        return self.loss(batch)


def test_train_mode_without_mode_dependent_layers_warns(make_trainer: Any) -> None:
    # Embedding and Linear compute the same in both modes: no output changes, so a warning
    # naming the modules (code that branches on self.training would still change), not a fail.
    frame = _fit(make_trainer, TrainModeInValidation(), max_steps=3, val_check_interval=2)
    validation = _row(frame, "validation")
    assert validation["verdict"] == "warn"
    detail = _check(validation, "eval_mode")["detail"]
    assert detail.startswith("4 module(s) in train mode during validation, none of a type known")
    assert "<root> (TrainModeInValidation), embed (Embedding), hidden (Linear)" in detail
    assert "separate its settings from training's" in validation["reason"]


class ForgetsEvalGPT2(pl.LightningModule):
    """A Hugging Face GPT-2 whose validation forgets eval mode (its dropout stays on)."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.GPT2Config(
            n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=32
        )
        self.model = transformers.GPT2LMHeadModel(config)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"])
        return out.loss  # type: ignore[no-any-return]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def on_validation_start(self) -> None:
        self.model.train()  # the planted bug, as in a real user module

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TokenData(16, 8), batch_size=4)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TokenData(8, 8, seed=1), batch_size=4)


def test_hugging_face_model_left_in_train_mode_names_its_dropout_first(
    make_trainer: Any,
) -> None:
    model = ForgetsEvalGPT2()
    frame = _fit(make_trainer, model, max_steps=2, val_check_interval=2)
    validation = _row(frame, "validation")
    assert validation["verdict"] == "fail"
    detail = _check(validation, "eval_mode")["detail"]
    # What Lightning would have switched off: every Dropout with p > 0 of the HF model.
    dropouts = [
        name
        for name, module in model.named_modules(prefix="")
        if isinstance(module, nn.Dropout) and module.p > 0
    ]
    assert len(dropouts) == 4
    listed = ", ".join(f"{name} (Dropout)" for name in dropouts)
    assert detail.startswith(
        f"4 module(s) whose outputs change in train mode during validation: {listed}; "
    )
    # HF's own leaf layers (Conv1D, its GELU) are unknown to torch: listed after, with types.
    assert "5 more leaf module(s) of types not known to be mode-independent:" in detail
    assert "model.transformer.h.0.attn.c_attn (Conv1D)" in detail
    # Every HF module is in train mode; the containers and torch's own layers are counted only.
    in_train = sum(1 for _ in model.model.modules())
    assert detail.endswith(f"; {in_train} module(s) in train mode in all")
    names = re.findall(r"(?:^|: |, )([\w.<>]+) \(", detail)
    assert "model" not in names
    assert "model.lm_head" not in names
    assert "model.transformer" not in names
    # The outputs do change: the same batch gives another loss in train mode.
    batch = next(iter(model.val_dataloader()))
    model.model.eval()
    with torch.no_grad():
        eval_loss = model.loss(batch)
        assert torch.equal(eval_loss, model.loss(batch))
        model.model.train()
        assert not torch.equal(eval_loss, model.loss(batch))


class NanLoss(TokenModel):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(batch) * float("nan")


def test_nan_forward_fails_forward(make_trainer: Any) -> None:
    frame = _fit(make_trainer, NanLoss(), max_steps=2, limit_val_batches=0)
    forward = _row(frame, "forward")
    assert _check(forward, "loss_finite") == {
        "name": "loss_finite",
        "verdict": "fail",
        "detail": "loss is nan",
    }
    assert "inspect the reduced batch and the values" in forward["reason"]
    assert _check(_row(frame, "backward"), "grads_finite")["verdict"] == "fail"


def test_dropped_validation_remainder_fails(make_trainer: Any) -> None:
    model = TokenModel(val_size=10, val_drop_last=True)  # batches of 4: 2 samples dropped
    frame = _fit(make_trainer, model, max_steps=3, val_check_interval=2, limit_val_batches=1.0)
    check = _check(_row(frame, "validation"), "outputs_complete")
    assert check["verdict"] == "fail"
    assert check["detail"].startswith("8 samples validated, expected 10")


def test_on_fail_raise_stops_the_fit_and_keeps_the_table(make_trainer: Any) -> None:
    monitor = PhaseMemoryMonitor(on_fail="raise")
    trainer = make_trainer(callbacks=[monitor], max_steps=5, limit_val_batches=0)
    with pytest.raises(
        PhaseCheckError, match=r"forward failed at step 0: loss_finite: loss is nan"
    ):
        trainer.fit(NanLoss())
    frame = read_phase_table(monitor.run.run_dir)
    assert _row(frame, "forward")["verdict"] == "fail"


def test_every_phase_round_trips_with_every_column(make_trainer: Any, tmp_path: Path) -> None:
    exported: list[Path] = []

    def export(module: pl.LightningModule, directory: Path) -> Path:
        path = directory / "model.pt"
        torch.save(module.state_dict(), path)
        exported.append(path)
        return path

    monitor = PhaseMemoryMonitor(export=export)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(
        callbacks=[monitor, checkpoint],
        max_steps=4,
        val_check_interval=2,
        enable_checkpointing=True,
    )
    model = TokenModel()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
        trainer.save_checkpoint(tmp_path / "manual.ckpt")  # after the fit: not measured
        trainer.test(model)
        trainer.predict(model)
    frame = read_phase_table(monitor.run.run_dir)
    assert list(frame.columns) == PHASE_SCHEMA.names
    assert frame["run_id"].nunique() == 1  # test and predict joined the fit's run
    assert {
        "setup", "data", "forward", "backward", "optimizer_step", "validation",
        "checkpoint_save", "test", "predict", "export",
    } <= set(frame["phase"])  # fmt: skip
    saves = frame[frame["phase"] == "checkpoint_save"]
    assert saves["occurrences"].sum() == 2  # steps 2 and 4 by ModelCheckpoint
    assert (saves["file_bytes"] > 0).all()
    export_row = _row(frame, "export")
    assert export_row["file_bytes"] == exported[0].stat().st_size
    assert _check(_row(frame, "test"), "outputs_complete")["detail"] == "8 samples"
    assert _row(frame, "predict")["verdict"] == "pass"
    placement = pd.read_parquet(monitor.run.run_dir / "placement.parquet")
    first_update = placement[placement["moment"] == "after_first_update"]
    assert set(first_update["kind"]) == {"param", "grad", "optimizer_state"}
    assert set(placement["device"]) == {"cpu"}
    by_kind = first_update.set_index("kind")["bytes"]
    assert by_kind["grad"] == by_kind["param"] == _param_bytes(model)


def test_resume_measures_the_checkpoint_load(make_trainer: Any, tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    first = _fit(
        make_trainer,
        TokenModel(),
        max_steps=2,
        limit_val_batches=0,
        enable_checkpointing=True,
        extra_callbacks=[checkpoint],
    )
    resumed = _fit(
        make_trainer,
        TokenModel(),
        max_steps=4,
        limit_val_batches=0,
        ckpt_path=tmp_path / "ckpt" / "epoch=0-step=2.ckpt",
    )
    assert resumed["run_id"].unique().tolist() == first["run_id"].unique().tolist()
    second = resumed[resumed["attempt"] == 2]
    load = _row(second, "checkpoint_load")
    assert load["file_bytes"] == (tmp_path / "ckpt" / "epoch=0-step=2.ckpt").stat().st_size
    assert load["duration_s"] > 0
    # After the restore the optimizer state is back from the first update of attempt 2 on.
    assert _row(second, "optimizer_step")["step_first"] == 2


def test_accumulation_counts_micro_batches_and_updates(make_trainer: Any) -> None:
    frame = _fit(
        make_trainer, TokenModel(), max_steps=3, accumulate_grad_batches=2, limit_val_batches=0
    )
    forwards = frame[frame["phase"] == "forward"]["occurrences"].sum()
    updates = frame[frame["phase"] == "optimizer_step"]["occurrences"].sum()
    assert (forwards, updates) == (6, 3)
    assert set(frame["verdict"]) == {"pass"}


def test_sampling_after_the_pilot_window(make_trainer: Any) -> None:
    monitor = PhaseMemoryMonitor(pilot_updates=2, sample_every=3)
    frame = _fit(make_trainer, TokenModel(), max_steps=11, limit_val_batches=0, monitor=monitor)
    steps = frame[frame["phase"] == "optimizer_step"]
    assert steps["occurrences"].sum() == 11
    # Updates 0 and 1 (pilot window), then one in three: 4, 7, 10.
    assert steps["measured_occurrences"].sum() == 5
    silent = PhaseMemoryMonitor(pilot_updates=2, sample_every=0)
    frame = _fit(make_trainer, TokenModel(), max_steps=6, limit_val_batches=0, monitor=silent)
    assert frame[frame["phase"] == "optimizer_step"]["measured_occurrences"].sum() == 2


class _AfterBackwardSpy(pl.Callback):
    """Per update: which of the monitor's hooks Lightning still dispatched, and whether the
    optimizer still carried the monitor's step post-hook."""

    def __init__(self, monitor: PhaseMemoryMonitor) -> None:
        self.monitor = monitor
        self.live: dict[int, bool] = {}
        self.hooks: dict[int, tuple[bool, ...]] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        self.live[trainer.global_step] = callable(self.monitor.on_after_backward)
        names = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step")
        post_hooks = trainer.optimizers[0]._optimizer_step_post_hooks.values()
        self.hooks[trainer.global_step] = (
            *(callable(getattr(self.monitor, name)) for name in names),
            any(getattr(h, "__self__", None) is self.monitor for h in post_hooks),
        )


def test_sampling_with_accumulation_and_validation_in_between(make_trainer: Any) -> None:
    monitor = PhaseMemoryMonitor(pilot_updates=2, sample_every=3)
    spy = _AfterBackwardSpy(monitor)
    frame = _fit(
        make_trainer, TokenModel(), max_steps=11, accumulate_grad_batches=2,
        val_check_interval=6, limit_val_batches=1, monitor=monitor, extra_callbacks=[spy],
    )  # fmt: skip
    counts = frame.groupby("phase")["occurrences"].sum()
    measured = frame.groupby("phase")["measured_occurrences"].sum()
    # Every micro-batch and update counted, quiet ones in bulk; validation runs three times
    # (after 3, 6 and 9 updates) without moving the sampled updates 0, 1, 4, 7 and 10.
    assert (counts["forward"], counts["backward"], counts["optimizer_step"]) == (22, 22, 11)
    assert measured["optimizer_step"] == 5
    assert counts["validation"] == 3
    # Lightning dispatches on_after_backward only in measured updates.
    assert [step for step, live in sorted(spy.live.items()) if live] == [0, 1, 4, 7, 10]
    # The other per-update hooks and the optimizer post-hook too: between measured updates
    # only the batch end runs (it counts).
    for step, live in spy.hooks.items():
        assert live == (spy.live[step],) * 4, step


class SometimesNoLoss(TokenModel):
    """Returns no loss on every third batch: Lightning skips that backward and step."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        return None if batch_idx % 3 == 2 else self.loss(batch)


def test_quiet_updates_count_skipped_backwards_and_steps(make_trainer: Any) -> None:
    monitor = PhaseMemoryMonitor(pilot_updates=2, sample_every=4)
    frame = _fit(
        make_trainer, SometimesNoLoss(), max_steps=12, limit_val_batches=0, monitor=monitor
    )
    counts = frame.groupby("phase")["occurrences"].sum()
    # 12 optimizer steps (Lightning steps even without a loss: global_step counts every
    # optimizer.step); 12 forwards; batches 2, 5, 8 and 11 ran no backward.
    assert (counts["forward"], counts["backward"], counts["optimizer_step"]) == (12, 8, 12)


def test_manual_optimisation_counts_between_measured_updates(make_trainer: Any) -> None:
    # 10 batches of two optimizer steps each: global_step moves 0, 2, 4, ... 20. Measured: the
    # window (steps 0 and 1: the first batch), then the batch that starts at or past each due
    # step (5, 9, 13, 17: the batches starting at 6, 10, 14 and 18), never skipped because
    # global_step jumped over the exact step.
    monitor = PhaseMemoryMonitor(pilot_updates=2, sample_every=4)
    frame = _fit(make_trainer, TinyGAN(), max_steps=20, limit_val_batches=0, monitor=monitor)
    counts = frame.groupby("phase")["occurrences"].sum()
    measured = frame.groupby("phase")["measured_occurrences"].sum()
    assert (counts["forward"], counts["backward"], counts["optimizer_step"]) == (10, 20, 20)
    assert (measured["forward"], measured["backward"], measured["optimizer_step"]) == (5, 10, 10)
    assert set(frame["verdict"]) == {"pass"}


@pytest.mark.parametrize(
    "options",
    [
        {"fast_dev_run": 2},
        {"logger": False, "max_steps": 2},
        {"val_check_interval": 2, "max_steps": 4},
        {"precision": "bf16-mixed", "max_steps": 2, "limit_val_batches": 0},
        {"overfit_batches": 2, "max_steps": 2},
    ],
    ids=["fast_dev_run", "no_logger", "val_every_2", "bf16_mixed", "overfit_batches"],
)
def test_composes_with_trainer_options(make_trainer: Any, options: dict[str, Any]) -> None:
    frame = _fit(make_trainer, TokenModel(), **options)
    assert {"setup", "forward", "backward", "optimizer_step"} <= set(frame["phase"])
    assert "fail" not in set(frame["verdict"])
    if "precision" in options:
        assert set(frame["precision"]) == {"bf16-mixed"}


def test_summary_scalars_reach_the_logger(make_trainer: Any, tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path / "logs", name="pilot")
    _fit(make_trainer, TokenModel(), max_steps=2, limit_val_batches=0, logger=logger)
    metrics = pd.read_csv(Path(logger.log_dir) / "metrics.csv")
    value = metrics["pilot/optimizer_step_first/peak_allocated_bytes"].dropna().iloc[0]
    assert value > 0
    assert not math.isnan(value)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"pilot_updates": 1},
            ValueError,
            r"pilot_updates=1\) is invalid: expected an integer >= 2 \(the first update allocates",
        ),
        (
            {"memory_updates": 4},
            ValueError,
            r"memory_updates=4\) is invalid: expected an integer from 1 to 3 \(at most pilot_up",
        ),
        (
            {"sample_every": -1},
            ValueError,
            r"sample_every=-1\) is invalid: expected an integer >= 0",
        ),
        ({"export": "model.pt"}, TypeError, r"export='model.pt'\) is invalid: expected a callable"),
        ({"on_fail": "stop"}, ValueError, r"on_fail='stop'\) is invalid: expected one of 'rec"),
        ({"adapter": {"ids": "x"}}, TypeError, r"adapter=\{'ids': 'x'\}\) is invalid"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        PhaseMemoryMonitor(**kwargs)


@pytest.mark.parametrize(
    ("limit", "verdict"),
    [(1, "not_checked"), (2, "not_checked"), (1.0, "pass"), (50, "pass"), (0.5, "not_checked")],
)
def test_limit_val_batches_int_is_a_batch_count(
    make_trainer: Any, limit: float, verdict: str
) -> None:
    # 16 validation samples in 4 batches: 1 is one batch, 1.0 is all of them, 50 covers all.
    frame = _fit(
        make_trainer, TokenModel(val_size=16), max_steps=3, val_check_interval=2,
        limit_val_batches=limit,
    )  # fmt: skip
    assert _check(_row(frame, "validation"), "outputs_complete")["verdict"] == verdict


@pytest.mark.parametrize("name", ["pilot_updates", "memory_updates", "sample_every"])
def test_non_integer_counts_are_type_errors(name: str) -> None:
    with pytest.raises(
        TypeError,
        match=rf"PhaseMemoryMonitor\({name}='3'\) is invalid: expected an integer .*, got str",
    ):
        PhaseMemoryMonitor(**{name: "3"})


@pytest.mark.parametrize("value", ["no", 0, 1, None])
def test_track_cpu_takes_only_a_bool(value: object) -> None:
    with pytest.raises(TypeError, match=r"PhaseMemoryMonitor\(track_cpu=.*expected True or False"):
        PhaseMemoryMonitor(track_cpu=value)


class VectorData(Dataset[torch.Tensor]):
    """Random vectors from a seed."""

    def __init__(self, size: int = 32, width: int = 4, seed: int = 0) -> None:
        self.data = torch.randn(size, width, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]


class TinyGAN(pl.LightningModule):
    """Two Adam optimizers in manual optimisation, with Lightning's toggle/untoggle recipe."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        self.discriminator = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def generate(self, noise: torch.Tensor) -> torch.Tensor:
        return self.generator(noise)  # type: ignore[no-any-return]

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        bce = nn.functional.binary_cross_entropy_with_logits
        noise = torch.randn_like(batch)
        real, fake = torch.ones(len(batch), 1), torch.zeros(len(batch), 1)

        self.toggle_optimizer(opt_d)  # the generator's parameters: requires_grad=False
        generated = self.generate(noise).detach()
        loss_d = bce(self.discriminator(batch), real) + bce(self.discriminator(generated), fake)
        self.manual_backward(loss_d)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

        self.toggle_optimizer(opt_g)  # the discriminator's parameters: requires_grad=False
        loss_g = bce(self.discriminator(self.generate(noise)), real)
        self.manual_backward(loss_g)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.generator.parameters(), lr=1e-3),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-3),
        ]

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(VectorData(), batch_size=8)


def test_two_optimizers_toggled_in_manual_optimisation_pass(make_trainer: Any) -> None:
    # 4 batches of two optimizer steps each (global_step counts both): 8 updates.
    frame = _fit(make_trainer, TinyGAN(), max_steps=8, limit_val_batches=0)
    assert set(frame["verdict"]) == {"pass"}
    counts = frame.groupby("phase")["occurrences"].sum()
    assert (counts["backward"], counts["optimizer_step"]) == (8, 8)
    # The discriminator's backward comes first: the generator is toggled off, and said so.
    first_backward = _row(frame, "backward")
    assert _check(first_backward, "trainable_params_require_grad")["detail"] == (
        "4 parameter(s) switched off for this backward (e.g. by toggle_optimizer) were"
        " skipped: generator.0.weight, generator.0.bias, generator.2.weight, generator.2.bias"
    )
    assert _check(first_backward, "grads_reach_params")["verdict"] == "pass"
    # Both optimizers' updates are judged, the first (the discriminator's) included.
    for first in (True, False):
        update = _row(frame, "optimizer_step", first=first)
        assert [c["verdict"] for c in update["checks"]] == ["pass"] * 3
        assert update["measured_occurrences"] > 0


class FrozenDiscriminatorHead(TinyGAN):
    """The discriminator's last layer is frozen before the fit, yet handed to its optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.discriminator[2].requires_grad_(False)


def test_layer_frozen_before_the_fit_is_named_under_toggle_optimizer(make_trainer: Any) -> None:
    frame = _fit(make_trainer, FrozenDiscriminatorHead(), max_steps=4, limit_val_batches=0)
    for first in (True, False):  # the discriminator's backward, then the generator's
        check = _check(_row(frame, "backward", first=first), "trainable_params_require_grad")
        # Frozen in both readings (before the toggle and now): not a toggle, and named. The
        # discriminator's last layer holds 9 of the 125 optimized elements.
        assert check["verdict"] == "warn"
        assert check["detail"].startswith(
            "2 parameter(s) frozen before the fit (requires_grad=False, 7.2% of the optimized"
            " elements) are in the optimizer, in 1 frozen submodule(s): discriminator.2; "
        )


class DetachedGeneratorLayer(TinyGAN):
    """The generator's first layer is cut from the loss: it never learns."""

    def generate(self, noise: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.generator[0](noise)).detach()
        return self.generator[2](hidden)  # type: ignore[no-any-return]


def test_detached_layer_still_fails_under_toggle_optimizer(make_trainer: Any) -> None:
    frame = _fit(make_trainer, DetachedGeneratorLayer(), max_steps=4, limit_val_batches=0)
    # The generator's backward is the second one of each batch: on the later row.
    missing = _check(_row(frame, "backward", first=False), "grads_reach_params")
    assert missing["verdict"] == "fail"
    assert missing["detail"].endswith(": generator.0.weight, generator.0.bias")
    unchanged = _check(_row(frame, "optimizer_step", first=False), "trainable_params_changed")
    assert unchanged["verdict"] == "fail"
    assert unchanged["detail"].endswith(
        "did not change in the update: generator.0.weight, generator.0.bias"
    )


class LoRALinear(pl.LightningModule):
    """A frozen base layer plus a LoRA adapter whose up-projection B starts at zero."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 8)
        self.base.requires_grad_(False)  # not in the optimizer, on purpose
        self.lora_a = nn.Linear(8, 2, bias=False)
        self.lora_b = nn.Linear(2, 8, bias=False)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))  # type: ignore[no-any-return]

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self(batch), batch.flip(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        adapter = [*self.lora_a.parameters(), *self.lora_b.parameters()]
        return torch.optim.SGD(adapter, lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(VectorData(width=8), batch_size=8)


def test_lora_zero_initialised_up_projection_passes(make_trainer: Any) -> None:
    model = LoRALinear()
    base = model.base.weight.detach().clone()
    a_before = model.lora_a.weight.detach().clone()
    frame = _fit(make_trainer, model, max_steps=4, limit_val_batches=0)
    assert set(frame["verdict"]) == {"pass"}
    # Update 1: A's gradient is B^T times the output gradient, and B is zero: A stays as it was.
    update = _row(frame, "optimizer_step")
    assert _check(update, "trainable_params_changed")["detail"] == (
        "1 parameter(s) had a zero gradient at this update (e.g. a LoRA down-projection while"
        " its zero-initialised up-projection is still zero) and were not expected to change:"
        " lora_a.weight"
    )
    assert _check(update, "frozen_params_unchanged")["verdict"] == "pass"
    # The later updates move A (B is no longer zero); the base never moves.
    assert _check(_row(frame, "optimizer_step", first=False), "trainable_params_changed") == {
        "name": "trainable_params_changed",
        "verdict": "pass",
        "detail": "",
    }
    assert not torch.equal(model.lora_a.weight, a_before)
    assert torch.equal(model.base.weight, base)


class WipesGradientsBeforeStep(LoRALinear):
    """A misplaced ``zero_grad()`` between backward and the step: nothing ever updates."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad()


def test_nonzero_gradient_that_does_not_update_still_fails(make_trainer: Any) -> None:
    model = WipesGradientsBeforeStep()
    frame = _fit(make_trainer, model, max_steps=2, limit_val_batches=0)
    check = _check(_row(frame, "optimizer_step"), "trainable_params_changed")
    assert check["verdict"] == "fail"
    # B had a nonzero gradient and did not move: failed. A had a zero one: only named.
    assert check["detail"] == (
        "1 trainable parameter(s) with a nonzero or missing gradient did not change in the"
        " update: lora_b.weight; 1 parameter(s) had a zero gradient at this update (e.g. a LoRA"
        " down-projection while its zero-initialised up-projection is still zero) and were not"
        " expected to change: lora_a.weight"
    )
    assert not model.lora_b.weight.any()


class WarmupFromZero(LoRALinear):
    """AdamW with a linear warmup from lr 0 (the shape of transformers'
    ``get_linear_schedule_with_warmup``): the first update moves nothing, on purpose."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(
            [p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01
        )
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / 10))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def test_a_warmup_from_zero_is_not_a_failed_update(make_trainer: Any) -> None:
    frame = _fit(make_trainer, WarmupFromZero(), max_steps=3, limit_val_batches=0)
    assert set(frame["verdict"]) == {"pass"}, frame[["phase", "verdict", "reason"]]
    detail = _check(_row(frame, "optimizer_step"), "trainable_params_changed")["detail"]
    assert detail.startswith(
        "2 parameter(s) had a learning rate of 0 at this update (a warmup that starts at 0) and"
        " were not expected to change: "
    )
    # Later updates (lr > 0) move every trainable parameter: a plain pass.
    later = _check(_row(frame, "optimizer_step", first=False), "trainable_params_changed")
    assert later["verdict"] == "pass"


class _ExportsFirst(pl.Callback):
    """Another callback that asks the run for the same export before the monitor does."""

    def __init__(self, export: Any) -> None:
        self.export = export
        self.answer: Any = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_pilot.run import PilotRun

        self.answer = PilotRun.of(trainer).export(self.export, trainer, pl_module)


def test_a_shared_export_runs_once_and_is_measured_once(make_trainer: Any) -> None:
    calls: list[Path] = []

    def export(module: pl.LightningModule, directory: Path) -> Path:
        calls.append(directory / "model.pt")
        torch.save(module.state_dict(), calls[-1])
        return calls[-1]

    monitor = PhaseMemoryMonitor(export=export)
    first = _ExportsFirst(export)
    frame = _fit(make_trainer, TokenModel(), monitor=monitor, extra_callbacks=[first])
    assert len(calls) == 1
    assert calls[0].parent == monitor.run.run_dir / "export"
    assert first.answer == (calls[0], None)
    row = _row(frame, "export")
    assert (row["occurrences"], row["file_bytes"]) == (1, calls[0].stat().st_size)
    assert len(row["checks"]) == 0  # a clean export adds no check
    assert monitor.run.measure_export is None  # nothing of the monitor's is left on the run


def test_a_failing_export_fails_the_export_row(make_trainer: Any) -> None:
    def export(module: pl.LightningModule, directory: Path) -> Path:
        raise ValueError("disk says no")

    frame = _fit(make_trainer, TokenModel(), monitor=PhaseMemoryMonitor(export=export))
    row = _row(frame, "export")
    assert row["verdict"] == "fail"
    check = _check(row, "export_written")
    assert check["detail"] == "export(pl_module, directory) raised ValueError: disk says no"
    assert row["reason"].endswith("If the check fails: fix the export function before the campaign")


class CompiledWhole(pl.LightningModule):
    """A small regression fitted the way Lightning's docs compile a module,
    ``trainer.fit(torch.compile(module))``; ``logs=True`` calls ``self.log`` in the training
    step, which dynamo cannot trace on torch 2.13 / Lightning 2.6.6."""

    def __init__(self, logs: bool) -> None:
        super().__init__()
        self.net = nn.Linear(4, 4)
        self.logs = logs

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.net(batch), batch.flip(-1))
        if self.logs:
            self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(VectorData(size=16), batch_size=4)


def _fit_compiled(
    make_trainer: Any, logs: bool, monitor: PhaseMemoryMonitor | None
) -> tuple[str | None, list[str]]:
    """``trainer.fit(torch.compile(CompiledWhole(logs)))`` (backend aot_eager): the exception
    it raised (type and first line, or ``None``) and the graphs dynamo compiled (``"train"``:
    with gradients on)."""
    from torch._dynamo.backends.registry import lookup_backend

    torch._dynamo.reset()  # each fit compiles afresh
    graphs: list[str] = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append("train" if torch.is_grad_enabled() else "eval")
        return lookup_backend("aot_eager")(graph, example_inputs)

    trainer = make_trainer(callbacks=[monitor] if monitor else [], max_steps=3)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(torch.compile(CompiledWhole(logs), backend=backend))
    except Exception as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0]}", graphs
    return None, graphs


@pytest.mark.parametrize("logs", [True, False], ids=["self.log", "no_log"])
def test_a_compiled_module_fits_as_it_does_without_the_monitor(
    make_trainer: Any, logs: bool
) -> None:
    bare = _fit_compiled(make_trainer, logs, None)
    monitor = PhaseMemoryMonitor()
    assert _fit_compiled(make_trainer, logs, monitor) == bare  # the same exception, or none
    if logs:
        return
    assert "train" in bare[1]  # the training step was compiled, with the monitor too
    frame = read_phase_table(monitor.run.run_dir)
    forward = _row(frame, "forward")
    # The CPU tensor tracker stayed off: no memory column, said why; the timings are kept.
    assert forward["counter"] == "none"
    assert pd.isna(forward["peak_allocated_bytes"])
    assert forward["notes"] == (
        "not measured: the CPU tensor tracker would stop torch.compile from compiling; measured"
        " on CUDA by the allocator (compiled: <root> (torch.compile of the LightningModule))"
    )
    assert forward["duration_s"] > 0
    assert set(frame["verdict"]) == {"pass"}


class SkipsHiddenAtFirstUpdate(TokenModel):
    """Stochastic depth made deterministic: the hidden layer is skipped (the identity of its
    32 leading features) in the first update only, so it gets no gradient there."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embedded = self.embed(tokens)
        if self.training and self.global_step == 0:
            hidden = torch.cat([embedded, embedded], dim=-1)  # the skipped layer
        else:
            hidden = self.hidden(embedded)
        return self.head(torch.relu(hidden))


def test_a_layer_skipped_at_the_first_update_passes_named(make_trainer: Any) -> None:
    # A validation after every update publishes the rows before the evidence is complete; the
    # 3 updates of the pilot window are measured (the 4th is not: sample_every=100).
    monitor = PhaseMemoryMonitor(on_fail="raise")
    frame = _fit(
        make_trainer, SkipsHiddenAtFirstUpdate(), monitor=monitor, max_steps=4, val_check_interval=1
    )
    assert set(frame["verdict"]) == {"pass"}, frame[["phase", "first", "verdict", "reason"]]
    first = _row(frame, "backward")
    assert _check(first, "grads_reach_params") == {
        "name": "grads_reach_params",
        "verdict": "pass",
        "detail": "2 trainable parameter(s) received no gradient in some of 3 measured"
        " backward(s) and one in another (a layer skipped by LayerDrop or stochastic depth, or"
        " an expert no token was routed to, in those steps): hidden.weight, hidden.bias",
    }
    assert pd.isna(first["reason"])
    assert _check(_row(frame, "backward", first=False), "grads_reach_params")["detail"] == ""
    update = _check(_row(frame, "optimizer_step"), "trainable_params_changed")
    assert update["verdict"] == "pass"
    assert update["detail"] == (
        "2 trainable parameter(s) had no gradient at some of 3 measured update(s), so the"
        " optimizer skipped them there, and received one in another (a layer skipped by"
        " LayerDrop or stochastic depth, or an expert no token was routed to, in those steps):"
        " hidden.weight, hidden.bias"
    )


def test_a_layer_skipped_in_every_measured_update_fails(make_trainer: Any) -> None:
    # A fit of one update, shorter than the pilot window: judged over that one at the fit end.
    frame = _fit(make_trainer, SkipsHiddenAtFirstUpdate(), max_steps=1, limit_val_batches=0)
    check = _check(_row(frame, "backward"), "grads_reach_params")
    assert check["verdict"] == "fail"
    assert check["detail"] == (
        "2 trainable parameter(s) received no gradient in any of 1 measured backward(s) (not in"
        " the graph of the loss, or detached): hidden.weight, hidden.bias"
    )


def test_on_fail_raise_stops_a_detached_layer_when_the_window_ends(make_trainer: Any) -> None:
    monitor = PhaseMemoryMonitor(on_fail="raise")
    trainer = make_trainer(callbacks=[monitor], max_steps=6, limit_val_batches=0)
    with pytest.raises(
        PhaseCheckError,
        match=r"failed over the measured updates: backward grads_reach_params: 3 trainable"
        r" parameter\(s\) received no gradient in any of 3 measured backward\(s\) \(not in the"
        r" graph of the loss, or detached\): embed.weight, hidden.weight, hidden.bias;"
        r" optimizer_step trainable_params_changed: 3 trainable parameter\(s\) that received no"
        r" gradient in any measured backward did not change in the update: embed.weight,"
        r" hidden.weight, hidden.bias$",
    ):
        trainer.fit(DetachedHead())
    assert trainer.global_step == 3  # the pilot window, then the stop
    frame = read_phase_table(monitor.run.run_dir)
    assert _row(frame, "backward")["verdict"] == "fail"


def test_compiled_code_is_found_wherever_torch_compile_put_it() -> None:
    from lightning_pilot.core.memory import compiled_code

    model = TokenModel()
    assert compiled_code(model) == []
    model.hidden = torch.compile(model.hidden, backend="eager")  # type: ignore[assignment]
    model.head.compile(backend="eager")
    model.forward = torch.compile(model.forward, backend="eager")  # type: ignore[method-assign]
    assert compiled_code(model) == ["<root>.forward", "hidden", "head (Module.compile)"]

    # @torch.compile on a method, and on a helper at the top level of the model's own module.
    import sys
    import types

    home = types.ModuleType("compiled_helpers")
    home.gelu = torch.compile(nn.functional.gelu, backend="eager")  # type: ignore[attr-defined]

    class Block(nn.Module):
        @torch.compile(backend="eager")
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    class Helped(nn.Module):
        __module__ = "compiled_helpers"

    sys.modules["compiled_helpers"] = home
    try:
        assert compiled_code(nn.Sequential(Block(), Helped())) == [
            "test_compiled_code_is_found_wherever_torch_compile_put_it.<locals>.Block.forward",
            "compiled_helpers.gelu",
        ]
    finally:
        del sys.modules["compiled_helpers"]
