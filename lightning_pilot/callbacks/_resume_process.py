"""ResumeVerifier's process work: launching the new process, its fallback, the artifact trip.

Private to :mod:`lightning_pilot.callbacks.resume_verifier`; kept apart so the callback module
stays hook glue.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_pilot import resume_child
from lightning_pilot.core.checks import CheckResult
from lightning_pilot.core.resume import capture_rng, plain_values, restore_rng
from lightning_pilot.ledger import file_sha256
from lightning_pilot.resume_child import PARENT_PID

if TYPE_CHECKING:
    from lightning_pilot.callbacks.resume_verifier import ResumeVerifier


def _not_importable(spec: Mapping[str, Any]) -> str | None:
    """Why a new process cannot rebuild the module and data, or None if it can."""
    if spec.get("factory"):
        return None
    for key in ("module_class", "datamodule_class"):
        path = spec.get(key)
        if path and (path.startswith("__main__:") or "<locals>" in path):
            return (
                f"{path} cannot be imported by a new process (defined in __main__ or inside a"
                " function)"
            )
    for key in ("module_class", "datamodule_class"):
        if spec.get(key) and spec.get(f"{key}_unsaved_args"):
            return (
                f"{spec[key]} takes constructor arguments but did not call"
                " save_hyperparameters(): a new process would build it with default arguments,"
                " which may be another model or other data; call self.save_hyperparameters() in"
                " its __init__"
            )
    if (
        spec["mode"] == "resume"
        and not spec.get("datamodule_class")
        and not spec.get("module_has_data")
    ):
        return (
            "the training data was passed to fit() as loaders, which a new process cannot rebuild"
        )
    return None


def _takes_arguments(cls: type) -> bool:
    try:
        parameters = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return False
    return any(
        p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        for p in parameters
    )


def unsaved_arguments(pl_module: Any, datamodule: Any) -> dict[str, bool]:
    """Whether the module / datamodule take constructor arguments they did not save."""
    flags = {
        "module_class_unsaved_args": _takes_arguments(type(pl_module)) and not pl_module.hparams
    }
    if datamodule is not None:
        flags["datamodule_class_unsaved_args"] = _takes_arguments(type(datamodule)) and not getattr(
            datamodule, "hparams", None
        )
    return flags


def _subprocess(
    spec: dict[str, Any], folder: Path, timeout_s: float, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{spec['mode']}{spec.get('tag', '')}"
    spec_path = folder / f"spec-{name}.json"
    result_path = folder / f"result-{name}.json"
    spec = spec | {"result": str(result_path)}
    # An earlier attempt's answer must never be read as this one's (a child that dies before
    # it writes leaves no result): remove what a previous run of this spec left.
    result_path.unlink(missing_ok=True)
    for task in spec.get("tasks") or [spec]:
        if task.get("outputs"):
            Path(task["outputs"]).unlink(missing_ok=True)
    spec_path.write_text(json.dumps(spec, default=str))
    # The new process imports what this one can: same interpreter, same import path.
    env = (
        os.environ
        | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p), PARENT_PID: str(os.getpid())}
        | dict(env or {})
    )
    try:
        done = subprocess.run(
            [sys.executable, "-m", "lightning_pilot.resume_child", str(spec_path)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"crash": f"the new process did not finish within {timeout_s:.0f} s"}
    if not result_path.exists():
        tail = (done.stderr or done.stdout or "").strip().splitlines()[-5:]
        return {"crash": f"the new process exited with {done.returncode}: {' | '.join(tail)}"}
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result


def run_tasks(
    verifier: ResumeVerifier, specs: list[dict[str, Any]], trainer: pl.Trainer, pl_module: Any
) -> list[dict[str, Any]]:
    """Run every task in one new process (in this one when asked to and a new one cannot).

    One interpreter start and one import of the user's code serve every probe checkpoint and
    the artifact. Returns one result per spec, in order.
    """
    results: list[dict[str, Any] | None] = [None] * len(specs)
    runnable: list[int] = []
    for index, spec in enumerate(specs):
        blocker = _not_importable(spec)
        if blocker is None:
            runnable.append(index)
        elif spec["mode"] == "artifact":
            results[index] = {"blocked": f"{blocker}; or pass factory=..."}
        elif verifier.fallback != "in_process":
            results[index] = {
                "blocked": f"{blocker}: pass ResumeVerifier(factory='package.module:function'),"
                " or fallback='in_process' to compare in this process (weaker: shared globals)"
            }
        else:
            results[index] = _in_process(spec, trainer, pl_module)
    if runnable:
        batch = {
            "mode": "tasks",
            "tag": "",
            "tasks": [specs[i] for i in runnable],
            "num_threads": torch.get_num_threads(),
        }
        folder = Path(specs[runnable[0]]["checkpoint"]).parent
        answer = _subprocess(batch, folder, verifier.timeout_s * len(runnable))
        answers = answer.get("results") or [answer] * len(runnable)
        for index, one in zip(runnable, answers, strict=False):
            results[index] = dict(one) | {"mode_label": "a new process"}
    return [r if r is not None else {"crash": "no result"} for r in results]


def _in_process(spec: dict[str, Any], trainer: pl.Trainer, pl_module: Any) -> dict[str, Any]:
    """The in-process fallback: copies of the live objects, this process's RNG put back after."""
    live_datamodule = getattr(trainer, "datamodule", None)
    datamodule = copy.copy(live_datamodule) if live_datamodule is not None else None
    loaders = None
    if datamodule is None and not spec.get("module_has_data"):
        try:
            loaders = copy.deepcopy(trainer.train_dataloader)
        except (TypeError, NotImplementedError, RuntimeError) as err:
            return {
                "crash": f"cannot copy the training loader for the in-process fallback"
                f" ({err}): pass ResumeVerifier(factory='package.module:function')"
            }
    objects = (copy.deepcopy(pl_module), datamodule, loaders)
    saved = capture_rng()
    result: dict[str, Any] = {"mode": "resume", "mode_label": "the in-process fallback"}
    try:
        resume_child.run_resume(spec | {"factory": None}, result, objects=objects)
    except Exception as err:  # the user's code, in this process: an answer, not a crash
        result["crash"] = f"{type(err).__name__}: {err}"
    finally:
        restore_rng(saved)
    return result


def replays_every_rank(trainer: pl.Trainer) -> bool:
    """Whether the resume is checked as the fit runs: one new process per rank, a DDP group."""
    return trainer.world_size > 1 and isinstance(trainer.strategy, DDPStrategy)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        port: int = probe.getsockname()[1]
        return port


def run_children_per_rank(
    verifier: ResumeVerifier, specs: list[dict[str, Any]], trainer: pl.Trainer
) -> list[dict[str, Any]]:
    """Resume in one new process per rank: together a DDP group shaped like the fit's.

    Every rank calls this at the same update (it holds a collective: the port of the new
    group, chosen by rank 0). Each new process gets its rank's environment (rank, local rank,
    node rank, world size, the new group's address), so Lightning starts no processes of its
    own and each rank reads its own shard of the data again, on its own device.
    """
    port = trainer.strategy.broadcast(_free_port() if trainer.is_global_zero else 0, src=0)
    blocker = _not_importable(specs[0])
    if blocker is not None:  # the same on every rank: no rank waits for another
        blocked = {
            "blocked": f"{blocker}: pass ResumeVerifier(factory='package.module:function'); under"
            " several processes the check needs one new process per rank"
        }
        return [dict(blocked) for _ in specs]
    rank = trainer.global_rank
    strategy = trainer.strategy
    assert isinstance(strategy, DDPStrategy)
    ddp = getattr(strategy, "model", None)
    # The fit's devices (indices, not only how many) and its DDP options, as far as public.
    devices = (
        trainer.num_devices if trainer.strategy.root_device.type == "cpu" else trainer.device_ids
    )
    ddp_options = {
        "process_group_backend": strategy.process_group_backend,
        "find_unused_parameters": bool(getattr(ddp, "find_unused_parameters", False)),
        "static_graph": bool(getattr(ddp, "static_graph", False)),
    }
    tasks = [
        spec
        | {
            "workdir": f"{spec['workdir']}-rank{rank}",
            "trainer": dict(spec["trainer"]) | {"devices": devices, "num_nodes": trainer.num_nodes},
            "ddp": ddp_options,
        }
        for spec in specs
    ]
    batch = {
        "mode": "tasks",
        "tag": f"-rank{rank}",
        "tasks": tasks,
        "checkpoint": specs[0]["checkpoint"],
        "num_threads": torch.get_num_threads(),
    }
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
    folder = Path(specs[0]["checkpoint"]).parent
    answer = _subprocess(batch, folder, verifier.timeout_s * len(specs), env=env)
    label = f"{trainer.world_size} new processes (one per rank, DDP)"
    answers = answer.get("results") or [answer] * len(specs)
    return [dict(one) | {"mode_label": label, "per_rank": True} for one in answers]


def final_artifact(
    verifier: ResumeVerifier, trainer: pl.Trainer, pl_module: Any
) -> tuple[Path, str | None]:
    """Write the final artifact and return its path, with why the user's export failed if it did.

    Every rank saves the final checkpoint (saving is a collective); the user's ``export`` runs
    on global rank 0 only (every rank writing one file at once would leave rank 0 hashing a
    half-written file), then every rank waits for it. An exception from ``export`` (an
    ``OSError`` too: it is the user's code) is returned as text, never raised.
    """
    folder = verifier.run.run_dir / "resume"
    folder.mkdir(parents=True, exist_ok=True)
    # One final checkpoint per attempt: a resumed fit must not re-read an earlier attempt's.
    checkpoint = folder / f"final-attempt-{verifier.run.attempt}.ckpt"
    if not checkpoint.exists():
        trainer.save_checkpoint(checkpoint, weights_only=False)  # full, and said so
    if verifier.export is None:
        return checkpoint, None
    path, error = checkpoint, None
    if verifier.run.is_global_zero:
        try:
            path = Path(os.fspath(verifier.export(pl_module, folder)))
        except Exception as err:  # the user's export function
            error = f"export(pl_module, folder) raised {type(err).__name__}: {err}"
        else:
            if not path.is_file():
                error = f"export(pl_module, folder) returned {str(path)!r}, which is not a file"
    if trainer.world_size > 1:
        trainer.strategy.barrier("lightning_pilot.final_artifact")
    return path, error


def _control_batches(trainer: pl.Trainer, count: int) -> list[Any]:
    loaders = trainer.val_dataloaders
    if isinstance(loaders, list | tuple):
        loaders = loaders[0] if loaders else None
    if not loaders:
        loaders = trainer.train_dataloader
    batches: list[Any] = []
    if loaders is None:
        return batches
    for batch in loaders:
        batches.append(batch)
        if len(batches) >= count:
            break
    return batches


def _close(a: Any, b: Any, atol: float, rtol: float) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point():
            return bool(torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True))
        return bool(torch.equal(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_close(a[k], b[k], atol, rtol) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_close(x, y, atol, rtol) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_cpu(v) for v in value]
    return value


_PROBE_REMEDY = (
    "define predict_step(self, batch, batch_idx) returning the model's outputs on a batch,"
    " or pass ResumeVerifier(check_artifact=False)"
)


@dataclass
class ArtifactProbe:
    """The artifact round trip prepared in the training process: a spec for the new process,
    the live outputs to compare with, or the verdict that ends it early."""

    artifact: Path
    checksum: str
    spec: dict[str, Any] | None = None
    live: list[Any] = field(default_factory=list)
    early: CheckResult | None = None


def _live_outputs(pl_module: Any, batches: list[Any]) -> tuple[str, list[Any]]:
    """Run the live module on the control batches (on the CPU, where Lightning's teardown put
    it), trying each way of calling it; the first that works for every batch is the answer.

    Raises:
        RuntimeError: no way worked; the message names each attempt's error.
    """
    errors = []
    was_training = pl_module.training
    pl_module.eval()
    try:
        for call in resume_child.control_calls(pl_module, batches[0]):
            try:
                with torch.no_grad():
                    outputs = [
                        plain_values(resume_child.control_outputs(pl_module, batch, call, index))
                        for index, batch in enumerate(batches)
                    ]
            except Exception as err:  # the user's code: each failure is part of the answer
                errors.append(f"{call} raised {type(err).__name__}: {str(err)[:200]}")
                continue
            return call, outputs
    finally:
        pl_module.train(was_training)
    raise RuntimeError("; ".join(errors))


def prepare_artifact(
    verifier: ResumeVerifier, trainer: pl.Trainer, pl_module: Any, artifact: Path
) -> ArtifactProbe:
    """Record the live outputs on the control inputs and write the new process's spec."""
    folder = artifact.parent
    checksum = file_sha256(artifact)
    verifier.run.set_ledger_fields(checkpoint_uri=str(artifact), checkpoint_sha256=checksum)
    probe = ArtifactProbe(artifact, checksum)
    try:
        batches = [_to_cpu(b) for b in _control_batches(trainer, verifier.control_batches)]
    except Exception as err:  # the user's loader
        probe.early = CheckResult(
            "artifact_roundtrip",
            "not_checked",
            f"reading the control batches from the validation (else training) loader raised"
            f" {type(err).__name__}: {err}",
        )
        return probe
    if not batches:
        probe.early = CheckResult(
            "artifact_roundtrip", "not_checked", "no loader gave a control batch"
        )
        return probe
    try:
        call, probe.live = _live_outputs(pl_module, batches)
    except RuntimeError as err:
        probe.early = CheckResult(
            "artifact_roundtrip",
            "not_checked",
            f"the live module could not be run on a control batch ({err}): {_PROBE_REMEDY}",
        )
        return probe
    if resume_child.count_tensors(probe.live) == 0:
        probe.early = CheckResult(
            "artifact_roundtrip",
            "not_checked",
            f"{call} returned no tensor to compare: {_PROBE_REMEDY}",
        )
        return probe
    control = folder / "control.pt"
    torch.save(batches, control)
    try:  # the new process loads them with weights_only=True: so must they load here
        torch.load(control, map_location="cpu", weights_only=True)
    except Exception as err:  # a batch of custom objects (a dataclass): not comparable
        probe.early = CheckResult(
            "artifact_roundtrip",
            "not_checked",
            f"the control batches hold objects torch.load(weights_only=True) refuses"
            f" ({type(err).__name__}: {str(err).splitlines()[0][:200]}); batches of tensors,"
            " numbers, strings, lists and dicts can be carried to a new process safely",
        )
        return probe
    floats = [p.dtype for p in pl_module.parameters() if p.is_floating_point()]
    probe.spec = {
        "mode": "artifact",
        "checkpoint": str(folder / f"final-attempt-{verifier.run.attempt}.ckpt"),
        "artifact": str(artifact),
        "control": str(control),
        "call": call,
        # The live module's floating dtype (bf16-true, 16-true): the rebuilt one is cast to it.
        "dtype": str(floats[0]).removeprefix("torch.") if floats else None,
        "outputs": str(folder / "control-outputs.pt"),
        "factory": verifier.factory,
        "module_class": f"{type(pl_module).__module__}:{type(pl_module).__qualname__}",
        "datamodule_class": None,
        "num_threads": torch.get_num_threads(),
        "state_key": verifier.state_key,
        "workdir": str(folder / "child"),
    } | unsaved_arguments(pl_module, None)
    return probe


def judge_artifact(
    verifier: ResumeVerifier, probe: ArtifactProbe, result: Mapping[str, Any]
) -> CheckResult:
    """The artifact round trip's verdict from the new process's answer."""
    name, checksum = probe.artifact.name, probe.checksum
    if "blocked" in result:
        return CheckResult("artifact_roundtrip", "not_checked", str(result["blocked"]))
    for key in ("load_error", "build_error", "artifact_error", "crash"):
        if key in result:
            extra = ""
            if key == "load_error":
                extra = f" (unsafe globals: {', '.join(result.get('unsafe_globals') or [])})"
            return CheckResult(
                "artifact_roundtrip",
                "fail",
                f"{name} (sha256 {checksum[:16]}) did not reload into a fresh"
                f" module: {result[key]}{extra}",
            )
    reloaded = torch.load(result["outputs"], map_location="cpu", weights_only=True)
    call = probe.spec["call"] if probe.spec else "predict_step"
    if _close(probe.live, reloaded, verifier.atol, verifier.rtol):
        return CheckResult(
            "artifact_roundtrip",
            "pass",
            f"{name} sha256 {checksum} reproduces the live outputs ({call}) on"
            f" {len(probe.live)} control batch(es)",
        )
    return CheckResult(
        "artifact_roundtrip",
        "fail",
        f"{name} (sha256 {checksum[:16]}) reloaded, but its outputs ({call}) on the control"
        " inputs differ from the live model's: the artifact misses state the model uses",
    )
