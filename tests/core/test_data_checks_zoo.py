"""Pure data checks on the model zoo's batches: an encoder-decoder's shifted labels, speech and
vision inputs, paired examples across splits, detection targets and where a prompt is."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.checks import CheckResult
from lightning_pilot.core.data_checks import example_rows
from lightning_pilot.core.label_checks import (
    check_decoder_label_shift,
    check_label_range,
    decoder_label_relations,
)
from lightning_pilot.core.prompt_checks import (
    PROMPT_OPTIONS_ADVICE,
    PromptSpec,
    check_instruction_masking,
    prompt_label_counts,
)
from lightning_pilot.core.split_inspection import SplitInspection
from lightning_pilot.core.split_scan import DatasetScan

shift_tokens_right = pytest.importorskip(
    "transformers.models.bart.modeling_bart"
).shift_tokens_right
PAD, START, EOS = 0, 1, 2


def _named(results: list[CheckResult]) -> dict[str, CheckResult]:
    return {r.name: r for r in results}


def _targets(rows: int = 4, width: int = 7, seed: int = 0) -> torch.Tensor:
    """Target sequences of their own lengths ending with EOS, -100 past them."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.full((rows, width), -100, dtype=torch.long)
    for row in range(rows):
        length = 3 + row % (width - 3)
        labels[row, : length - 1] = torch.randint(3, 50, (length - 1,), generator=generator)
        labels[row, length - 1] = EOS
    return labels


def _seq2seq_batch(*, double_shift: bool = False) -> dict[str, torch.Tensor]:
    """A seq2seq batch built the Hugging Face way: decoder_input_ids = the labels shifted right.
    ``double_shift``: the labels are then shifted left once more by hand (they run 2 ahead)."""
    target = _targets()
    decoder = shift_tokens_right(target, PAD, START)
    labels = target
    if double_shift:
        labels = torch.cat([target[:, 1:], torch.full_like(target[:, :1], -100)], dim=1)
    source = torch.randint(3, 50, (4, 5), generator=torch.Generator().manual_seed(1))
    return {
        "input_ids": source,
        "attention_mask": torch.ones_like(source),
        "decoder_input_ids": decoder,
        "labels": labels,
    }


# -- an encoder-decoder's labels against its decoder inputs ---------------------------------------


def test_decoder_label_relations_follow_the_shift() -> None:
    right, twice = _seq2seq_batch(), _seq2seq_batch(double_shift=True)
    decoder = right["decoder_input_ids"]
    assert (
        decoder_label_relations(decoder, right["labels"], ignore_index=-100) == ["shifted by 1"] * 4
    )
    assert (
        decoder_label_relations(decoder, twice["labels"], ignore_index=-100) == ["shifted by 2"] * 4
    )
    unshifted = torch.where(right["labels"] == -100, PAD, right["labels"])
    assert (
        decoder_label_relations(unshifted, right["labels"], ignore_index=-100) == ["identical"] * 4
    )
    nothing = torch.full((1, 7), -100)
    assert decoder_label_relations(decoder[:1], nothing, ignore_index=-100) == [None]
    assert decoder_label_relations(decoder[:, :5], right["labels"], ignore_index=-100) is None


def test_check_decoder_label_shift_verdicts() -> None:
    passed = check_decoder_label_shift({"shifted by 1": 4}, encoder_decoder="T5 at 'model'")
    assert passed.verdict == "pass"
    assert passed.detail.startswith("labels[t] == decoder_input_ids[t+1] where counted")
    assert "the module holds T5 at 'model'" in passed.detail
    twice = check_decoder_label_shift({"shifted by 2": 3, "shifted by 1": 1})
    assert twice.verdict == "fail"
    assert "labels run 2 tokens ahead of decoder_input_ids" in twice.detail
    assert "rows: 1 shifted by 1, 3 shifted by 2" in twice.detail
    copied = check_decoder_label_shift({"identical": 4})
    assert (copied.verdict, "it learns to copy" in copied.detail) == ("fail", True)
    assert check_decoder_label_shift({"other": 4}).verdict == "not_checked"
    assert check_decoder_label_shift({}).verdict == "not_checked"


@pytest.mark.parametrize(("double_shift", "verdict"), [(False, "pass"), (True, "fail")])
def test_split_inspection_compares_labels_with_decoder_inputs(
    double_shift: bool, verdict: str
) -> None:
    inspection = SplitInspection(
        "train", ignore_index=-100, output_size=50, encoder_decoder="T5ForConditionalGeneration"
    )
    inspection.add(BatchAdapter().view(_seq2seq_batch(double_shift=double_shift)))
    checks = _named(inspection.checks())
    assert checks["train/decoder_label_shift"].verdict == verdict
    assert checks["train/padding_not_in_loss"].verdict == "not_checked"
    assert "train/label_shift" not in checks  # labels and encoder inputs differ in shape


def test_decoder_inputs_read_as_the_inputs_are_named_so() -> None:
    # BatchAdapter(inputs="decoder_input_ids"): the inputs are the decoder's, not the encoder's.
    inspection = SplitInspection(
        "train", ignore_index=-100, output_size=50, encoder_decoder="T5ForConditionalGeneration"
    )
    batch = _seq2seq_batch(double_shift=True)
    inspection.add(BatchAdapter(inputs="decoder_input_ids").view(batch), batch)
    checks = _named(inspection.checks())
    for name in ("train/label_shift", "train/instruction_masked"):
        assert checks[name].verdict == "not_checked"
        assert "encoder's input_ids" not in checks[name].detail
        assert checks[name].detail.startswith(
            "the inputs read are the decoder_input_ids of T5ForConditionalGeneration"
        )
    mask = checks["train/attention_mask"]
    assert mask.verdict == "not_checked"
    assert "BatchAdapter(attention_mask='decoder_attention_mask')" in mask.detail
    assert checks["train/decoder_label_shift"].verdict == "fail"


def test_decoder_inputs_of_another_shape_are_not_compared() -> None:
    inspection = SplitInspection("train", ignore_index=-100)
    batch = _seq2seq_batch()
    batch["decoder_input_ids"] = batch["decoder_input_ids"][:, :5]
    inspection.add(BatchAdapter().view(batch))
    check = _named(inspection.checks())["train/decoder_label_shift"]
    assert check.verdict == "not_checked"
    assert "decoder_input_ids (4, 5) torch.int64 and labels (4, 7) torch.int64" in check.detail


# -- speech and vision inputs, detection targets --------------------------------------------------


def test_detection_targets_are_not_checked_with_the_remedy_and_never_crash() -> None:
    labels = [
        {"class_labels": torch.tensor([1]), "boxes": torch.tensor([[0.5, 0.5, 0.2, 0.2]])},
        {"class_labels": torch.tensor([0, 2]), "boxes": torch.rand(2, 4)},
    ]
    batch = {
        "pixel_values": torch.randn(2, 3, 8, 8),
        "pixel_mask": torch.ones(2, 8, 8, dtype=torch.long),
        "labels": labels,
    }
    label_range = check_label_range(labels, output_size=4, ignore_index=-100)
    assert label_range.verdict == "not_checked"
    assert "the targets are a list, not a tensor" in label_range.detail
    assert "BatchAdapter(targets=lambda batch:" in label_range.detail
    view = BatchAdapter().view(batch)
    inspection = SplitInspection("train", ignore_index=-100, output_size=4)
    inspection.add(view, batch)
    verdicts = {c.name: c.verdict for c in inspection.checks()}
    assert "fail" not in verdicts.values()
    assert "warn" not in verdicts.values()
    rows = example_rows(view, split="train", batch_index=0, limit=2, ignore_index=-100)
    assert [len(r["input_values"]) for r in rows] == [192, 192]
    assert rows[0]["notes"] == "no id in the batch; target a list, not a tensor: not stored"


def test_missing_inputs_name_the_adapter_remedy() -> None:
    inspection = SplitInspection("train", ignore_index=-100)
    inspection.add(BatchAdapter().view({"spectrogram": torch.zeros(2, 4), "y": torch.ones(2)}))
    check = _named(inspection.checks())["train/inputs_present"]
    assert check.verdict == "not_checked"
    assert "input_features, input_values" in check.detail
    assert "give BatchAdapter(inputs=...)" in check.detail
    scan = DatasetScan(BatchAdapter(), max_examples=4)
    items = [{"spectrogram": torch.zeros(4), "y": torch.tensor(0)}] * 2
    duplicates = _named(scan.run({"train": [items], "val": [items]}))
    assert duplicates["duplicate_inputs_across_splits"].verdict == "not_checked"
    assert "give BatchAdapter(inputs=...)" in duplicates["duplicate_inputs_across_splits"].detail


def test_speech_inputs_are_compared_across_splits() -> None:
    features = torch.randn(6, 8, 16, generator=torch.Generator().manual_seed(0))
    train = [{"input_features": features[i], "labels": torch.tensor([3, 4, 2])} for i in range(4)]
    val = [{"input_features": features[i], "labels": torch.tensor([3, 4, 2])} for i in (3, 4, 5)]
    results = _named(
        DatasetScan(BatchAdapter(), max_examples=10).run({"train": [train], "val": [val]})
    )
    duplicates = results["duplicate_inputs_across_splits"]
    assert duplicates.verdict == "warn"
    assert duplicates.detail.startswith("1 exact duplicate input(s) across splits: 1 in train+val")


# -- paired examples: what identifies an example is all its inputs --------------------------------


def _pairs(captions: list[int], images: list[int]) -> list[dict[str, torch.Tensor]]:
    """CLIP-style items: a caption (token ids) and an image, no labels."""
    pixels = torch.randn(10, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    return [
        {
            "input_ids": torch.tensor([5, 10 + caption, 2]),
            "attention_mask": torch.ones(3, dtype=torch.long),
            "pixel_values": pixels[image],
        }
        for caption, image in zip(captions, images, strict=True)
    ]


def test_a_caption_shared_by_different_images_is_no_duplicate() -> None:
    # "a photo of a dog" describes many images: the same caption in both splits, new images.
    train, val = _pairs([0, 1, 2, 0], [0, 1, 2, 3]), _pairs([0, 1], [4, 5])
    results = _named(
        DatasetScan(BatchAdapter(), max_examples=10).run({"train": [train], "val": [val]})
    )
    assert results["duplicate_inputs_across_splits"].verdict == "pass"
    assert results["duplicate_inputs_across_splits"].detail == (
        "no input in two splits (examples scanned: train 4, val 2)"
    )


def test_the_same_caption_and_image_in_two_splits_warn() -> None:
    train, val = _pairs([0, 1, 2, 0], [0, 1, 2, 3]), _pairs([1, 3], [1, 5])
    results = _named(
        DatasetScan(BatchAdapter(), max_examples=10).run({"train": [train], "val": [val]})
    )
    duplicates = results["duplicate_inputs_across_splits"]
    assert duplicates.verdict == "warn"
    assert duplicates.detail.startswith("1 exact duplicate input(s) across splits: 1 in train+val")
    # The adapter's choice decides what identifies an example: the captions alone here.
    captions = DatasetScan(BatchAdapter(inputs="input_ids"), max_examples=10)
    shared = _named(captions.run({"train": [train], "val": [_pairs([0], [4])]}))
    assert shared["duplicate_inputs_across_splits"].verdict == "warn"


# -- where the prompt is -----------------------------------------------------------------------

TEMPLATE = (40, 41)


def _instruction_batch(*, masked: bool, left_pad: bool = False) -> dict[str, torch.Tensor]:
    """4 rows: prompt tokens, the response template, response tokens, EOS, padding 0; labels =
    input_ids (the model shifts), -100 on padding and, when ``masked``, on the prompt."""
    generator = torch.Generator().manual_seed(0)
    width, rows = 12, []
    for row in range(4):
        prompt = torch.randint(3, 30, (2 + row % 3,), generator=generator)
        response = torch.randint(3, 30, (2 + row % 2,), generator=generator)
        tokens = torch.cat([prompt, torch.tensor(TEMPLATE), response, torch.tensor([EOS])])
        rows.append((tokens, len(prompt) + len(TEMPLATE)))
    input_ids = torch.zeros(4, width, dtype=torch.long)
    mask = torch.zeros(4, width, dtype=torch.long)
    labels = torch.full((4, width), -100, dtype=torch.long)
    response_mask = torch.zeros(4, width, dtype=torch.long)
    for row, (tokens, prompt_length) in enumerate(rows):
        start = width - len(tokens) if left_pad else 0
        span = slice(start, start + len(tokens))
        input_ids[row, span], mask[row, span], labels[row, span] = tokens, 1, tokens
        response_mask[row, start + prompt_length : start + len(tokens)] = 1
        if masked:
            labels[row, start : start + prompt_length] = -100
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "labels": labels,
        "response_mask": response_mask,
        "prompt_length": torch.tensor([length for _, length in rows]),
    }


SPECS = [
    PromptSpec(response_mask_key="response_mask"),
    PromptSpec(prompt_length_key="prompt_length"),
    PromptSpec(response_template=TEMPLATE),
]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("left_pad", [False, True], ids=["right_padded", "left_padded"])
def test_the_three_ways_to_say_where_the_prompt_is_agree(spec: PromptSpec, left_pad: bool) -> None:
    batch = _instruction_batch(masked=True, left_pad=left_pad)
    prompt, without, why = spec.locate(batch, batch["input_ids"], batch["attention_mask"])
    assert (without, why) == ([], None)
    assert prompt is not None
    assert prompt.sum(dim=1).tolist() == batch["prompt_length"].tolist()
    assert ((batch["response_mask"] == 0) & (batch["attention_mask"] == 1)).eq(prompt).all()


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_an_unmasked_prompt_fails_naming_the_rows(spec: PromptSpec) -> None:
    inspection = SplitInspection("train", ignore_index=-100, prompt=spec)
    for masked in (True, False):  # the second batch leaves its prompt in the loss
        batch = _instruction_batch(masked=masked)
        inspection.add(BatchAdapter().view(batch), batch)
    check = _named(inspection.checks())["train/instruction_masked"]
    assert check.verdict == "fail"
    assert check.detail.startswith(
        "the prompt is in the loss: 19 of 38 prompt position(s), in 4 of 8 row(s), have a label"
        " other than -100 (batch 1 row 0 (4 of 4), batch 1 row 1 (5 of 5), batch 1 row 2 (6 of"
        " 6), batch 1 row 3 (4 of 4); the prompt from "
    )
    assert f"the prompt from {spec}): set the labels of prompt tokens to -100" in check.detail


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_a_masked_prompt_passes(spec: PromptSpec) -> None:
    inspection = SplitInspection("train", ignore_index=-100, prompt=spec)
    batch = _instruction_batch(masked=True, left_pad=True)
    inspection.add(BatchAdapter().view(batch), batch)
    check = _named(inspection.checks())["train/instruction_masked"]
    assert check.verdict == "pass"
    assert check.detail == (
        f"all 19 prompt position(s) of 4 row(s) are masked out of the loss (labels -100; the"
        f" prompt from {spec})"
    )


def test_labels_shifted_left_are_read_one_position_earlier() -> None:
    # A loss that does not shift: labels[t] = input_ids[t + 1]; a masked prompt still passes.
    batch = _instruction_batch(masked=True)
    labels = torch.cat([batch["labels"][:, 1:], torch.full((4, 1), -100)], dim=1)
    spec = PromptSpec(prompt_length_key="prompt_length")
    prompt, _, _ = spec.locate(batch, batch["input_ids"], batch["attention_mask"])
    assert prompt is not None
    positions, unmasked = prompt_label_counts(prompt, labels, ignore_index=-100)
    assert positions == [4, 5, 6, 4]
    assert unmasked == [1, 1, 1, 1]  # read unshifted, the last prompt label is the response's
    _, unmasked = prompt_label_counts(prompt, labels, ignore_index=-100, shifted=[True] * 4)
    assert unmasked == [0, 0, 0, 0]
    inspection = SplitInspection("train", ignore_index=-100, prompt=spec)
    inspection.add(BatchAdapter().view(batch | {"labels": labels}), batch | {"labels": labels})
    assert _named(inspection.checks())["train/instruction_masked"].verdict == "pass"


def test_a_template_missing_from_rows_is_said() -> None:
    batch = _instruction_batch(masked=True)
    batch["input_ids"][1, 3:5] = 7  # row 1 lost its template (truncated, tokenized otherwise)
    inspection = SplitInspection(
        "train", ignore_index=-100, prompt=PromptSpec(response_template=TEMPLATE)
    )
    inspection.add(BatchAdapter().view(batch), batch)
    check = _named(inspection.checks())["train/instruction_masked"]
    assert check.verdict == "warn"
    assert "1 row(s) hold no response template (batch 0 row 1)" in check.detail
    absent = SplitInspection("train", ignore_index=-100, prompt=PromptSpec(response_template=(49,)))
    absent.add(BatchAdapter().view(batch), batch)
    check = _named(absent.checks())["train/instruction_masked"]
    assert check.verdict == "not_checked"
    assert "response_template=(49,) was found in none of 4 row(s)" in check.detail


@pytest.mark.parametrize(
    ("spec", "change", "reason"),
    [
        (
            PromptSpec(response_mask_key="loss_mask"),
            {},
            "field 'loss_mask' (response_mask_key='loss_mask') not found in the batch (the"
            " batch's keys: 'input_ids', 'attention_mask', 'labels', 'response_mask',"
            " 'prompt_length')",
        ),
        (
            PromptSpec(response_mask_key="response_mask"),
            {"response_mask": torch.ones(4, 3)},
            "has shape (4, 3), the inputs (4, 12): it needs one 0/1 value per token",
        ),
        (
            PromptSpec(prompt_length_key="prompt_length"),
            {"prompt_length": torch.tensor([1.5, 2.0])},
            "holds (2,) torch.float32 values for 4 rows: it needs one integer length per row",
        ),
    ],
)
def test_a_prompt_field_that_cannot_be_read_is_not_checked(
    spec: PromptSpec, change: dict[str, Any], reason: str
) -> None:
    batch = _instruction_batch(masked=False) | change
    inspection = SplitInspection("train", ignore_index=-100, prompt=spec)
    inspection.add(BatchAdapter().view(batch), batch)
    check = _named(inspection.checks())["train/instruction_masked"]
    assert check.verdict == "not_checked"
    assert reason in check.detail


def test_rows_without_a_prompt_are_not_a_pass() -> None:
    # Pretraining rows described with a response mask of ones: no prompt, nothing proven.
    batch = _instruction_batch(masked=False)
    batch["response_mask"] = batch["attention_mask"].clone()
    inspection = SplitInspection(
        "train", ignore_index=-100, prompt=PromptSpec(response_mask_key="response_mask")
    )
    inspection.add(BatchAdapter().view(batch), batch)
    check = _named(inspection.checks())["train/instruction_masked"]
    assert (check.verdict, check.detail) == (
        "not_checked",
        "none of 4 row(s) has a prompt position (response_mask_key='response_mask'): nothing to"
        " check",
    )


def test_without_a_prompt_option_the_warning_says_how_to_check() -> None:
    batch = _instruction_batch(masked=False)
    result = check_instruction_masking(
        batch["input_ids"], batch["labels"], batch["attention_mask"], ignore_index=-100
    )
    assert result.verdict == "warn"
    assert result.detail.endswith(PROMPT_OPTIONS_ADVICE)
    for option in ("response_mask_key=", "prompt_length_key=", "response_template="):
        assert option in result.detail


def test_a_response_template_marks_the_prompt_up_to_its_end_and_names_rows_without_it() -> None:
    spec = PromptSpec(response_template=(9, 9))
    ids = torch.tensor([[5, 9, 9, 7, 8], [5, 6, 7, 8, 0]])
    prompt, without, why = spec.locate({"input_ids": ids}, ids, None)
    assert prompt is not None
    assert prompt.long().tolist() == [[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]]
    assert (without, why, str(spec)) == ([1], None, "response_template=(9, 9)")
