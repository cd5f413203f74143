"""Pure checks of what the loss is fed (ids, targets, label ranges, masks, lengths, splits): values
and tensors in, ``CheckResult`` out, no Trainer (docs/data-and-overfit.md)."""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import torch
from torch import nn
from torch.utils.data import IterableDataset
from torch.utils.hooks import RemovableHandle

from lightning_pilot.core.batches import INPUT_KEYS, BatchAdapter, BatchView, is_int_tensor
from lightning_pilot.core.checks import CheckResult, shown_names
from lightning_pilot.core.phases import worst_verdict

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

#: Child-module names tried first when looking for a model's output layer.
HEAD_NAMES: Final = ("lm_head", "head", "classifier", "fc", "output_layer", "out")
TargetKind = Literal["classification", "sequence", "regression", "unknown"]
#: How a row's token labels relate to its ``input_ids`` (:func:`label_relations`).
LABEL_RELATIONS: Final = ("identical", "shifted by 1", "shifted by -1", "other")
#: How a row's labels relate to an encoder-decoder's ``decoder_input_ids``
#: (:func:`decoder_label_relations`); ``shifted by 1`` (``labels[t] == decoder_input_ids[t+1]``)
#: is the convention.
DECODER_RELATIONS: Final = ("shifted by 1", "shifted by 2", "identical", "other")
#: How to turn the ``instruction_masked`` warning into a check (BatchInspector's options).
PROMPT_OPTIONS_ADVICE: Final = (
    "to check the masking instead, tell BatchInspector where each prompt is: response_mask_key="
    " (a batch field, 1 on response tokens, 0 on prompt tokens), prompt_length_key= (a batch"
    " field, the prompt's length in tokens) or response_template= (the token ids that start"
    " the response)"
)
#: The advice of ``label_shift`` when the labels are ``input_ids`` shifted left by one.
SHIFTED_LABELS_ADVICE: Final = (
    "labels are input_ids shifted left by 1; Hugging Face *ForCausalLM models shift labels"
    " internally, so this trains to predict 2 tokens ahead; pass labels = input_ids (with -100"
    " on masked positions) to such models, or ignore this warning if your loss does not shift"
)


def _judged(name: str, problem: str | None, verdict: str = "fail", passed: str = "") -> CheckResult:
    """``verdict`` with the problem when there is one, else ``pass`` (with ``passed``)."""
    return CheckResult(name, verdict, problem) if problem else CheckResult(name, "pass", passed)


def infer_output_size(module: nn.Module) -> tuple[int | None, str]:
    """Guess how many outputs the targets index into, as ``(size or None, where it came from)``
    (the order tried: docs/data-and-overfit.md).

    Example:
        >>> infer_output_size(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)))
        (3, "out_features of the last nn.Linear '2'")
    """
    getter = getattr(module, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except (NotImplementedError, AttributeError, TypeError):
            head = None
        if isinstance(head, nn.Linear):
            return head.out_features, "out_features of get_output_embeddings()"
        if isinstance(head, nn.Embedding):
            return head.num_embeddings, "num_embeddings of get_output_embeddings()"
    children = dict(module.named_children())
    for name in HEAD_NAMES:
        child = children.get(name)
        if isinstance(child, nn.Linear):
            return child.out_features, f"out_features of the head '{name}'"
    linear = [(name, sub) for name, sub in module.named_modules() if isinstance(sub, nn.Linear)]
    if linear:
        return linear[-1][1].out_features, f"out_features of the last nn.Linear '{linear[-1][0]}'"
    return None, "no nn.Linear head found in the module"


#: Hugging Face causal LMs whose loss does not shift the labels it is given.
_NOT_SHIFTING: Final = frozenset({"XLNetLMHeadModel"})


def find_causal_lm(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The first Hugging Face causal LM in ``module`` as ``(path, model)`` (``""``: the module
    itself), or ``None``; matched by class name (docs/data-and-overfit.md)."""
    for name, sub in module.named_modules():
        cls = type(sub)
        if cls.__name__ in _NOT_SHIFTING or not cls.__name__.endswith(
            ("ForCausalLM", "LMHeadModel")
        ):
            continue
        if any(
            base.__name__ == "PreTrainedModel" and base.__module__.startswith("transformers.")
            for base in cls.__mro__
        ):
            return name, sub
    return None


def find_encoder_decoder(module: nn.Module) -> str | None:
    """The first submodule whose ``config.is_encoder_decoder`` is true (T5, BART), named as
    ``Class at 'path'`` (its labels are decoder targets); ``None`` when there is none.

    Example:
        >>> find_encoder_decoder(nn.Sequential(nn.Linear(2, 2))) is None
        True
    """
    for name, sub in module.named_modules():
        if getattr(getattr(sub, "config", None), "is_encoder_decoder", False) is True:
            cls = type(sub).__name__
            return f"{cls} at '{name}'" if name else cls
    return None


def target_kind(inputs: Any, targets: Any) -> TargetKind:
    """What the targets are: one class per example, one token per position, or real values.

    Example:
        >>> target_kind(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long))
        'sequence'
        >>> target_kind(torch.zeros(2, 3), torch.tensor([0, 1]))
        'classification'
    """
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


def check_label_range(
    targets: Any,
    *,
    output_size: int | None,
    ignore_index: int,
    source: str = "the caller",
) -> CheckResult:
    """Every counted label is a valid output index ``0 <= label < output_size``; ``source``
    says where ``output_size`` came from.

    Example:
        >>> check_label_range(torch.tensor([0, 3, -100]), output_size=4, ignore_index=-100).verdict
        'pass'
        >>> print(check_label_range(torch.tensor([1, 4]), output_size=4, ignore_index=-100).detail)
        1 of 2 label value(s) outside [0, 3] (the model has 4 outputs, from the caller): values 4;
        labels look shifted by one class (1-based?)
    """
    name = "label_range"
    if not isinstance(targets, torch.Tensor):
        detail = "no targets tensor to check"
        if isinstance(targets, Sequence | Mapping) and not isinstance(targets, str | bytes):
            detail = (
                f"the targets are a {type(targets).__name__}, not a tensor (detection or"
                " segmentation targets, one dict per image?): to check the class range give"
                " BatchAdapter(targets=lambda batch: torch.cat([t['class_labels'] for t in"
                " batch['labels']])) and num_classes="
            )
        return CheckResult(name, "not_checked", detail)
    if not is_int_tensor(targets):
        return CheckResult(
            name, "not_checked", f"targets are {targets.dtype} (regression or soft labels)"
        )
    counted = targets[targets != ignore_index]
    if counted.numel() == 0:
        return CheckResult(name, "not_checked", f"every target is the ignore index {ignore_index}")
    low, high = int(counted.min()), int(counted.max())
    if output_size is None:
        detail = (
            f"labels span [{low}, {high}] but the model's output size is unknown ({source}):"
            " give num_classes= or vocab_size="
        )
        return CheckResult(name, "not_checked", detail)
    bad = counted[(counted < 0) | (counted >= output_size)]
    if bad.numel() == 0:
        return CheckResult(
            name, "pass", f"labels in [{low}, {high}] within {output_size} outputs ({source})"
        )
    values = sorted({int(v) for v in bad.tolist()})
    hint = ""
    if low >= 1 and high == output_size:
        hint = "; labels look shifted by one class (1-based?)"
    elif any(v < 0 for v in values):
        hint = f"; negative labels other than the ignore index {ignore_index}"
    detail = (
        f"{bad.numel()} of {counted.numel()} label value(s) outside [0, {output_size - 1}] (the"
        f" model has {output_size} outputs, from {source}): values {shown_names(values)}{hint}"
    )
    return CheckResult(name, "fail", detail)


def row_lengths(inputs: Any, mask: Any) -> list[int] | None:
    """Real (non-padding) length of each sequence: the mask's row sums, else the full width."""
    if isinstance(mask, torch.Tensor) and mask.ndim == 2:
        lengths: list[int] = mask.detach().to(torch.int64).sum(dim=1).cpu().tolist()
        return lengths
    if is_int_tensor(inputs) and inputs.ndim == 2:
        return [int(inputs.shape[1])] * int(inputs.shape[0])
    return None


def check_truncation(lengths: Sequence[int] | None, max_length: int | None) -> CheckResult:
    """Fraction of sequences that reach the maximum length (and were probably cut there)."""
    name = "truncation"
    if lengths is None:
        return CheckResult(name, "not_checked", "inputs are not token sequences")
    if not lengths:
        return CheckResult(name, "not_checked", "no sequences inspected")
    if max_length is None:
        detail = (
            f"longest sequence {max(lengths)} tokens; the maximum length is unknown: give"
            " max_length= to count truncated sequences"
        )
        return CheckResult(name, "not_checked", detail)
    at_max = sum(1 for n in lengths if n >= max_length)
    fraction = at_max / len(lengths)
    detail = (
        f"{at_max} of {len(lengths)} sequence(s) ({fraction:.0%}) reach max_length={max_length}"
    )
    problem = detail + ": they were probably truncated, which can cut the part the loss needs"
    return _judged(name, problem if at_max else None, "warn", detail)


def check_padding(padding: int, total: int, *, warn_above: float = 0.5) -> CheckResult:
    """Fraction of positions that are padding (``padding`` of ``total``); warn above a limit.

    Example:
        >>> check_padding(30, 100).detail
        '30.0% of 100 positions are padding'
    """
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


def _masking_counts(
    inputs: Any, targets: Any, mask: Any, ignore_index: int
) -> tuple[int, int, int]:
    """Real tokens of aligned token targets, those whose label is the input, those ignored."""
    real = (
        mask.detach().cpu() != 0
        if isinstance(mask, torch.Tensor) and mask.shape == targets.shape
        else torch.ones(targets.shape, dtype=torch.bool)
    )
    labels, tokens = targets.detach().cpu(), inputs.detach().cpu()
    equal, ignored = (real & (labels == tokens)), (real & (labels == ignore_index))
    return int(real.sum()), int(equal.sum()), int(ignored.sum())


def check_instruction_masking(
    inputs: Any, targets: Any, mask: Any, *, ignore_index: int
) -> CheckResult:
    """For causal-LM batches: are prompt (instruction) positions masked out of the labels?"""
    if target_kind(inputs, targets) != "sequence":
        return CheckResult(
            "instruction_masked", "not_checked", "targets are not aligned token sequences"
        )
    return _masking(*_masking_counts(inputs, targets, mask, ignore_index), ignore_index)


def _masking(total: int, equal: int, ignored: int, ignore_index: int) -> CheckResult:
    name = "instruction_masked"
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
    everything up to and including its first occurrence is prompt).

    Example:
        >>> spec = PromptSpec(response_template=(9, 9))
        >>> ids = torch.tensor([[5, 9, 9, 7, 8], [5, 6, 7, 8, 0]])
        >>> prompt, without, why = spec.locate({"input_ids": ids}, ids, None)
        >>> prompt.long().tolist(), without, why, str(spec)
        ([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], [1], None, 'response_template=(9, 9)')
    """

    response_mask_key: str | None = None
    prompt_length_key: str | None = None
    response_template: tuple[int, ...] | None = None

    def __str__(self) -> str:
        given = (
            ("response_mask_key", self.response_mask_key),
            ("prompt_length_key", self.prompt_length_key),
            ("response_template", self.response_template),
        )
        return ", ".join(f"{name}={value!r}" for name, value in given if value is not None)

    def locate(
        self, batch: Any, inputs: Any, mask: Any
    ) -> tuple[torch.Tensor | None, list[int], str | None]:
        """``(prompt, rows without one, why)``: the prompt positions of each row as a bool
        ``[batch, length]`` tensor (real tokens only), the rows whose prompt was not found (no
        response template), or ``None`` and why the batch cannot say."""
        if not is_int_tensor(inputs) or inputs.ndim != 2:
            return None, [], "the inputs are not token ids [batch, length]"
        tokens = inputs.detach().cpu()
        real = torch.ones(tokens.shape, dtype=torch.bool)
        if isinstance(mask, torch.Tensor) and mask.shape == tokens.shape:
            real = mask.detach().cpu() != 0
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
        if self.response_mask_key is not None:
            if values.shape != tokens.shape:
                return (
                    None,
                    [],
                    (
                        f"field {key!r} ({self}) has shape {tuple(values.shape)}, the inputs"
                        f" {tuple(tokens.shape)}: it needs one 0/1 value per token"
                    ),
                )
            return real & (values == 0), [], None
        lengths = values.reshape(-1)
        if lengths.numel() != tokens.shape[0] or lengths.is_floating_point():
            return (
                None,
                [],
                (
                    f"field {key!r} ({self}) holds {tuple(values.shape)} {values.dtype} values for"
                    f" {tokens.shape[0]} rows: it needs one integer length per row"
                ),
            )
        rank = real.to(torch.int64).cumsum(dim=1)  # the position among the row's real tokens
        return real & (rank <= lengths.to(torch.int64)[:, None]), [], None


def _template_prompt(
    tokens: torch.Tensor, real: torch.Tensor, template: Sequence[int]
) -> tuple[torch.Tensor, list[int]]:
    """Each row's positions up to the end of the first occurrence of ``template`` in its real
    tokens, and the rows that hold none."""
    rows, width, size = int(tokens.shape[0]), int(tokens.shape[1]), len(template)
    if size > width:
        return torch.zeros(tokens.shape, dtype=torch.bool), list(range(rows))
    windows = tokens.unfold(1, size, 1) == torch.tensor(template, dtype=tokens.dtype)
    found = windows.all(dim=2) & real.unfold(1, size, 1).all(dim=2)
    has = found.any(dim=1)
    end = found.to(torch.int64).argmax(dim=1) + size
    prompt = real & has[:, None] & (torch.arange(width)[None, :] < end[:, None])
    return prompt, [int(i) for i in torch.nonzero(~has).flatten().tolist()]


def prompt_label_counts(
    prompt: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int,
    shifted: Sequence[bool] | None = None,
) -> tuple[list[int], list[int]]:
    """Per row: its prompt positions, and those whose label is not ``ignore_index`` (the prompt
    in the loss). ``shifted``: rows whose labels are shifted left by one (``labels[t]`` is the
    target of input position ``t + 1``), whose prompt labels sit one position earlier.

    Example:
        >>> prompt = torch.tensor([[True, True, False, False]])
        >>> prompt_label_counts(prompt, torch.tensor([[5, -100, 7, 8]]), ignore_index=-100)
        ([2], [1])
    """
    labelled = prompt.clone()
    if shifted is not None and any(shifted):
        moved = torch.cat([prompt[:, 1:], torch.zeros_like(prompt[:, :1])], dim=1)
        rows = torch.tensor(list(shifted), dtype=torch.bool)[:, None]
        labelled = torch.where(rows, moved, prompt)
    counted = targets.detach().cpu() != ignore_index
    return (
        [int(n) for n in labelled.sum(dim=1).tolist()],
        [int(n) for n in (labelled & counted).sum(dim=1).tolist()],
    )


def check_loss_positions(targets: Any, *, ignore_index: int) -> CheckResult:
    """Every sequence has at least one position that counts in the loss."""
    name = "loss_positions_present"
    if not is_int_tensor(targets) or targets.ndim != 2:
        return CheckResult(name, "not_checked", "targets are not token sequences")
    per_row = (targets.detach().cpu() != ignore_index).sum(dim=1)
    empty = [int(i) for i in torch.nonzero(per_row == 0).flatten().tolist()]
    problem = (
        f"{len(empty)} of {targets.shape[0]} sequence(s) have no position counted in the loss"
        f" (rows {shown_names(empty)}): truncated before the response, or fully masked"
    )
    counted = f"{int(per_row.sum())} positions counted in the loss"
    return _judged(name, problem if empty else None, "warn", counted)


def label_relations(inputs: Any, targets: Any, *, ignore_index: int) -> list[str | None] | None:
    """How each row's token labels relate to its ``input_ids`` on the positions counted: one of
    :data:`LABEL_RELATIONS` (``shifted by 1``: ``labels[t] == input_ids[t + 1]``), the first
    whose every comparable counted position agrees; ``None`` for a row with no counted position,
    and for the whole list when the targets are not token sequences aligned with the inputs.

    Example:
        >>> ids = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]])
        >>> label_relations(ids, torch.tensor([[5, 6, 7, -100], [6, 7, 8, -100]]),
        ...                 ignore_index=-100)
        ['identical', 'shifted by 1']
    """
    if target_kind(inputs, targets) != "sequence":
        return None
    labels, tokens = targets.detach().cpu(), inputs.detach().cpu()
    counted = labels != ignore_index

    def holds(lab: torch.Tensor, tok: torch.Tensor, cnt: torch.Tensor) -> list[bool]:
        return list((((lab == tok) | ~cnt).all(dim=1) & cnt.any(dim=1)).tolist())

    same = holds(labels, tokens, counted)
    left = right = [False] * int(labels.shape[0])
    if labels.shape[1] > 1:
        left = holds(labels[:, :-1], tokens[:, 1:], counted[:, :-1])
        right = holds(labels[:, 1:], tokens[:, :-1], counted[:, 1:])
    rows = zip(counted.any(dim=1).tolist(), same, left, right, strict=True)
    # Each row's first relation that holds, in LABEL_RELATIONS order ("other" when none does).
    return [
        next((r for r, agree in zip(LABEL_RELATIONS, flags, strict=False) if agree), "other")
        if seen
        else None
        for seen, *flags in rows
    ]


def _agree(
    labels: torch.Tensor, tokens: torch.Tensor, counted: torch.Tensor, offset: int
) -> list[bool]:
    """Per row: ``labels[t] == tokens[t + offset]`` on every counted position that has a token
    there, and at least one such position."""
    width = int(labels.shape[1])
    if abs(offset) >= width:
        return [False] * int(labels.shape[0])
    if offset >= 0:
        lab, tok, cnt = (
            labels[:, : width - offset],
            tokens[:, offset:],
            counted[:, : width - offset],
        )
    else:
        lab, tok, cnt = labels[:, -offset:], tokens[:, : width + offset], counted[:, -offset:]
    return list((((lab == tok) | ~cnt).all(dim=1) & cnt.any(dim=1)).tolist())


def decoder_label_relations(
    decoder_inputs: Any, targets: Any, *, ignore_index: int
) -> list[str | None] | None:
    """How each row's labels relate to an encoder-decoder's ``decoder_input_ids`` on the
    positions counted: one of :data:`DECODER_RELATIONS`, the first that holds. ``shifted by 1``
    (``labels[t] == decoder_input_ids[t + 1]``: the decoder inputs are the labels shifted right)
    is the convention; ``shifted by 2``: the labels were shifted once more; ``identical``: the
    decoder is shown the token it must predict. ``None`` for a row with nothing counted, and
    for the whole list when the two are not integer tensors of one shape.

    Example:
        >>> decoder = torch.tensor([[0, 5, 6, 7], [0, 5, 6, 7]])
        >>> decoder_label_relations(decoder, torch.tensor([[5, 6, 7, 1], [6, 7, 1, -100]]),
        ...                         ignore_index=-100)
        ['shifted by 1', 'shifted by 2']
    """
    if not (is_int_tensor(decoder_inputs) and is_int_tensor(targets)):
        return None
    if targets.ndim != 2 or decoder_inputs.shape != targets.shape:
        return None
    labels, tokens = targets.detach().cpu(), decoder_inputs.detach().cpu()
    counted = labels != ignore_index
    flags = [_agree(labels, tokens, counted, offset) for offset in (1, 2, 0)]
    return [
        next((r for r, agree in zip(DECODER_RELATIONS, row, strict=False) if agree), "other")
        if seen
        else None
        for seen, *row in zip(counted.any(dim=1).tolist(), *flags, strict=True)
    ]


def _tally(
    counts: Mapping[str, int], relations: Sequence[str] = LABEL_RELATIONS
) -> tuple[str | None, int, str]:
    """The relation of at least half the rows (``None``: none), the rows, and the counts."""
    total = sum(counts.values())
    text = ", ".join(f"{counts[r]} {r}" for r in relations if counts.get(r))
    for relation in relations:
        if total and 2 * counts.get(relation, 0) >= total:
            return relation, total, text
    return None, total, text


def check_decoder_label_shift(
    counts: Mapping[str, int], *, encoder_decoder: str | None = None
) -> CheckResult:
    """What relation an encoder-decoder batch's labels bear to its ``decoder_input_ids``
    (``counts``: rows per :data:`DECODER_RELATIONS`); ``fail`` when the labels run two tokens
    ahead (shifted twice) or equal the decoder inputs (docs/data-and-overfit.md).
    ``encoder_decoder``: the model found in the module, named.

    Example:
        >>> check_decoder_label_shift({"shifted by 1": 8}).verdict
        'pass'
        >>> print(check_decoder_label_shift({"shifted by 2": 8}).detail)
        labels run 2 tokens ahead of decoder_input_ids (labels[t] == decoder_input_ids[t+2] in
        rows: 8 shifted by 2): the labels were shifted twice (decoder_input_ids are already the
        labels shifted right), so the decoder learns to predict the token after next; give the
        unshifted target sequence as labels and build decoder_input_ids from it (the model's
        prepare_decoder_input_ids_from_labels), or give labels only
    """
    name = "decoder_label_shift"
    relation, total, text = _tally(counts, DECODER_RELATIONS)
    if total == 0:
        return CheckResult(name, "not_checked", "no row has a position counted in the loss")
    rows = f"rows: {text}"
    held = "" if encoder_decoder is None else f"; the module holds {encoder_decoder}"
    remedy = (
        "give the unshifted target sequence as labels and build decoder_input_ids from it (the"
        " model's prepare_decoder_input_ids_from_labels), or give labels only"
    )
    verdict, detail = {
        "shifted by 1": (
            "pass",
            "labels[t] == decoder_input_ids[t+1] where counted: decoder_input_ids are the labels"
            f" shifted right, the Hugging Face convention ({rows}{held})",
        ),
        "shifted by 2": (
            "fail",
            "labels run 2 tokens ahead of decoder_input_ids (labels[t] =="
            f" decoder_input_ids[t+2] in {rows}{held}): the labels were shifted twice"
            " (decoder_input_ids are already the labels shifted right), so the decoder learns to"
            f" predict the token after next; {remedy}",
        ),
        "identical": (
            "fail",
            f"labels equal decoder_input_ids ({rows}{held}): the decoder is shown the token it"
            f" must predict, so it learns to copy; decoder_input_ids must be the labels shifted"
            f" right by 1: {remedy}",
        ),
        "other": (
            "not_checked",
            f"labels are not decoder_input_ids shifted by 0, 1 or 2 ({rows}{held}): not"
            " teacher-forced targets",
        ),
    }[relation or "other"]
    return CheckResult(name, verdict, detail)


def check_label_shift(counts: Mapping[str, int], *, causal_lm: str | None = None) -> CheckResult:
    """What relation the labels bear to ``input_ids`` (``counts``: rows per relation); warns when
    they are already shifted (docs/data-and-overfit.md). ``causal_lm``: a Hugging Face causal LM
    found in the module, named.

    Example:
        >>> check_label_shift({"identical": 8}).verdict
        'pass'
        >>> check_label_shift({"shifted by 1": 8}).detail.startswith(SHIFTED_LABELS_ADVICE)
        True
    """
    relation, total, text = _tally(counts)
    if total == 0:
        return CheckResult(
            "label_shift", "not_checked", "no row has a position counted in the loss"
        )
    rows = f"rows: {text}"
    held = "" if causal_lm is None else f"; the module holds {causal_lm}, which shifts labels"
    verdict, detail = {
        "shifted by 1": (
            "warn",
            f"{SHIFTED_LABELS_ADVICE} (labels[t] == input_ids[t+1] in {rows}{held})",
        ),
        "shifted by -1": (
            "warn",
            "labels are input_ids shifted right by 1 (labels[t] == input_ids[t-1]): every"
            " target is a token the model has already seen, so it learns to copy; pass labels"
            " = input_ids to a model that shifts internally, or input_ids shifted left by 1 to"
            f" a loss that does not ({rows}{held})",
        ),
        "identical": (
            "pass",
            "labels equal input_ids where counted (the Hugging Face convention: the model or"
            f" the loss shifts them; {rows}{held})",
        ),
        "other": (
            "not_checked",
            f"labels are not input_ids, shifted or not ({rows}): not next-token targets",
        ),
    }[relation or "other"]
    return CheckResult("label_shift", verdict, detail)


def check_causal_lm_labels(causal_lm: str, counts: Mapping[str, int], calls: int) -> CheckResult:
    """What a Hugging Face causal LM was given as ``labels=`` in ``calls`` forward calls
    (``counts``: rows per relation); ``fail`` for labels already shifted left by one
    (docs/data-and-overfit.md).

    Example:
        >>> check_causal_lm_labels("GPT2LMHeadModel at 'model'", {"shifted by 1": 4}, 1).verdict
        'fail'
    """
    relation, total, text = _tally(counts)
    seen = f"{calls} forward call(s) seen"
    if calls == 0:
        detail = f"{causal_lm} was not called before the verdict"
        return CheckResult("causal_lm_labels", "not_checked", detail)
    if total == 0:
        detail = (
            f"{causal_lm} was given no labels= comparable with its input_ids ({seen}): the"
            " loss is computed outside it, see label_shift"
        )
        return CheckResult("causal_lm_labels", "not_checked", detail)
    verdict, detail = {
        "shifted by 1": (
            "fail",
            f"{causal_lm} was given labels equal to its input_ids shifted left by 1"
            f" (labels[t] == input_ids[t+1]; rows: {text}; {seen}); it shifts labels"
            " internally, so this trains to predict 2 tokens ahead: pass labels = input_ids"
            " (with -100 on masked positions)",
        ),
        "shifted by -1": (
            "warn",
            f"{causal_lm} was given labels equal to its input_ids shifted right by 1 (rows:"
            f" {text}; {seen}); it shifts labels internally, so it learns to copy its current"
            " token: pass labels = input_ids (with -100 on masked positions)",
        ),
        "identical": (
            "pass",
            f"{causal_lm} was given labels = input_ids where counted and shifts them"
            f" internally: next-token targets (rows: {text}; {seen})",
        ),
        "other": (
            "not_checked",
            f"the labels given to {causal_lm} are not its input_ids, shifted or not (rows:"
            f" {text}; {seen})",
        ),
    }[relation or "other"]
    return CheckResult("causal_lm_labels", verdict, detail)


def class_histogram(labels: Iterable[Any], *, ignore_index: int = -100) -> dict[int, int]:
    """Count examples per class (integer labels; ``ignore_index`` and non-integers skipped).

    Example:
        >>> class_histogram([0, 2, 2, -100])
        {0: 1, 2: 2}
    """
    counts: Counter[int] = Counter()
    for label in labels:
        value = label.item() if isinstance(label, torch.Tensor) and label.numel() == 1 else label
        if isinstance(value, bool) or not isinstance(value, int) or value == ignore_index:
            continue
        counts[value] += 1
    return dict(sorted(counts.items()))


def check_class_histograms(histograms: Mapping[str, Mapping[int, int]]) -> list[CheckResult]:
    """Compare the class histograms of the splits (``train`` first): ``class_histograms``,
    ``val_classes_in_train`` and ``label_ranges_agree`` (docs/data-and-overfit.md)."""
    present = {split: dict(h) for split, h in histograms.items() if h}
    if not present:
        return [CheckResult("class_histograms", "not_checked", "no class labels were read")]
    summary = "; ".join(
        f"{split}: " + ", ".join(f"{c}:{n}" for c, n in h.items()) for split, h in present.items()
    )
    results = [CheckResult("class_histograms", "pass", summary)]
    train = present.get("train")
    if train is None:
        results.append(
            CheckResult("val_classes_in_train", "not_checked", "no training labels were read")
        )
        return results
    others = {split: h for split, h in present.items() if split != "train"}
    unseen = {split: sorted(set(h) - set(train)) for split, h in others.items()}
    text = "; ".join(f"{split} class(es) {shown_names(c)}" for split, c in unseen.items() if c)
    problem = f"{text} never occur in training: the model cannot learn them"
    results.append(_judged("val_classes_in_train", problem if text else None, "warn"))
    low, high = min(train), max(train)
    text = ", ".join(
        f"{split} [{min(h)}, {max(h)}]"
        for split, h in others.items()
        if min(h) < low or max(h) > high
    )
    problem = (
        f"label ranges differ between splits: train [{low}, {high}], {text} (labels"
        " shifted or numbered differently in one split?)"
    )
    results.append(_judged("label_ranges_agree", problem if text else None, "warn"))
    return results


def find_shared(keys_by_split: Mapping[str, Iterable[Hashable]]) -> dict[Hashable, list[str]]:
    """Keys found in more than one split, with the splits they are in (in split order).

    Example:
        >>> find_shared({"train": [1, 2, 3], "val": [3, 4], "test": [4, 5]})
        {3: ['train', 'val'], 4: ['val', 'test']}
    """
    where: dict[Hashable, list[str]] = {}
    for split, keys in keys_by_split.items():
        for key in dict.fromkeys(keys):
            where.setdefault(key, []).append(split)
    return {key: splits for key, splits in where.items() if len(splits) > 1}


def check_leakage(
    keys_by_split: Mapping[str, Sequence[Hashable]] | None, *, scanned: Mapping[str, int]
) -> CheckResult:
    """Fail when a group key (``None``: no ``group_fn``) is in more than one split; ``scanned``:
    the examples scanned per split."""
    name = "split_leakage"
    if keys_by_split is None:
        detail = "no group_fn given: pass group_fn=lambda example: <conversation/patient/document>"
        return CheckResult(name, "not_checked", detail)
    if len(keys_by_split) < 2:
        return CheckResult(
            name, "not_checked", f"only {len(keys_by_split)} split(s) readable: nothing to compare"
        )
    scope = ", ".join(f"{split} {n}" for split, n in scanned.items())
    shared = find_shared(keys_by_split)
    if not shared:
        groups = sum(len(set(k)) for k in keys_by_split.values())
        return CheckResult(
            name, "pass", f"{groups} group(s), none in two splits (examples scanned: {scope})"
        )
    listed = [f"{key!r} ({'+'.join(splits)})" for key, splits in shared.items()]
    detail = (
        f"{len(shared)} group(s) found in more than one split: {shown_names(listed)} (examples"
        f" scanned: {scope}); split by group, not by example"
    )
    return CheckResult(name, "fail", detail)


def input_fingerprint(value: Any) -> str | None:
    """A stable digest of one example's input: tensor bytes with dtype and shape; for a dict
    (several inputs, e.g. ``{"input_ids": ..., "pixel_values": ...}``) or a list or tuple, the
    digests of its parts with their keys; else its repr.

    Example:
        >>> caption, image = torch.tensor([5, 6]), torch.zeros(3, 2, 2)
        >>> pair = input_fingerprint({"input_ids": caption, "pixel_values": image})
        >>> pair == input_fingerprint({"input_ids": caption, "pixel_values": image + 1})
        False
    """
    if value is None:
        return None
    digest = hashlib.blake2b(digest_size=16)
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif isinstance(value, Mapping):
        for key in sorted(value, key=repr):
            digest.update(f"{key!r}={input_fingerprint(value[key])};".encode())
    elif isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
        # A tensor's repr shortens it: each part by its own digest.
        parts = ",".join(str(input_fingerprint(part)) for part in value)
        digest.update(f"{type(value).__name__}({parts})".encode())
    else:
        digest.update(repr(value).encode())
    return digest.hexdigest()


def check_duplicates(
    fingerprints_by_split: Mapping[str, Sequence[str | None]], *, scanned: Mapping[str, int]
) -> CheckResult:
    """Report exact duplicate inputs found in more than one split (a warning); a fingerprint
    covers everything that identifies an example (:meth:`BatchAdapter.example_inputs`)."""
    name = "duplicate_inputs_across_splits"
    known = {s: [f for f in fps if f is not None] for s, fps in fingerprints_by_split.items()}
    known = {s: fps for s, fps in known.items() if fps}
    if len(fingerprints_by_split) < 2:
        detail = f"{len(fingerprints_by_split)} split(s) scanned: nothing to compare"
        return CheckResult(name, "not_checked", detail)
    if len(known) < 2:
        unread = [split for split in fingerprints_by_split if split not in known]
        detail = (
            f"the inputs of {', '.join(unread)} could not be read (a dict item needs one of the"
            f" keys {', '.join(INPUT_KEYS)}): give BatchAdapter(inputs=...) if they are"
            " elsewhere"
        )
        return CheckResult(name, "not_checked", detail)
    shared = find_shared(known)
    scope = ", ".join(f"{split} {n}" for split, n in scanned.items())
    if not shared:
        return CheckResult(name, "pass", f"no input in two splits (examples scanned: {scope})")
    pairs = Counter("+".join(splits) for splits in shared.values())
    text = ", ".join(f"{n} in {pair}" for pair, n in pairs.items())
    detail = (
        f"{len(shared)} exact duplicate input(s) across splits: {text} (examples scanned:"
        f" {scope}); an evaluation on them measures memory, not generalisation"
    )
    return CheckResult(name, "warn", detail)


class SplitInspection:
    """Run the batch checks over the first batches of one split, each check keeping its worst
    verdict (with an ``encoder_decoder``, those comparing labels with inputs are ``not_checked``
    and the labels are compared with the decoder inputs instead; ``prompt``: where each prompt
    is, for ``instruction_masked``).

    Example:
        >>> inspection = SplitInspection("train", ignore_index=-100, output_size=3)
        >>> inspection.add(BatchAdapter().view({"ids": torch.tensor([1, 1]),
        ...                                     "x": torch.zeros(2, 4),
        ...                                     "y": torch.tensor([0, 2])}))
        >>> [(c.name, c.verdict) for c in inspection.checks()][:3]
        [('train/ids_present_unique', 'fail'), ('train/targets_present', 'pass'),
         ('train/label_range', 'pass')]
    """

    def __init__(
        self,
        split: str,
        *,
        ignore_index: int,
        output_size: int | None = None,
        size_source: str = "the caller",
        max_length: int | None = None,
        pad_token_id: int | None = None,
        padding_warn: float = 0.5,
        causal_lm: str | None = None,
        encoder_decoder: str | None = None,
        prompt: PromptSpec | None = None,
    ) -> None:
        self.split, self.ignore_index, self.max_length = split, ignore_index, max_length
        self.output_size, self.size_source = output_size, size_source
        self.pad_token_id, self.padding_warn, self.causal_lm = pad_token_id, padding_warn, causal_lm
        self.encoder_decoder, self.prompt = encoder_decoder, prompt
        self.unaligned = (
            None
            if encoder_decoder is None
            else f"{encoder_decoder} is an encoder-decoder model: its labels are decoder targets,"
            " which the encoder's input_ids and attention_mask do not describe"
        )
        # The adapter's inputs are the decoder inputs (BatchAdapter(inputs="decoder_input_ids")).
        self._inputs_are_decoder = False
        self._decoder: Counter[str] = Counter()
        self._decoder_problem: CheckResult | None = None
        # instruction_masked with a prompt: rows checked, prompt positions, unmasked positions,
        # the rows with an unmasked prompt and those without a prompt found; or why not.
        self._prompt = [0, 0, 0]
        self._prompt_rows: list[str] = []
        self._prompt_missing: list[str] = []
        self._prompt_problem: str | None = None
        self.batches = self.examples = 0
        self._worst: dict[str, CheckResult] = {}
        self._lengths: list[int] = []
        self._padding = self._positions = 0
        self._sequence = False
        # Real tokens of aligned token targets, those equal to the input, those ignored.
        self._masking = [0, 0, 0]
        self._relations: Counter[str] = Counter()

    def _keep(self, result: CheckResult) -> None:
        previous = self._worst.get(result.name)
        if (
            previous is None
            or worst_verdict([previous.verdict, result.verdict]) != previous.verdict
        ):
            self._worst[result.name] = result

    def add(self, view: BatchView, batch: Any = None) -> None:
        """Check one batch, as a :class:`~lightning_pilot.core.batches.BatchAdapter` read it
        (``batch``: the batch itself, where the ``prompt`` fields are read)."""
        self.batches += 1
        self.examples += view.batch_size or 0
        inputs, targets, mask = view.inputs, view.targets, view.attention_mask
        decoder = view.decoder_inputs
        if decoder is not None and inputs is decoder:
            self._inputs_are_decoder = True
        if decoder is not None and targets is not None:
            self._add_decoder(decoder, targets)
        self._keep(check_ids(view.ids_list(), view.batch_size))
        if inputs is None:
            detail = (
                f"field 'inputs' not found in the batch (looked for {', '.join(INPUT_KEYS)}):"
                " give BatchAdapter(inputs=...) to check the inputs, lengths and masks"
            )
            self._keep(CheckResult("inputs_present", "not_checked", detail))
        self._keep(check_targets_present(targets))
        if targets is not None:
            self._keep(
                check_label_range(
                    targets,
                    output_size=self.output_size,
                    ignore_index=self.ignore_index,
                    source=self.size_source,
                )
            )
        encoder_mask = isinstance(batch, Mapping) and mask is batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and self._inputs_are_decoder and encoder_mask:
            # The decoder inputs are read as the inputs, the attention mask is the encoder's.
            detail = (
                "the inputs read are decoder_input_ids, the attention_mask is the encoder's:"
                " give BatchAdapter(attention_mask='decoder_attention_mask') to check the"
                " decoder's mask"
            )
            self._keep(CheckResult("attention_mask", "not_checked", detail))
        elif isinstance(mask, torch.Tensor):
            for result in check_attention_mask(
                inputs,
                mask,
                targets,
                ignore_index=self.ignore_index,
                pad_token_id=self.pad_token_id,
                labels_unaligned=self.unaligned,
            ):
                self._keep(result)
            self._padding += int((mask == 0).sum())
            self._positions += int(mask.numel())
        self._lengths += row_lengths(inputs, mask) or []
        if target_kind(inputs, targets) == "sequence":
            self._sequence = True
            self._keep(check_loss_positions(targets, ignore_index=self.ignore_index))
            counts = _masking_counts(inputs, targets, mask, self.ignore_index)
            self._masking = [a + b for a, b in zip(self._masking, counts, strict=True)]
            relations = label_relations(inputs, targets, ignore_index=self.ignore_index) or []
            self._relations.update(r for r in relations if r is not None)
            if self.prompt is not None and self.unaligned is None:
                self._add_prompt(self.prompt, batch, inputs, targets, mask, relations)

    def _add_decoder(self, decoder: Any, targets: Any) -> None:
        relations = decoder_label_relations(decoder, targets, ignore_index=self.ignore_index)
        if relations is not None:
            self._decoder.update(r for r in relations if r is not None)
            return
        shapes = " and ".join(
            f"{name} {tuple(v.shape)} {v.dtype}"
            if isinstance(v, torch.Tensor)
            else f"{name} a {type(v).__name__}"
            for name, v in (("decoder_input_ids", decoder), ("labels", targets))
        )
        detail = f"{shapes}: labels and decoder inputs need one integer shape to be compared"
        self._decoder_problem = CheckResult("decoder_label_shift", "not_checked", detail)

    def _add_prompt(
        self,
        spec: PromptSpec,
        batch: Any,
        inputs: Any,
        targets: Any,
        mask: Any,
        relations: Sequence[str | None],
    ) -> None:
        prompt, without, why = spec.locate(batch, inputs, mask)
        if prompt is None:
            self._prompt_problem = self._prompt_problem or why
            return
        shifted = [r == "shifted by 1" for r in relations] if relations else None
        positions, unmasked = prompt_label_counts(
            prompt, targets, ignore_index=self.ignore_index, shifted=shifted
        )
        index = self.batches - 1
        skipped = set(without)
        for row, (n, bad) in enumerate(zip(positions, unmasked, strict=True)):
            if row in skipped:
                self._prompt_missing.append(f"batch {index} row {row}")
                continue
            self._prompt = [self._prompt[0] + 1, self._prompt[1] + n, self._prompt[2] + bad]
            if bad:
                self._prompt_rows.append(f"batch {index} row {row} ({bad} of {n})")

    def _prompt_check(self) -> CheckResult:
        name, spec = "instruction_masked", str(self.prompt)
        rows, positions, unmasked = self._prompt
        missing = self._prompt_missing
        if rows == 0:
            why = self._prompt_problem or "no row to check"
            if missing:
                why = (
                    f"{spec} was found in none of {len(missing)} row(s): truncated before the"
                    " response, or the template tokenizes differently inside a text than alone"
                    " (take its ids from a tokenized example)"
                )
            return CheckResult(name, "not_checked", why)
        if positions == 0:
            why = f"none of {rows} row(s) has a prompt position ({spec}): nothing to check"
            return CheckResult(name, "not_checked", why)
        if unmasked:
            detail = (
                f"the prompt is in the loss: {unmasked} of {positions} prompt position(s), in"
                f" {len(self._prompt_rows)} of {rows} row(s), have a label other than"
                f" {self.ignore_index} ({shown_names(self._prompt_rows)}; the prompt from {spec}):"
                f" set the labels of prompt tokens to {self.ignore_index} if only the response"
                " should count"
            )
            return CheckResult(name, "fail", detail)
        detail = (
            f"all {positions} prompt position(s) of {rows} row(s) are masked out of the loss"
            f" (labels {self.ignore_index}; the prompt from {spec})"
        )
        if missing:
            problem = (
                f"{detail}; {len(missing)} row(s) hold no response template"
                f" ({shown_names(missing)}): truncated before the response, or the template"
                " tokenizes differently inside a text than alone; their prompt is not checked"
            )
            return CheckResult(name, "warn", problem)
        return CheckResult(name, "pass", detail)

    def checks(self) -> list[CheckResult]:
        """The folded checks, names prefixed with ``<split>/``."""
        if self.batches == 0:
            return [CheckResult(f"{self.split}/batches", "not_checked", "no batch was inspected")]
        results = list(self._worst.values())
        if self._sequence and (self.unaligned is not None or self._inputs_are_decoder):
            unaligned = self.unaligned or ""
            if self._inputs_are_decoder:
                held = f" of {self.encoder_decoder}" if self.encoder_decoder else ""
                unaligned = (
                    f"the inputs read are the decoder_input_ids{held}, the labels shifted right"
                    " (the decoder's inputs, not a prompt followed by its response): the labels"
                    " are compared with them in decoder_label_shift"
                )
            results.append(CheckResult("instruction_masked", "not_checked", unaligned))
            results.append(CheckResult("label_shift", "not_checked", unaligned))
        elif self._sequence:
            if self.prompt is not None:
                results.append(self._prompt_check())
            else:
                total, equal, ignored = self._masking
                results.append(_masking(total, equal, ignored, self.ignore_index))
            results.append(check_label_shift(self._relations, causal_lm=self.causal_lm))
        if self._decoder:
            results.append(
                check_decoder_label_shift(self._decoder, encoder_decoder=self.encoder_decoder)
            )
        elif self._decoder_problem is not None:
            results.append(self._decoder_problem)
        if self._lengths:
            results.append(check_truncation(self._lengths, self.max_length))
        if self._positions:
            results.append(
                check_padding(self._padding, self._positions, warn_above=self.padding_warn)
            )
        return [CheckResult(f"{self.split}/{r.name}", r.verdict, r.detail) for r in results]


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


class CausalLMWatch:
    """A forward pre-hook on a Hugging Face causal LM: the ``labels=`` its first ``max_calls`` calls
    get (never raising into the user's forward; a copy of the model carries an inert watch).

    Example:
        >>> CausalLMWatch.attach(nn.Linear(2, 2), ignore_index=-100, max_calls=8) is None
        True
        >>> watch = CausalLMWatch("GPT2LMHeadModel", -100, max_calls=8)
        >>> ids = torch.tensor([[5, 6, 7]])
        >>> watch(nn.Identity(), (), {"input_ids": ids, "labels": ids})
        >>> watch.check().verdict
        'pass'
    """

    def __init__(self, name: str, ignore_index: int, max_calls: int) -> None:
        self.name, self.ignore_index, self.max_calls = name, ignore_index, max_calls
        self.calls = 0
        self.relations: Counter[str] = Counter()
        self.error: str | None = None
        self._handle: RemovableHandle | None = None

    @classmethod
    def attach(
        cls, module: nn.Module, *, ignore_index: int, max_calls: int
    ) -> CausalLMWatch | None:
        """Watch the first Hugging Face causal LM of ``module``; ``None`` when it holds none."""
        found = find_causal_lm(module)
        if found is None:
            return None
        path, model = found
        name = f"{type(model).__name__} at '{path}'" if path else type(model).__name__
        watch = cls(name, ignore_index, max_calls)
        watch._handle = model.register_forward_pre_hook(watch, with_kwargs=True)
        return watch

    def remove(self) -> None:
        """Stop watching (the counts are kept)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.calls >= self.max_calls:
            return
        try:
            self.calls += 1
            labels = kwargs.get("labels")
            if labels is None:
                return
            ids = kwargs.get("input_ids", args[0] if args else None)
            relations = label_relations(ids, labels, ignore_index=self.ignore_index)
            self.relations.update(r for r in relations or [] if r is not None)
        except Exception as err:  # inside the user's forward: record, never raise
            self.error = f"{type(err).__name__}: {err}"

    def __reduce__(self) -> tuple[type[CausalLMWatch], tuple[str, int, int]]:
        return CausalLMWatch, (self.name, self.ignore_index, 0)

    def check(self) -> CheckResult:
        """``causal_lm_labels`` (:func:`check_causal_lm_labels`), or the error that stopped it."""
        if self.error is not None:
            detail = f"reading the labels given to {self.name} raised {self.error}"
            return CheckResult("causal_lm_labels", "not_checked", detail)
        return check_causal_lm_labels(self.name, self.relations, self.calls)


def first_items(dataset: Any, limit: int) -> Iterator[Any]:
    """The first ``limit`` items of a dataset: by index, or iterated when it has no length."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        yield from itertools.islice(iter(dataset), limit)
        return
    for index in range(min(len(dataset), limit)):
        yield dataset[index]


class DatasetScan:
    """Class histograms, leakage and duplicates over the first ``max_examples`` items of each split
    (user code that raises is listed in :attr:`raised`).

    Example:
        >>> scan = DatasetScan(BatchAdapter(), max_examples=10, group_fn=lambda item: item[2])
        >>> train = [(torch.tensor([i]), torch.tensor(i % 2), i // 2) for i in range(4)]
        >>> val = [(torch.tensor([9]), torch.tensor(0), 1)]
        >>> [(c.name, c.verdict) for c in scan.run({"train": [train], "val": [val]})]
        [('class_histograms', 'pass'), ('val_classes_in_train', 'pass'),
         ('label_ranges_agree', 'pass'), ('split_leakage', 'fail'),
         ('duplicate_inputs_across_splits', 'pass')]
    """

    def __init__(
        self,
        adapter: BatchAdapter,
        *,
        max_examples: int,
        group_fn: Callable[[Any], Hashable] | None = None,
    ) -> None:
        self.adapter, self.max_examples, self.group_fn = adapter, max_examples, group_fn
        self.raised: list[CheckResult] = []

    def run(
        self, datasets: Mapping[str, Sequence[Any]], problems: Sequence[CheckResult] = ()
    ) -> list[CheckResult]:
        """The checks over the datasets of each split; ``problems`` (splits left out) last. The
        random states are restored afterwards: random transforms do not change the fit."""
        keys: dict[str, list[Hashable]] = {}
        prints: dict[str, list[str | None]] = {}
        labels: dict[str, dict[int, int]] = {}
        scanned: dict[str, int] = {}
        left_out: list[CheckResult] = []
        group_error: CheckResult | None = None
        python_state = random.getstate()
        try:
            with torch.random.fork_rng(devices=[]):
                for split, sets in datasets.items():
                    try:
                        items = [i for d in sets for i in first_items(d, self.max_examples)]
                        views = [self.adapter.view(item, count_tokens=False) for item in items]
                        # Everything that identifies an example: a CLIP pair is its caption and
                        # its image together (a caption shared by two images is no duplicate).
                        found = [self.adapter.example_inputs(item) for item in items]
                    except Exception as err:  # the user's dataset or adapter: report it
                        detail = (
                            f"reading the {split} dataset raised {type(err).__name__}: {err};"
                            f" split leakage, duplicates and class histograms leave {split} out:"
                            " check the dataset's items (dataset[i]) and the adapter's field specs"
                        )
                        left_out.append(
                            CheckResult(f"{split}/split_leakage", "not_checked", detail)
                        )
                        continue
                    if not items:
                        continue
                    scanned[split] = len(items)
                    prints[split] = [input_fingerprint(value) for value in found]
                    labels[split] = class_histogram(
                        (v.targets for v in views), ignore_index=self.adapter.ignore_index
                    )
                    if self.group_fn is not None and group_error is None:
                        try:
                            keys[split] = [self.group_fn(item) for item in items]
                        except Exception as err:  # the user's function: report it
                            detail = (
                                f"group_fn raised {type(err).__name__}: {err} on a {split} item:"
                                " fix group_fn (it receives one dataset item, as dataset[i]"
                                " returns it)"
                            )
                            group_error = CheckResult("split_leakage", "not_checked", detail)
        finally:
            random.setstate(python_state)
        self.raised += [*left_out, *([group_error] if group_error else [])]
        results = check_class_histograms(labels) if any(labels.values()) else []
        results.append(
            group_error or check_leakage(keys if self.group_fn else None, scanned=scanned)
        )
        results.append(check_duplicates(prints, scanned=scanned))
        return [*results, *problems, *left_out]


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
        #: Per split: the batch the adapter could not read (the split's checks stop there).
        self.errors: dict[str, CheckResult] = {}
        #: Every check left ``not_checked`` because user code raised, in the order it happened.
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
            kept = sum(1 for r in self.rows if r["split"] == split)
            rows = []
            if kept < self.examples:
                rows = example_rows(
                    view,
                    split=split,
                    batch_index=inspection.batches,
                    limit=self.examples - kept,
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
