"""No trace: after a fit (clean, failed or repeated) the Trainer, its strategy, the user's module
and DataModule, the optimizers, torch's global hooks and dispatch modes, and the pilot callbacks
themselves are as they were before it."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from lightning_pilot import (
    BatchInspector,
    DivergenceLedger,
    EffectiveBatchAccountant,
    OverfitTinySubset,
    PhaseMemoryMonitor,
    ResumeVerifier,
    pilot_callbacks,
)
from lightning_pilot.demo import ClassificationDataModule, TinyClassifier
from lightning_pilot.run import GUARDED_HOOKS, PilotCallback

pytestmark = pytest.mark.timeout(300)

#: Trainer options a pilot callback could change for its fit.
_TRAINER_OPTIONS = (
    "limit_train_batches",
    "limit_val_batches",
    "limit_test_batches",
    "limit_predict_batches",
    "accumulate_grad_batches",
    "val_check_interval",
    "check_val_every_n_epoch",
    "num_sanity_val_steps",
    "gradient_clip_val",
    "log_every_n_steps",
    "precision",
)
_MODULE_HOOKS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_GLOBAL_HOOKS = (
    (nn_module, "_global_forward_hooks"),
    (nn_module, "_global_forward_pre_hooks"),
    (nn_module, "_global_backward_hooks"),
    (nn_module, "_global_backward_pre_hooks"),
    (nn_module, "_global_module_registration_hooks"),
    (nn_module, "_global_parameter_registration_hooks"),
    (nn_module, "_global_buffer_registration_hooks"),
    (optim_module, "_global_optimizer_pre_hooks"),
    (optim_module, "_global_optimizer_post_hooks"),
)
_OPTIMIZER_HOOKS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


class Data(ClassificationDataModule):
    """The demo data, with its own transfer hook (so OverfitTinySubset wraps the DataModule's)."""

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch


class Failing(TinyClassifier):
    """Raises in its third training step."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step == 2:
            raise RuntimeError("planted failure")
        return super().training_step(batch, batch_idx)


def _hooks(holder: Any, names: tuple[str, ...]) -> dict[str, list[tuple[int, Any]]]:
    return {name: list(getattr(holder, name, {}).items()) for name in names}


def _instance(obj: Any) -> dict[str, Any]:
    """The instance attributes that are callables (a hook set on the instance) and the keys."""
    return {
        "keys": set(vars(obj)),
        "callables": {k: v for k, v in vars(obj).items() if callable(v) and not k.startswith("__")},
    }


def _callback_state(callback: Callback) -> dict[str, Any]:
    held = {hook: vars(callback)[hook] for hook in GUARDED_HOOKS if hook in vars(callback)}
    return {"hooks": held, "muted": dict(vars(callback).get("_muted_hooks", {}))}


def _snapshot(
    trainer: pl.Trainer, model: pl.LightningModule, data: pl.LightningDataModule
) -> dict[str, Any]:
    return {
        "trainer": {name: getattr(trainer, name) for name in _TRAINER_OPTIONS},
        "trainer_keys": set(vars(trainer)),
        "callbacks_list": list(trainer.callbacks),  # type: ignore[attr-defined]
        "checkpoint_io": trainer.strategy.checkpoint_io,
        "precision_plugin": trainer.strategy.precision_plugin,
        "module": _instance(model),
        "datamodule": _instance(data),
        "submodules": {name: _hooks(m, _MODULE_HOOKS) for name, m in model.named_modules()},
        "parameters": {
            name: (p._backward_hooks, getattr(p, "_post_accumulate_grad_hooks", None))
            for name, p in model.named_parameters()
        },
        "global_hooks": {name: list(getattr(m, name).items()) for m, name in _GLOBAL_HOOKS},
        "dispatch_modes": list(_get_current_dispatch_mode_stack()),
        "grad_enabled": torch.is_grad_enabled(),
        "pilot_callbacks": {
            id(c): _callback_state(c)
            for c in trainer.callbacks  # type: ignore[attr-defined]
            if isinstance(c, PilotCallback)
        },
    }


def _assert_no_trace(before: dict[str, Any], trainer: pl.Trainer, model: Any, data: Any) -> None:
    after = _snapshot(trainer, model, data)
    # Lightning itself may add instance attributes to the Trainer during a fit (its loops'
    # state); what a pilot could add is checked by the named options and the strategy.
    after["trainer_keys"] = before["trainer_keys"] = None
    for key, value in before.items():
        assert after[key] == value, f"{key} changed by the fit: {value!r} -> {after[key]!r}"
    assert after["checkpoint_io"] is before["checkpoint_io"]
    for optimizer in trainer.optimizers:
        assert not any(_hooks(optimizer, _OPTIMIZER_HOOKS).values()), "optimizer hooks left"
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if not isinstance(callback, PilotCallback):
            continue
        for hook in GUARDED_HOOKS:
            bound = getattr(callback, hook)
            assert callable(bound), f"{type(callback).__name__}.{hook} is muted after the fit"
            assert getattr(bound, "__func__", None) is getattr(type(callback), hook), (
                f"{type(callback).__name__}.{hook} is not the class's method after the fit"
            )


def _trainer(tmp_path: Path, callbacks: list[Callback], **options: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
        **({"max_steps": 4, "limit_val_batches": 2, "val_check_interval": 2} | options),
    )


_CALLBACKS: dict[str, Callable[[Path], list[Callback]]] = {
    "PhaseMemoryMonitor": lambda out: [PhaseMemoryMonitor(pilot_updates=2, export=_export)],
    "BatchInspector": lambda out: [BatchInspector()],
    "OverfitTinySubset": lambda out: [OverfitTinySubset(max_steps=3)],
    # Verified in a new process after the first fit only (the second ends before at_step).
    "ResumeVerifier": lambda out: [
        ResumeVerifier(at_step=3, epoch_boundary=False, check_artifact=False)
    ],
    "EffectiveBatchAccountant": lambda out: [EffectiveBatchAccountant()],
    "DivergenceLedger": lambda out: [DivergenceLedger(experiment="no-trace", variant="a")],
    # Everything together; the resume check in a new process is covered above.
    "pilot_callbacks": lambda out: [
        *pilot_callbacks(
            out,
            resume={"at_step": 100, "epoch_boundary": False, "check_artifact": False},
            phase_memory={"export": _export},
        )
    ],
}


def _export(module: pl.LightningModule, directory: Path) -> Path:
    path = directory / "model.pt"
    torch.save(module.state_dict(), path)
    return path


def _fit(trainer: pl.Trainer, model: Any, data: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=data)


@pytest.mark.parametrize("name", list(_CALLBACKS))
def test_a_fit_and_a_second_fit_leave_no_trace(name: str, tmp_path: Path) -> None:
    model, data = TinyClassifier(), Data(dataset_size=64)
    trainer = _trainer(tmp_path, _CALLBACKS[name](tmp_path / "pilot"))
    before = _snapshot(trainer, model, data)
    _fit(trainer, model, data)
    _assert_no_trace(before, trainer, model, data)
    trainer.fit_loop.epoch_loop.max_steps = 6  # the second fit goes on training
    _fit(trainer, model, data)
    _assert_no_trace(before, trainer, model, data)


@pytest.mark.parametrize("name", list(_CALLBACKS))
def test_a_fit_that_raises_leaves_no_trace(name: str, tmp_path: Path) -> None:
    model, data = Failing(), Data(dataset_size=64)
    trainer = _trainer(tmp_path, _CALLBACKS[name](tmp_path / "pilot"))
    before = _snapshot(trainer, model, data)
    with pytest.raises(RuntimeError, match="planted failure"):
        _fit(trainer, model, data)
    _assert_no_trace(before, trainer, model, data)
