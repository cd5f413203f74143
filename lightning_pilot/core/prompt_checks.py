"""Checks that the prompt is out of the loss (guessed from labels equal to the inputs, or located
by a :class:`PromptSpec`) and that every row keeps a position in it (docs/data-and-overfit.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Final

import torch

from lightning_pilot.core.batch_checks import real_positions, target_kind
from lightning_pilot.core.batches import is_int_tensor
from lightning_pilot.core.checks import CheckResult, _judged, shown_names

#: How to turn the ``instruction_masked`` warning into a check (BatchInspector's options).
PROMPT_OPTIONS_ADVICE: Final = (
    "to check the masking instead, tell BatchInspector where each prompt is: response_mask_key="
    " (a batch field, 1 on response tokens, 0 on prompt tokens), prompt_length_key= (a batch"
    " field, the prompt's length in tokens) or response_template= (the token ids that start"
    " the response)"
)


def _masking_counts(
    inputs: Any, targets: Any, mask: Any, ignore_index: int
) -> tuple[int, int, int]:
    """Real tokens of aligned token targets, those whose label is the input, those ignored."""
    real = real_positions(mask, targets.shape)
    labels, tokens = targets.detach().cpu(), inputs.detach().cpu()
    equal, ignored = (real & (labels == tokens)), (real & (labels == ignore_index))
    return int(real.sum()), int(equal.sum()), int(ignored.sum())


def check_instruction_masking(
    inputs: Any, targets: Any, mask: Any, *, ignore_index: int
) -> CheckResult:
    """For causal-LM batches: are prompt (instruction) positions masked out of the labels?"""
    if target_kind(inputs, targets) != "sequence":
        why = "targets are not aligned token sequences"
        return CheckResult("instruction_masked", "not_checked", why)
    return _masking(_masking_counts(inputs, targets, mask, ignore_index), ignore_index)


def _masking(counts: Sequence[int], ignore_index: int) -> CheckResult:
    """``instruction_masked`` from the :func:`_masking_counts` of the batches."""
    name = "instruction_masked"
    total, equal, ignored = counts
    if total == 0:
        return CheckResult(name, "not_checked", "no real token in the batch")
    masked = f"{ignored} of {total} real tokens ({ignored / total:.0%}) are masked out of the loss"
    problem = (
        f"labels equal input_ids on all {total} real tokens: the instruction (prompt) is a"
        f" target too; set its labels to {ignore_index} if only the response should count"
        " (expected for pretraining data or training on whole sequences); " + PROMPT_OPTIONS_ADVICE
    )
    return _judged(name, problem if equal == total else None, "warn", masked)


@dataclass(frozen=True)
class PromptSpec:
    """Where each row's prompt is, so that ``instruction_masked`` checks it is out of the loss:
    one of ``response_mask_key`` (a batch field, 1 on response tokens, 0 on prompt tokens),
    ``prompt_length_key`` (a batch field, each prompt's length in tokens, counted from the
    row's first real token) or ``response_template`` (the token ids that start the response:
    everything up to and including its first occurrence is prompt)."""

    response_mask_key: str | None = None
    prompt_length_key: str | None = None
    response_template: tuple[int, ...] | None = None

    def __str__(self) -> str:
        given = ((f.name, getattr(self, f.name)) for f in fields(self))
        return ", ".join(f"{name}={value!r}" for name, value in given if value is not None)

    def locate(
        self, batch: Any, inputs: Any, mask: Any
    ) -> tuple[torch.Tensor | None, list[int], str | None]:
        """``(prompt, rows without one, why)``: each row's prompt positions as a bool ``[batch,
        length]`` tensor (real tokens only) and the rows holding no response template; or
        ``None`` and why the batch cannot say."""
        if not is_int_tensor(inputs) or inputs.ndim != 2:
            return None, [], "the inputs are not token ids [batch, length]"
        tokens = inputs.detach().cpu()
        real = real_positions(mask, tokens.shape)
        if self.response_template is not None:
            return (*_template_prompt(tokens, real, self.response_template), None)
        key = self.response_mask_key or self.prompt_length_key
        field = batch.get(key) if isinstance(batch, Mapping) else None
        if field is None:
            keys = ", ".join(map(repr, batch)) if isinstance(batch, Mapping) else None
            found = f"the batch's keys: {keys}" if keys else "the batch is not a dict"
            return None, [], f"field {key!r} ({self}) not found in the batch ({found})"
        try:
            values = torch.as_tensor(field).detach().cpu()
        except (TypeError, ValueError, RuntimeError) as err:
            why = f"field {key!r} ({self}) is not a tensor or a list of numbers ({err})"
            return None, [], why
        if self.response_mask_key is not None and values.shape == tokens.shape:
            return real & (values == 0), [], None
        if self.response_mask_key is not None:
            why = (
                f"field {key!r} ({self}) has shape {tuple(values.shape)}, the inputs"
                f" {tuple(tokens.shape)}: it needs one 0/1 value per token"
            )
            return None, [], why
        lengths = values.reshape(-1)
        if lengths.numel() != tokens.shape[0] or lengths.is_floating_point():
            why = (
                f"field {key!r} ({self}) holds {tuple(values.shape)} {values.dtype} values for"
                f" {tokens.shape[0]} rows: it needs one integer length per row"
            )
            return None, [], why
        rank = real.to(torch.int64).cumsum(dim=1)  # the position among the row's real tokens
        return real & (rank <= lengths.to(torch.int64)[:, None]), [], None


def _template_prompt(
    tokens: torch.Tensor, real: torch.Tensor, template: Sequence[int]
) -> tuple[torch.Tensor, list[int]]:
    """Each row's positions up to the end of the first ``template`` in its real tokens, and the
    rows holding none."""
    rows, width, size = int(tokens.shape[0]), int(tokens.shape[1]), len(template)
    if size > width:
        return torch.zeros(tokens.shape, dtype=torch.bool), list(range(rows))
    windows = tokens.unfold(1, size, 1) == torch.tensor(template, dtype=tokens.dtype)
    found = windows.all(dim=2) & real.unfold(1, size, 1).all(dim=2)
    has = found.any(dim=1)
    end = found.to(torch.int64).argmax(dim=1) + size
    prompt = real & has[:, None] & (torch.arange(width)[None, :] < end[:, None])
    return prompt, torch.nonzero(~has).flatten().tolist()


def prompt_label_counts(
    prompt: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int,
    shifted: Sequence[bool] | None = None,
) -> tuple[list[int], list[int]]:
    """Per row: its prompt positions, and those whose label is not ``ignore_index`` (the prompt
    in the loss). ``shifted``: rows whose labels are shifted left by one, whose prompt labels sit
    one position earlier."""
    labelled = prompt
    if shifted is not None and any(shifted):
        moved = torch.cat([prompt[:, 1:], torch.zeros_like(prompt[:, :1])], dim=1)
        rows = torch.tensor(list(shifted), dtype=torch.bool)[:, None]
        labelled = torch.where(rows, moved, prompt)
    counted = targets.detach().cpu() != ignore_index
    return labelled.sum(dim=1).tolist(), (labelled & counted).sum(dim=1).tolist()


def check_loss_positions(targets: torch.Tensor, *, ignore_index: int) -> CheckResult:
    """Every sequence of token targets ``[batch, length]`` has a position counted in the loss."""
    per_row = (targets.detach().cpu() != ignore_index).sum(dim=1)
    empty = torch.nonzero(per_row == 0).flatten().tolist()
    problem = (
        f"{len(empty)} of {targets.shape[0]} sequence(s) have no position counted in the loss"
        f" (rows {shown_names(empty)}): truncated before the response, or fully masked"
    )
    counted = f"{int(per_row.sum())} positions counted in the loss"
    return _judged("loss_positions_present", problem if empty else None, "warn", counted)
