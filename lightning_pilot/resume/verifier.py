"""ResumeVerifier: prove resume in a new process, then re-read the final artifact."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_pilot import storage
from lightning_pilot.core import validate
from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.checks import CheckResult
from lightning_pilot.core.phases import judge
from lightning_pilot.core.resume import (
    StepRecord,
    capture_rng,
    compare_trajectories,
    content_keys,
    dataset_fingerprint,
    digest,
    json_id,
    restore_rng,
    rng_of_this_rank,
    unsafe_values,
)
from lightning_pilot.resume import parent
from lightning_pilot.resume.protocol import ResumeTask, State, TaskResult
from lightning_pilot.resume.replay import finished, started, state_of
from lightning_pilot.run import ExportFn, PilotCallback
from lightning_pilot.schemas import RESUME_SCHEMA

log = logging.getLogger(__name__)

_STATE_REMEDIES = {
    "global_step": "the loop progress was not restored: resume with trainer.fit(ckpt_path=...)",
    "epoch": "the epoch counter was not restored",
    "lrs": "the learning rate differs after the resume: check on_load_checkpoint and the"
    " scheduler's state (is it saved and restored?)",
    "optimizer_state": "the optimizer state differs after the resume: something resets or"
    " rebuilds the optimizer (on_load_checkpoint, configure_optimizers depending on state)",
    "scheduler_state": "the LR scheduler state differs after the resume",
    "grad_scaler": "the GradScaler state differs after the resume",
    "weights": "the weights differ after the resume: the state_dict did not load as saved",
    "rng": "the RNG states differ after the resume: keep ResumeVerifier in the resumed Trainer"
    " so it restores them at train start",
}

#: Why a ReduceLROnPlateau stepped per update fails ``lr_trajectory`` (Lightning 2.6's
#: ``training_epoch_loop``: other schedulers step before ``on_train_batch_end``, plateau ones
#: in ``on_advance_end``, after it).
_PLATEAU_ON_STEP = (
    "; a ReduceLROnPlateau with interval='step' is stepped by Lightning after"
    " on_train_batch_end, where checkpoints are saved (ModelCheckpoint's too), so a mid-epoch"
    " checkpoint holds it before that update's step and the resumed fit never makes it: every"
    " resume from such a checkpoint trains with other learning rates; use interval='epoch',"
    " or save checkpoints at epoch ends"
)


def _factory(value: object) -> str | None:
    """``"package.module:function"``: dotted identifiers on both sides of one colon."""
    owner, expected = "ResumeVerifier", "'package.module:function'"
    factory = validate.text(owner, "factory", value, optional=True, hint=expected)
    if factory is None:
        return None
    module, colon, function = factory.partition(":")
    parts = [*module.split("."), *function.split(".")]
    if not colon or not all(part.isidentifier() for part in parts):
        raise ValueError(validate.invalid(owner, "factory", value, expected))
    return factory


class ResumeVerifier(PilotCallback):
    """Resume a checkpoint in a genuinely new process and compare it with the reference run.

    Probes at update ``at_step`` and the first epoch's end, ``compare_steps`` updates compared,
    the final artifact reloaded; ``factory`` (``"package.module:function"``) builds the module
    there; ``atol``/``rtol`` (0 = exact) bound the comparisons (docs/resume.md).

    Example:
        >>> ResumeVerifier(at_step=2, compare_steps=3).state_key
        "ResumeVerifier{'at_step': 2, 'compare_steps': 3}"
    """

    def __init__(
        self,
        *,
        at_step: int = 2,
        compare_steps: int = 2,
        factory: str | None = None,
        fallback: Literal["none", "in_process"] = "none",
        atol: float = 0.0,
        rtol: float = 0.0,
        epoch_boundary: bool = True,
        check_artifact: bool = True,
        export: ExportFn | None = None,
        control_batches: int = 1,
        timeout_s: float = 600.0,
        adapter: BatchAdapter | None = None,
        out_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        owner = "ResumeVerifier"
        super().__init__(out_dir=out_dir)
        self.at_step = validate.integer(owner, "at_step", at_step, minimum=1)
        self.compare_steps = validate.integer(owner, "compare_steps", compare_steps, minimum=1)
        self.factory = _factory(factory)
        self.fallback: Literal["none", "in_process"] = validate.choice(
            owner, "fallback", fallback, ("none", "in_process")
        )
        self.atol = validate.number(owner, "atol", atol, minimum=0, hint="0 = exact")
        self.rtol = validate.number(owner, "rtol", rtol, minimum=0, hint="0 = exact")
        self.epoch_boundary = validate.boolean(owner, "epoch_boundary", epoch_boundary)
        self.check_artifact = validate.boolean(owner, "check_artifact", check_artifact)
        self.export = validate.callable_or_none(
            owner, "export", export, "a callable fn(pl_module, directory) -> path"
        )
        self.control_batches = validate.integer(
            owner, "control_batches", control_batches, minimum=1
        )
        self.timeout_s = validate.number(
            owner, "timeout_s", timeout_s, minimum=0, allow_minimum=False, hint="seconds"
        )
        validate.instance(owner, "adapter", adapter, BatchAdapter)
        self.adapter = adapter or BatchAdapter()
        self._pending_rng: Mapping[str, Any] | None = None  # loaded states: outlive _reset
        self._reset()

    def _reset(self) -> None:
        self._saved_rng_digest: str | None = None
        self._saving = False
        self._unsafe: list[str] = []
        self._probes: list[_Probe] = []
        # This epoch's ids as the batches held them (a set only at a checkpoint), and its head's.
        self._epoch_ids: list[Any] = []
        self._epoch_head: list[Any] = []
        self._boundary_reachable = True
        self._current: StepRecord | None = None
        self._head_left = self._batch_step = self._step_at_start = self._epoch_at_start = 0
        self._results: list[CheckResult] = []
        self._load_row: TaskResult | None = None

    @override
    def _state_key_fields(self) -> dict[str, Any]:
        return {"at_step": self.at_step, "compare_steps": self.compare_steps}

    @override
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict() | {"rng": capture_rng()}
        if not self._saving:
            return state
        self._saved_rng_digest = digest(state["rng"])
        if self.run.world_size > 1 and torch.distributed.is_initialized():
            # Every rank saves a probe at once: keep each rank's states for its resumed copy.
            by_rank: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(by_rank, state["rng"])
            state["rng_by_rank"] = by_rank
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._pending_rng = rng_of_this_rank(state_dict)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._saving:
            self._unsafe = unsafe_values(checkpoint)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        previous = self._run
        super().setup(trainer, pl_module, stage)
        if self.run is not previous:
            self._reset()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending_rng is not None:
            # Restored here, not in load_state_dict: the loop consumes RNG in between.
            restore_rng(self._pending_rng)
            self._pending_rng = None
        self._step_at_start = trainer.global_step
        self._epoch_at_start = trainer.current_epoch

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_ids, self._epoch_head = [], []
        self._head_left = self.compare_steps * trainer.accumulate_grad_batches
        self._unmute("on_train_batch_start", "on_train_batch_end")
        batches = trainer.num_training_batches  # infinite for a loader without a length
        updates = (
            math.ceil(batches / trainer.accumulate_grad_batches) if math.isfinite(batches) else None
        )
        self._boundary_reachable = self._boundary_ahead(trainer, updates)

    def _boundary_ahead(self, trainer: pl.Trainer, updates: int | None) -> bool:
        """Whether the epoch-boundary probe can come, ``updates`` (None: unknown) before it."""
        return (
            self.epoch_boundary
            and trainer.current_epoch == self._epoch_at_start
            and (
                updates is None
                or trainer.max_steps == -1
                or trainer.global_step + updates + self.compare_steps <= trainer.max_steps
            )
        )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_step = trainer.global_step
        kinds = {p.kind for p in self._probes}
        recording = any(not p.done for p in self._probes)
        # The mid-epoch probe needs the epoch's ids before it; the epoch-boundary one, its head's.
        keep_all = "mid_epoch" not in kinds
        keep_head = (
            self._head_left > 0 and self._boundary_reachable and "epoch_boundary" not in kinds
        )
        self._current = started(trainer, self.adapter, batch, batch_idx) if recording else None
        ids: Any = None if self._current is None else self._current.ids
        if self._current is None and (keep_all or keep_head):
            ids = self.adapter.view(batch, count_tokens=False).ids
            if ids is None:  # told apart by their content (a device read, until the probes have it)
                ids = content_keys(self.adapter.example_inputs(batch))
        if ids is not None:
            chunk = ids.detach() if isinstance(ids, torch.Tensor) else ids
            if keep_all:
                self._epoch_ids.append(chunk)
            if keep_head:
                self._epoch_head.append(chunk)
        self._head_left -= 1
        # Nothing left to record or keep: both hooks muted until an epoch starts or a probe.
        if not (recording or keep_all or keep_head):
            self._mute("on_train_batch_start", "on_train_batch_end")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any
    ) -> None:
        stepped = trainer.global_step != self._batch_step
        if self._current is not None:
            record = finished(self._current, trainer, outputs)
            for probe in self._probes:
                if not probe.done:
                    probe.reference.append(record)
                    probe.end_step = trainer.global_step
                    if stepped and trainer.global_step >= probe.step + self.compare_steps:
                        probe.done = True  # recorded; compared once the fit has ended
        # ">=": with several optimizers stepped by hand, global_step moves by more than one per
        # micro-batch and may pass at_step without landing on it.
        if (
            stepped
            and trainer.global_step >= self._step_at_start + self.at_step
            and not any(p.kind == "mid_epoch" for p in self._probes)
        ):
            self._save("mid_epoch", trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The first epoch boundary of the fit, unless the mid-epoch probe already sits there.
        epochs_left = trainer.max_epochs in (None, -1) or (
            trainer.current_epoch + 1 < trainer.max_epochs
        )
        if (
            self._boundary_ahead(trainer, 0)
            and epochs_left
            and not trainer.should_stop
            and not any(p.step == trainer.global_step for p in self._probes)
        ):
            self._save("epoch_boundary", trainer, pl_module)

    def _save(self, kind: str, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._unmute("on_train_batch_start", "on_train_batch_end")  # the probe records what follows
        # Local even when out_dir is remote: the verification process loads these files.
        folder = storage.work_folder(self.run.run_dir, "resume")
        path = folder / f"{kind}-step-{trainer.global_step}.ckpt"
        self._saving = True
        try:
            # Every rank: saving is a collective. A full checkpoint, said so (Lightning logs a
            # line when weights_only is left unset).
            trainer.save_checkpoint(path, weights_only=False)
        finally:
            self._saving = False
        state = replace(state_of(trainer, pl_module), rng=self._saved_rng_digest)
        seen = self._epoch_ids if kind == "mid_epoch" else self._epoch_head
        probe = _Probe(kind, trainer.global_step, path, state, _id_set(seen))
        self._probes.append(probe)
        rank_zero_info(
            f"ResumeVerifier: {kind.replace('_', '-')} checkpoint at update {probe.step} -> {path};"
            f" recording the next {self.compare_steps} updates for the comparison"
        )

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning's teardown freed the device: the verification process gets it.
        try:
            self._verify_all(trainer, pl_module)
        except OSError:
            raise
        except Exception as err:  # never the user's fit: the row says what could not be done
            self._not_checked(
                f"the verification raised {type(err).__name__}: {err} (the fit went on)"
            )
        self._publish_row(trainer)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if self._probes and self._run is not None and not self._results:
            self._not_checked(
                f"the fit raised {type(exception).__name__} before its end, where the resume"
                f" check runs; the probe checkpoints stay in {self._probes[0].checkpoint.parent}"
            )
            try:
                self._publish_row(trainer)
            except Exception as err:  # never replace the user's exception
                log.warning("ResumeVerifier could not record its row: %s", err)
        super().on_exception(trainer, pl_module, exception)

    def _not_checked(self, detail: str, name: str = "resume") -> None:
        self._results.append(CheckResult(name, "not_checked", detail))

    def _verify_all(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._probes and self.run.is_global_zero:
            self._not_checked(
                f"the fit ended after {trainer.global_step - self._step_at_start} update(s),"
                f" before update {self.at_step} where the checkpoint is taken: lower at_step"
            )
        # Under DDP one new process per rank, a DDP group like the fit's: every rank checks its own.
        per_rank = trainer.world_size > 1 and isinstance(trainer.strategy, DDPStrategy)
        compared = []
        for probe in self._probes if self.run.is_global_zero or per_rank else []:
            probe.done = True
            if probe.reference:
                compared.append(probe)
            else:
                self._not_checked(
                    f"the fit ended right after the checkpoint at update {probe.step}:"
                    " nothing to compare; run at least compare_steps more updates",
                    _prefixed(probe, "resume"),
                )
        # The fit's first training examples, read once for every probe (the new process
        # compares its own with them, and rebuilds in the other order when they differ).
        dataset = getattr(trainer.train_dataloader, "dataset", None)
        data = dataset_fingerprint(dataset) if compared else None
        tasks = [self._task(p, trainer, pl_module, data) for p in compared]
        path: Path | None = None
        if self.check_artifact:
            # A collective: every rank saves the final checkpoint.
            path, error = parent.final_artifact(self.run, trainer, pl_module, self.export)
            if self.run.is_global_zero and error is not None:
                self._results.append(CheckResult("artifact_roundtrip", "fail", error))
                path = None
        launcher = parent.Launcher(self.factory, self.fallback, self.timeout_s)
        # The collectives first (every rank reaches them), then rank 0's own work.
        results = launcher.run_per_rank(tasks, trainer, pl_module) if per_rank and tasks else []
        artifact = None
        if path is not None and self.run.is_global_zero:
            artifact = parent.prepare_artifact(
                self.run, trainer, pl_module, path, self.factory, self.control_batches
            )
            if artifact.early is not None:
                self._results.append(artifact.early)
        extra = [artifact.task] if artifact is not None and artifact.task is not None else []
        left: list[parent.Task] = [*extra] if per_rank else [*tasks, *extra]  # per rank: ran above
        if left:
            results += launcher.run(left, trainer, pl_module)
        for probe, result in zip(compared, results, strict=False):
            checks = self._judge(probe, result, trainer, data, per_rank)
            self._results += [replace(c, name=_prefixed(probe, c.name)) for c in checks]
        if artifact is not None and extra:
            self._results.append(parent.judge_artifact(artifact, results[-1], self.atol, self.rtol))

    def _task(
        self, probe: _Probe, trainer: pl.Trainer, pl_module: pl.LightningModule, data: str | None
    ) -> ResumeTask:
        datamodule = getattr(trainer, "datamodule", None)
        return ResumeTask(
            checkpoint=str(probe.checkpoint),
            state_key=self.state_key,
            module_class=parent.class_path(type(pl_module)),
            workdir=str(probe.checkpoint.parent / "child"),
            trainer={
                "accelerator": trainer.strategy.root_device.type,
                # As far as the reference went (the fit may have ended before compare_steps).
                "max_steps": probe.end_step,
                "max_epochs": trainer.max_epochs,
                "accumulate_grad_batches": trainer.accumulate_grad_batches,
                "precision": str(trainer.precision),
                "gradient_clip_val": trainer.gradient_clip_val,
                "gradient_clip_algorithm": trainer.gradient_clip_algorithm,
                "limit_train_batches": trainer.limit_train_batches,
                "limit_val_batches": 0,
            },
            factory=self.factory,
            datamodule_class=None if datamodule is None else parent.class_path(type(datamodule)),
            dataset_fingerprint=data,
            adapter=_portable_adapter(self.adapter),
        )

    def _judge(
        self,
        probe: _Probe,
        result: TaskResult,
        trainer: pl.Trainer,
        ours: str | None,
        per_rank: bool,
    ) -> list[CheckResult]:
        where = result.where
        if result.load_error is not None:
            found = ", ".join(result.unsafe_globals) or "unknown"
            origin = "; ".join(self._unsafe) or "not found in the saved dictionary"
            refused = (
                f"torch.load(weights_only=True) refused the checkpoint: {result.load_error}."
                f" Unsafe globals: {found}. They come from: {origin}. Store plain types"
                " (str instead of pathlib.Path, int/float/list instead of numpy objects)."
            )
            return [CheckResult("weights_only_load", "fail", refused)]
        if result.blocked is not None:
            return [CheckResult("rebuild", "not_checked", result.blocked)]
        results = [CheckResult("weights_only_load", "pass", f"loaded in {where}")]
        failure = result.build_error or result.crash
        source = result.data_source  # how loaders passed to fit were rebuilt, or compared here
        if failure is not None:
            detail = f"{failure} ({where}{'; ' + source if source else ''})"
            return [*results, CheckResult("rebuild", "fail", detail)]
        if source is not None:
            results.append(CheckResult("rebuild", "pass", source))
        if self._load_row is None:
            self._load_row = result
        rows = []
        for key in (f.name for f in fields(State)):
            expected = getattr(probe.state, key)
            if key == "epoch" and probe.reference:
                # The epoch training continues in: after the last batch of an epoch, the next.
                expected = probe.reference[0].epoch
            got = None if result.restored is None else getattr(result.restored, key)
            rows.append(_detail(probe, key, None, None, expected, got, expected == got))
            if expected == got:  # both None: nothing of this kind in the fit (no GradScaler)
                detail = "none saved, none restored" if got is None else ""
            elif key == "epoch" and probe.kind == "epoch_boundary" and got == expected - 1:
                detail = (
                    f"training continued in epoch {expected}, the resumed run went back into"
                    f" the finished epoch {got} and trained extra batches there: Lightning"
                    " re-enters the epoch of an end-of-epoch checkpoint when the loader"
                    " cannot save its position; use torchdata's StatefulDataLoader, or"
                    " checkpoint mid-epoch"
                )
            else:
                detail = f"{expected!r} saved, {got!r} after resume; {_STATE_REMEDIES.get(key, '')}"
            results.append(CheckResult(key, "pass" if expected == got else "fail", detail))
        theirs = result.dataset_fingerprint
        if ours is not None and theirs is not None:
            order = f" (rebuilt with {result.build_order}, as the fit's data show)"
            detail = f"the first training examples are equal{order if result.build_order else ''}"
            if ours != theirs:
                detail = (
                    f"the new process built other training data (the first examples differ:"
                    f" digest {ours} in the fit, {theirs} after the rebuild), so the data"
                    " position and the losses cannot match; a restarted job would train on"
                    " other examples too. Data drawn at random in a constructor needs a seed"
                    " set before it is built (seed_everything(...) before creating the"
                    " DataModule: the new process repeats that seed), or data built from files"
                )
            results.append(
                CheckResult("data_rebuilt", "pass" if ours == theirs else "fail", detail)
            )
        loader = trainer.train_dataloader
        configs = trainer.lr_scheduler_configs
        plateau_on_step = any(c.reduce_on_plateau and c.interval == "step" for c in configs)
        trajectory, pairs = compare_trajectories(
            probe.reference,
            result.steps,
            seen_before=probe.seen_before,
            loader_stateful=hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"),
            at_epoch_boundary=probe.kind == "epoch_boundary",
            atol=self.atol,
            rtol=self.rtol,
            lr_cause=_PLATEAU_ON_STEP if plateau_on_step else "",
        )
        if trainer.world_size > 1 and not per_rank:
            why = (
                f"the fit runs on {trainer.world_size} processes and the verification process"
                " resumes on one device, so per-rank data order and losses cannot be compared;"
                " the state checks above still apply"
            )
            trajectory = [
                CheckResult(c.name, "not_checked", why)
                if c.name in ("data_position", "loss_trajectory")
                else c
                for c in trajectory
            ]
        results.extend(trajectory)
        rows += [
            _detail(probe, "micro_batch", index, ref.step, _shown(ref), _shown(got), equal)
            for index, ref, got, equal in pairs
        ]
        # The global steps the reference advanced (several per update: manual optimisation).
        expected_updates = probe.end_step - probe.step
        done = result.global_step_end - probe.step
        detail = f"{done} update(s)"
        if done != expected_updates:
            detail += (
                f" ran after the resume, expected {expected_updates}: a checkpoint on the last"
                " batch of an epoch can resume into no further steps; checkpoint mid-epoch or"
                " raise max_epochs"
            )
        verdict = "pass" if done == expected_updates else "fail"
        results.append(CheckResult("updates_after_resume", verdict, detail))
        self.run.register_table("resume", RESUME_SCHEMA)
        self.run.append_rows("resume", rows)
        return results

    def _publish_row(self, trainer: pl.Trainer) -> None:
        # Rank 0 always; other ranks when they checked their own replay (DDP).
        if not self._results:
            return
        verdict, reason = judge("resume", ((r.name, r.verdict, r.detail) for r in self._results))
        if verdict == "not_checked" and reason is not None and reason.startswith("not proven"):
            # Passing side checks (the artifact) must not read as "resume verified".
            reason = "resume not verified: " + reason.removeprefix("not proven: ")
        self._put_checks(
            "resume",
            self._results,
            occurrences=1,
            step_first=min((p.step for p in self._probes), default=None),
            device=str(trainer.strategy.root_device),
            precision=str(trainer.precision),
            counter="none",
            reason=reason,
            notes="; ".join(f"{p.kind} checkpoint {p.checkpoint}" for p in self._probes) or None,
        )
        load = self._load_row
        # This attempt's own checkpoint_load row (a fit resumed with ckpt_path, measured by
        # PhaseMemoryMonitor) is another load in another process: never merge the two.
        loaded_here = any(row["phase"] == "checkpoint_load" for row in self.run.phase_rows())
        if load is not None and load.load_seconds is not None and not loaded_here:
            self._put_checks(
                "checkpoint_load",
                [CheckResult("weights_only_load", "pass")],
                occurrences=1,
                measured_occurrences=1,
                counter="none",
                duration_s=load.load_seconds,
                file_bytes=load.file_bytes,
                host_rss_bytes=load.load_rss_bytes,
                notes="torch.load(weights_only=True) timed in the verification process;"
                " device memory not measured there",
            )


@dataclass
class _Probe:
    """One checkpoint under test and the reference run's micro-batches after it."""

    kind: str
    step: int
    checkpoint: Path
    state: State
    seen_before: set[Any]
    reference: list[StepRecord] = field(default_factory=list)
    #: The global step after the last recorded micro-batch.
    end_step: int = 0
    done: bool = False


def _detail(
    probe: _Probe, check: str, micro: int | None, step: int | None, ref: Any, got: Any, equal: bool
) -> dict[str, Any]:
    return {
        "checkpoint_step": probe.step,
        "check": _prefixed(probe, check),
        "micro_batch": micro,
        "step": step,
        "reference": json.dumps(ref, default=str),
        "resumed": json.dumps(got, default=str),
        "equal": equal,
    }


def _shown(record: StepRecord | None) -> dict[str, Any]:
    if record is None:
        return {"ids": None, "loss": None, "lrs": None}
    ids = None if record.ids is None else [str(i) for i in record.ids]
    return {"ids": ids, "loss": record.loss, "lrs": list(record.lrs)}


def _prefixed(probe: _Probe, name: str) -> str:
    return name if probe.kind == "mid_epoch" else f"{probe.kind}.{name}"


def _portable_adapter(adapter: BatchAdapter) -> dict[str, str | int]:
    specs: dict[str, Any] = getattr(adapter, "_specs", {})
    return {k: v for k, v in specs.items() if isinstance(v, str | int)} | {
        "ignore_index": adapter.ignore_index
    }


def _id_set(chunks: list[Any]) -> set[Any]:
    """The example ids of the batches' id chunks (tensors or sequences) as one set."""
    ids: set[Any] = set()
    for chunk in chunks:
        values = chunk.cpu().reshape(-1).tolist() if isinstance(chunk, torch.Tensor) else chunk
        ids.update(json_id(v) for v in values)
    return ids
