"""What both sides of the comparison record, with the same functions so the records compare
value for value, and the resumed fit itself."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_pilot.callbacks._shared import step_loss
from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.memory import host_memory
from lightning_pilot.core.resume import (
    StepRecord,
    capture_rng,
    content_keys,
    dataset_fingerprint,
    digest,
    json_id,
    plain_values,
    restore_rng,
    rng_of_this_rank,
)
from lightning_pilot.resume.protocol import ResumeTask, State, TaskResult


def current_lrs(trainer: pl.Trainer) -> list[float]:
    """The learning rate of every param group of every optimizer."""
    return [float(g["lr"]) for o in trainer.optimizers for g in o.param_groups]


def started(trainer: pl.Trainer, adapter: BatchAdapter, batch: Any, batch_idx: int) -> StepRecord:
    """Where a micro-batch is and which examples it holds (at ``on_train_batch_start``)."""
    ids = adapter.view(batch, count_tokens=False).ids_list()
    if ids is None:
        ids = content_keys(adapter.example_inputs(batch))
    shown = None if ids is None else tuple(json_id(i) for i in ids)
    return StepRecord(trainer.global_step, batch_idx, trainer.current_epoch, ids=shown, loss=None)


def finished(record: StepRecord, trainer: pl.Trainer, outputs: Any) -> StepRecord:
    """The micro-batch's record once it ran (at ``on_train_batch_end``): loss and LRs added."""
    loss = step_loss(outputs)
    value = float(loss.detach()) if isinstance(loss, torch.Tensor) else None
    return dataclasses.replace(record, loss=value, lrs=tuple(current_lrs(trainer)))


def state_of(trainer: pl.Trainer, pl_module: pl.LightningModule) -> State:
    """What a resume must restore, as comparable values (the RNG digest is added by the caller)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    # Schedulers may hold functions (LambdaLR), whose identity differs across processes.
    schedulers = [
        {k: v for k, v in c.scheduler.state_dict().items() if not callable(v) and k != "lr_lambdas"}
        for c in trainer.lr_scheduler_configs
    ]
    return State(
        global_step=trainer.global_step,
        epoch=trainer.current_epoch,
        lrs=current_lrs(trainer),
        optimizer_state=digest([o.state_dict()["state"] for o in trainer.optimizers]),
        scheduler_state=digest(schedulers),
        grad_scaler=None if scaler is None else digest(scaler.state_dict()),
        weights=digest(pl_module.state_dict()),
    )


class ResumeRecorder(pl.Callback):
    """Records the restored state and the micro-batches after a resume. Its ``state_key`` is the
    verifier's, so Lightning hands it the saved RNG states, which it restores at train start."""

    def __init__(self, state_key: str, adapter: BatchAdapter) -> None:
        self._key = state_key
        self.adapter = adapter
        self.rng: Mapping[str, Any] | None = None
        self.restored: State | None = None
        self.steps: list[StepRecord] = []
        self._current: StepRecord | None = None

    @property
    def state_key(self) -> str:
        return self._key

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rng = rng_of_this_rank(state_dict)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.rng is not None:
            restore_rng(self.rng)
        rng = digest(capture_rng()) if self.rng is not None else None
        self.restored = dataclasses.replace(state_of(trainer, pl_module), rng=rng)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.steps and self._current is None and self.restored is not None:
            # The epoch training continues in: at train start Lightning has not yet moved on
            # from an epoch that a checkpoint at its last batch closed; at the first batch it
            # has (the reference side reads it there too).
            self.restored = dataclasses.replace(self.restored, epoch=trainer.current_epoch)
        self._current = started(trainer, self.adapter, batch, batch_idx)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any
    ) -> None:
        if self._current is not None:
            self.steps.append(finished(self._current, trainer, outputs))


def load_checkpoint(path: str, result: TaskResult) -> dict[str, Any] | None:
    """``torch.load(path, weights_only=True)`` timed into ``result``, which says why if ``None``."""
    started_at = time.perf_counter()
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # the unpickler raises several types; the message is the answer
        result.load_error = f"{type(err).__name__}: {str(err).splitlines()[0]}"
        with contextlib.suppress(Exception):  # a corrupt file: the load error says enough
            result.unsafe_globals = list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        return None
    result.load_seconds = time.perf_counter() - started_at
    result.load_rss_bytes = host_memory().rss_bytes
    result.file_bytes = Path(path).stat().st_size
    return dict(loaded)


def replay(
    task: ResumeTask, result: TaskResult, model: Any, datamodule: Any, loaders: Any = None
) -> None:
    """Resume ``fit`` from the task's checkpoint for the compared updates (on one device, or as
    one rank of a DDP group with ``task.ddp``); record into ``result``."""
    adapter: dict[str, Any] = task.adapter  # checked by BatchAdapter
    recorder = ResumeRecorder(task.state_key, BatchAdapter(**adapter))
    options = dict(task.trainer)
    if task.ddp is not None:
        options["strategy"] = DDPStrategy(**task.ddp)
    trainer = pl.Trainer(
        devices=options.pop("devices", 1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder],
        default_root_dir=task.workdir,
        **options,
    )
    data = {"datamodule": datamodule} if datamodule is not None else {}
    if datamodule is None and loaders is not None:
        data = {"train_dataloaders": loaders}
    trainer.fit(model, ckpt_path=task.checkpoint, weights_only=True, **data)
    result.dataset_fingerprint = dataset_fingerprint(
        getattr(trainer.train_dataloader, "dataset", None)
    )
    result.restored = recorder.restored
    result.steps = recorder.steps
    result.global_step_end = trainer.global_step


#: How the control inputs reach the model, tried in this order when ``predict_step`` is not the
#: module's own: Lightning's default ``predict_step`` is ``self(batch)``, which a ``forward``
#: taking unpacked inputs (``forward(x)``, ``forward(input_ids, attention_mask)``) refuses.
CONTROL_CALLS: Final[dict[str, Callable[[Any, Any, int], Any]]] = {
    "predict_step": lambda model, batch, index: model.predict_step(batch, index),
    "forward(batch)": lambda model, batch, index: model(batch),
    "forward(batch[0])": lambda model, batch, index: model(batch[0]),
    "forward(**batch)": lambda model, batch, index: model(**batch),
}


def control_calls(model: Any, batch: Any) -> list[str]:
    """The ways to run ``model`` on ``batch`` worth trying (keys of :data:`CONTROL_CALLS`)."""
    if isinstance(model, pl.LightningModule) and is_overridden("predict_step", model):
        return ["predict_step"]
    calls = ["forward(batch)"]
    if isinstance(batch, list | tuple) and batch:
        calls.append("forward(batch[0])")
    if isinstance(batch, Mapping) and all(isinstance(k, str) for k in batch):
        calls.append("forward(**batch)")
    return calls


def control_outputs(model: Any, call: str, batches: list[Any]) -> list[Any]:
    """``model``'s outputs on ``batches`` (reached as ``call`` names) as :func:`plain_values`."""
    with torch.no_grad():
        return [
            plain_values(CONTROL_CALLS[call](model, batch, index))
            for index, batch in enumerate(batches)
        ]
