"""The data phase's checks of what the loss is fed, wired for one fit by :class:`DataInspection`
without a Trainer (docs/data-and-overfit.md) from ``batch_checks`` (one batch), ``label_checks``
(labels against the model and inputs), ``prompt_checks`` (prompt masking), ``split_inspection``
(one split's batches) and ``split_scan`` (the datasets across splits); and the rows of
``examples.parquet`` (:func:`example_rows`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lightning_pilot.core.batch_checks import row_lengths
from lightning_pilot.core.batches import BatchAdapter, BatchView, is_int_tensor
from lightning_pilot.core.checks import CheckResult
from lightning_pilot.core.label_checks import CausalLMWatch, label_relations
from lightning_pilot.core.split_inspection import SplitInspection


class DataInspection:
    """The ``data`` phase of a fit: ``batches`` of each split's :class:`SplitInspection`,
    ``examples`` per split kept for the table, and every check."""

    def __init__(
        self,
        splits: Mapping[str, SplitInspection],
        *,
        batches: int,
        examples: int,
        decode: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        self.splits, self.batches = dict(splits), batches
        self.examples, self.decode = examples, decode
        self.rows: list[dict[str, Any]] = []
        #: Per split: the unreadable batch's check; and every check user code left not_checked.
        self.errors: dict[str, CheckResult] = {}
        self.raised: list[CheckResult] = []
        self._decode_errors: list[str] = []

    def done(self, split: str) -> bool:
        """Nothing more to read from ``split``: all its batches read, or one that failed."""
        inspection = self.splits.get(split)
        return inspection is None or inspection.batches >= self.batches or split in self.errors

    def add(self, split: str, batch: Any, adapter: BatchAdapter) -> None:
        """Inspect one batch of ``split``; user code that raises is kept as ``batch_read``."""
        inspection = self.splits[split]
        try:
            view = adapter.view(batch)
            limit = self.examples - sum(1 for r in self.rows if r["split"] == split)
            rows = []
            if limit > 0:
                rows = example_rows(
                    view,
                    split=split,
                    batch_index=inspection.batches,
                    limit=limit,
                    ignore_index=adapter.ignore_index,
                    max_length=inspection.max_length,
                    decode=self.decode,
                    errors=self._decode_errors,
                )
            inspection.add(view, batch)
            self.rows += rows
        except Exception as err:  # a field function of the adapter, an odd batch: not the fit
            detail = (
                f"reading a {split} batch raised {type(err).__name__}: {err}; the {split} batch"
                " checks stop there: give adapter=BatchAdapter(...) field specs that fit the batch"
            )
            self.errors[split] = CheckResult(f"{split}/batch_read", "not_checked", detail)
            self.raised.append(self.errors[split])

    def results(
        self,
        watch: CausalLMWatch | None,
        *,
        dataset_checks: Sequence[CheckResult] | None,
        failed: BaseException | None = None,
    ) -> list[CheckResult]:
        """Every check of the phase; ``dataset_checks`` is ``None`` when the fit ``failed``
        before training started (and the datasets were scanned)."""
        results = [c for s in self.splits.values() for c in s.checks()]
        results += self.errors.values()
        if self._decode_errors:
            detail = (
                f"{self._decode_errors[0]} ({len(self._decode_errors)} call(s)): input_text"
                " and target stay null in examples.parquet; fix decode= (it receives a 1-d"
                " LongTensor of token ids, e.g. a tokenizer's decode)"
            )
            self.raised.append(CheckResult("decode", "not_checked", detail))
            results.append(self.raised[-1])
        if watch is not None:
            results.append(watch.check())
            if watch.error is not None:
                self.raised.append(results[-1])
        if dataset_checks is None:
            detail = f"the fit ended ({type(failed).__name__}) before training started"
            results.append(CheckResult("datasets_scanned", "not_checked", detail))
        return results + list(dataset_checks or [])

    def table_rows(self) -> list[dict[str, Any]]:
        """The kept examples, in split order, then by batch and position."""
        order = {split: i for i, split in enumerate(self.splits)}
        return sorted(self.rows, key=lambda r: (order[r["split"]], r["batch_index"], r["position"]))


def example_rows(
    view: BatchView,
    *,
    split: str,
    batch_index: int,
    limit: int,
    ignore_index: int,
    max_length: int | None = None,
    decode: Callable[[torch.Tensor], Any] | None = None,
    max_values: int = 256,
    errors: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Rows of ``examples.parquet`` (docs/data-and-overfit.md) for the first ``limit`` examples of
    one batch (a ``decode`` that raises: null text, the message in the note and ``errors``)."""
    ids = view.ids_list()
    rows = []
    lengths = row_lengths(view.inputs, view.attention_mask)
    relations = label_relations(view.inputs, view.targets, ignore_index=ignore_index)
    for i in range(min(limit, view.batch_size or 0)):
        notes: list[str] = []
        row: dict[str, Any] = {
            "split": split,
            "batch_index": batch_index,
            "position": i,
            "example_id": str(ids[i]) if ids is not None and i < len(ids) else None,
        }
        if row["example_id"] is None:
            notes.append("no id in the batch")
        x = view.inputs[i] if isinstance(view.inputs, torch.Tensor) else None
        real = None
        if isinstance(view.attention_mask, torch.Tensor) and view.attention_mask.ndim == 2:
            real = view.attention_mask[i].detach().cpu() != 0
        if x is not None and is_int_tensor(x):
            tokens = x.detach().cpu()
            kept = tokens[real] if real is not None and real.shape == tokens.shape else tokens
            row["input_tokens"] = kept.reshape(-1).tolist()
            if decode is not None:
                row["input_text"] = _decoded(decode, kept, notes, errors)
        elif x is not None and x.is_floating_point():
            flat = x.detach().cpu().reshape(-1).to(torch.float64)
            row["input_values"] = flat[:max_values].tolist()
            if flat.numel() > max_values:
                notes.append(f"input_values keeps {max_values} of {flat.numel()} values")
        else:
            notes.append("input not a tensor: not stored")
        y = view.targets[i] if isinstance(view.targets, torch.Tensor) else None
        if y is not None and y.ndim == 0:
            row["target"] = str(y.item())
            row["loss_tokens"] = int(y.item() != ignore_index) if is_int_tensor(y) else 1
        elif y is not None and is_int_tensor(y):
            labels = y.detach().cpu().reshape(-1)
            counted = torch.nonzero(labels != ignore_index).flatten()
            row["target_tokens"] = labels.tolist()
            row["loss_positions"] = counted.tolist()
            row["loss_tokens"] = int(counted.numel())
            if decode is not None:
                row["target"] = _decoded(decode, labels[counted], notes, errors)
            if relations is not None and i < len(relations):
                row["label_relation"] = relations[i]
        elif view.targets is None:
            notes.append("no target in the batch")
        elif y is None:
            notes.append(f"target a {type(view.targets).__name__}, not a tensor: not stored")
        if lengths is not None:
            row["length"] = lengths[i]
            row["seq_len"] = view.seq_len
            if max_length is not None:
                row["truncated"] = lengths[i] >= max_length
        row["notes"] = "; ".join(notes) or None
        rows.append(row)
    return rows


def _decoded(
    decode: Callable[[torch.Tensor], Any],
    tokens: torch.Tensor,
    notes: list[str],
    errors: list[str] | None,
) -> str | None:
    """``str(decode(tokens))``; ``None`` with a note when the user's ``decode`` raises."""
    try:
        return str(decode(tokens))
    except Exception as err:  # the user's function: report it, keep the row
        message = f"decode raised {type(err).__name__}: {err}"
        if message not in notes:
            notes.append(message)
        if errors is not None:
            errors.append(message)
        return None
