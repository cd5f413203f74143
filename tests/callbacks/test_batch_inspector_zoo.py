"""BatchInspector on the model zoo, in real fits of real Hugging Face and diffusers models built
from tiny configs: no false fail on stock batches, and each family's own bug caught (a seq2seq
double shift, paired data read as leakage, an unmasked prompt)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_pilot import pilot_callbacks, read_phase_table
from lightning_pilot.callbacks.batch_inspector import BatchInspector
from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.storage import read_snapshot_table

transformers = pytest.importorskip("transformers")
from tiny_models import detr, detr_set_loss, llama, mixtral, t5, unet2d, wav2vec2_ctc, whisper  # noqa: E402
from transformers.models.bart.modeling_bart import shift_tokens_right  # noqa: E402

VOCAB, PAD, START, EOS = 48, 0, 1, 2
Item = dict[str, Any]


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


class HFModule(pl.LightningModule):
    """Any Hugging Face model trained the Hugging Face way: ``model(**batch).loss``."""

    def __init__(self, model: torch.nn.Module, **extra: Any) -> None:
        super().__init__()
        self.model, self.extra = model, extra

    def training_step(self, batch: Item, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(**batch, **self.extra).loss
        return loss

    def validation_step(self, batch: Item, batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch, **self.extra).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(
    make_trainer: Any,
    module: pl.LightningModule,
    train: list[Item],
    val: list[Item] | None = None,
    *,
    inspector: BatchInspector | None = None,
    collate: Callable[[list[Item]], Item] | None = None,
) -> BatchInspector:
    inspector = inspector or BatchInspector()
    trainer = make_trainer(callbacks=[inspector], max_steps=2, limit_val_batches=1)
    loaders = [DataLoader(d, batch_size=4, collate_fn=collate) for d in (train, val) if d]
    trainer.fit(module, *loaders)
    assert trainer.global_step == 2
    assert inspector.verdict is not None
    return inspector


def _bad(inspector: BatchInspector) -> dict[str, str]:
    return {c.name: c.detail for c in inspector.checks.values() if c.verdict in ("warn", "fail")}


def _data_row(inspector: BatchInspector) -> dict[str, Any]:
    table = read_phase_table(inspector.run.run_dir)
    [row] = table[(table["phase"] == "data") & table["first"]].to_dict("records")
    return row


def _targets(n: int, width: int, seed: int) -> torch.Tensor:
    """``n`` target sequences of their own lengths ending with EOS, -100 past them."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.full((n, width), -100, dtype=torch.long)
    for row in range(n):
        length = 3 + row % (width - 3)
        labels[row, : length - 1] = torch.randint(3, VOCAB, (length - 1,), generator=generator)
        labels[row, length - 1] = EOS
    return labels


# -- seq2seq: labels against decoder_input_ids ---------------------------------------------------


def _t5() -> Any:
    return t5(vocab_size=VOCAB, decoder_start_token_id=PAD, pad_token_id=PAD)


def _translation(n: int, seed: int, *, double_shift: bool = False) -> list[Item]:
    """Source and target pairs with decoder_input_ids = the labels shifted right (the model's
    convention). ``double_shift``: the labels are then shifted left by hand once more, the bug of
    a script written for a loss that does not shift: they run two tokens ahead."""
    target = _targets(n, 8, seed)
    decoder = shift_tokens_right(target, PAD, PAD)
    labels = target
    if double_shift:
        labels = torch.cat([target[:, 1:], torch.full_like(target[:, :1], -100)], dim=1)
    source = torch.randint(3, VOCAB, (n, 6), generator=torch.Generator().manual_seed(seed + 1))
    return [
        {
            "input_ids": source[i],
            "attention_mask": torch.ones(6, dtype=torch.long),
            "decoder_input_ids": decoder[i],
            "labels": labels[i],
        }
        for i in range(n)
    ]


def test_seq2seq_decoder_inputs_shifted_right_pass(make_trainer: Any) -> None:
    inspector = _fit(make_trainer, HFModule(_t5()), _translation(16, 0), _translation(8, 1))

    check = inspector.checks["train/decoder_label_shift"]
    assert check.verdict == "pass"
    assert check.detail.startswith("labels[t] == decoder_input_ids[t+1] where counted")
    assert "rows: 8 shifted by 1; the module holds T5ForConditionalGeneration at 'model'" in (
        check.detail
    )
    assert inspector.checks["val/decoder_label_shift"].verdict == "pass"
    assert _bad(inspector) == {}


def test_seq2seq_labels_shifted_twice_fail(make_trainer: Any) -> None:
    train, val = _translation(16, 0, double_shift=True), _translation(8, 1, double_shift=True)
    inspector = _fit(make_trainer, HFModule(_t5()), train, val)

    check = inspector.checks["train/decoder_label_shift"]
    assert check.verdict == "fail"
    assert check.detail.startswith(
        "labels run 2 tokens ahead of decoder_input_ids (labels[t] == decoder_input_ids[t+2]"
        " in rows: 8 shifted by 2; the module holds T5ForConditionalGeneration at 'model')"
    )
    row = _data_row(inspector)
    assert row["verdict"] == "fail"
    assert "train/decoder_label_shift: labels run 2 tokens ahead" in row["reason"]


def test_decoder_inputs_read_as_inputs_are_not_called_the_encoders(make_trainer: Any) -> None:
    inspector = BatchInspector(adapter=BatchAdapter(inputs="decoder_input_ids"))
    _fit(make_trainer, HFModule(_t5()), _translation(16, 0), inspector=inspector)

    shift = inspector.checks["train/label_shift"]
    assert shift.verdict == "not_checked"
    assert "encoder's" not in shift.detail
    assert shift.detail == (
        "the inputs read are the decoder_input_ids of T5ForConditionalGeneration at 'model', the"
        " labels shifted right (the decoder's inputs, not a prompt followed by its response):"
        " the labels are compared with them in decoder_label_shift"
    )
    assert inspector.checks["train/decoder_label_shift"].verdict == "pass"
    assert "fail" not in {c.verdict for c in inspector.checks.values()}


# -- speech: Whisper (input_features) and wav2vec2 CTC (input_values) -----------------------------


def _whisper() -> Any:
    return whisper(
        vocab_size=VOCAB,
        num_mel_bins=8,
        max_source_positions=8,
        max_target_positions=16,
        decoder_start_token_id=START,
        pad_token_id=PAD,
        bos_token_id=START,
        eos_token_id=EOS,
        suppress_tokens=[],
        begin_suppress_tokens=[],
    )


def _speech(n: int, seed: int) -> list[Item]:
    """Log-mel features and transcripts, decoder_input_ids = the labels shifted right."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(n, 8, 16, generator=generator)
    labels = _targets(n, 6, seed)
    decoder = shift_tokens_right(labels, PAD, START)
    return [
        {"input_features": features[i], "decoder_input_ids": decoder[i], "labels": labels[i]}
        for i in range(n)
    ]


def test_a_stock_whisper_fine_tune_is_read_and_passes(make_trainer: Any) -> None:
    inspector = _fit(make_trainer, HFModule(_whisper()), _speech(16, 0), _speech(8, 1))

    assert _bad(inspector) == {}
    # The features are the inputs: the splits are compared, the examples stored.
    assert inspector.checks["duplicate_inputs_across_splits"].detail == (
        "no input in two splits (examples scanned: train 16, val 8)"
    )
    assert inspector.checks["train/decoder_label_shift"].verdict == "pass"
    assert "train/inputs_present" not in inspector.checks
    assert (
        inspector.checks["train/label_range"].detail.startswith(
            f"labels in [2, {VOCAB - 1}] within {VOCAB} outputs"
        )
        or inspector.checks["train/label_range"].verdict == "pass"
    )
    examples = read_snapshot_table(inspector.run.run_dir / "examples.parquet").to_pylist()
    assert [len(r["input_values"]) for r in examples] == [128] * 8


def _wav2vec2() -> Any:
    return wav2vec2_ctc(
        vocab_size=16,
        conv_stride=(4, 4),
        conv_kernel=(8, 4),
        num_conv_pos_embeddings=4,
        pad_token_id=PAD,
    )


def _waveforms(n: int, seed: int) -> list[Item]:
    """Raw audio padded to 400 samples (attention_mask 0 on padding), CTC labels padded -100."""
    generator = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        length, chars = 300 + 20 * (i % 5), 3 + i % 3
        values = torch.zeros(400)
        values[:length] = torch.randn(length, generator=generator)
        labels = torch.full((5,), -100, dtype=torch.long)
        labels[:chars] = torch.randint(1, 16, (chars,), generator=generator)
        mask = (torch.arange(400) < length).long()
        items.append({"input_values": values, "attention_mask": mask, "labels": labels})
    return items


def test_a_stock_wav2vec2_ctc_fine_tune_is_read_and_passes(make_trainer: Any) -> None:
    inspector = _fit(make_trainer, HFModule(_wav2vec2()), _waveforms(16, 0), _waveforms(8, 1))

    assert _bad(inspector) == {}
    assert inspector.checks["duplicate_inputs_across_splits"].verdict == "pass"
    assert inspector.checks["train/label_range"].detail.startswith("labels in [")
    assert inspector.checks["train/attention_mask_contiguous"].verdict == "pass"


# -- paired examples: CLIP ------------------------------------------------------------------------


def _clip() -> Any:
    config = transformers.CLIPConfig(
        text_config={
            "vocab_size": VOCAB,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 8,
            "bos_token_id": START,
            "eos_token_id": EOS,
            "pad_token_id": PAD,
        },
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 16,
            "patch_size": 8,
        },
        projection_dim=8,
    )
    return transformers.CLIPModel(config)


IMAGES = torch.randn(40, 3, 16, 16, generator=torch.Generator().manual_seed(0))


def _pairs(captions: range | list[int], images: range | list[int]) -> list[Item]:
    """(caption, image) pairs; 4 captions only, as in a dataset of "a photo of a <class>"."""
    return [
        {
            "input_ids": torch.tensor([START, 10 + caption % 4, 20, EOS]),
            "attention_mask": torch.ones(4, dtype=torch.long),
            "pixel_values": IMAGES[image],
        }
        for caption, image in zip(captions, images, strict=True)
    ]


def test_clip_pairs_sharing_captions_across_splits_are_not_duplicates(make_trainer: Any) -> None:
    train, val = _pairs(range(16), range(16)), _pairs(range(8), range(16, 24))
    inspector = _fit(make_trainer, HFModule(_clip(), return_loss=True), train, val)

    duplicates = inspector.checks["duplicate_inputs_across_splits"]
    assert duplicates.verdict == "pass"
    assert duplicates.detail == "no input in two splits (examples scanned: train 16, val 8)"
    assert _bad(inspector) == {}


def test_the_same_clip_pair_in_train_and_val_warns(make_trainer: Any) -> None:
    train, val = _pairs(range(16), range(16)), _pairs([0, 1, 2, 3], [0, 1, 30, 31])
    inspector = _fit(make_trainer, HFModule(_clip(), return_loss=True), train, val)

    duplicates = inspector.checks["duplicate_inputs_across_splits"]
    assert duplicates.verdict == "warn"
    assert duplicates.detail.startswith(
        "2 exact duplicate input(s) across splits: 2 in train+val (examples scanned: train 16,"
        " val 4)"
    )


# -- detection: DETR, labels a list of dicts -------------------------------------------------------


def _detr() -> Any:
    backbone = {"embedding_size": 8, "hidden_sizes": [8, 8], "depths": [1, 1]}
    return detr(backbone | {"out_features": ["stage2"]}, num_labels=3)


def _detections(n: int, seed: int) -> list[Item]:
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            "pixel_values": torch.randn(3, 32, 32, generator=generator),
            "pixel_mask": torch.ones(32, 32, dtype=torch.long),
            "labels": {
                "class_labels": torch.tensor([i % 3, (i + 1) % 3]),
                "boxes": torch.rand(2, 4, generator=generator) * 0.5 + 0.25,
            },
        }
        for i in range(n)
    ]


def _collate_detections(items: list[Item]) -> Item:
    """The DETR recipe's collate: images stacked, one target dict per image."""
    return {
        "pixel_values": torch.stack([item["pixel_values"] for item in items]),
        "pixel_mask": torch.stack([item["pixel_mask"] for item in items]),
        "labels": [item["labels"] for item in items],
    }


class DetrModule(HFModule):
    """DETR trained on its set loss, matched without scipy (``tiny_models.detr_set_loss``)."""

    def training_step(self, batch: Item, batch_idx: int) -> torch.Tensor:
        return detr_set_loss(self.model, batch)

    def validation_step(self, batch: Item, batch_idx: int) -> None:
        self.log("val_loss", detr_set_loss(self.model, batch))


def test_detr_targets_as_a_list_of_dicts_neither_crash_nor_fail(make_trainer: Any) -> None:
    inspector = _fit(
        make_trainer,
        DetrModule(_detr()),
        _detections(8, 0),
        _detections(4, 1),
        collate=_collate_detections,
    )

    assert _bad(inspector) == {}
    assert "train/batch_read" not in inspector.checks
    label_range = inspector.checks["train/label_range"]
    assert label_range.verdict == "not_checked"
    assert "BatchAdapter(targets=lambda batch:" in label_range.detail
    assert inspector.checks["duplicate_inputs_across_splits"].verdict == "pass"


# -- diffusion: a UNet trained on images, no labels -----------------------------------------------


class DiffusionModule(pl.LightningModule):
    """The diffusers training recipe: noise the images at random timesteps, predict the noise."""

    def __init__(self) -> None:
        super().__init__()
        diffusers = pytest.importorskip("diffusers")
        self.unet = unet2d(sample_size=8)
        self.scheduler = diffusers.DDPMScheduler(num_train_timesteps=100)

    def training_step(self, batch: Item, batch_idx: int) -> torch.Tensor:
        images = batch["pixel_values"]
        noise = torch.randn_like(images)
        timesteps = torch.randint(0, 100, (images.shape[0],))
        noisy = self.scheduler.add_noise(images, noise, timesteps)
        return torch.nn.functional.mse_loss(self.unet(noisy, timesteps).sample, noise)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_diffusion_training_without_labels_does_not_fail(make_trainer: Any) -> None:
    images = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    inspector = _fit(make_trainer, DiffusionModule(), [{"pixel_values": x} for x in images])

    assert _bad(inspector) == {}
    targets = inspector.checks["train/targets_present"]
    assert targets.verdict == "not_checked"
    assert "a model trained without targets, such as diffusion" in targets.detail
    assert "train/inputs_present" not in inspector.checks


# -- causal LMs: a mixture of experts, a LoRA adapter ---------------------------------------------


def _chat(n: int, seed: int) -> list[Item]:
    """Prompt + response rows right-padded with PAD; labels = input_ids with -100 on the prompt
    and the padding (the model shifts); ``response_mask`` 1 on the response, ``prompt_length``."""
    generator = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        prompt, response = 3 + i % 3, 3 + i % 2
        length = prompt + response
        input_ids = torch.full((10,), PAD, dtype=torch.long)
        input_ids[:length] = torch.randint(3, VOCAB, (length,), generator=generator)
        input_ids[prompt - 2 : prompt] = torch.tensor([40, 41])  # the response template
        labels = torch.full((10,), -100, dtype=torch.long)
        labels[prompt:length] = input_ids[prompt:length]
        items.append(
            {
                "input_ids": input_ids,
                "attention_mask": (torch.arange(10) < length).long(),
                "labels": labels,
                "response_mask": (
                    (torch.arange(10) >= prompt) & (torch.arange(10) < length)
                ).long(),
                "prompt_length": torch.tensor(prompt),
            }
        )
    return items


class CausalModule(HFModule):
    def training_step(self, batch: Item, batch_idx: int) -> torch.Tensor:
        fields = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
        loss: torch.Tensor = self.model(**fields).loss
        return loss

    def validation_step(self, batch: Item, batch_idx: int) -> None:
        return None


def _llama() -> Any:
    return llama(vocab_size=VOCAB, num_key_value_heads=1)


def test_a_mixture_of_experts_lm_passes(make_trainer: Any) -> None:
    model = mixtral(vocab_size=VOCAB)
    inspector = _fit(make_trainer, CausalModule(model), _chat(16, 0))

    assert _bad(inspector) == {}
    assert inspector.checks["causal_lm_labels"].verdict == "pass"
    assert f"within {VOCAB} outputs" in inspector.checks["train/label_range"].detail


def test_a_lora_adapter_on_a_causal_lm_passes(make_trainer: Any) -> None:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(_llama(), config)
    inspector = _fit(make_trainer, CausalModule(model), _chat(16, 0))

    assert _bad(inspector) == {}
    assert inspector.checks["train/label_shift"].verdict == "pass"
    assert f"{VOCAB} outputs" in inspector.checks["train/label_range"].detail
    # The causal LM under the adapter is found and watched.
    model_labels = inspector.checks["causal_lm_labels"]
    assert model_labels.verdict == "pass"
    assert model_labels.detail.startswith("LlamaForCausalLM at 'model.base_model.model' was given")


# -- where the prompt is: an unmasked prompt fails once the user says where it is ------------------


def _unmasked(items: list[Item]) -> list[Item]:
    """The planted bug: labels = input_ids on every real token, the prompt included."""
    return [
        item | {"labels": torch.where(item["attention_mask"] == 1, item["input_ids"], -100)}
        for item in items
    ]


@pytest.mark.parametrize(
    "option",
    [
        {"response_mask_key": "response_mask"},
        {"prompt_length_key": "prompt_length"},
        {"response_template": [40, 41]},
    ],
    ids=lambda option: next(iter(option)),
)
def test_an_unmasked_prompt_fails_once_its_place_is_given(
    make_trainer: Any, option: dict[str, Any]
) -> None:
    inspector = _fit(
        make_trainer,
        CausalModule(_llama()),
        _unmasked(_chat(16, 0)),
        inspector=BatchInspector(**option),
    )

    check = inspector.checks["train/instruction_masked"]
    assert check.verdict == "fail"
    assert check.detail.startswith(
        "the prompt is in the loss: 31 of 31 prompt position(s), in 8 of 8 row(s), have a label"
        " other than -100 (batch 0 row 0 (3 of 3), batch 0 row 1 (4 of 4),"
    )
    row = _data_row(inspector)
    assert row["verdict"] == "fail"
    assert "train/instruction_masked: the prompt is in the loss" in row["reason"]


def test_a_masked_prompt_passes_through_pilot_callbacks(make_trainer: Any) -> None:
    callbacks = pilot_callbacks(batch_inspector={"response_template": [40, 41]})
    [inspector] = [c for c in callbacks if isinstance(c, BatchInspector)]
    assert str(inspector.prompt) == "response_template=(40, 41)"
    _fit(make_trainer, CausalModule(_llama()), _chat(16, 0), inspector=inspector)

    check = inspector.checks["train/instruction_masked"]
    assert check.verdict == "pass"
    assert check.detail == (
        "all 31 prompt position(s) of 8 row(s) are masked out of the loss (labels -100; the"
        " prompt from response_template=(40, 41))"
    )


def test_without_a_prompt_option_labels_equal_to_inputs_warn_with_the_way_out(
    make_trainer: Any,
) -> None:
    inspector = _fit(make_trainer, CausalModule(_llama()), _unmasked(_chat(16, 0)))

    check = inspector.checks["train/instruction_masked"]
    assert check.verdict == "warn"
    assert "the instruction (prompt) is a target too" in check.detail
    for option in ("response_mask_key=", "prompt_length_key=", "response_template="):
        assert option in check.detail


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"response_mask_key": ""}, ValueError, r"response_mask_key=''\) is invalid"),
        ({"prompt_length_key": 3}, TypeError, r"prompt_length_key=3\) is invalid"),
        (
            {"response_template": "### Response:"},
            TypeError,
            r"response_template='### Response:'\) is invalid: expected a non-empty list of"
            r" token ids",
        ),
        ({"response_template": []}, ValueError, r"response_template=\[\]\) is invalid"),
        (
            {"response_template": [40, -1]},
            ValueError,
            r"response_template\[1\]=-1\) is invalid: expected an integer >= 0",
        ),
        ({"response_template": [40, True]}, TypeError, r"response_template\[1\]=True\) is invalid"),
        (
            {"response_mask_key": "response_mask", "response_template": [40]},
            ValueError,
            r"BatchInspector\(response_mask_key='response_mask', response_template=\(40,\)\) is"
            r" invalid: expected one of response_mask_key, prompt_length_key, response_template"
            r" at most",
        ),
    ],
)
def test_invalid_prompt_options(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        BatchInspector(**kwargs)
    with pytest.raises(error, match=match):
        pilot_callbacks(batch_inspector=kwargs)
