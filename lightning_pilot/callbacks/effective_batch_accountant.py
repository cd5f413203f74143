"""EffectiveBatchAccountant: examples, tokens and updates, planned and counted."""

from __future__ import annotations

import functools
import math
import os
import weakref
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from typing import Any, Final

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_pilot.core import accounting, update_plan, validate
from lightning_pilot.core.batches import BatchAdapter, size_and_tokens_of
from lightning_pilot.core.scalars import read_scalars
from lightning_pilot.run import PilotCallback
from lightning_pilot.schemas import UPDATES_SCHEMA, UPDATES_SCHEMA_VERSION, UPDATES_TABLE

#: Updates between flush points (``_flush``): token counts stay on the device until then.
FLUSH_EVERY: Final = 50
#: A micro-batch's size, tokens (maybe still on the device) and where the tokens were counted.
_Counts = tuple[int | None, torch.Tensor | int | None, str | None]
#: Micro-batches read at both ends of the step before the reading moves to the end alone.
COMPARED_MICRO_BATCHES: Final = 3


def _finite(value: float | int | None) -> int | None:
    if value is None or (isinstance(value, float) and not math.isfinite(value)) or value < 0:
        return None
    return int(value)


class EffectiveBatchAccountant(PilotCallback):
    """Plan and count the examples, tokens and updates of a fit, per update and over all ranks.

    One row per update per rank goes to ``updates.parquet`` (:data:`UPDATES_SCHEMA`); the plan,
    the counts, the findings and the ``optimizer_step`` check: docs/effective-batch.md.

    Args:
        keep: what a comparison of runs holds constant (``"updates"``, ``"examples"`` or
            ``"epochs"``); it is checked against the plan, the other quantities are recorded.
        token_spread_ratio: warn when the most tokens in a full update exceed the fewest by
            more than this factor.
        out_dir: the output folder; default ``<trainer.default_root_dir>/pilot``.

    Raises:
        ValueError: ``keep`` or ``token_spread_ratio`` out of range.
        TypeError: ``adapter`` is not a :class:`BatchAdapter`.

    Example:
        >>> import tempfile, torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> class Model(BoringModel):
        ...     def training_step(self, batch, batch_idx):
        ...         return super().training_step(batch[0], batch_idx)
        >>> data = DataLoader(TensorDataset(torch.randn(64, 32)), batch_size=2)
        >>> accountant = EffectiveBatchAccountant()
        >>> trainer = pl.Trainer(max_epochs=1, accumulate_grad_batches=8, logger=False,
        ...                      callbacks=[accountant], enable_checkpointing=False,
        ...                      enable_progress_bar=False, enable_model_summary=False,
        ...                      default_root_dir=tempfile.mkdtemp())
        >>> trainer.fit(Model(), data)
        >>> accountant.summary["line"]
        '16 examples per update (2 x 8 x 1 replica); 4 updates; 64 examples; last window full'
        >>> from lightning_pilot.storage import read_snapshot_table
        >>> rows = read_snapshot_table(accountant.run.run_dir / "updates.parquet").to_pylist()
        >>> [(row["update"], row["micro_batches"], row["examples_all_ranks"]) for row in rows]
        [(1, 8, 16), (2, 8, 16), (3, 8, 16), (4, 8, 16)]
    """

    def __init__(
        self,
        *,
        keep: update_plan.Keep = "updates",
        adapter: BatchAdapter | None = None,
        token_spread_ratio: float = 1.5,
        out_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        owner = "EffectiveBatchAccountant"
        super().__init__(out_dir=out_dir)
        self.keep: update_plan.Keep = validate.choice(owner, "keep", keep, update_plan.KEEP_CHOICES)
        validate.instance(owner, "adapter", adapter, BatchAdapter)
        self.adapter = adapter or BatchAdapter()
        hint = "max/min tokens per update"
        self.token_spread_ratio = validate.number(
            owner, "token_spread_ratio", token_spread_ratio, minimum=1, hint=hint
        )
        self._counter = accounting.UpdateCounter()
        self._loaded_counts: Mapping[str, Any] | None = None
        self._reset_fit()

    def _reset_fit(self) -> None:
        self._plan: update_plan.UpdatePlan | None = None
        # Makes the plan once the micro-batch size is known (the loader's, else the first batch's).
        self._planner: Callable[..., tuple[update_plan.UpdatePlan | None, str | None]] | None = None
        self._config = accounting.BatchConfig(None, 1, 1)
        self._world = self._dp = 1
        self._estimated: int | None = None
        self._sampler: DistributedSampler[Any] | None = None
        self._loader_batch_size: int | None = None
        self._last_step = self._last_flush = self._step_calls = 0
        # The micro-batch read at its start (see _read), counted once its step ran.
        self._micro: tuple[tuple[Any, ...] | None, _Counts] | None = None
        self._compared = 0
        self._scaler = self._training = False
        self._hooks: list[RemovableHandle] = []
        self._epochs_done = 0
        self._notes: list[str] = []
        self._summary: accounting.Summary | None = None
        # Manual optimization: the module steps when it chooses, so no plan; K is measured.
        self._manual = False

    @override
    def _state_key_fields(self) -> dict[str, Any]:
        return {"out_dir": str(self.out_dir), "keep": self.keep}

    @property
    def plan(self) -> update_plan.UpdatePlan | None:
        """The plan of the current (or last) fit; ``None`` when it could not be made."""
        return self._plan

    @property
    def summary(self) -> dict[str, Any]:
        """Plan against count (:class:`~lightning_pilot.core.accounting.Summary`) as a dict."""
        return (self._summary or self._summarize(self._epochs_done)).as_dict()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            self._reset_fit()
            self.run.register_table(UPDATES_TABLE, UPDATES_SCHEMA)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._counter = accounting.UpdateCounter()
        if self._loaded_counts is not None:
            self._counter.load_state_dict(self._loaded_counts)
            self._loaded_counts = None
        note = self._counter.resume_at(trainer.global_step)
        self._notes += [note] if note else []
        self._manual = not getattr(pl_module, "automatic_optimization", True)
        self._read_configuration(trainer)
        self._remove_step_hooks()
        self._scaler = isinstance(
            getattr(trainer.precision_plugin, "scaler", None), torch.amp.GradScaler
        )
        self._hooks = [
            o.register_step_post_hook(self._on_optimizer_step) for o in trainer.optimizers
        ]
        self._last_step = self._last_flush = trainer.global_step
        self._training = True
        if self._config.micro_batch_size is not None:
            self._make_plan()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        fields = self.adapter.fields(batch)
        comparing = 0 <= self._compared < COMPARED_MICRO_BATCHES
        self._micro = (_identity(fields) if comparing else None, size_and_tokens_of(fields))

    def _read(self, batch: Any) -> _Counts:
        """The micro-batch's size and tokens: read at its start while the first
        :data:`COMPARED_MICRO_BATCHES` steps leave the fields alone (the start hook is then
        muted); a step that replaces or changes them keeps the reading at the start."""
        start, self._micro = self._micro, None
        if start is None:  # the start hook is muted (or Lightning skipped it)
            return size_and_tokens_of(self.adapter.fields(batch))
        identity, counts = start
        if identity is not None:
            if not _same(identity, self.adapter.fields(batch)):
                self._compared = -1  # read at the start for the rest of the fit
            else:
                self._compared += 1
                if self._compared == COMPARED_MICRO_BATCHES:
                    self._mute("on_train_batch_start")
        return counts

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if batch is None:  # Lightning ran no step for it
            return
        size, tokens, source = self._read(batch)
        if self._planner is not None:  # the loader did not say: the first batch does
            self._config = replace(self._config, micro_batch_size=size)
            self._make_plan()
        self._counter.add_micro_batch(
            epoch=trainer.current_epoch,
            batch_idx=batch_idx,
            examples=size,
            tokens=tokens,
            tokens_source=source,
            duplicates=self._duplicates(batch_idx),
        )
        step = trainer.global_step
        if step == self._last_step:
            return
        self._last_step = step
        stepped = True if self._step_calls else (False if self._scaler else None)
        self._step_calls = 0
        self._counter.close_update(
            update=step,
            accumulate_grad_batches=None if self._manual else trainer.accumulate_grad_batches,
            stepped=stepped,
        )
        if step - self._last_flush >= FLUSH_EVERY:  # the same update on every rank
            self._flush(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epochs_done = trainer.current_epoch + 1
        self._flush(trainer)
        self.run.set_ledger_fields(**self._summarize(self._epochs_done).ledger_fields())

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Every rank saves together, so the sums can be made here; the state saved by
        # rank 0 then holds the totals of all ranks (state_dict ran before, with local ones).
        if not self._training:
            return
        self._flush(trainer)
        states = checkpoint.get("callbacks")
        if self._world > 1 and isinstance(states, dict) and self.state_key in states:
            states[self.state_key] = self.state_dict()
        self.run.set_ledger_fields(**self._summarize(self._epochs_done).ledger_fields())

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer)
        self._training = False
        self._remove_step_hooks()
        self._summary = summary = self._summarize(trainer.current_epoch)
        for flag in summary.flags:
            if flag.flag not in ("note", "estimate_mismatch"):
                rank_zero_warn(f"EffectiveBatchAccountant: {flag.detail}")
        rank_zero_info(f"EffectiveBatchAccountant: {summary.line}")
        self.run.set_ledger_fields(**summary.ledger_fields())
        self.run.summary.add(**{f"batch/{k}": v for k, v in summary.ledger_fields().items()})
        self._put_verdict()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # No collective here: rows not summed yet are kept with this rank's counts only.
        pending: list[dict[str, Any]] = []
        try:
            if self._world == 1:
                self._flush()  # one process: its counts are the totals
            else:
                pending = self._counter.take_pending(read_scalars)
        except RuntimeError as err:  # the device itself failed: its counts are lost
            self._notes.append(f"the last micro-batches could not be counted: {err}")
        # The optimizer steps of the pending rows (several per row when a batch steps several).
        unsummed = pending[-1]["update"] - (self._counter.last_update or 0) if pending else 0
        open_run = self._run is not None and not self._run.closed
        if pending and open_run:
            note = "not summed over ranks: the fit failed before the next flush point"
            self._append([dict(row, notes=note) for row in pending])
        self._training = False
        self._remove_step_hooks()
        if pending:
            self._notes.append(f"{unsummed} update(s) before the failure not summed")
        self._summary = self._summarize(trainer.current_epoch, unsummed=unsummed)
        if open_run:
            self.run.set_ledger_fields(**self._summary.ledger_fields())
            self._put_verdict()
        super().on_exception(trainer, pl_module, exception)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_step_hooks()
        self._loaded_counts = None
        super().teardown(trainer, pl_module, stage)

    @override
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._world == 1 and self._counter.pending:
            self._flush()  # one process: counting needs no collective
        if state:
            state["counts"] = self._counter.state_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        counts = state_dict.get("counts")
        if isinstance(counts, Mapping):
            self._loaded_counts = counts

    def _read_configuration(self, trainer: pl.Trainer) -> None:
        self._world = trainer.world_size
        sampler_kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
        self._dp = int((sampler_kwargs or {}).get("num_replicas", 1) or 1)
        accumulate: int | dict[int, int] = trainer.accumulate_grad_batches
        for callback in getattr(trainer, "callbacks", []):
            if isinstance(callback, GradientAccumulationScheduler):
                accumulate = dict(callback.scheduling)
                break
        schedule = update_plan.normalise_schedule(accumulate, owner="EffectiveBatchAccountant")
        try:
            self._estimated = _finite(trainer.estimated_stepping_batches)
        except (MisconfigurationException, ValueError, TypeError) as err:
            self._notes.append(f"estimated_stepping_batches is unavailable: {err}")
        loader = trainer.train_dataloader
        sampler = getattr(loader, "sampler", None)
        size: int | None = None
        if isinstance(sampler, DistributedSampler):
            self._sampler = sampler
            size = len(sampler.dataset)  # type: ignore[arg-type]
        elif isinstance(loader, DataLoader) and sampler is not None:
            try:
                size = len(sampler) * self._dp
            except TypeError:
                self._notes.append("the training sampler has no length: no plan")
            if self._dp > 1 and size is not None:
                self._notes.append(
                    "the loader is not sharded by a DistributedSampler: planned as if every"
                    " replica had the same share; padding duplicates are not knowable"
                )
        else:
            self._notes.append("the training data is not one DataLoader: no plan")
        b = self._loader_batch_size = loader.batch_size if isinstance(loader, DataLoader) else None
        self._config = accounting.BatchConfig(b, schedule[0][1], self._dp)
        epochs, steps = trainer.max_epochs, trainer.max_steps
        split = "drop" if self._sampler is not None and self._sampler.drop_last else "pad"
        if self._manual:
            self._notes.append(
                "manual optimization: the module steps its optimizers itself, so no plan; a row"
                " of updates.parquet is a batch in which global_step advanced, with the"
                " micro-batches since the previous one"
            )
        else:
            self._planner = functools.partial(
                update_plan.plan_for_fit,
                size,
                accumulate_grad_batches=dict(schedule),
                dp_replicas=self._dp,
                epochs=epochs if epochs is not None and epochs >= 0 else None,
                max_steps=steps if steps >= 0 else None,
                drop_last=bool(getattr(loader, "drop_last", False)),
                replica_split=split,
                limit_micro_batches=_finite(trainer.num_training_batches),
            )
        if self._world % self._dp:
            self._notes.append(
                f"world size {self._world} is not a multiple of {self._dp} data replicas:"
                " counts are not summed over ranks"
            )

    def _make_plan(self) -> None:
        if self._planner is None:
            return
        self._plan, note = self._planner(self._config.micro_batch_size)
        self._planner = None
        self._notes += [note] if note else []
        line = "no plan (see the summary's notes)"
        if self._plan is not None:
            line = f"plan: {self._plan.describe()}"
            if self._estimated is not None and self._estimated != self._plan.total_updates:
                rank_zero_warn(
                    f"EffectiveBatchAccountant: Lightning's estimated_stepping_batches is"
                    f" {self._estimated:,} but the plan is {self._plan.total_updates:,}"
                    " updates; a schedule sized from the estimate ends elsewhere."
                )
        rank_zero_info(
            f"EffectiveBatchAccountant: {line}; Lightning's estimated_stepping_batches ="
            f" {self._estimated}"
        )
        self.run.set_ledger_fields(
            **asdict(self._config),
            effective_batch_size=self._config.effective_batch_size,
            planned_updates=self._plan.total_updates if self._plan is not None else self._estimated,
        )

    def _on_optimizer_step(self, *_: Any) -> None:
        self._step_calls += 1

    def _remove_step_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _duplicates(self, batch_idx: int) -> int | None:
        sampler, b = self._sampler, self._loader_batch_size
        if sampler is None:
            return 0 if self._dp == 1 else None
        if b is None:
            return None
        return update_plan.replica_duplicates(
            dataset_size=len(sampler.dataset),  # type: ignore[arg-type]
            num_replicas=sampler.num_replicas,
            rank=sampler.rank,
            samples_per_replica=sampler.num_samples,
            batch_idx=batch_idx,
            micro_batch_size=b,
        )

    def _flush(self, trainer: pl.Trainer | None = None) -> None:
        """Count the pending rows (one host sync) and sum them over ranks (one ``max`` and one
        ``sum`` all-reduce, at a flush point every rank reaches at the same update)."""
        self._last_flush = self._last_step
        rows = self._counter.take_pending(read_scalars)
        if self._world == 1:
            summed = accounting.UpdateCounter.local_as_all_ranks(rows)
        else:
            assert trainer is not None
            strategy, device = trainer.strategy, trainer.lightning_module.device
            length = torch.tensor([len(rows)], dtype=torch.int64, device=device)
            longest = int(strategy.reduce(length, reduce_op="max").item())
            if longest == 0:
                return
            local = torch.tensor(
                accounting.pack_counts(rows, longest), dtype=torch.int64, device=device
            )
            total = strategy.reduce(local, reduce_op="sum").cpu().tolist()
            summed = accounting.unpack_sums(
                rows, total, world_size=self._world, dp_replicas=self._dp
            )
        if summed:
            self._counter.absorb(r for r in summed if r["micro_batches_all_ranks"] is not None)
            self._append(summed)

    def _append(self, rows: list[dict[str, Any]]) -> None:
        meta = {"schema_version": UPDATES_SCHEMA_VERSION, "dp_replicas": self._dp}
        self.run.append_rows(UPDATES_TABLE, [meta | row for row in rows])

    def _summarize(self, epochs_done: int, unsummed: int = 0) -> accounting.Summary:
        config = self._config
        if self._manual and self._counter.last_k is not None:  # K as the module stepped
            config = replace(config, accumulate_grad_batches=self._counter.last_k)
        return accounting.summarize(
            counter=self._counter,
            config=config,
            plan=self._plan,
            keep=self.keep,
            epochs_done=epochs_done,
            # Under manual optimization Lightning's estimate counts batches, not the module's steps.
            estimated_updates=None if self._manual else self._estimated,
            token_spread_ratio=self.token_spread_ratio,
            notes=self._notes,
            unsummed=unsummed,
        )

    def _put_verdict(self) -> None:
        """The accumulation windows' check, on the later ``optimizer_step`` row (a partial window
        is rarely the first update) unless the fit made one update."""
        check = accounting.check_accumulation_windows(self._counter, self._plan)
        if check is not None:
            first = self._counter.counted_from + self._counter.updates <= 1
            self._put_checks("optimizer_step", [check], first=first)


def _identity(fields: tuple[Any, ...]) -> tuple[Any, ...]:
    """What tells the fields apart from any replacement or in-place change, keeping nothing
    alive: each tensor's weak reference and version counter; the ``id`` of other values."""
    return tuple(
        (weakref.ref(f), f._version) if isinstance(f, torch.Tensor) else id(f) for f in fields
    )


def _same(identity: tuple[Any, ...], fields: tuple[Any, ...]) -> bool:
    """Whether ``fields`` are the very objects :func:`_identity` saw, unchanged in place
    (compared by ``is``: a weak reference's ``==`` would compare two live tensors' values)."""
    for seen, field in zip(identity, fields, strict=True):
        if isinstance(seen, tuple):
            if seen[0]() is not field or field._version != seen[1]:
                return False
        elif isinstance(field, torch.Tensor) or seen != id(field):
            return False
    return True
