"""The new process ResumeVerifier starts: ``python -m lightning_pilot.resume.child REQUEST``; it
runs the request's tasks and publishes a ``Result``, user failures included (docs/resume.md)."""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import torch

from lightning_pilot import storage
from lightning_pilot.core.progress import marker_line
from lightning_pilot.resume.protocol import (
    PARENT_PID,
    ArtifactTask,
    Request,
    Result,
    ResumeTask,
    TaskResult,
)
from lightning_pilot.resume.replay import control_outputs, load_checkpoint, replay

#: The largest request a child reads: a few paths and options per task.
MAX_REQUEST_BYTES: Final = 1 << 20

#: Told what a task does now (``"loading the checkpoint"``); see :func:`announce`.
Progress = Callable[[str], None]


def announce(done: int, total: int, message: str) -> None:
    """Print a progress marker line on stderr; a closed one (the parent is gone) is ignored."""
    with contextlib.suppress(OSError, ValueError):
        print(marker_line(done, total, message), file=sys.stderr, flush=True)


def load_object(path: str) -> Any:
    """Import ``"package.module:attribute"`` (also ``"package.module.attribute"``)."""
    module_name, sep, attribute = path.partition(":")
    if not sep:
        module_name, _, attribute = path.rpartition(".")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


def _seed_like_the_script() -> None:
    """Seed as ``seed_everything`` did in the script (its ``PL_GLOBAL_SEED`` is inherited), so
    random data or weights drawn in a constructor come out the same."""
    seed = os.environ.get("PL_GLOBAL_SEED")
    if seed is not None and seed.lstrip("-").isdigit():
        from lightning.fabric.utilities.seed import seed_everything

        seed_everything(int(seed), workers=os.environ.get("PL_SEED_WORKERS") == "1", verbose=False)


#: Keys LightningCLI adds to saved hyperparameters (``class_path`` instantiation): how it built
#: the object, not its arguments.
_BUILDER_KEYS = frozenset({"_class_path", "_instantiator"})


def _build(
    task: ResumeTask | ArtifactTask, checkpoint: Mapping[str, Any], datamodule_first: bool
) -> tuple[Any, Any]:
    _seed_like_the_script()
    if task.factory:
        built = load_object(task.factory)()
        if isinstance(built, tuple):
            return built[0], (built[1] if len(built) > 1 else None)
        if isinstance(built, Mapping):
            return built["model"], built.get("datamodule")
        return built, None
    module_cls = load_object(task.module_class)
    path = task.datamodule_class if isinstance(task, ResumeTask) else None
    dm_cls = load_object(path) if path else None

    def arguments(key: str) -> dict[str, Any]:
        return {k: v for k, v in (checkpoint.get(key) or {}).items() if k not in _BUILDER_KEYS}

    def build_datamodule() -> Any:
        return None if dm_cls is None else dm_cls(**arguments("datamodule_hyper_parameters"))

    # After the seed, the script built one of the two first: random data drawn in a
    # constructor depends on which (the module's weight init draws from the same generator).
    datamodule = build_datamodule() if datamodule_first else None
    model = module_cls(**arguments("hyper_parameters"))
    return model, (datamodule if datamodule_first else build_datamodule())


def unpickle_loaders(payload: bytes | None, result: TaskResult) -> Any:
    """The training loaders pickled on stdin (a fresh copy per call), or ``None`` with the
    reason in ``result.loader_error``. Safe to unpickle, unlike a file: the anonymous pipe has
    no name anything else could open, and the bytes are the training process's own pickle of
    the objects passed to ``fit``, so unpickling runs only code that building them already ran.
    """
    if not payload:
        result.loader_error = "no loaders came on stdin"
        return None
    try:
        return pickle.loads(payload)  # the parent's own pickle, on a private pipe
    except Exception as err:  # a class this process cannot import, ...: the parent falls back
        result.loader_error = f"{type(err).__name__}: {str(err)[:300]}"
        return None


def run_resume(
    task: ResumeTask,
    checkpoint: Mapping[str, Any],
    result: TaskResult,
    progress: Progress,
    loaders_payload: bytes | None,
) -> None:
    """Rebuild the module and data as the script probably did (seed, module, data) and resume;
    when the data differ from the fit's after a seed, build the data first and resume again.
    With ``task.fit_loaders`` the training data are the loaders in ``loaders_payload``."""
    step, end = checkpoint.get("global_step"), task.trainer.get("max_steps")
    resuming = f"resuming the fit{'' if step is None else f' at update {step}'} until update {end}"
    for datamodule_first in (False, True):
        progress(
            "rebuilding the DataModule, then the module (the data differed)"
            if datamodule_first
            else "rebuilding the module and data"
        )
        loaders = None
        if task.fit_loaders:
            progress("unpickling the training loaders passed to fit")
            loaders = unpickle_loaders(loaders_payload, result)
            if loaders is None:
                return
        try:
            model, datamodule = _build(task, checkpoint, datamodule_first)
        except Exception as err:  # reported to the parent as "cannot rebuild"
            result.build_error = f"{type(err).__name__}: {err}"
            return
        progress(resuming)
        replay(task, result, model, datamodule, loaders)
        if (
            datamodule_first
            or task.dataset_fingerprint is None
            or result.dataset_fingerprint in (None, task.dataset_fingerprint)
            or datamodule is None
            or task.factory
            or os.environ.get("PL_GLOBAL_SEED") is None
        ):
            return
        result.build_order = "the DataModule before the module"


def run_artifact(
    task: ArtifactTask, checkpoint: Mapping[str, Any], result: TaskResult, progress: Progress
) -> None:
    """Load the final artifact into a fresh module and save its outputs on the control inputs."""
    progress("rebuilding the module")
    try:
        model, _ = _build(task, checkpoint, datamodule_first=False)
    except Exception as err:
        result.build_error = f"{type(err).__name__}: {err}"
        return
    progress("loading the artifact into it")
    weights = (
        checkpoint["state_dict"]
        if task.artifact == task.checkpoint
        else torch.load(task.artifact, map_location="cpu", weights_only=True)
    )
    dtype = getattr(torch, task.dtype or "", None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        model = model.to(dtype)  # as the live module was (precision="bf16-true", "16-true")
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        lines = str(err).splitlines()
        result.artifact_error = " ".join([lines[0], *(line.strip() for line in lines[1:3])])
        return
    progress("running it on the control inputs")
    model.eval()
    control = torch.load(task.control, map_location="cpu", weights_only=True)
    outputs = control_outputs(model, task.call, control)
    storage.publish_file(task.outputs, lambda handle: torch.save(outputs, handle))
    result.outputs = task.outputs


def _exit_with_parent(poll_s: float = 0.5) -> None:
    """End this process when the training process that started it is gone (killed), which
    would otherwise leave it running and holding its memory (on a GPU too)."""
    expected = os.environ.get(PARENT_PID)
    parent = int(expected) if expected and expected.isdigit() else os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(3)

    threading.Thread(target=watch, name="lightning-pilot-parent-watch", daemon=True).start()


def run_task(
    task: ResumeTask | ArtifactTask, progress: Progress, loaders_payload: bytes | None
) -> TaskResult:
    """One task's result; an exception of the user's code becomes its ``crash``."""
    result = TaskResult(kind=task.kind)
    try:
        progress("loading the checkpoint")
        checkpoint = load_checkpoint(task.checkpoint, result)
        if checkpoint is None:
            return result
        if isinstance(task, ResumeTask):
            run_resume(task, checkpoint, result, progress, loaders_payload)
        else:
            run_artifact(task, checkpoint, result, progress)
    except Exception as err:  # the user's code: reported whole
        result.crash = f"{type(err).__name__}: {err}"
        result.traceback = traceback.format_exc(limit=8)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the request named by the only argument and publish its result, printing progress
    marker lines on stderr as each task goes; :class:`ProtocolError` for an unusable request."""
    args = sys.argv[1:] if argv is None else argv
    request = Request.from_dict(storage.read_json(args[0], max_bytes=MAX_REQUEST_BYTES))
    sent = any(isinstance(t, ResumeTask) and t.fit_loaders for t in request.tasks)
    payload = sys.stdin.buffer.read() if sent else None
    warnings.simplefilter("ignore")
    _exit_with_parent()
    torch.set_num_threads(request.num_threads)
    total = len(request.tasks)
    results = []
    for index, task in enumerate(request.tasks):
        if isinstance(task, ResumeTask):
            where = f"task {index + 1} of {total}, resume from {Path(task.checkpoint).name}"
        else:
            where = f"task {index + 1} of {total}, artifact check of {Path(task.artifact).name}"

        def progress(phase: str, done: int = index, where: str = where) -> None:
            announce(done, total, f"{where}: {phase}")

        results.append(run_task(task, progress, payload))
    announce(total, total, "writing the answer")
    storage.publish_json(Result(tasks=tuple(results)).to_dict(), request.result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
