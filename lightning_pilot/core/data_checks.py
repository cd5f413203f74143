"""The data phase's checks of what the loss is fed, wired for one fit by :class:`DataInspection`
without a Trainer (docs/data-and-overfit.md). Every name of their modules is importable here:
``batch_checks`` (one batch), ``label_checks`` (labels against the model and inputs),
``prompt_checks`` (prompt masking), ``split_inspection`` (one split's batches), ``split_scan``
(the datasets across splits) and ``example_table`` (the rows of ``examples.parquet``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lightning_pilot.core.batch_checks import (
    TargetKind,
    check_attention_mask,
    check_ids,
    check_padding,
    check_targets_present,
    check_truncation,
    row_lengths,
    target_kind,
)
from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.checks import CheckResult
from lightning_pilot.core.example_table import example_rows
from lightning_pilot.core.label_checks import (
    DECODER_RELATIONS,
    HEAD_NAMES,
    LABEL_RELATIONS,
    SHIFTED_LABELS_ADVICE,
    CausalLMWatch,
    check_causal_lm_labels,
    check_decoder_label_shift,
    check_label_range,
    check_label_shift,
    decoder_label_relations,
    find_causal_lm,
    find_encoder_decoder,
    infer_output_size,
    label_relations,
)
from lightning_pilot.core.prompt_checks import (
    PROMPT_OPTIONS_ADVICE,
    PromptSpec,
    check_instruction_masking,
    check_loss_positions,
    prompt_label_counts,
)
from lightning_pilot.core.split_inspection import SplitInspection
from lightning_pilot.core.split_scan import (
    DatasetScan,
    check_class_histograms,
    check_duplicates,
    check_leakage,
    class_histogram,
    find_shared,
    first_items,
    input_fingerprint,
)

__all__ = [
    "DECODER_RELATIONS",
    "HEAD_NAMES",
    "LABEL_RELATIONS",
    "PROMPT_OPTIONS_ADVICE",
    "SHIFTED_LABELS_ADVICE",
    "CausalLMWatch",
    "DataInspection",
    "DatasetScan",
    "PromptSpec",
    "SplitInspection",
    "TargetKind",
    "check_attention_mask",
    "check_causal_lm_labels",
    "check_class_histograms",
    "check_decoder_label_shift",
    "check_duplicates",
    "check_ids",
    "check_instruction_masking",
    "check_label_range",
    "check_label_shift",
    "check_leakage",
    "check_loss_positions",
    "check_padding",
    "check_targets_present",
    "check_truncation",
    "class_histogram",
    "decoder_label_relations",
    "example_rows",
    "find_causal_lm",
    "find_encoder_decoder",
    "find_shared",
    "first_items",
    "infer_output_size",
    "input_fingerprint",
    "label_relations",
    "prompt_label_counts",
    "row_lengths",
    "target_kind",
]


class DataInspection:
    """The ``data`` phase of a fit: ``batches`` of each split's :class:`SplitInspection`,
    ``examples`` per split kept for the table, and every check.

    Example:
        >>> inspection = DataInspection(
        ...     {"train": SplitInspection("train", ignore_index=-100, output_size=2)},
        ...     batches=1, examples=1)
        >>> inspection.add("train", (torch.zeros(2, 3), torch.tensor([0, 1])), BatchAdapter())
        >>> inspection.done("train"), [r["target"] for r in inspection.table_rows()]
        (True, ['0'])
        >>> inspection.add("train", "x", BatchAdapter(ids=lambda batch: batch["uid"]))
        >>> [c.verdict for c in inspection.results(None, dataset_checks=[])][-1]
        'not_checked'
    """

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
