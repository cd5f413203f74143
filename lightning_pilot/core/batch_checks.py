"""Pure checks of one batch's shape: ids, targets present, what the targets are, real lengths,
truncation, padding and the attention mask; values and tensors in, ``CheckResult`` out, no
Trainer (docs/data-and-overfit.md)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

import torch

from lightning_pilot.core.batches import is_int_tensor
from lightning_pilot.core.checks import CheckResult, _judged, shown_names

TargetKind = Literal["classification", "sequence", "regression", "unknown"]


def target_kind(inputs: Any, targets: Any) -> TargetKind:
    """What the targets are: one class per example, one token per position, or real values."""
    if not isinstance(targets, torch.Tensor):
        return "unknown"
    if targets.is_floating_point():
        return "regression"
    if not is_int_tensor(targets):
        return "unknown"
    if targets.ndim == 1:
        return "classification"
    if targets.ndim == 2 and isinstance(inputs, torch.Tensor) and inputs.shape == targets.shape:
        return "sequence"
    return "unknown"


def real_positions(mask: Any, shape: torch.Size) -> torch.Tensor:
    """The real (non-padding) positions: the mask's nonzero ones when it has ``shape``, else all."""
    if isinstance(mask, torch.Tensor) and mask.shape == shape:
        return mask.detach().cpu() != 0
    return torch.ones(shape, dtype=torch.bool)


def check_ids(ids: Sequence[Any] | None, batch_size: int | None) -> CheckResult:
    """Every example of the batch carries an id, and no id repeats within the batch."""
    name = "ids_present_unique"
    if ids is None:
        detail = (
            "field 'ids' not found in the batch: give BatchAdapter(ids=...) or add an id to each"
            " example"
        )
        return CheckResult(name, "not_checked", detail)
    problem = None
    if batch_size is not None and len(ids) != batch_size:
        problem = (
            f"{len(ids)} id(s) for {batch_size} example(s): ids must have one entry per example"
        )
    elif missing := [i for i, value in enumerate(ids) if value is None or value == ""]:
        where = shown_names(missing)
        problem = f"{len(missing)} example(s) without an id at batch position(s) {where}"
    elif repeated := sorted(v for v, n in Counter(map(str, ids)).items() if n > 1):
        problem = f"{len(repeated)} id(s) repeated within one batch: {shown_names(repeated)}"
    return _judged(name, problem, passed=f"{len(ids)} unique id(s)")


def check_targets_present(targets: Any) -> CheckResult:
    """The batch has targets the loss can use."""
    if targets is None:
        detail = (
            "field 'targets' not found in the batch (looked for labels/label/targets/target/y):"
            " give BatchAdapter(targets=...) if they are elsewhere (a model trained without"
            " targets, such as diffusion or contrastive training, has none to check)"
        )
        return CheckResult("targets_present", "not_checked", detail)
    empty = isinstance(targets, torch.Tensor) and targets.numel() == 0
    return _judged("targets_present", "the targets tensor is empty" if empty else None)


def row_lengths(inputs: Any, mask: Any) -> list[int] | None:
    """Real length of each sequence: the mask's row sums (one per choice for a ``[batch, choices,
    length]`` mask of the inputs' shape), else the full width."""
    if isinstance(mask, torch.Tensor) and (
        mask.ndim == 2
        or (isinstance(inputs, torch.Tensor) and inputs.ndim > 2 and inputs.shape == mask.shape)
    ):
        rows = mask.detach().to(torch.int64).reshape(-1, mask.shape[-1])
        return list(rows.sum(dim=1).cpu().tolist())
    if is_int_tensor(inputs) and inputs.ndim == 2:
        return [int(inputs.shape[1])] * int(inputs.shape[0])
    return None


def check_truncation(lengths: Sequence[int] | None, max_length: int | None) -> CheckResult:
    """Share of the sequences (``lengths``: one or more) reaching ``max_length``, probably cut."""
    name = "truncation"
    if lengths is None:
        return CheckResult(name, "not_checked", "inputs are not token sequences")
    if max_length is None:
        detail = (
            f"longest sequence {max(lengths)} tokens; the maximum length is unknown: give"
            " max_length= to count truncated sequences"
        )
        return CheckResult(name, "not_checked", detail)
    at_max = sum(1 for n in lengths if n >= max_length)
    share = f"{at_max / len(lengths):.0%}"
    detail = f"{at_max} of {len(lengths)} sequence(s) ({share}) reach max_length={max_length}"
    problem = detail + ": they were probably truncated, which can cut the part the loss needs"
    return _judged(name, problem if at_max else None, "warn", detail)


def check_padding(padding: int, total: int, *, warn_above: float = 0.5) -> CheckResult:
    """Fraction of positions that are padding (``padding`` of ``total``); warn above a limit."""
    name = "padding"
    if total <= 0:
        return CheckResult(name, "not_checked", "field 'attention_mask' not found")
    fraction = padding / total
    detail = f"{fraction:.1%} of {total} positions are padding"
    advice = f" (above {warn_above:.0%}): sort or bucket by length to waste less compute"
    return _judged(name, detail + advice if fraction > warn_above else None, "warn", detail)


def check_attention_mask(
    inputs: Any,
    mask: Any,
    targets: Any,
    *,
    ignore_index: int,
    pad_token_id: int | None = None,
    labels_unaligned: str | None = None,
) -> list[CheckResult]:
    """The mask fits the inputs, marks padding as a contiguous block, and padding is not a target
    (``labels_unaligned``: why the targets are not aligned with the inputs, then not checked)."""
    if not isinstance(mask, torch.Tensor):
        return [CheckResult("attention_mask", "not_checked", "field 'attention_mask' not found")]
    if isinstance(inputs, torch.Tensor) and inputs.ndim == 2 and inputs.shape != mask.shape:
        shapes = f"attention_mask has shape {tuple(mask.shape)} but inputs {tuple(inputs.shape)}"
        return [CheckResult("attention_mask_shape", "fail", shapes)]
    results = [CheckResult("attention_mask_shape", "pass", "")]
    values = sorted({int(v) for v in torch.unique(mask.detach().to(torch.int64)).cpu().tolist()})
    if not set(values) <= {0, 1}:
        problem = f"attention_mask holds {values}; expected only 0 (padding) and 1 (real token)"
        return [*results, CheckResult("attention_mask_values", "fail", problem)]
    results.append(CheckResult("attention_mask_values", "pass", ""))
    real = mask.detach().to(torch.int64).cpu()
    if real.ndim == 2:
        # A row is contiguous when its 0/1 sequence changes value at most once.
        changes = (real[:, 1:] != real[:, :-1]).sum(dim=1)
        broken = [int(i) for i in torch.nonzero(changes > 1).flatten().tolist()]
        problem = (
            f"{len(broken)} row(s) have padding inside the sequence (rows {shown_names(broken)}):"
            " packed sequences need position ids and a block mask"
        )
        results.append(_judged("attention_mask_contiguous", problem if broken else None, "warn"))
    if pad_token_id is not None and isinstance(inputs, torch.Tensor) and inputs.shape == mask.shape:
        wrong = int(((real == 0) & (inputs.detach().cpu() != pad_token_id)).sum())
        problem = f"{wrong} masked position(s) do not hold pad_token_id={pad_token_id}"
        results.append(_judged("padding_token_masked", problem if wrong else None, "warn"))
    if labels_unaligned is not None and is_int_tensor(targets):
        results.append(CheckResult("padding_not_in_loss", "not_checked", labels_unaligned))
    elif is_int_tensor(targets) and targets.shape == mask.shape:
        counted = int(((real == 0) & (targets.detach().cpu() != ignore_index)).sum())
        problem = (
            f"{counted} padding position(s) have a label other than {ignore_index}: the loss"
            " trains the model to predict padding"
        )
        results.append(_judged("padding_not_in_loss", problem if counted else None))
    return results
