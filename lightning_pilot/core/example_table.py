"""The rows of ``examples.parquet``: the first examples of each split as the loss sees them, with
a note on what could not be stored (docs/data-and-overfit.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_pilot.core.batch_checks import row_lengths
from lightning_pilot.core.batches import BatchView, is_int_tensor
from lightning_pilot.core.label_checks import label_relations

__all__ = ["example_rows"]


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
