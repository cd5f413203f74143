"""TargetEstimator: at the end of a pilot, memory per GPU and step time on the GPUs to rent."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_pilot.callbacks._shared import trainer_progress
from lightning_pilot.core import validate
from lightning_pilot.run import PilotCallback
from lightning_pilot.schemas import ESTIMATE_SCHEMA, LARGEST_SCHEMA

_OWNER = "TargetEstimator"


class TargetEstimator(PilotCallback):
    """Estimate, at the end of the pilot, memory per GPU and step time on target GPUs.

    At fit end, global rank 0 runs :func:`lightning_pilot.estimate.estimate` on the fit's module
    and a CPU copy of its first batch (fake tensors: nothing allocated) over the grid given here,
    into ``runs/<run_id>/estimate.parquet`` and ``estimate_largest.parquet``, the choice sheet
    and the Trainer's loggers (docs/estimate.md).

    Args:
        targets: names of :data:`lightning_pilot.estimate.TARGETS` or
            :class:`~lightning_pilot.estimate.Target` objects.
        precisions: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"bf16-true"`` (default:
            the Trainer's when it is one of these, else ``"bf16-mixed"``).
        micro_batches: micro-batch sizes (default: the pilot's first batch's).
        seq_lens: sequence lengths (``None``: the pilot batch's own).
        checkpointing: activation checkpointing: ``False`` (off), ``True`` (every block),
            ``"selective"`` (per operator), one or more.
        strategies: ``"single"``, ``"ddp:N"``, ``"fsdp:N"``.
        largest: also search the largest micro-batch and sequence length that fit each target.
        options: further keyword arguments of :func:`~lightning_pilot.estimate.estimate`
            (``efficiency``, ``checkpoint_classes``, ``wrap_classes``, ``seq_step``,
            ``max_seq_len``, ``blocks``, ...); every argument is checked at construction.
        out_dir: the output folder (see :class:`~lightning_pilot.PilotCallback`).

    Example:
        >>> import tempfile
        >>> import lightning.pytorch as pl
        >>> from lightning_pilot import TargetEstimator
        >>> from lightning_pilot.demo import InstructionDataModule, TinyCausalLM
        >>> folder = tempfile.mkdtemp()
        >>> estimator = TargetEstimator(targets=["L4-24GB"], precisions=["32-true"],
        ...                             micro_batches=[4, 64], seq_lens=[32], largest=False)
        >>> trainer = pl.Trainer(max_steps=2, callbacks=[estimator], logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, default_root_dir=folder)
        >>> trainer.fit(TinyCausalLM(d_model=16, n_heads=2, n_layers=1),
        ...             datamodule=InstructionDataModule(dataset_size=32, batch_size=4))
        >>> table = estimator.result.frame()
        >>> sorted(set(table["micro_batch"])), bool(table["fits"].all())
        ([4, 64], True)
    """

    def __init__(
        self,
        *,
        targets: Sequence[Any] = ("H100-SXM-80GB",),
        precisions: Sequence[str] | None = None,
        micro_batches: Sequence[int] | None = None,
        seq_lens: Sequence[int | None] = (None,),
        checkpointing: Sequence[bool | str] = (False,),
        strategies: Sequence[str] = ("single",),
        largest: bool = True,
        options: Mapping[str, Any] | None = None,
        out_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(out_dir=out_dir)
        from lightning_pilot.estimate.job import check_arguments

        # Checked here, once: the estimate at fit end runs on these as they are.
        given = {
            "targets": targets,
            "precisions": precisions,
            "micro_batches": micro_batches,
            "seq_lens": seq_lens,
            "checkpointing": checkpointing,
            "strategies": strategies,
            "largest": largest,
        }
        checked = check_arguments(_OWNER, {k: v for k, v in given.items() if v is not None})
        self.targets = list(checked["targets"])
        self.precisions = list(checked["precisions"]) if precisions is not None else None
        self.micro_batches = list(checked["micro_batches"]) if micro_batches is not None else None
        self.seq_lens = list(checked["seq_lens"])
        self.checkpointing = list(checked["checkpointing"])
        self.strategies = list(checked["strategies"])
        self.largest: bool = checked["largest"]
        # One process: forking traced workers inside a Trainer's process is not safe.
        self.options = check_arguments(_OWNER, {"workers": 1} | _options(options))
        self.result: Any = None
        self._batch: Any = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            self._mute("on_train_batch_start")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # A copy on the CPU: the loader may reuse its buffers, and the estimate runs at fit end.
        self._batch = apply_to_collection(
            batch, torch.Tensor, lambda t: t.detach().to("cpu", copy=True)
        )
        self._mute("on_train_batch_start")

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._batch is None or not self.run.is_global_zero:
            return
        from lightning_pilot.core.batches import BatchAdapter
        from lightning_pilot.estimate import PRECISIONS
        from lightning_pilot.estimate.grid import run_grid
        from lightning_pilot.estimate.job import GridJob
        from lightning_pilot.estimate.rows import named_checkpointing

        batch, self._batch = self._batch, None
        own = str(trainer.precision)
        precisions = self.precisions or [own if own in PRECISIONS else "bf16-mixed"]
        size = BatchAdapter().view(batch, count_tokens=False).batch_size
        micro_batches = self.micro_batches or [size or 1]
        rank_zero_info(
            f"{_OWNER}: estimating {len(self.targets)} target(s) x {len(precisions)}"
            f" precision(s) x {len(micro_batches)} micro-batch(es) on fake tensors"
        )
        job = GridJob(
            pl_module,
            None,
            batch,
            targets=tuple(self.targets),
            precisions=tuple(precisions),
            micro_batches=tuple(micro_batches),
            seq_lens=tuple(self.seq_lens),
            checkpointing=tuple(self.checkpointing),
            strategies=tuple(self.strategies),
            largest=self.largest,
            **self.options,
        )
        progress = trainer_progress(trainer, len(precisions), _OWNER)
        self.result = result = run_grid(job, progress=progress)
        self.run.register_table("estimate", ESTIMATE_SCHEMA)
        self.run.append_rows("estimate", named_checkpointing(result.rows))
        if result.largest:
            self.run.register_table("estimate_largest", LARGEST_SCHEMA)
            self.run.append_rows("estimate_largest", named_checkpointing(result.largest))
        self._summarize(result)
        rank_zero_info(f"{_OWNER}: {len(result.rows)} row(s) in {result.seconds:.1f} s")

    def _summarize(self, result: Any) -> None:
        from lightning_pilot.core.per_target import on_target

        for c in on_target(result.frame()).to_dict("records"):
            key = (
                f"estimate/{c['target']}/{c['precision']}/{c['strategy']}/mb{c['micro_batch']}"
                f"{_KEY_SUFFIX.get(str(c['checkpointing']), '/' + str(c['checkpointing']))}"
            )
            columns = ("reserved_bytes", "fits", "step_high_s")
            self.run.summary.add(**{f"{key}/{column}": c[column] for column in columns})


#: The logger keys' end per checkpointing mode.
_KEY_SUFFIX: dict[str, str] = {"off": "", "full": "/ckpt", "selective": "/sac"}


#: ``estimate`` arguments this callback sets itself (not through ``options``).
_OWN: tuple[str, ...] = (
    "module", "batch", "factory", "targets", "precisions", "micro_batches", "seq_lens",
    "checkpointing", "strategies", "largest", "out_dir", "progress",
)  # fmt: skip


def _options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``options`` checked now against :func:`~lightning_pilot.estimate.estimate`'s arguments."""
    import inspect

    from lightning_pilot.estimate import estimate

    if options is None:
        return {}
    allowed = sorted(set(inspect.signature(estimate).parameters) - set(_OWN))
    problem = validate.invalid(
        _OWNER, "options", options, "a dict with keys among " + ", ".join(allowed)
    )
    if not isinstance(options, Mapping):
        raise TypeError(problem)
    if any(k not in allowed for k in options):
        raise ValueError(problem)
    return dict(options)
