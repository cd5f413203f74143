"""The fresh process that ResumeVerifier launches: resume from a checkpoint, record, answer.

``python -m lightning_pilot.resume_child SPEC.json`` reads a spec written by
:class:`~lightning_pilot.callbacks.resume_verifier.ResumeVerifier`, and writes a JSON result next
to it. A spec holds one task or, under ``"tasks"``, several run one after the other in this one
process (every probe checkpoint and the artifact: one interpreter start, one import of the
user's code). Two modes:

* ``resume``: load the checkpoint with ``weights_only=True`` (timing it), rebuild the module and
  datamodule (a user factory ``"package.module:function"``, else the classes with the
  checkpoint's hyperparameters), resume ``fit`` from the checkpoint for the compared updates
  and record the restored state and every micro-batch (sample ids, loss, learning rates).
* ``artifact``: rebuild a fresh module, load the final artifact into it (a checkpoint's
  ``state_dict`` or an exported ``state_dict`` file, strictly), run it on the saved control
  inputs the way the training process did (:func:`control_outputs`) and save the outputs.

Failures that are the answer (an unsafe checkpoint, a module that cannot be rebuilt) are
written into the result, not raised: the parent turns them into verdicts.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.memory import host_memory
from lightning_pilot.core.resume import (
    StepRecord,
    capture_rng,
    content_keys,
    dataset_fingerprint,
    digest,
    plain_values,
    restore_rng,
    rng_of_this_rank,
)


def load_object(path: str) -> Any:
    """Import ``"package.module:attribute"`` (also ``"package.module.attribute"``)."""
    module_name, sep, attribute = path.partition(":")
    if not sep:
        module_name, _, attribute = path.rpartition(".")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


def current_lrs(trainer: pl.Trainer) -> list[float]:
    """The learning rate of every param group of every optimizer."""
    return [float(g["lr"]) for o in trainer.optimizers for g in o.param_groups]


def batch_position(
    trainer: pl.Trainer, adapter: BatchAdapter, batch: Any, batch_idx: int
) -> dict[str, Any]:
    """Where a micro-batch is and which examples it holds (at ``on_train_batch_start``)."""
    view = adapter.view(batch, count_tokens=False)
    ids = view.ids_list()
    if ids is None:
        ids = content_keys(view.inputs)
    return {
        "step": trainer.global_step,
        "batch_idx": batch_idx,
        "epoch": trainer.current_epoch,
        "ids": None if ids is None else [json_id(i) for i in ids],
    }


def step_record(trainer: pl.Trainer, position: Mapping[str, Any], outputs: Any) -> StepRecord:
    """The micro-batch's record once it ran (at ``on_train_batch_end``): loss and LRs added."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    value = float(loss.detach()) if isinstance(loss, torch.Tensor) else None
    return StepRecord.from_dict(dict(position) | {"loss": value, "lrs": current_lrs(trainer)})


def state_digests(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """What a resume must restore, as comparable values (shared by parent and child)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "lrs": current_lrs(trainer),
        "optimizer_state": digest([o.state_dict()["state"] for o in trainer.optimizers]),
        "scheduler_state": digest(
            [_plain(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs]
        ),
        "grad_scaler": None if scaler is None else digest(scaler.state_dict()),
        "weights": digest(pl_module.state_dict()),
    }


def _plain(state: Mapping[str, Any]) -> dict[str, Any]:
    # Schedulers may hold functions (LambdaLR); their identity differs across processes.
    return {k: v for k, v in state.items() if not callable(v) and k != "lr_lambdas"}


class ResumeRecorder(pl.Callback):
    """Records the restored state and the micro-batches after a resume (child side).

    Its ``state_key`` is the parent verifier's, so Lightning hands it the verifier's saved
    state (the RNG states), which it restores at train start.
    """

    def __init__(self, state_key: str, adapter: BatchAdapter) -> None:
        self._key = state_key
        self.adapter = adapter
        self.rng: Mapping[str, Any] | None = None
        self.restored: dict[str, Any] = {}
        self.steps: list[StepRecord] = []
        self._current: dict[str, Any] = {}

    @property
    def state_key(self) -> str:
        return self._key

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rng = rng_of_this_rank(state_dict)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.rng is not None:
            restore_rng(self.rng)
        self.restored = state_digests(trainer, pl_module)
        self.restored["rng"] = digest(capture_rng()) if self.rng is not None else None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.steps and not self._current:
            # The epoch training continues in: at train start Lightning has not yet moved on
            # from an epoch that a checkpoint at its last batch closed; at the first batch it
            # has (the reference side records the same).
            self.restored["epoch"] = trainer.current_epoch
        self._current = batch_position(trainer, self.adapter, batch, batch_idx)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.steps.append(step_record(trainer, self._current, outputs))


def json_id(value: Any) -> Any:
    """An example id as a JSON value: numbers, strings and booleans as they are, else ``str``."""
    return value if isinstance(value, int | float | str | bool) or value is None else str(value)


#: How the control inputs reach the model, tried in this order when ``predict_step`` is not the
#: module's own: Lightning's default ``predict_step`` is ``self(batch)``, which a ``forward``
#: taking unpacked inputs (``forward(x)``, ``forward(input_ids, attention_mask)``) refuses.
CONTROL_CALLS: Final = ("predict_step", "forward(batch)", "forward(batch[0])", "forward(**batch)")


def control_outputs(model: Any, batch: Any, call: str, index: int = 0) -> Any:
    """The model's outputs on one control batch, reached the way ``call`` names."""
    if call == "predict_step":
        return model.predict_step(batch, index)
    if call == "forward(batch)":
        return model(batch)
    if call == "forward(batch[0])":
        return model(batch[0])
    if call == "forward(**batch)":
        return model(**batch)
    raise ValueError(f"call={call!r} is invalid; expected one of {CONTROL_CALLS}.")


def control_calls(model: Any, batch: Any) -> list[str]:
    """The ways to run ``model`` on ``batch`` worth trying, best first."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if isinstance(model, pl.LightningModule) and is_overridden("predict_step", model):
        return ["predict_step"]
    calls = ["forward(batch)"]
    if isinstance(batch, list | tuple) and batch:
        calls.append("forward(batch[0])")
    if isinstance(batch, Mapping) and all(isinstance(k, str) for k in batch):
        calls.append("forward(**batch)")
    return calls


def count_tensors(value: Any) -> int:
    """How many tensors a :func:`~lightning_pilot.core.resume.plain_values` value holds."""
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, Mapping):
        return sum(count_tensors(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(count_tensors(v) for v in value)
    return 0


def _seed_like_the_script() -> None:
    """Seed as the training script did before it built its objects.

    ``seed_everything`` leaves its seed in ``PL_GLOBAL_SEED`` (and ``PL_SEED_WORKERS``), which
    this process inherits: a module or DataModule that draws random data or weights in its
    constructor (Lightning's ``BoringDataModule``) is then rebuilt with the same values. The
    RNG states of the fit are restored at train start, separately.
    """
    seed = os.environ.get("PL_GLOBAL_SEED")
    if seed is not None and seed.lstrip("-").isdigit():
        from lightning.fabric.utilities.seed import seed_everything

        seed_everything(int(seed), workers=os.environ.get("PL_SEED_WORKERS") == "1", verbose=False)


def _build(
    spec: Mapping[str, Any], checkpoint: Mapping[str, Any], *, datamodule_first: bool = False
) -> tuple[Any, Any]:
    _seed_like_the_script()
    factory = spec.get("factory")
    if factory:
        built = load_object(factory)()
        if isinstance(built, tuple):
            return built[0], (built[1] if len(built) > 1 else None)
        if isinstance(built, Mapping):
            return built["model"], built.get("datamodule")
        return built, None
    module_cls = load_object(spec["module_class"])
    dm_cls = load_object(spec["datamodule_class"]) if spec.get("datamodule_class") else None

    def build_datamodule() -> Any:
        if dm_cls is None:
            return None
        return dm_cls(**dict(checkpoint.get("datamodule_hyper_parameters") or {}))

    # After the seed, the script built one of the two first: random data drawn in a
    # constructor depends on which (the module's weight init draws from the same generator).
    datamodule = build_datamodule() if datamodule_first else None
    model = module_cls(**dict(checkpoint.get("hyper_parameters") or {}))
    if not datamodule_first:
        datamodule = build_datamodule()
    return model, datamodule


def _safe_load(path: str, result: dict[str, Any]) -> dict[str, Any] | None:
    started = time.perf_counter()
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # the unpickler raises several types; the message is the answer
        result["load_error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
        try:
            result["unsafe_globals"] = list(
                torch.serialization.get_unsafe_globals_in_checkpoint(path)
            )
        except Exception as inner:  # a corrupt file: report it too
            result["unsafe_globals_error"] = f"{type(inner).__name__}: {inner}"
        return None
    result["load_seconds"] = time.perf_counter() - started
    result["load_rss_bytes"] = host_memory().rss_bytes
    result["file_bytes"] = Path(path).stat().st_size
    return dict(loaded)


def run_resume(
    spec: Mapping[str, Any], result: dict[str, Any], objects: tuple[Any, Any, Any] | None = None
) -> None:
    """Resume from the checkpoint for the compared updates and record everything.

    ``objects`` (module, datamodule, train loaders) replaces the rebuild, for the in-process
    fallback.
    """
    checkpoint = _safe_load(spec["checkpoint"], result)
    if checkpoint is None:
        return
    if objects is not None:
        del checkpoint
        _resume_once(spec, result, objects)
        return
    # Build as the script probably did (seed, module, data); when the data come out other
    # than the fit's and a seed was set, the script built the data first: build that way and
    # resume again (only then: one fit in the common case).
    wanted = spec.get("dataset_fingerprint")
    for datamodule_first in (False, True):
        try:
            model, datamodule = _build(spec, checkpoint, datamodule_first=datamodule_first)
        except Exception as err:  # reported to the parent as "cannot rebuild"
            result["build_error"] = f"{type(err).__name__}: {err}"
            return
        _resume_once(spec, result, (model, datamodule, None))
        retry = (
            not datamodule_first
            and wanted is not None
            and result.get("dataset_fingerprint") not in (None, wanted)
            and datamodule is not None
            and not spec.get("factory")
            and os.environ.get("PL_GLOBAL_SEED") is not None
        )
        if not retry:
            return
        result["build_order"] = "the DataModule before the module"


def _resume_once(
    spec: Mapping[str, Any], result: dict[str, Any], objects: tuple[Any, Any, Any]
) -> None:
    model, datamodule, loaders = objects
    adapter = BatchAdapter(**{k: v for k, v in (spec.get("adapter") or {}).items()})
    recorder = ResumeRecorder(spec["state_key"], adapter)
    options = dict(spec["trainer"])
    if spec.get("ddp") is not None:  # one rank of a DDP group shaped like the fit's
        options["strategy"] = DDPStrategy(**spec["ddp"])
    trainer = pl.Trainer(
        # One device, or (with the rank's environment) one rank of a DDP group like the fit's.
        devices=options.pop("devices", 1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder],
        default_root_dir=spec["workdir"],
        **options,
    )
    fit_kwargs: dict[str, Any] = {"ckpt_path": spec["checkpoint"], "weights_only": True}
    if datamodule is not None:
        fit_kwargs["datamodule"] = datamodule
    elif loaders is not None:
        fit_kwargs["train_dataloaders"] = loaders
    trainer.fit(model, **fit_kwargs)
    result["dataset_fingerprint"] = dataset_fingerprint(
        getattr(trainer.train_dataloader, "dataset", None)
    )
    result["restored"] = recorder.restored
    result["steps"] = [s.as_dict() for s in recorder.steps]
    result["global_step_end"] = trainer.global_step


def run_artifact(spec: Mapping[str, Any], result: dict[str, Any]) -> None:
    """Load the final artifact into a fresh module and run it on the control inputs."""
    checkpoint = _safe_load(spec["checkpoint"], result)
    if checkpoint is None:
        return
    try:
        model, _ = _build(spec, checkpoint)
    except Exception as err:
        result["build_error"] = f"{type(err).__name__}: {err}"
        return
    artifact = spec["artifact"]
    weights = (
        checkpoint["state_dict"]
        if artifact == spec["checkpoint"]
        else torch.load(artifact, map_location="cpu", weights_only=True)
    )
    dtype = getattr(torch, str(spec.get("dtype") or ""), None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        model = model.to(dtype)  # as the live module was (precision="bf16-true", "16-true")
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        result["artifact_error"] = (
            str(err).splitlines()[0]
            + " "
            + " ".join(line.strip() for line in str(err).splitlines()[1:3])
        )
        return
    model.eval()
    control = torch.load(spec["control"], map_location="cpu", weights_only=True)
    call = spec.get("call") or "predict_step"
    with torch.no_grad():
        outputs = [
            plain_values(control_outputs(model, batch, call, index))
            for index, batch in enumerate(control)
        ]
    torch.save(outputs, spec["outputs"])
    result["outputs"] = spec["outputs"]


#: The environment variable that names the training process (the parent to outlive not).
PARENT_PID: Final = "LIGHTNING_PILOT_PARENT_PID"


def _exit_with_parent(poll_s: float = 0.5) -> None:
    """End this process when the training process that started it is gone (killed).

    The parent enforces the timeout; without it a verification process would live on and
    keep its memory (on a GPU too).
    """
    expected = os.environ.get(PARENT_PID)
    parent = int(expected) if expected and expected.isdigit() else os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(3)

    threading.Thread(target=watch, name="lightning-pilot-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the spec given as the only argument; 0 unless the spec is unusable."""
    args = sys.argv[1:] if argv is None else argv
    spec_path = Path(args[0])
    spec = json.loads(spec_path.read_text())
    result: dict[str, Any] = {"mode": spec.get("mode", "tasks")}
    runners: dict[str, Callable[[Mapping[str, Any], dict[str, Any]], None]] = {
        "resume": run_resume,
        "artifact": run_artifact,
    }
    warnings.simplefilter("ignore")
    _exit_with_parent()
    # The parent's thread count: CPU reductions (and so losses) depend on it.
    torch.set_num_threads(int(spec.get("num_threads") or torch.get_num_threads()))
    tasks = spec.get("tasks")
    if tasks is None:
        _run_task(runners, spec, result)
    else:
        result["results"] = []
        for task in tasks:
            answer: dict[str, Any] = {"mode": task["mode"]}
            _run_task(runners, task, answer)
            result["results"].append(answer)
    Path(spec["result"]).write_text(json.dumps(result, default=str))
    return 0


def _run_task(
    runners: Mapping[str, Callable[[Mapping[str, Any], dict[str, Any]], None]],
    spec: Mapping[str, Any],
    result: dict[str, Any],
) -> None:
    try:
        runners[spec["mode"]](spec, result)
    except Exception as err:  # anything else is a crash of the user's code: report it whole
        result["crash"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc(limit=8)


if __name__ == "__main__":
    raise SystemExit(main())
