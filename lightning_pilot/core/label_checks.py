"""Pure checks of the labels against the model and the inputs: the label range against the
output size, how labels relate to ``input_ids`` or ``decoder_input_ids`` (shifted or not), and
what a Hugging Face causal LM is given as ``labels=`` (docs/data-and-overfit.md)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import Self

from lightning_pilot.core.batch_checks import real_positions, target_kind
from lightning_pilot.core.batches import is_int_tensor
from lightning_pilot.core.checks import CheckResult, shown_names

#: Child-module names tried first when looking for a model's output layer.
HEAD_NAMES: Final = ("lm_head", "head", "classifier", "fc", "output_layer", "out")


#: How a row's token labels relate to its ``input_ids`` (:func:`label_relations`).
LABEL_RELATIONS: Final = ("identical", "shifted by 1", "shifted by -1", "other")


#: How a row's labels relate to an encoder-decoder's ``decoder_input_ids``
#: (:func:`decoder_label_relations`); ``shifted by 1`` (``labels[t] == decoder_input_ids[t+1]``)
#: is the convention.
DECODER_RELATIONS: Final = ("shifted by 1", "shifted by 2", "identical", "other")


#: The advice of ``label_shift`` when the labels are ``input_ids`` shifted left by one.
SHIFTED_LABELS_ADVICE: Final = (
    "labels are input_ids shifted left by 1; Hugging Face *ForCausalLM models shift labels"
    " internally, so this trains to predict 2 tokens ahead; pass labels = input_ids (with -100"
    " on masked positions) to such models, or ignore this warning if your loss does not shift"
)


def infer_output_size(module: nn.Module) -> tuple[int | None, str]:
    """Guess how many outputs the targets index into, as ``(size or None, where it came from)``
    (the order tried: docs/data-and-overfit.md)."""
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
    head = find_encoder_head(module)
    if head is not None and type(head[1]).__name__.endswith("ForMultipleChoice"):
        # Its classifier has one output, a score per choice: the labels index the choices.
        return None, (
            f"{_named(*head)} scores each choice with one logit, so its labels index the"
            " choices of input_ids [batch, choices, length] (checked by choice_labels)"
        )
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
    return _find_hugging_face(module, ("ForCausalLM", "LMHeadModel"), _NOT_SHIFTING)


#: Hugging Face encoder heads, by class-name ending, and the check of the ``labels=`` they get.
ENCODER_HEAD_CHECKS: Final = {
    "ForMaskedLM": "masked_lm_labels",
    "ForTokenClassification": "token_labels",
    "ForMultipleChoice": "choice_labels",
}


def find_encoder_head(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The first Hugging Face masked LM, token classifier or multiple-choice model in ``module``
    as ``(path, model)`` (``""``: the module itself), or ``None``; matched by class name."""
    return _find_hugging_face(module, tuple(ENCODER_HEAD_CHECKS), frozenset())


def _find_hugging_face(
    module: nn.Module, endings: tuple[str, ...], excluded: frozenset[str]
) -> tuple[str, nn.Module] | None:
    for name, sub in module.named_modules():
        cls = type(sub)
        if cls.__name__ in excluded or not cls.__name__.endswith(endings):
            continue
        if any(
            base.__name__ == "PreTrainedModel" and base.__module__.startswith("transformers.")
            for base in cls.__mro__
        ):
            return name, sub
    return None


def _named(path: str, model: nn.Module) -> str:
    return f"{type(model).__name__} at '{path}'" if path else type(model).__name__


def find_encoder_decoder(module: nn.Module) -> str | None:
    """The first submodule whose ``config.is_encoder_decoder`` is true (T5, BART), named as
    ``Class at 'path'``; ``None`` when there is none."""
    for name, sub in module.named_modules():
        if getattr(getattr(sub, "config", None), "is_encoder_decoder", False) is True:
            return _named(name, sub)
    return None


def check_label_range(
    targets: Any,
    *,
    output_size: int | None,
    ignore_index: int,
    source: str = "the caller",
) -> CheckResult:
    """Every counted label is a valid output index ``0 <= label < output_size``; with one
    output (a binary logit) 0 or 1, and other labels are a regression's (``not_checked``).
    ``source`` says where ``output_size`` came from."""
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
        detail = f"targets are {targets.dtype} (regression or soft labels)"
        return CheckResult(name, "not_checked", detail)
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
    if output_size == 1:
        # One output is a binary logit (labels 0 and 1) or a regression value, never the
        # scores of one class: the labels are not indices into it.
        if low >= 0 and high <= 1:
            detail = f"labels in [{low}, {high}] for one output, a binary logit (from {source})"
            return CheckResult(name, "pass", detail)
        detail = (
            f"labels span [{low}, {high}] and the model has one output (from {source}): a"
            " regression value, whose labels are not class indices; give num_classes= if they"
            " are"
        )
        return CheckResult(name, "not_checked", detail)
    bad = counted[(counted < 0) | (counted >= output_size)]
    if bad.numel() == 0:
        detail = f"labels in [{low}, {high}] within {output_size} outputs ({source})"
        return CheckResult(name, "pass", detail)
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


def label_relations(inputs: Any, targets: Any, *, ignore_index: int) -> list[str | None] | None:
    """How each row's token labels relate to its ``input_ids`` on the counted positions: the
    first of :data:`LABEL_RELATIONS` that holds (``shifted by 1``: ``labels[t] == ids[t + 1]``);
    ``None`` for a row with nothing counted, and for the whole list when the targets are not
    token sequences aligned with the inputs."""
    if target_kind(inputs, targets) != "sequence":
        return None
    return _relations(inputs, targets, ignore_index, LABEL_RELATIONS, (0, 1, -1))


def _relations(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    names: Sequence[str],
    offsets: Sequence[int],
) -> list[str | None]:
    """Per row, the first of ``names`` whose offset agrees, else ``"other"`` (``None``: nothing
    counted)."""
    labels, tokens = labels.detach().cpu(), tokens.detach().cpu()
    counted = labels != ignore_index
    flags = [_agree(labels, tokens, counted, offset) for offset in offsets]
    return [
        next((r for r, agree in zip(names, row, strict=False) if agree), "other") if seen else None
        for seen, *row in zip(counted.any(dim=1).tolist(), *flags, strict=True)
    ]


def _agree(
    labels: torch.Tensor, tokens: torch.Tensor, counted: torch.Tensor, offset: int
) -> list[bool]:
    """Per row: ``labels[t] == tokens[t + offset]`` on every counted position that has a token
    there, and at least one such position."""
    width = int(labels.shape[1])
    if abs(offset) >= width:
        return [False] * int(labels.shape[0])
    kept = slice(max(-offset, 0), width - max(offset, 0))
    lab, cnt = labels[:, kept], counted[:, kept]
    tok = tokens[:, max(offset, 0) : width + min(offset, 0)]
    return list((((lab == tok) | ~cnt).all(dim=1) & cnt.any(dim=1)).tolist())


def decoder_label_relations(
    decoder_inputs: Any, targets: Any, *, ignore_index: int
) -> list[str | None] | None:
    """How each row's labels relate to an encoder-decoder's ``decoder_input_ids`` on the counted
    positions: the first of :data:`DECODER_RELATIONS` that holds; ``None`` for a row with nothing
    counted, and for the whole list when the two are not integer tensors of one shape."""
    if not (is_int_tensor(decoder_inputs) and is_int_tensor(targets)) or targets.ndim != 2:
        return None
    if decoder_inputs.shape != targets.shape:
        return None
    return _relations(decoder_inputs, targets, ignore_index, DECODER_RELATIONS, (1, 2, 0))


def _tally(
    counts: Mapping[str, int], relations: Sequence[str] = LABEL_RELATIONS
) -> tuple[str | None, int, str]:
    """The relation of at least half the rows (``None``: none), the rows, and the counts."""
    total = sum(counts.values())
    text = ", ".join(f"{counts[r]} {r}" for r in relations if counts.get(r))
    majority = next((r for r in relations if total and 2 * counts.get(r, 0) >= total), None)
    return majority, total, text


def check_decoder_label_shift(
    counts: Mapping[str, int], *, encoder_decoder: str | None = None
) -> CheckResult:
    """``decoder_label_shift`` from ``counts`` (rows per :data:`DECODER_RELATIONS`): ``fail`` when
    the labels are shifted twice or equal the decoder inputs (docs/data-and-overfit.md);
    ``encoder_decoder``: the model found in the module, named."""
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
    """``label_shift`` from ``counts`` (rows per relation): warns when the labels are already
    shifted (docs/data-and-overfit.md); ``causal_lm``: a causal LM found in the module, named."""
    relation, total, text = _tally(counts)
    if total == 0:
        detail = "no row has a position counted in the loss"
        return CheckResult("label_shift", "not_checked", detail)
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
    """``causal_lm_labels``: what a Hugging Face causal LM was given as ``labels=`` in ``calls``
    forward calls (``counts``: rows per relation); ``fail`` for labels already shifted left."""
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


class CausalLMWatch:
    """A forward pre-hook on a Hugging Face causal LM: the ``labels=`` its first ``max_calls`` calls
    get (never raising into the user's forward; a copy of the model carries an inert watch)."""

    #: The watched model shifts the labels it is given (a causal LM).
    shifts_labels: bool = True
    #: The check of the labels the watched model gets.
    check_name: str = "causal_lm_labels"
    #: The watched kind of model in a module as ``(path, model)``: a causal LM here.
    find = staticmethod(find_causal_lm)

    def __init__(self, name: str, ignore_index: int, max_calls: int) -> None:
        self.name, self.ignore_index, self.max_calls = name, ignore_index, max_calls
        self.calls = 0
        self.relations: Counter[str] = Counter()
        self.error: str | None = None
        self._handle: RemovableHandle | None = None

    @classmethod
    def attach(cls, module: nn.Module, *, ignore_index: int, max_calls: int) -> Self | None:
        """Watch the first model of the kind :meth:`find` finds in ``module``; ``None`` when it
        holds none."""
        found = cls.find(module)
        if found is None:
            return None
        watch = cls(_named(*found), ignore_index, max_calls)
        watch._handle = found[1].register_forward_pre_hook(watch, with_kwargs=True)
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
            ids = kwargs.get("input_ids", args[0] if args else None)
            self._read(kwargs.get("labels"), ids, kwargs)
        except Exception as err:  # inside the user's forward: record, never raise
            self.error = f"{type(err).__name__}: {err}"

    def _read(self, labels: Any, ids: Any, kwargs: dict[str, Any]) -> None:
        """Count one call's ``labels=`` against its ``input_ids``."""
        if labels is not None:
            relations = label_relations(ids, labels, ignore_index=self.ignore_index)
            self.relations.update(r for r in relations or [] if r is not None)

    def __reduce__(self) -> tuple[type[CausalLMWatch], tuple[str, int, int]]:
        return type(self), (self.name, self.ignore_index, 0)

    def check(self) -> CheckResult:
        """The check of the labels the model was given, or the error that stopped it."""
        if self.error is not None:
            detail = f"reading the labels given to {self.name} raised {self.error}"
            return CheckResult(self.check_name, "not_checked", detail)
        return self._judged()

    def _judged(self) -> CheckResult:
        return check_causal_lm_labels(self.name, self.relations, self.calls)


class EncoderHeadWatch(CausalLMWatch):
    """A forward pre-hook on a Hugging Face masked LM, token classifier or multiple-choice model:
    what its first ``max_calls`` calls get as ``labels=``, judged by the head's convention
    (``masked_lm_labels``, ``token_labels`` or ``choice_labels``; docs/data-and-overfit.md)."""

    shifts_labels = False

    def __init__(self, name: str, ignore_index: int, max_calls: int) -> None:
        super().__init__(name, ignore_index, max_calls)
        ending = next(e for e in ENCODER_HEAD_CHECKS if name.split(" at ")[0].endswith(e))
        self.check_name = ENCODER_HEAD_CHECKS[ending]
        self.tally: Counter[str] = Counter()
        self.values: set[int] = set()  # multiple choice: the counted labels out of range
        self.choices: set[int] = set()  # multiple choice: the choice counts seen
        self.ends: dict[str, set[int]] = {"first": set(), "last": set()}  # token labels: ids
        self.end_labels: set[int] = set()  # token labels: the labels counted on those tokens

    find = staticmethod(find_encoder_head)

    def _read(self, labels: Any, ids: Any, kwargs: dict[str, Any]) -> None:
        if not (is_int_tensor(labels) and is_int_tensor(ids)):
            self.tally["unread"] += labels is not None
            return
        labels, ids = labels.detach().cpu(), ids.detach().cpu()
        if self.check_name == "choice_labels":
            self._add_choices(labels, ids)
        elif labels.shape != ids.shape or labels.ndim != 2:
            self.tally["unread"] += 1
        else:
            self._add_tokens(labels, ids, real_positions(kwargs.get("attention_mask"), ids.shape))

    def _add_choices(self, labels: torch.Tensor, ids: torch.Tensor) -> None:
        if ids.ndim != 3 or labels.shape != ids.shape[:1]:
            self.tally["unread"] += 1
            return
        choices = int(ids.shape[1])
        counted = labels[labels != self.ignore_index]
        bad = counted[(counted < 0) | (counted >= choices)]
        self.values.update(int(v) for v in bad.tolist())
        self.tally.update(rows=int(counted.numel()), bad=int(bad.numel()))
        self.choices.add(choices)

    def _add_tokens(self, labels: torch.Tensor, ids: torch.Tensor, real: torch.Tensor) -> None:
        counted = labels != self.ignore_index
        self.tally.update(
            real=int(real.sum()),
            counted=int(counted.sum()),
            visible=int((counted & (labels == ids)).sum()),
        )
        # Each row's first and last real positions: where a tokenizer puts [CLS] and [SEP].
        rows = torch.nonzero(real.any(dim=1)).flatten()
        first = real.to(torch.int64).argmax(dim=1)
        last = int(ids.shape[1]) - 1 - real.flip(1).to(torch.int64).argmax(dim=1)
        for end, where in (("first", first[rows]), ("last", last[rows])):
            self.tally[f"{end}_rows"] += int(rows.numel())
            self.tally[f"{end}_counted"] += int(counted[rows, where].sum())
            on_end = labels[rows, where]
            self.end_labels.update(on_end[on_end != self.ignore_index].tolist())
            self.ends[end].update(ids[rows, where].tolist())

    def _judged(self) -> CheckResult:
        name, seen = self.check_name, f"{self.calls} forward call(s) seen"
        if self.calls == 0:
            detail = f"{self.name} was not called before the verdict"
            return CheckResult(name, "not_checked", detail)
        if name == "choice_labels":
            return self._choice_check(seen)
        counted, unread = self.tally["counted"], self.tally["unread"]
        if counted == 0:
            given = f"{unread} labels= of another shape than its input_ids, " if unread else ""
            detail = (
                f"{self.name} was given no token labels= comparable with its input_ids ({given}"
                f"{seen}): the loss is computed outside it, or every label is {self.ignore_index}"
            )
            return CheckResult(name, "not_checked", detail)
        if name == "masked_lm_labels":
            return self._masked_check(seen)
        return self._token_check(seen)

    def _masked_check(self, seen: str) -> CheckResult:
        counted, visible, real = self.tally["counted"], self.tally["visible"], self.tally["real"]
        share = (
            f"{counted} of {real} real position(s) ({counted / max(real, 1):.0%}) are counted in"
            f" the loss, and the label equals the input token at {visible} of them"
            f" ({visible / counted:.0%}; {seen})"
        )
        if 2 * visible > counted:
            detail = (
                f"{self.name} was given labels equal to its input_ids: {share}; a masked LM"
                " predicts each position's own token (it does not shift), so a position that"
                " shows its label teaches it to copy: mask the inputs as"
                " DataCollatorForLanguageModeling does (about 15% of positions get the original"
                f" id as label and the mask token in input_ids, labels {self.ignore_index}"
                " elsewhere)"
            )
            return CheckResult("masked_lm_labels", "fail", detail)
        return CheckResult("masked_lm_labels", "pass", f"{share}: the inputs hide the targets")

    def _token_check(self, seen: str) -> CheckResult:
        ends = []
        for end, what in (("first", "[CLS]/<s>"), ("last", "[SEP]/</s>")):
            rows = self.tally[f"{end}_rows"]
            if len(self.ends[end]) == 1 and rows >= 2:  # one id ends every row: a special token
                (token,) = self.ends[end]
                ends.append((end, what, token, rows, self.tally[f"{end}_counted"]))
        if not ends:
            detail = (
                f"the first and last real tokens differ between rows ({seen}): no special token"
                " ([CLS], [SEP]) to check the labels' alignment on"
            )
            return CheckResult("token_labels", "not_checked", detail)
        said = "; ".join(
            f"the {end} real token (id {token} in all {rows} rows, a {what}) is counted in"
            f" {n} row(s)"
            for end, what, token, rows, n in ends
        )
        if any(n for *_, n in ends):
            detail = (
                f"special tokens are in the loss: {said} ({seen}); {self.name} gives each word"
                f" a label and special tokens {self.ignore_index}: labels shifted by one"
                " position put a word's label on the token before or after it; align them"
                " with the tokenizer's word_ids() and give special tokens"
                f" {self.ignore_index}"
            )
            if len(self.end_labels) == 1:  # one fixed label (an "O"): deliberate, or a shift
                fixed = f"; they all carry label {next(iter(self.end_labels))}, harmless if that"
                return CheckResult("token_labels", "warn", detail + fixed + " is deliberate")
            return CheckResult("token_labels", "fail", detail)
        return CheckResult("token_labels", "pass", f"{said}: special tokens out of the loss")

    def _choice_check(self, seen: str) -> CheckResult:
        rows, bad, unread = self.tally["rows"], self.tally["bad"], self.tally["unread"]
        choices = sorted(self.choices)
        if rows == 0:
            detail = (
                f"{self.name} was given no labels= of one choice index per example with"
                f" input_ids [batch, choices, length] ({unread} of another shape; {seen})"
            )
            return CheckResult("choice_labels", "not_checked", detail)
        fewest = choices[0]
        if bad == 0:
            detail = f"{rows} label(s) index the {shown_names(choices)} choice(s) ({seen})"
            return CheckResult("choice_labels", "pass", detail)
        values = sorted(self.values)
        hint = "; labels look shifted by one choice (1-based?)" if fewest in values else ""
        detail = (
            f"{bad} of {rows} label(s) outside [0, {fewest - 1}] ({self.name} scores"
            f" {shown_names(choices)} choice(s) per example, the second dimension of input_ids):"
            f" values {shown_names(values)}{hint}"
        )
        return CheckResult("choice_labels", "fail", detail)
