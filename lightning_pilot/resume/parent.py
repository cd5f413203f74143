"""The training process's side: start the new process (or one per DDP rank), read its answer,
and prepare and judge the artifact round trip."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import io
import itertools
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_pilot import storage
from lightning_pilot.callbacks._shared import evaluating, trainer_progress
from lightning_pilot.core.checks import CheckResult
from lightning_pilot.core.progress import Mark, Reporter, parse_marker
from lightning_pilot.core.resume import capture_rng, count_tensors, outputs_close, restore_rng
from lightning_pilot.ledger import file_sha256
from lightning_pilot.resume.protocol import (
    PARENT_PID,
    ArtifactTask,
    Request,
    Result,
    ResumeTask,
    TaskResult,
)
from lightning_pilot.resume.replay import control_calls, control_outputs, load_checkpoint, replay
from lightning_pilot.run import ExportFn, PilotRun

Task = ResumeTask | ArtifactTask

#: The largest answer read back: the records of a few hundred micro-batches are far smaller.
MAX_RESULT_BYTES: Final = 64 << 20
#: How often the training process looks at the new process while it waits (its progress lines,
#: the heartbeat, the timeout).
POLL_S: Final = 1.0
#: The last lines of each of the new process's streams kept for the error messages.
KEPT_LINES: Final = 2000
#: Who shows the new process's progress (docs/resume.md, "Progress").
PROGRESS_LABEL: Final = "ResumeVerifier"


def class_path(cls: type) -> str:
    """``"package.module:QualName"``, what a new process imports."""
    return f"{cls.__module__}:{cls.__qualname__}"


def _takes_arguments(cls: type) -> bool:
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters)


def rebuild_blocker(factory: str | None, pl_module: Any, datamodule: Any) -> str | None:
    """Why a new process cannot rebuild the module (and data), or ``None`` if it can."""
    if factory:
        return None
    objects = [o for o in (pl_module, datamodule) if o is not None]
    for path in (class_path(type(o)) for o in objects):
        if path.startswith("__main__:") or "<locals>" in path:
            return (
                f"{path} cannot be imported by a new process (defined in __main__ or inside a"
                " function)"
            )
    for obj in objects:
        if _takes_arguments(type(obj)) and not getattr(obj, "hparams", None):
            return (
                f"{class_path(type(obj))} takes constructor arguments but did not call"
                " save_hyperparameters(): a new process would build it with default arguments,"
                " which may be another model or other data; call self.save_hyperparameters() in"
                " its __init__"
            )
    return None


def fit_loaders(trainer: pl.Trainer) -> Any:
    """The training loaders passed straight to ``fit`` (as the fit used them), or ``None`` when a
    DataModule or the module's ``train_dataloader()`` gave the data."""
    instance = trainer.fit_loop._data_source.instance
    if instance is None or isinstance(instance, pl.LightningModule | pl.LightningDataModule):
        return None
    loaders = trainer.train_dataloader
    return loaders if loaders is not None else instance


#: What a loader gains by being iterated (a StatefulDataLoader keeps its iterator after a fit;
#: persistent workers' iterators hold processes): reset in the copies sent or compared.
_ITERATION_STATE: Final = {
    "_iterator": None,
    "_initial_iter_for_state_dict": False,
    "next_iter_state": None,
}


def as_built(loaders: Any) -> Any:
    """Shallow copies of ``loaders`` (a DataLoader, or a list, tuple or dict of them) without
    what iterating them left behind, as the script built them; other objects as they are."""
    if isinstance(loaders, DataLoader):
        clone = copy.copy(loaders)
        state = vars(clone)
        state.update({k: v for k, v in _ITERATION_STATE.items() if k in state})
        return clone
    if isinstance(loaders, Mapping):
        return {key: as_built(value) for key, value in loaders.items()}
    if isinstance(loaders, list | tuple):
        copies = [as_built(value) for value in loaders]
        return copies if isinstance(loaders, list) else tuple(copies)
    return loaders


class _Pickler(pickle.Pickler):
    """A pickler that notes the first class or function defined in ``__main__``: it pickles
    here, but a new process (whose ``__main__`` is the child module) cannot find it."""

    in_main: str | None = None

    def reducer_override(self, obj: Any) -> Any:
        if self.in_main is None and getattr(obj, "__module__", None) == "__main__":
            name = getattr(obj, "__qualname__", None)
            if isinstance(name, str) and (isinstance(obj, type) or callable(obj)):
                self.in_main = f"__main__.{name}"
        return NotImplemented


def pickle_loaders(loaders: Any) -> tuple[bytes | None, str | None]:
    """``loaders`` pickled for a new process, or ``None`` and why they cannot go there."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        pickler.dump(as_built(loaders))
    except Exception as err:  # the user's objects: any type (PicklingError, TypeError, ...)
        first = str(err).splitlines()[0][:300] if str(err) else ""
        return None, f"the loader is not picklable ({type(err).__name__}: {first})"
    if pickler.in_main is not None:
        return None, (
            f"the loader holds {pickler.in_main}, defined in __main__, which a new process"
            " cannot import"
        )
    return buffer.getvalue(), None


def launch(
    tasks: Sequence[Task],
    folder: Path,
    timeout_s: float,
    *,
    tag: str = "",
    env: dict[str, str] | None = None,
    progress: Reporter | None = None,
    stdin: bytes | None = None,
) -> list[TaskResult]:
    """Run ``tasks`` in one new process (request and answer in ``folder``): one result per task,
    a ``crash`` for each when the process fails to answer; its progress goes to ``progress``;
    ``stdin``: what it reads there (the pickled loaders of tasks with ``fit_loaders``)."""
    reporter = progress if progress is not None else Reporter()
    with reporter:
        results = _launch(tasks, folder, timeout_s, tag, env, reporter, stdin)
        failed = next((r.crash for r in results if r.crash is not None), None)
        reporter.close(
            "new process done" if failed is None else f"new process ended: {failed}",
            done=len(tasks),
        )
    return results


def _launch(
    tasks: Sequence[Task],
    folder: Path,
    timeout_s: float,
    tag: str,
    env: dict[str, str] | None,
    progress: Reporter,
    stdin: bytes | None = None,
) -> list[TaskResult]:
    request_path = folder / f"spec-tasks{tag}.json"
    result_path = folder / f"result-tasks{tag}.json"
    # An earlier attempt's answer must never be read as this one's.
    outputs = [Path(t.outputs) for t in tasks if isinstance(t, ArtifactTask)]
    for stale in (request_path, result_path, *outputs):
        stale.unlink(missing_ok=True)
    request = Request(
        tasks=tuple(tasks), result=str(result_path), num_threads=torch.get_num_threads()
    )
    try:
        storage.publish_json(request.to_dict(), request_path)
    except OSError as err:  # a full disk: no process to start; the tables will say so too
        return _crashed(tasks, f"the request {request_path.name} could not be written: {err}")
    # The new process imports what this one can: same interpreter, same import path.
    path = os.pathsep.join(p for p in sys.path if p)
    env = os.environ | {"PYTHONPATH": path, PARENT_PID: str(os.getpid())} | (env or {})
    command = [sys.executable, "-m", "lightning_pilot.resume.child", str(request_path)]
    progress.update(f"new process starting for {len(tasks)} task(s)", done=0)
    try:
        done = run_streaming(command, env, timeout_s, progress, stdin=stdin)
    except subprocess.TimeoutExpired:
        return _crashed(tasks, f"the new process did not finish within {timeout_s:.0f} s")
    if not result_path.exists():
        tail = (done.stderr or done.stdout or "").strip().splitlines()[-5:]
        return _crashed(tasks, f"the new process exited with {done.returncode}: {' | '.join(tail)}")
    return read_result(result_path, tasks)


def _read_lines(pipe: IO[str], kept: deque[str], marks: queue.SimpleQueue[Mark] | None) -> None:
    """Read ``pipe`` to its end (or closing): marker lines into ``marks`` if given, others kept."""
    with contextlib.suppress(OSError, ValueError):
        for line in pipe:
            mark = parse_marker(line) if marks is not None else None
            if marks is None or mark is None:
                kept.append(line)
            else:
                marks.put(mark)


def _show(marks: queue.SimpleQueue[Mark], progress: Reporter) -> None:
    while not marks.empty():
        mark = marks.get_nowait()
        progress.update(f"new process: {mark.message}", done=mark.done)


def _feed(pipe: Any, data: bytes) -> None:
    """Write ``data`` to the text-mode ``pipe``'s byte stream and close it; a process that ended
    before reading it all (its crash is the answer) is no error here."""
    with contextlib.suppress(OSError, ValueError), pipe:
        pipe.buffer.write(data)


def run_streaming(
    command: Sequence[str],
    env: Mapping[str, str],
    timeout_s: float,
    progress: Reporter,
    *,
    stdin: bytes | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` as ``subprocess.run(capture_output=True, text=True, timeout=timeout_s)``
    does (killed on any exception here), its stderr's progress markers sent to ``progress`` and
    left out of its output, of which the last :data:`KEPT_LINES` lines of each stream are kept;
    ``stdin`` (bytes) goes to its standard input through a pipe only the two processes hold."""
    process = subprocess.Popen(
        list(command),
        stdin=None if stdin is None else subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",  # a user's print of raw bytes: never a decoding error here
        env=dict(env),
    )
    if stdin is not None:
        threading.Thread(target=_feed, args=(process.stdin, stdin), daemon=True).start()
    stdout: deque[str] = deque(maxlen=KEPT_LINES)
    stderr: deque[str] = deque(maxlen=KEPT_LINES)
    marks: queue.SimpleQueue[Mark] = queue.SimpleQueue()
    readers = [
        threading.Thread(target=_read_lines, args=(process.stdout, stdout, None), daemon=True),
        threading.Thread(target=_read_lines, args=(process.stderr, stderr, marks), daemon=True),
    ]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                process.wait(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                _show(marks, progress)
                progress.tick()
                if time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(command, timeout_s) from None
    except BaseException:
        process.kill()
        process.wait()
        deadline = time.monotonic()  # the readers below then get POLL_S at most
        raise
    finally:
        # Its output to the end (a child of the process may hold the pipes: not past the deadline).
        for reader in readers:
            reader.join(timeout=max(POLL_S, deadline - time.monotonic()))
        _show(marks, progress)
    return subprocess.CompletedProcess(
        command, process.returncode, "".join(stdout), "".join(stderr)
    )


def read_result(path: Path, tasks: Sequence[Task]) -> list[TaskResult]:
    """The new process's answer to ``tasks``; an unusable answer (not JSON, too large, of the
    wrong shape, or for other tasks) gives every task a ``crash`` result that says why."""
    try:
        answers = Result.from_dict(storage.read_json(path, max_bytes=MAX_RESULT_BYTES))
    except (OSError, ValueError, RecursionError) as err:  # hostile or broken: ProtocolError too
        return _crashed(tasks, f"the new process's answer is unusable: {err}")
    if [a.kind for a in answers.tasks] != [t.kind for t in tasks]:
        return _crashed(tasks, "the new process answered other tasks than it was given")
    return list(answers.tasks)


def _crashed(tasks: Sequence[Task], why: str) -> list[TaskResult]:
    return [TaskResult(kind=t.kind, crash=why) for t in tasks]


@dataclass(frozen=True)
class Launcher:
    """How the training process gets its tasks run (the ResumeVerifier options of those names)."""

    factory: str | None
    fallback: Literal["none", "in_process"]
    timeout_s: float

    def run(self, tasks: Sequence[Task], trainer: pl.Trainer, pl_module: Any) -> list[TaskResult]:
        """Run every task in one new process (in this one when asked to and a new one cannot).

        Training loaders passed straight to ``fit`` go to the new process pickled, on its stdin;
        loaders that cannot (not picklable, or unpicklable there) are compared in this process.
        """
        datamodule = getattr(trainer, "datamodule", None)
        loaders = fit_loaders(trainer) if any(isinstance(t, ResumeTask) for t in tasks) else None
        payload, unsent = pickle_loaders(loaders) if loaders is not None else (None, None)
        results: list[TaskResult | None] = []
        runnable: dict[int, Task] = {}  # by position in results
        for task in tasks:
            artifact = isinstance(task, ArtifactTask)
            blocker = rebuild_blocker(self.factory, pl_module, None if artifact else datamodule)
            if blocker is None and isinstance(task, ResumeTask) and loaders is not None:
                if unsent is not None:  # the loaders cannot travel: compared here
                    results.append(_in_process(task, trainer, pl_module, _IN_HERE, unsent))
                    continue
                task = dataclasses.replace(task, fit_loaders=True)
            if blocker is None:
                runnable[len(results)] = task
                results.append(None)
            elif isinstance(task, ResumeTask) and self.fallback == "in_process":
                why = "the module cannot be rebuilt in a new process (fallback='in_process')"
                results.append(
                    _in_process(task, trainer, pl_module, why=why if loaders is not None else None)
                )
            else:
                hint = "; or pass factory=..." if artifact else _FALLBACK_HINT
                results.append(TaskResult(kind=task.kind, blocked=blocker + hint))
        if runnable:
            sent = any(isinstance(t, ResumeTask) and t.fit_loaders for t in runnable.values())
            answers = self._launch([*runnable.values()], trainer, stdin=payload if sent else None)
            for (index, task), answer in zip(runnable.items(), answers, strict=True):
                results[index] = answer
                if not isinstance(task, ResumeTask) or not task.fit_loaders:
                    continue
                if answer.loader_error is not None:  # e.g. a class the new process cannot import
                    why = f"the new process could not unpickle the loader ({answer.loader_error})"
                    results[index] = _in_process(task, trainer, pl_module, _IN_HERE, why)
                else:
                    built = answer.crash is None and answer.build_error is None
                    answer.data_source = (
                        f"loaders passed to fit: {'rebuilt in' if built else 'sent to'} the new"
                        f" process from a private pickle ({len(payload or b'')} bytes, on its"
                        " stdin)"
                    )
        return [r for r in results if r is not None]

    def run_per_rank(
        self, tasks: Sequence[ResumeTask], trainer: pl.Trainer, pl_module: Any
    ) -> list[TaskResult]:
        """Resume in one new process per rank, with its rank's environment: together a DDP group
        shaped like the fit's. Every rank calls it at once (rank 0 broadcasts the group's port)."""
        port = trainer.strategy.broadcast(_free_port() if trainer.is_global_zero else 0, src=0)
        blocker = rebuild_blocker(self.factory, pl_module, getattr(trainer, "datamodule", None))
        if blocker is None and self.factory is None and fit_loaders(trainer) is not None:
            blocker = (
                "the training data was passed to fit() as loaders, which are not sent to the"
                " per-rank new processes"
            )
        if blocker is not None:  # the same on every rank: no rank waits for another
            why = (
                f"{blocker}: pass ResumeVerifier(factory='package.module:function'); under"
                " several processes the check needs one new process per rank"
            )
            return [TaskResult(kind="resume", blocked=why) for _ in tasks]
        strategy = trainer.strategy
        assert isinstance(strategy, DDPStrategy)
        ddp = getattr(strategy, "model", None)
        # The fit's devices (indices, not only how many) and its DDP options, as far as public.
        devices = trainer.num_devices if strategy.root_device.type == "cpu" else trainer.device_ids
        ddp_options = {
            "process_group_backend": strategy.process_group_backend,
            "find_unused_parameters": bool(getattr(ddp, "find_unused_parameters", False)),
            "static_graph": bool(getattr(ddp, "static_graph", False)),
        }
        rank = trainer.global_rank
        tasks = [
            dataclasses.replace(
                task,
                workdir=f"{task.workdir}-rank{rank}",
                trainer=task.trainer | {"devices": devices, "num_nodes": trainer.num_nodes},
                ddp=ddp_options,
            )
            for task in tasks
        ]
        env = {
            "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(trainer.world_size),
            "RANK": str(rank),
            "LOCAL_RANK": str(trainer.local_rank),
            "NODE_RANK": str(trainer.node_rank),
            "GROUP_RANK": str(trainer.node_rank),
            "LOCAL_WORLD_SIZE": str(trainer.num_devices),
            # torchrun's default: the group's store would be expected from an agent on this port.
            "TORCHELASTIC_USE_AGENT_STORE": "False",
        }
        results = self._launch(tasks, trainer, tag=f"-rank{rank}", env=env)
        for result in results:
            result.where = f"{trainer.world_size} new processes (one per rank, DDP)"
        return results

    def _launch(
        self, tasks: Sequence[Task], trainer: pl.Trainer, **options: Any
    ) -> list[TaskResult]:
        """:func:`launch` beside the checkpoints, its progress shown as the Trainer shows its own
        (rank 0's own process only)."""
        folder = Path(tasks[0].checkpoint).parent
        progress = trainer_progress(trainer, len(tasks), PROGRESS_LABEL)
        return launch(tasks, folder, self.timeout_s * len(tasks), progress=progress, **options)


#: What to do when the module cannot be rebuilt in a new process.
_FALLBACK_HINT: Final = (
    ": pass ResumeVerifier(factory='package.module:function'), or fallback='in_process' to"
    " compare in this process (weaker: shared globals)"
)
#: Where a comparison of loaders passed to ``fit`` that cannot travel runs.
_IN_HERE: Final = "this process (in-process comparison)"


def _in_process(
    task: ResumeTask,
    trainer: pl.Trainer,
    pl_module: Any,
    where: str = "the in-process fallback",
    why: str | None = None,
) -> TaskResult:
    """The in-process comparison: copies of the live objects, this process's RNG put back after;
    ``why``: the reason the loaders passed to ``fit`` are compared here."""
    result = TaskResult(kind="resume", where=where)
    if why is not None:
        result.data_source = f"loaders passed to fit: compared in-process: {why}"
    live = getattr(trainer, "datamodule", None)
    datamodule = copy.copy(live) if live is not None else None
    loaders = None
    passed = fit_loaders(trainer) if datamodule is None else None
    if passed is not None:
        try:
            loaders = copy.deepcopy(as_built(passed))
        except Exception as err:  # the user's objects: any type
            result.crash = (
                f"cannot copy the training loader for the in-process comparison"
                f" ({type(err).__name__}: {err}): pass"
                " ResumeVerifier(factory='package.module:function')"
            )
            return result
    model = copy.deepcopy(pl_module)
    saved = capture_rng()
    try:
        if load_checkpoint(task.checkpoint, result) is not None:
            replay(task, result, model, datamodule, loaders)
    except Exception as err:  # the user's code, in this process: an answer, not a crash
        result.crash = f"{type(err).__name__}: {err}"
    finally:
        restore_rng(saved)
    return result


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def final_artifact(
    run: PilotRun, trainer: pl.Trainer, pl_module: Any, export: ExportFn | None
) -> tuple[Path | None, str | None]:
    """Write the final artifact (the attempt's final checkpoint, saved by every rank: a
    collective; or the file :meth:`PilotRun.export` returns); its path, or why export failed."""
    checkpoint = storage.work_folder(run.run_dir, "resume") / f"final-attempt-{run.attempt}.ckpt"
    if not checkpoint.exists():
        trainer.save_checkpoint(checkpoint, weights_only=False)  # full, and said so
    if export is None:
        return checkpoint, None
    path, error = run.export(export, trainer, pl_module)
    if path is not None and not path.is_file():
        error = f"export(pl_module, directory) returned {str(path)!r}, which is not a file"
    return path, error


_PROBE_REMEDY: Final = (
    "define predict_step(self, batch, batch_idx) returning the model's outputs on a batch,"
    " or pass ResumeVerifier(check_artifact=False)"
)


@dataclass
class ArtifactProbe:
    """The artifact round trip's task for the new process and the live outputs to compare
    with, or the verdict that ends it early."""

    artifact: Path
    checksum: str
    task: ArtifactTask | None = None
    live: list[Any] = field(default_factory=list)
    early: CheckResult | None = None

    def _stop(self, why: str) -> ArtifactProbe:
        self.early = CheckResult("artifact_roundtrip", "not_checked", why)
        return self


def _control_batches(trainer: pl.Trainer, count: int) -> list[Any]:
    loaders = trainer.val_dataloaders
    if isinstance(loaders, list | tuple):
        loaders = loaders[0] if loaders else None
    loaders = loaders or trainer.train_dataloader
    batches = itertools.islice(loaders if loaders is not None else (), count)
    return [_to_cpu(batch) for batch in batches]


def _to_cpu(value: Any) -> Any:
    """Tensors on the CPU, containers as plain dicts and lists, anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_cpu(v) for v in value]
    return value


def _live_outputs(pl_module: Any, batches: list[Any]) -> tuple[str, list[Any]]:
    """The first way to call the live module (on the CPU after teardown) that works on every
    control batch, and its outputs; ``RuntimeError`` naming each attempt's error if none does."""
    errors = []
    with evaluating(pl_module):
        for call in control_calls(pl_module, batches[0]):
            try:
                return call, control_outputs(pl_module, call, batches)
            except Exception as err:  # the user's code: each failure is part of the answer
                errors.append(f"{call} raised {type(err).__name__}: {str(err)[:200]}")
    raise RuntimeError("; ".join(errors))


def prepare_artifact(
    run: PilotRun,
    trainer: pl.Trainer,
    pl_module: Any,
    artifact: Path,
    factory: str | None,
    control_batches: int,
) -> ArtifactProbe:
    """Record the live outputs on the control inputs and the task for the new process."""
    checksum = file_sha256(artifact)
    run.set_ledger_fields(checkpoint_uri=str(artifact), checkpoint_sha256=checksum)
    probe = ArtifactProbe(artifact, checksum)
    try:
        batches = _control_batches(trainer, control_batches)
    except Exception as err:  # the user's loader
        return probe._stop(
            f"reading the control batches from the validation (else training) loader raised"
            f" {type(err).__name__}: {err}"
        )
    if not batches:
        return probe._stop("no loader gave a control batch")
    try:
        call, probe.live = _live_outputs(pl_module, batches)
    except RuntimeError as err:
        return probe._stop(
            f"the live module could not be run on a control batch ({err}): {_PROBE_REMEDY}"
        )
    if count_tensors(probe.live) == 0:
        return probe._stop(f"{call} returned no tensor to compare: {_PROBE_REMEDY}")
    folder = storage.work_folder(run.run_dir, "resume")
    control = folder / "control.pt"
    control.unlink(missing_ok=True)
    storage.publish_file(control, lambda handle: torch.save(batches, handle))
    try:  # the new process loads them with weights_only=True: so must they load here
        torch.load(control, map_location="cpu", weights_only=True)
    except Exception as err:  # a batch of custom objects (a dataclass): not comparable
        return probe._stop(
            f"the control batches hold objects torch.load(weights_only=True) refuses"
            f" ({type(err).__name__}: {str(err).splitlines()[0][:200]}); batches of tensors,"
            " numbers, strings, lists and dicts can be carried to a new process safely"
        )
    floats = [p.dtype for p in pl_module.parameters() if p.is_floating_point()]
    probe.task = ArtifactTask(
        checkpoint=str(folder / f"final-attempt-{run.attempt}.ckpt"),
        artifact=str(artifact),
        control=str(control),
        call=call,
        outputs=str(folder / "control-outputs.pt"),
        module_class=class_path(type(pl_module)),
        factory=factory,
        # The live module's floating dtype (bf16-true, 16-true): the rebuilt one is cast to it.
        dtype=str(floats[0]).removeprefix("torch.") if floats else None,
    )
    return probe


def judge_artifact(
    probe: ArtifactProbe, result: TaskResult, atol: float, rtol: float
) -> CheckResult:
    """The artifact round trip's verdict from the new process's answer."""
    name, checksum = probe.artifact.name, probe.checksum
    check = functools.partial(CheckResult, "artifact_roundtrip")
    if result.blocked is not None:
        return check("not_checked", result.blocked)
    failure = result.load_error or result.build_error or result.artifact_error or result.crash
    if result.load_error is not None:
        failure = f"{failure} (unsafe globals: {', '.join(result.unsafe_globals)})"
    if failure is None and (result.outputs is None or probe.task is None):
        failure = "the new process saved no outputs"
    if failure is not None:
        return check(
            "fail", f"{name} (sha256 {checksum[:16]}) did not reload into a fresh module: {failure}"
        )
    assert probe.task is not None
    reloaded = torch.load(probe.task.outputs, map_location="cpu", weights_only=True)
    call = probe.task.call
    if outputs_close(probe.live, reloaded, atol, rtol):
        return check(
            "pass",
            f"{name} sha256 {checksum} reproduces the live outputs ({call}) on"
            f" {len(probe.live)} control batch(es)",
        )
    return check(
        "fail",
        f"{name} (sha256 {checksum[:16]}) reloaded, but its outputs ({call}) on the control"
        " inputs differ from the live model's: the artifact misses state the model uses",
    )
