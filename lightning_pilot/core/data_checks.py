"""Pure checks of what the loss is fed (ids, targets, label ranges, masks, lengths, splits): values
and tensors in, ``CheckResult`` out, no Trainer (docs/data-and-overfit.md)."""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, Literal

import torch
from torch import nn
from torch.utils.data import IterableDataset
from torch.utils.hooks import RemovableHandle

from lightning_pilot.core.batches import BatchAdapter, BatchView, is_int_tensor
from lightning_pilot.core.checks import CheckResult, shown_names
from lightning_pilot.core.phases import worst_verdict

__all__ = [
    "HEAD_NAMES",
    "LABEL_RELATIONS",
    "SHIFTED_LABELS_ADVICE",
    "CausalLMWatch",
    "DataInspection",
    "DatasetScan",
    "SplitInspection",
    "TargetKind",
    "check_attention_mask",
    "check_causal_lm_labels",
    "check_class_histograms",
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
    "example_rows",
    "find_causal_lm",
    "find_encoder_decoder",
    "find_shared",
    "first_items",
    "infer_output_size",
    "input_fingerprint",
    "label_relations",
    "row_lengths",
    "target_kind",
]

#: Child-module names tried first when looking for a model's output layer.
HEAD_NAMES: Final = ("lm_head", "head", "classifier", "fc", "output_layer", "out")
TargetKind = Literal["classification", "sequence", "regression", "unknown"]
#: How a row's token labels relate to its ``input_ids`` (:func:`label_relations`).
LABEL_RELATIONS: Final = ("identical", "shifted by 1", "shifted by -1", "other")
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
            " give BatchAdapter(targets=...) if they are elsewhere"
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
        return CheckResult(name, "not_checked", "no targets tensor to check")
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
    )
    return _judged(name, problem if equal == total else None, "warn", masked)


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


def _tally(counts: Mapping[str, int]) -> tuple[str | None, int, str]:
    """The relation of at least half the rows (``None``: none), the rows, and the counts."""
    total = sum(counts.values())
    text = ", ".join(f"{counts[r]} {r}" for r in LABEL_RELATIONS if counts.get(r))
    for relation in LABEL_RELATIONS:
        if total and 2 * counts.get(relation, 0) >= total:
            return relation, total, text
    return None, total, text


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
    """A stable digest of one example's input (tensor bytes with dtype and shape, or its repr)."""
    if value is None:
        return None
    digest = hashlib.blake2b(digest_size=16)
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    else:
        digest.update(repr(value).encode())
    return digest.hexdigest()


def check_duplicates(
    fingerprints_by_split: Mapping[str, Sequence[str | None]], *, scanned: Mapping[str, int]
) -> CheckResult:
    """Report exact duplicate inputs found in more than one split (a warning)."""
    name = "duplicate_inputs_across_splits"
    known = {s: [f for f in fps if f is not None] for s, fps in fingerprints_by_split.items()}
    known = {s: fps for s, fps in known.items() if fps}
    if len(known) < 2:
        return CheckResult(name, "not_checked", "the inputs of fewer than two splits could be read")
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
    verdict (with an ``encoder_decoder``, those comparing labels with inputs are ``not_checked``).

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
    ) -> None:
        self.split, self.ignore_index, self.max_length = split, ignore_index, max_length
        self.output_size, self.size_source = output_size, size_source
        self.pad_token_id, self.padding_warn, self.causal_lm = pad_token_id, padding_warn, causal_lm
        self.unaligned = (
            None
            if encoder_decoder is None
            else f"{encoder_decoder} is an encoder-decoder model: its labels are decoder targets,"
            " which the encoder's input_ids and attention_mask do not describe"
        )
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

    def add(self, view: BatchView) -> None:
        """Check one batch, as a :class:`~lightning_pilot.core.batches.BatchAdapter` read it."""
        self.batches += 1
        self.examples += view.batch_size or 0
        inputs, targets, mask = view.inputs, view.targets, view.attention_mask
        self._keep(check_ids(view.ids_list(), view.batch_size))
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
        if isinstance(mask, torch.Tensor):
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

    def checks(self) -> list[CheckResult]:
        """The folded checks, names prefixed with ``<split>/``."""
        if self.batches == 0:
            return [CheckResult(f"{self.split}/batches", "not_checked", "no batch was inspected")]
        results = list(self._worst.values())
        if self._sequence and self.unaligned is not None:
            results.append(CheckResult("instruction_masked", "not_checked", self.unaligned))
            results.append(CheckResult("label_shift", "not_checked", self.unaligned))
        elif self._sequence:
            total, equal, ignored = self._masking
            results.append(_masking(total, equal, ignored, self.ignore_index))
            results.append(check_label_shift(self._relations, causal_lm=self.causal_lm))
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
        elif y is None:
            notes.append("no target in the batch")
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
                    prints[split] = [input_fingerprint(v.inputs) for v in views]
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
            inspection.add(view)
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
