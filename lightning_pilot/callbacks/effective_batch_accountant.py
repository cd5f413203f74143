"""EffectiveBatchAccountant: examples, tokens and updates, planned and counted."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any, Final

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_pilot.core import validate
from lightning_pilot.core.accounting import (
    KEEP_CHOICES,
    BatchConfig,
    Keep,
    UpdateCounter,
    UpdatePlan,
    check_accumulation_windows,
    normalise_schedule,
    pack_counts,
    plan_updates,
    replica_duplicates,
    summarize,
    unpack_sums,
)
from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.phases import judge
from lightning_pilot.core.scalars import read_scalars
from lightning_pilot.run import PilotCallback
from lightning_pilot.schemas import UPDATES_SCHEMA, UPDATES_SCHEMA_VERSION, UPDATES_TABLE

__all__ = ["UPDATES_SCHEMA", "UPDATES_SCHEMA_VERSION", "UPDATES_TABLE", "EffectiveBatchAccountant"]

#: Updates between reads of the buffered counts (one host sync and, under several processes,
#: one collective each): token counts stay on the device until then.
FLUSH_EVERY: Final = 50
#: ``runs/<run_id>/updates.parquet``: one row per update per rank (see the class docstring).


def _finite(value: float | int | None) -> int | None:
    if value is None or (isinstance(value, float) and not math.isfinite(value)) or value < 0:
        return None
    return int(value)


class EffectiveBatchAccountant(PilotCallback):
    """Plan and count the examples, tokens and updates of a fit, per update and over all ranks.

    At ``on_train_start`` it reads the real configuration: the micro-batch size (the loader's
    ``batch_size``, else the first batch through the :class:`BatchAdapter`), ``K`` (with a
    ``GradientAccumulationScheduler``'s schedule), the data-parallel replicas (the strategy's
    ``distributed_sampler_kwargs["num_replicas"]``: DDP, FSDP and DeepSpeed count every
    process, ``ModelParallelStrategy`` only its ``data_parallel`` mesh dimension; tensor and
    pipeline ranks sharing a batch are never replicas) and the dataset. It logs the plan
    (:func:`~lightning_pilot.core.accounting.plan_updates`) once and checks it against
    ``trainer.estimated_stepping_batches``. During training it counts micro-batches, examples
    and non-padding tokens (from the attention mask; without one, every token of integer
    ``[B, T]`` inputs) into updates. At the end it compares plan and count, warns about partial
    accumulation windows (with the weight Lightning's division by ``K`` gave them), padding
    duplicates of a ``DistributedSampler``, steps skipped by a GradScaler, ``K`` changing and a
    wide spread of tokens per update, logs a summary line, and hands ``micro_batch_size``,
    ``accumulate_grad_batches``, ``dp_replicas``, ``effective_batch_size``, ``planned_updates``,
    ``updates_done``, ``examples_seen`` and ``tokens_seen`` to the run's ledger fields. The
    phase table's ``optimizer_step`` row (the later occurrences') gets the check
    ``partial_accumulation_windows`` when ``K > 1``: ``warn`` naming the updates that stepped an
    incomplete window, their weight and the remedy that fits the cause
    (:func:`~lightning_pilot.core.accounting.partial_window_remedy`), else ``pass``.

    Table ``<out_dir>/runs/<run_id>/updates.parquet`` (:data:`UPDATES_SCHEMA`), one row per
    update per rank, written by every rank into its own snapshot files:

    ========================================  =========  ======================================
    column                                    dtype      meaning
    ========================================  =========  ======================================
    run_id, attempt, attempt_id, rank,        str/int32  identity (``world_size``: processes,
    world_size, dp_replicas                              ``dp_replicas``: data replicas)
    update                                    int64      ``global_step`` after the update
    epoch, batch_idx_first, batch_idx_last    int64      where its micro-batches came from
    accumulate_grad_batches                   int64      ``K`` in effect
    micro_batches, examples, tokens           int64      this rank's counts (tokens: null when
                                                         the batch has no mask or token ids)
    tokens_source                             str        ``attention_mask`` or ``input_ids``
    padding_duplicates                        int64      sampler duplicates in this rank's
                                                         examples (null: not knowable)
    ``<count>_all_ranks``                     int64      the four counts summed over the data
                                                         replicas; null if the fit failed
                                                         before they were summed
    window_partial, weight                    bool/f64   fewer than ``K`` micro-batches; weight
                                                         = micro_batches / K
    optimizer_stepped                         bool       false: a GradScaler skipped the step;
                                                         null: not observable (no GradScaler)
    notes, schema_version, written_at         str/...    why a value is null; file metadata
    ========================================  =========  ======================================

    When written: rows are counted and handed to the shared run at flush points (every
    ``FLUSH_EVERY`` = 50 updates, epoch ends, checkpoint saves, the end of training) and
    published with the run's snapshots: at the end of the fit, on an exception (rows not summed
    over ranks yet keep null sums and a note) and at any ``run.flush()``. The ledger fields are
    refreshed at every epoch end, checkpoint save and at the end.

    Ranks: every rank counts its own micro-batches. The ``*_all_ranks`` sums are computed at
    the flush points, which every rank reaches at the same update (one ``max`` and one ``sum``
    all-reduce of a small integer tensor each, never per micro-batch and never in
    ``on_exception``); a single process needs no collective. Token counts (the attention
    mask's sum) stay on the device until a flush reads them all with one host sync.

    Args:
        keep: what a comparison of runs holds constant (``"updates"``, ``"examples"`` or
            ``"epochs"``); it is checked against the plan, and the other quantities are
            recorded.
        adapter: how to read batches (default :class:`BatchAdapter`).
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
        keep: Keep = "updates",
        adapter: BatchAdapter | None = None,
        token_spread_ratio: float = 1.5,
        out_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        owner = "EffectiveBatchAccountant"
        validate.path(owner, "out_dir", out_dir)
        super().__init__(out_dir=out_dir)
        self.keep: Keep = validate.choice(owner, "keep", keep, KEEP_CHOICES)
        validate.instance(owner, "adapter", adapter, BatchAdapter)
        self.adapter = adapter or BatchAdapter()
        self.token_spread_ratio = validate.number(
            owner,
            "token_spread_ratio",
            token_spread_ratio,
            minimum=1,
            hint="max/min tokens per update",
        )
        self._counter = UpdateCounter()
        self._loaded_counts: Mapping[str, Any] | None = None
        self._reset_fit()

    def _reset_fit(self) -> None:
        self._plan: UpdatePlan | None = None
        self._config = BatchConfig(None, 1, 1)
        self._world = 1
        self._dp = 1
        self._estimated: int | None = None
        self._sampler: DistributedSampler[Any] | None = None
        self._loader_batch_size: int | None = None
        self._plan_inputs: dict[str, Any] | None = None
        self._last_step = 0
        self._step_calls = 0
        # Micro-batches and update ends not yet counted (token counts still on the device).
        self._raw: list[tuple[Any, ...]] = []
        self._micro: tuple[Any, ...] | None = None
        self._last_flush = 0
        self._scaler = False
        self._hooks: list[RemovableHandle] = []
        self._training = False
        self._epochs_done = 0
        self._notes: list[str] = []
        self._summary: dict[str, Any] | None = None

    @override
    def _state_key_fields(self) -> dict[str, Any]:
        return {"out_dir": str(self.out_dir), "keep": self.keep}

    @property
    def plan(self) -> UpdatePlan | None:
        """The plan of the current (or last) fit; ``None`` when it could not be made."""
        return self._plan

    @property
    def summary(self) -> dict[str, Any]:
        """Plan against count: configuration, totals, ``flags`` and the summary ``line``."""
        if self._summary is not None:
            return dict(self._summary)
        return self._summarize(self._epochs_done)

    # -- lifecycle -------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            self._reset_fit()
            self.run.register_table(UPDATES_TABLE, UPDATES_SCHEMA)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._counter = UpdateCounter()
        if self._loaded_counts is not None:
            self._counter.load_state_dict(self._loaded_counts)
            self._loaded_counts = None
        self._check_resume(trainer.global_step)
        self._read_configuration(trainer)
        self._install_step_hooks(trainer)
        self._last_step = self._last_flush = trainer.global_step
        self._training = True
        if self._plan_inputs is not None and self._plan_inputs["micro_batch_size"] is not None:
            self._make_plan()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Read while the batch is fresh; counted once its step ran (on_train_batch_end).
        self._read(trainer, batch, batch_idx)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._count(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epochs_done = trainer.current_epoch + 1
        self._flush(trainer, pl_module)
        self._set_ledger_fields(self._summarize(self._epochs_done))

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Every rank saves together, so the sums can be made here; the state saved by
        # rank 0 then holds the totals of all ranks (state_dict ran before, with local ones).
        if not self._training:
            return
        self._flush(trainer, pl_module)
        if self._world > 1:
            states = checkpoint.get("callbacks")
            if isinstance(states, dict) and self.state_key in states:
                states[self.state_key] = self.state_dict()
        self._set_ledger_fields(self._summarize(self._epochs_done))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer, pl_module)
        self._training = False
        self._remove_step_hooks()
        self._summary = self._summarize(trainer.current_epoch)
        for flag in self._summary["flags"]:
            if flag["flag"] not in ("note", "estimate_mismatch"):
                rank_zero_warn(f"EffectiveBatchAccountant: {flag['detail']}")
        rank_zero_info(f"EffectiveBatchAccountant: {self._summary['line']}")
        self._set_ledger_fields(self._summary)
        self._put_verdict()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # No collective here: rows not summed yet are kept with this rank's counts only.
        try:
            if self._world == 1:
                self._flush(None, None)  # one process: its counts are the totals
            else:
                self._count_buffered()
        except RuntimeError as err:  # the device itself failed: its counts are lost
            self._notes.append(f"the last micro-batches could not be counted: {err}")
        pending = self._counter.take_pending()
        if pending and self._run is not None and not self._run.closed:
            note = "not summed over ranks: the fit failed before the next flush point"
            self._append([dict(row, notes=note) for row in pending])
        self._training = False
        self._remove_step_hooks()
        if pending:
            self._notes.append(f"{len(pending)} update(s) before the failure not summed")
        summary = self._summarize(trainer.current_epoch)
        if pending:
            summary["updates_done"] += len(pending)
            summary["examples_seen"] = summary["tokens_seen"] = None
        self._summary = summary
        if self._run is not None and not self._run.closed:
            self._set_ledger_fields(summary)
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
        if self._world == 1 and self._raw:
            self._flush(None, None)  # one process: counting needs no collective
        if state:
            state["counts"] = self._counter.state_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        counts = state_dict.get("counts")
        if isinstance(counts, Mapping):
            self._loaded_counts = counts

    # -- configuration and plan ------------------------------------------------------------------

    def _check_resume(self, global_step: int) -> None:
        counted = self._counter.counted_from + self._counter.updates
        if global_step == counted:
            return
        if counted == 0:
            self._counter.start_late(global_step)
            self._notes.append(
                f"resumed at update {global_step} from a checkpoint without accountant counts:"
                " examples and tokens before it are unknown"
            )
        else:
            self._notes.append(
                f"the checkpoint's counts cover {counted} updates but training resumed at"
                f" update {global_step}"
            )

    def _read_configuration(self, trainer: pl.Trainer) -> None:
        strategy = trainer.strategy
        self._world = trainer.world_size
        sampler_kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
        self._dp = int((sampler_kwargs or {}).get("num_replicas", 1) or 1)
        callbacks = getattr(trainer, "callbacks", [])
        schedulers = [c for c in callbacks if isinstance(c, GradientAccumulationScheduler)]
        accumulate: int | dict[int, int] = (
            dict(schedulers[0].scheduling) if schedulers else trainer.accumulate_grad_batches
        )
        schedule = normalise_schedule(accumulate, owner="EffectiveBatchAccountant")
        self._estimated = self._estimate(trainer)
        loader = trainer.train_dataloader
        sampler = getattr(loader, "sampler", None)
        size: int | None = None
        split = "pad"
        if isinstance(sampler, DistributedSampler):
            self._sampler = sampler
            size = len(sampler.dataset)  # type: ignore[arg-type]
            split = "drop" if sampler.drop_last else "pad"
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
        b = loader.batch_size if isinstance(loader, DataLoader) else None
        self._loader_batch_size = b
        self._config = BatchConfig(b, schedule[0][1], self._dp)
        max_epochs = trainer.max_epochs
        self._plan_inputs = {
            "dataset_size": size,
            "micro_batch_size": b,
            "accumulate_grad_batches": dict(schedule),
            "dp_replicas": self._dp,
            "epochs": max_epochs if max_epochs is not None and max_epochs >= 0 else None,
            "max_steps": trainer.max_steps if trainer.max_steps >= 0 else None,
            "drop_last": bool(getattr(loader, "drop_last", False)),
            "replica_split": split,
            "limit_micro_batches": _finite(trainer.num_training_batches),
        }
        if self._world % self._dp:
            self._notes.append(
                f"world size {self._world} is not a multiple of {self._dp} data replicas:"
                " counts are not summed over ranks"
            )

    def _estimate(self, trainer: pl.Trainer) -> int | None:
        try:
            return _finite(trainer.estimated_stepping_batches)
        except (MisconfigurationException, ValueError, TypeError) as err:
            self._notes.append(f"estimated_stepping_batches is unavailable: {err}")
            return None

    def _make_plan(self) -> None:
        inputs = self._plan_inputs
        self._plan_inputs = None
        if inputs is None:
            return
        line = "no plan (see the summary's notes)"
        budget = inputs["epochs"] is not None or inputs["max_steps"] is not None
        if not budget:
            self._notes.append("neither max_epochs nor max_steps limits the run: no plan")
        elif inputs["dataset_size"] and inputs["micro_batch_size"]:
            try:
                self._plan = plan_updates(**inputs)
            except (TypeError, ValueError) as err:  # e.g. max_epochs=0: nothing to plan
                self._notes.append(f"no plan: {err}")
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
        planned = self._plan.total_updates if self._plan is not None else self._estimated
        self.run.set_ledger_fields(
            micro_batch_size=self._config.micro_batch_size,
            accumulate_grad_batches=self._config.accumulate_grad_batches,
            dp_replicas=self._config.dp_replicas,
            effective_batch_size=self._config.effective_batch_size,
            planned_updates=planned,
        )

    def _install_step_hooks(self, trainer: pl.Trainer) -> None:
        self._remove_step_hooks()
        self._scaler = isinstance(
            getattr(trainer.precision_plugin, "scaler", None), torch.amp.GradScaler
        )
        for optimizer in trainer.optimizers:
            self._hooks.append(optimizer.register_step_post_hook(self._on_optimizer_step))

    def _on_optimizer_step(self, *_: Any) -> None:
        self._step_calls += 1

    def _remove_step_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- counting ----------------------------------------------------------------------------------

    def _read(self, trainer: pl.Trainer, batch: Any, batch_idx: int) -> None:
        size, tokens, source = self.adapter.size_and_tokens(batch)
        if self._plan_inputs is not None:  # the loader did not say: the first batch does
            self._plan_inputs["micro_batch_size"] = size
            k = self._config.accumulate_grad_batches
            self._config = BatchConfig(size, k, self._dp)
            self._make_plan()
        duplicates = self._duplicates(batch_idx)
        self._micro = (trainer.current_epoch, batch_idx, size, tokens, source, duplicates)

    def _count(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._micro is None:
            return
        self._raw.append(self._micro)
        self._micro = None
        step = trainer.global_step
        if step == self._last_step:
            return
        self._last_step = step
        stepped = True if self._step_calls else (False if self._scaler else None)
        self._step_calls = 0
        self._raw.append((step, trainer.accumulate_grad_batches, stepped))
        if step - self._last_flush >= FLUSH_EVERY:  # the same update on every rank
            self._flush(trainer, pl_module)

    def _count_buffered(self) -> None:
        """Count the buffered micro-batches, reading their token counts with one host sync."""
        raw, self._raw = self._raw, []
        sums = iter(
            read_scalars([e[3] for e in raw if len(e) == 6 and isinstance(e[3], torch.Tensor)])
        )
        for entry in raw:
            if len(entry) == 3:
                self._counter.close_update(
                    update=entry[0], accumulate_grad_batches=entry[1], stepped=entry[2]
                )
                continue
            epoch, batch_idx, examples, tokens, source, duplicates = entry
            self._counter.add_micro_batch(
                epoch=epoch,
                batch_idx=batch_idx,
                examples=examples,
                tokens=int(next(sums)) if isinstance(tokens, torch.Tensor) else tokens,
                tokens_source=source,
                duplicates=duplicates,
            )

    def _duplicates(self, batch_idx: int) -> int | None:
        sampler, b = self._sampler, self._loader_batch_size
        if sampler is None:
            return 0 if self._dp == 1 else None
        if b is None:
            return None
        return replica_duplicates(
            dataset_size=len(sampler.dataset),  # type: ignore[arg-type]
            num_replicas=sampler.num_replicas,
            rank=sampler.rank,
            samples_per_replica=sampler.num_samples,
            batch_idx=batch_idx,
            micro_batch_size=b,
        )

    def _flush(self, trainer: pl.Trainer | None, pl_module: pl.LightningModule | None) -> None:
        """Sum the pending rows over ranks (a collective when several processes run)."""
        self._last_flush = self._last_step
        self._count_buffered()
        rows = self._counter.take_pending()
        if self._world == 1:
            summed = UpdateCounter.local_as_all_ranks(rows)
        else:
            assert trainer is not None
            assert pl_module is not None
            summed = self._sum_over_ranks(trainer, pl_module, rows)
        if not summed:
            return
        self._counter.absorb(row for row in summed if row["micro_batches_all_ranks"] is not None)
        self._append(summed)

    def _sum_over_ranks(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, rows: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        strategy = trainer.strategy
        device = pl_module.device
        length = torch.tensor([len(rows)], dtype=torch.int64, device=device)
        longest = int(strategy.reduce(length, reduce_op="max").item())
        if longest == 0:
            return []
        local = torch.tensor(pack_counts(rows, longest), dtype=torch.int64, device=device)
        total = strategy.reduce(local, reduce_op="sum").cpu().tolist()
        return unpack_sums(rows, total, world_size=self._world, dp_replicas=self._dp)

    def _append(self, rows: list[dict[str, Any]]) -> None:
        meta = {"schema_version": UPDATES_SCHEMA_VERSION, "dp_replicas": self._dp}
        self.run.append_rows(UPDATES_TABLE, [meta | row for row in rows])

    # -- summary ---------------------------------------------------------------------------------

    def _summarize(self, epochs_done: int) -> dict[str, Any]:
        return summarize(
            counter=self._counter,
            config=self._config,
            plan=self._plan,
            keep=self.keep,
            epochs_done=epochs_done,
            estimated_updates=self._estimated,
            token_spread_ratio=self.token_spread_ratio,
            notes=self._notes,
        )

    def _put_verdict(self) -> None:
        """The ``optimizer_step`` verdict on the accumulation windows, in the phase table.

        A partial window is rarely the first update, so the row is the later occurrences'
        (``first=False``), shared with ``PhaseMemoryMonitor``'s timing of the step; a fit of
        one update writes the first occurrence's row.
        """
        check = check_accumulation_windows(self._counter, self._plan)
        if check is None:
            return
        verdict, reason = judge("optimizer_step", [(check.name, check.verdict, check.detail)])
        self.run.put_phase_row(
            {
                "phase": "optimizer_step",
                "first": self._counter.counted_from + self._counter.updates <= 1,
                "verdict": verdict,
                "checks": [check.as_row()],
                "reason": reason,
            },
            source=type(self).__name__,
        )

    def _set_ledger_fields(self, summary: Mapping[str, Any]) -> None:
        self.run.set_ledger_fields(
            micro_batch_size=summary["micro_batch_size"],
            accumulate_grad_batches=summary["accumulate_grad_batches"],
            dp_replicas=summary["dp_replicas"],
            effective_batch_size=summary["effective_batch_size"],
            planned_updates=summary["planned_updates"],
            updates_done=summary["updates_done"],
            examples_seen=summary["examples_seen"],
            tokens_seen=summary["tokens_seen"],
        )
