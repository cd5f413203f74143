"""ValidationPredictionWriter: keep a fit's validation predictions, referenced from the ledger."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_pilot import storage
from lightning_pilot.core import validate
from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.phases import CheckResult
from lightning_pilot.ledger import file_sha256
from lightning_pilot.run import PilotCallback
from lightning_pilot.schemas import PREDICTIONS_SCHEMA

#: ``fn(pl_module, batch, outputs) -> tensor [B, ...]``: the predictions of one batch.
PredictionsFn = Callable[[pl.LightningModule, Any, Any], Any]


class ValidationPredictionWriter(PilotCallback):
    """Keep the validation predictions of a fit in ``runs/<run_id>/predictions.parquet``.

    One row per example of every validation batch (global rank 0's under several processes),
    published once per attempt when the run closes; a ``DivergenceLedger`` in the same fit puts
    its path and sha256 in the end record (docs/ledger.md).

    Args:
        predictions_fn, predictions_key: ``fn(pl_module, batch, outputs) -> tensor [B, ...]``;
            default: the ``predictions_key`` entry of the dict ``validation_step`` returns.
        adapter: reads example ids and targets of validation batches.
        out_dir: the output folder (see :class:`~lightning_pilot.PilotCallback`).

    Example:
        >>> import tempfile
        >>> import lightning.pytorch as pl
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> from lightning_pilot.storage import read_parquet_files
        >>> folder = tempfile.mkdtemp()
        >>> writer = ValidationPredictionWriter(predictions_fn=lambda m, batch, out: m(batch))
        >>> trainer = pl.Trainer(max_steps=2, limit_val_batches=2, val_check_interval=2,
        ...                      callbacks=[writer], logger=False, enable_checkpointing=False,
        ...                      enable_progress_bar=False, enable_model_summary=False,
        ...                      default_root_dir=folder)
        >>> trainer.fit(BoringModel())
        >>> path = writer.run.run_dir / "predictions.parquet"
        >>> frame = read_parquet_files([path], PREDICTIONS_SCHEMA).to_pandas()
        >>> len(frame), frame["step"].unique().tolist(), frame["prediction_shape"][0].tolist()
        (2, [2], [2])
    """

    def __init__(
        self,
        *,
        predictions_fn: PredictionsFn | None = None,
        predictions_key: str = "preds",
        adapter: BatchAdapter | None = None,
        out_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        owner = "ValidationPredictionWriter"
        super().__init__(out_dir=out_dir)
        expected = "a callable (pl_module, batch, outputs) -> tensor"
        self.predictions_fn = validate.callable_or_none(
            owner, "predictions_fn", predictions_fn, expected
        )
        self.predictions_key = validate.text(owner, "predictions_key", predictions_key)
        validate.instance(owner, "adapter", adapter, BatchAdapter)
        self.adapter = adapter or BatchAdapter()
        self._active = False
        self._rows: list[dict[str, Any]] = []
        self._error: str | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._rows, self._error = [], None
        self._active = stage == "fit"
        if not self._active:
            return
        # Registered before any closer the ledger registers (at fit end or on an exception),
        # so the file and its sha256 are in run.ledger_fields when the end record is written.
        self.run.on_close(self._publish)
        if trainer.world_size > 1 and self.run.is_global_zero:
            warnings.warn(
                "ValidationPredictionWriter under several processes keeps rank 0's validation"
                " batches only (its shard of the validation set).",
                RuntimeWarning,
                stacklevel=2,
            )

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not self._active or not self.run.is_global_zero or self._error is not None:
            return
        try:
            preds = self._predictions(pl_module, batch, outputs)
            view = self.adapter.view(batch)
            rows = prediction_rows(
                preds,
                ids=view.ids_list(),
                targets=view.targets,
                step=trainer.global_step,
                batch_idx=batch_idx,
                dataloader_idx=dataloader_idx,
            )
        except Exception as err:  # the user's outputs or predictions_fn: a verdict
            # Keep no predictions for this fit and say why on the validation row.
            detail = str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
            self._error = detail
            check = CheckResult("predictions", "not_checked", detail)
            reason = f"predictions not kept: {detail}"
            self._put_checks("validation", [check], counter="none", reason=reason)
            warnings.warn(f"lightning-pilot: {reason}", RuntimeWarning, stacklevel=2)
            return
        if not trainer.sanity_checking:  # checked during the sanity check, kept after it
            self._rows.extend(rows)

    def _predictions(self, module: pl.LightningModule, batch: Any, outputs: Any) -> Any:
        if self.predictions_fn is not None:
            return self.predictions_fn(module, batch, outputs)
        key = self.predictions_key
        if isinstance(outputs, Mapping) and key in outputs:
            return outputs[key]
        got = type(outputs).__name__
        if isinstance(outputs, Mapping):
            got = f"a dict without it (keys: {sorted(map(str, outputs))})"
        raise ValueError(
            "ValidationPredictionWriter found no predictions: validation_step must return a dict"
            f" with the key {key!r}, it returned {got}. Return {{{key!r}: tensor[B, ...]}} from"
            " validation_step, or pass predictions_fn=(pl_module, batch, outputs)"
            " -> tensor[B, ...]."
        )

    def _publish(self, error: OSError | None) -> None:
        """Publish the rows (a run closer); a failure while the fit failed is a warning."""
        if not self._rows:
            return
        run = self.run
        table = run.stamped_table(self._rows, PREDICTIONS_SCHEMA)
        self._rows = []
        try:
            try:
                path = storage.publish_table(table, run.run_dir / "predictions.parquet")
            except FileExistsError:  # an earlier attempt of this run published its own
                path = storage.publish_table(
                    table, run.run_dir / f"predictions-{run.attempt_id}.parquet"
                )
        except OSError as err:
            if error is None and run.exception is None:
                raise  # the ledger's end record then says the run's files were not written
            warnings.warn(
                f"lightning-pilot: could not write predictions: {err}", RuntimeWarning, stacklevel=2
            )
            return
        run.set_ledger_fields(predictions_uri=str(path), predictions_sha256=file_sha256(path))


def prediction_rows(
    predictions: Any, *, ids: Sequence[Any] | None, targets: Any, **context: Any
) -> list[dict[str, Any]]:
    """Rows of :data:`~lightning_pilot.schemas.PREDICTIONS_SCHEMA` for one batch: ``predictions``
    with a batch dimension (else ``ValueError``); ``context``: the columns of every row."""
    preds = torch.as_tensor(predictions).detach().cpu()
    if preds.dim() == 0:
        raise ValueError(f"predictions must have a batch dimension, got a scalar {preds.item()!r}.")
    size = preds.shape[0]
    flat = preds.double().reshape(size, -1).tolist()
    target_rows = None
    if isinstance(targets, torch.Tensor) and targets.dim() > 0 and targets.shape[0] == size:
        target_rows = targets.detach().cpu().double().reshape(size, -1).tolist()
    return [
        {
            **context,
            "row": row,
            "example_id": str(ids[row]) if ids is not None and row < len(ids) else None,
            "prediction": flat[row],
            "prediction_shape": list(preds.shape[1:]),
            "target": target_rows[row] if target_rows is not None else None,
        }
        for row in range(size)
    ]
