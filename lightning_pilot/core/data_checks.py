"""The data phase's checks of what the loss is fed, wired for one fit by :class:`DataInspection`
without a Trainer (docs/data-and-overfit.md) from ``batch_checks`` (one batch), ``label_checks``
(labels against the model and inputs), ``prompt_checks`` (prompt masking), ``split_inspection``
(one split's batches), ``split_scan`` (the datasets across splits) and ``example_table`` (the rows
of ``examples.parquet``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.checks import CheckResult
from lightning_pilot.core.example_table import example_rows
from lightning_pilot.core.label_checks import CausalLMWatch
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
