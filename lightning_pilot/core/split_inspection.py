"""The per-batch inspection of one split: the batch checks over its first batches, each keeping its
worst verdict, and those that need every batch folded at the end (docs/data-and-overfit.md)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_pilot.core.batch_checks import (
    check_attention_mask,
    check_ids,
    check_padding,
    check_targets_present,
    check_truncation,
    row_lengths,
    target_kind,
)
from lightning_pilot.core.batches import INPUT_KEYS, BatchView
from lightning_pilot.core.checks import CheckResult, shown_names
from lightning_pilot.core.label_checks import (
    check_decoder_label_shift,
    check_label_range,
    check_label_shift,
    decoder_label_relations,
    label_relations,
)
from lightning_pilot.core.prompt_checks import (
    PromptSpec,
    _masking,
    _masking_counts,
    check_loss_positions,
    prompt_label_counts,
)
from lightning_pilot.vocabulary import worst_verdict


class SplitInspection:
    """Run the batch checks over the first batches of one split, each check keeping its worst
    verdict (with an ``encoder_decoder``, those comparing labels with inputs are ``not_checked``
    and the labels are compared with the decoder inputs instead; ``prompt``: where each prompt
    is, for ``instruction_masked``)."""

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
        encoder_head: str | None = None,
    ) -> None:
        self.split, self.ignore_index, self.max_length = split, ignore_index, max_length
        self.output_size, self.size_source = output_size, size_source
        self.pad_token_id, self.padding_warn, self.causal_lm = pad_token_id, padding_warn, causal_lm
        self.encoder_decoder, self.prompt = encoder_decoder, prompt
        self.encoder_head = encoder_head  # "<model> (<its check>)": it predicts its own labels
        self.unaligned = None
        if encoder_decoder is not None:
            self.unaligned = (
                f"{encoder_decoder} is an encoder-decoder model: its labels are decoder targets,"
                " which the encoder's input_ids and attention_mask do not describe"
            )
        self._inputs_are_decoder = False  # BatchAdapter(inputs="decoder_input_ids")
        self._decoder: Counter[str] = Counter()
        self._decoder_problem: CheckResult | None = None
        # With a prompt: rows checked, prompt positions, unmasked ones; rows named; or why not.
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
        kept = self._worst.setdefault(result.name, result)
        if worst_verdict([kept.verdict, result.verdict]) != kept.verdict:
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
            size, source = self.output_size, self.size_source
            ranged = check_label_range(
                targets, output_size=size, ignore_index=self.ignore_index, source=source
            )
            self._keep(ranged)
        encoder_mask = isinstance(batch, Mapping) and mask is batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and self._inputs_are_decoder and encoder_mask:
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
        # Why instruction_masked and label_shift do not apply to the sequences, if they do not.
        why = self.unaligned
        if self._inputs_are_decoder:
            held = f" of {self.encoder_decoder}" if self.encoder_decoder else ""
            why = (
                f"the inputs read are the decoder_input_ids{held}, the labels shifted right"
                " (the decoder's inputs, not a prompt followed by its response): the labels"
                " are compared with them in decoder_label_shift"
            )
        elif why is None and self.encoder_head is not None:
            why = (
                f"{self.encoder_head} predicts each position's own label (no prompt, no shift):"
                " its labels are checked there"
            )
        if self._sequence and why is not None:
            results += [
                CheckResult(n, "not_checked", why) for n in ("instruction_masked", "label_shift")
            ]
        elif self._sequence:
            masked = _masking(self._masking, self.ignore_index)
            results.append(masked if self.prompt is None else self._prompt_check())
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
