"""The conformance zoo: the model families users train today, each built from a small config.

Nothing is downloaded: every model is built from a config (hidden sizes 8 to 32, one or two
layers), every dataset is drawn at construction from its own seeded ``torch.Generator``, so a
new process (ResumeVerifier's) builds the same examples. Every class lives at module level and
saves its constructor arguments with ``save_hyperparameters()``: a new process rebuilds it from
``zoo_modules:<Class>`` (pytest puts this folder on ``sys.path``).

The families and their batches:

* ``LoRACausalLM``: a ``LlamaForCausalLM`` wrapped by peft's ``get_peft_model`` (LoRA on
  ``q_proj``/``v_proj``), on :class:`InstructionDataModule` batches (``input_ids``,
  ``attention_mask``, ``labels``, ``prompt_length``, ``response_mask``);
* ``MoECausalLM``: a ``MixtralForCausalLM`` (4 experts, 2 per token, router auxiliary loss);
* ``SpeechSeq2Seq``: ``WhisperForConditionalGeneration`` on ``input_features``,
  ``decoder_input_ids`` and ``labels`` (:class:`SpeechDataModule`);
* ``SpeechCTC``: ``Wav2Vec2ForCTC`` on raw ``input_values`` and ``labels`` padded with -100;
* ``Denoiser``: a diffusers ``UNet2DModel`` trained with a ``DDPMScheduler`` to predict the
  noise, on batches of images ``{"input": images}`` (diffusers' own training script's key);
* ``ContrastiveImageText``: ``CLIPModel`` on ``(input_ids, pixel_values)`` pairs whose captions
  repeat across examples (:class:`CaptionDataModule`);
* ``Detector``: ``DetrForObjectDetection`` with a small transformers ResNet backbone (no timm),
  ``labels`` a list of dicts with ``class_labels`` and ``boxes``;
* ``CompiledClassifier``: a small ``(x, y)`` classifier whose network is compiled with
  ``torch.compile``;
* ``ScheduledLM``: GPT-2 under ``bf16-mixed`` with gradient clipping and a per-step
  ``OneCycleLR`` over ``trainer.estimated_stepping_batches``.

``conformance_helpers.run_pilot_on_loaders`` fits these modules on loaders passed straight to
``trainer.fit(model, train_loader, val_loader)`` (:func:`text_loaders`).

Planted bugs are switched on with constructor arguments; the defaults are the clean modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F  # noqa: N812
from conformance_modules import CausalLM, HFCausalLMSteps
from tiny_models import (
    LoggedLossSteps,
    detr,
    detr_set_loss,
    llama,
    mixtral,
    unet2d,
    wav2vec2_ctc,
    whisper,
)
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

SEQ_LEN = 16
VOCAB = 64
PAD, BOS, EOS = 0, 1, 2
BATCH = 4
#: The tokens that open the response ("### Response:"), never drawn anywhere else.
RESPONSE_TEMPLATE = [VOCAB - 3, VOCAB - 2]
#: Token ids drawn for text: above the special tokens, below the template.
_FIRST_TOKEN, _LAST_TOKEN = 3, VOCAB - 4


class Examples(Dataset[dict[str, Any]]):
    """A list of dict examples, built once."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.items[index]


def _tokens(count: int, generator: torch.Generator) -> Tensor:
    return torch.randint(_FIRST_TOKEN, _LAST_TOKEN + 1, (count,), generator=generator)


def _padded(values: Tensor, length: int, fill: int) -> Tensor:
    out = torch.full((length,), fill, dtype=values.dtype)
    out[: len(values)] = values
    return out


class ZooDataModule(pl.LightningDataModule):
    """Train and validation splits of :meth:`examples`, built in ``setup``; a shuffled
    ``StatefulDataLoader`` for training (it resumes mid-epoch exactly)."""

    collate_fn: Callable[[list[Any]], Any] | None = None

    def __init__(
        self,
        train_size: int = 16,
        val_size: int = 8,
        batch_size: int = BATCH,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def examples(self, size: int, seed: int) -> list[dict[str, Any]]:
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        self.train_set = Examples(self.examples(self.hparams["train_size"], seed=11))
        self.val_set = Examples(self.examples(self.hparams["val_size"], seed=12))

    def train_dataloader(self) -> DataLoader[Any]:
        return StatefulDataLoader(
            self.train_set,
            batch_size=self.hparams["batch_size"],
            shuffle=True,
            collate_fn=self.collate_fn,
        )

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(
            self.val_set, batch_size=self.hparams["batch_size"], collate_fn=self.collate_fn
        )


# ------------------------------------------------------------------------------------------------
# Instruction tuning: prompt, response template, response
# ------------------------------------------------------------------------------------------------


class InstructionDataModule(ZooDataModule):
    """``prompt + RESPONSE_TEMPLATE + response`` sequences, right-padded to ``SEQ_LEN``.

    Each example says where its prompt ends two ways: ``prompt_length`` (the prompt and the
    template) and ``response_mask`` (1 on the response's tokens). ``labels="masked"`` is the
    completion-only convention (-100 on the prompt, the template and the padding; the model
    shifts); ``labels="unmasked"`` (planted) makes the prompt a target too.
    """

    max_length = SEQ_LEN

    def __init__(
        self,
        train_size: int = 16,
        val_size: int = 8,
        batch_size: int = BATCH,
        labels: str = "masked",
    ) -> None:
        super().__init__(train_size, val_size, batch_size)
        if labels not in ("masked", "unmasked"):
            raise ValueError(f"labels={labels!r}: expected 'masked' or 'unmasked'")
        self.save_hyperparameters()

    def examples(self, size: int, seed: int) -> list[dict[str, Any]]:
        generator = torch.Generator().manual_seed(seed)
        items = []
        for index in range(size):
            prompt = _tokens(int(torch.randint(3, 6, (1,), generator=generator)), generator)
            response = _tokens(int(torch.randint(4, 9, (1,), generator=generator)), generator)
            real = torch.cat([prompt, torch.tensor(RESPONSE_TEMPLATE), response])
            prompt_length = len(real) - len(response)
            input_ids = _padded(real, SEQ_LEN, PAD)
            mask = _padded(torch.ones(len(real), dtype=torch.long), SEQ_LEN, 0)
            response_mask = mask.clone()
            response_mask[:prompt_length] = 0
            labels = input_ids.masked_fill(mask == 0, -100)
            if self.hparams["labels"] == "masked":
                labels = labels.masked_fill(response_mask == 0, -100)
            items.append(
                {
                    "ids": torch.tensor(index),
                    "input_ids": input_ids,
                    "attention_mask": mask,
                    "labels": labels,
                    "prompt_length": torch.tensor(prompt_length),
                    "response_mask": response_mask,
                }
            )
        return items


class LoRACausalLM(HFCausalLMSteps):
    """A ``LlamaForCausalLM`` with peft LoRA adapters on its attention projections.

    ``optimize="all"`` is peft's own idiom, ``AdamW(model.parameters())``: the frozen base goes
    to the optimizer too (AdamW skips parameters without gradients); ``optimize="trainable"``
    hands it only the parameters that require gradients.
    """

    def __init__(self, optimize: str = "all", rank: int = 2, lr: float = 1e-2) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model

        if optimize not in ("all", "trainable"):
            raise ValueError(f"optimize={optimize!r}: expected 'all' or 'trainable'")
        self.save_hyperparameters()
        base = llama(
            vocab_size=VOCAB,
            num_key_value_heads=2,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
        )
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"])
        self.model = get_peft_model(base, lora)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = self.model.parameters()
        if self.hparams["optimize"] == "trainable":
            params = (p for p in self.model.parameters() if p.requires_grad)
        return torch.optim.AdamW(params, lr=self.hparams["lr"])


class MoECausalLM(HFCausalLMSteps):
    """``MixtralForCausalLM``: 4 experts, 2 per token, the router's load-balancing loss added
    to the loss by the model (``output_router_logits=True``)."""

    def __init__(self, lr: float = 1e-2, optimizer: str = "adamw") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = mixtral(
            vocab_size=VOCAB,
            head_dim=8,
            output_router_logits=True,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams["optimizer"] == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])


class ScheduledLM(CausalLM):
    """GPT-2 with a per-step ``OneCycleLR`` over ``trainer.estimated_stepping_batches``; the
    Trainer adds ``bf16-mixed`` and ``gradient_clip_val``."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer,
            max_lr=self.hparams["lr"],
            total_steps=int(self.trainer.estimated_stepping_batches),
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


# ------------------------------------------------------------------------------------------------
# Speech: Whisper (seq2seq on log-mel features) and wav2vec2 (CTC on raw audio)
# ------------------------------------------------------------------------------------------------

MEL_BINS, MEL_FRAMES = 8, 16  # Whisper: frames = 2 x max_source_positions
TARGET_LEN = 12


class SpeechDataModule(ZooDataModule):
    """Whisper batches: ``input_features`` ``[8, 16]``, ``decoder_input_ids`` (the start token,
    then the target) and ``labels`` (the target, then EOS, -100 on the padding): each label is
    the next decoder input, as ``shift_tokens_right`` makes them.

    ``labels="shifted_twice"`` (planted): the labels shifted once more by hand, so they run 2
    ahead of the decoder inputs (the model learns to predict 2 tokens ahead).
    """

    def __init__(
        self,
        train_size: int = 16,
        val_size: int = 8,
        batch_size: int = BATCH,
        labels: str = "aligned",
    ) -> None:
        super().__init__(train_size, val_size, batch_size)
        if labels not in ("aligned", "shifted_twice"):
            raise ValueError(f"labels={labels!r}: expected 'aligned' or 'shifted_twice'")
        self.save_hyperparameters()

    def examples(self, size: int, seed: int) -> list[dict[str, Any]]:
        generator = torch.Generator().manual_seed(seed)
        items = []
        for index in range(size):
            length = int(torch.randint(3, TARGET_LEN - 1, (1,), generator=generator))
            labels = _padded(
                torch.cat([_tokens(length, generator), torch.tensor([EOS])]), TARGET_LEN, -100
            )
            # shift_tokens_right(labels, PAD, BOS), as the model does when given labels alone.
            decoder_input_ids = torch.cat([torch.tensor([BOS]), labels[:-1]])
            decoder_input_ids = decoder_input_ids.masked_fill(decoder_input_ids == -100, PAD)
            if self.hparams["labels"] == "shifted_twice":
                labels = torch.cat([labels[1:], torch.tensor([-100])])
            items.append(
                {
                    "ids": torch.tensor(index),
                    "input_features": torch.randn(MEL_BINS, MEL_FRAMES, generator=generator),
                    "decoder_input_ids": decoder_input_ids,
                    "labels": labels,
                }
            )
        return items


class SpeechSeq2Seq(LoggedLossSteps, pl.LightningModule):
    """``WhisperForConditionalGeneration`` given ``decoder_input_ids`` and ``labels``."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = whisper(
            vocab_size=VOCAB,
            num_mel_bins=MEL_BINS,
            max_source_positions=MEL_FRAMES // 2,
            max_target_positions=SEQ_LEN,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
            decoder_start_token_id=BOS,
        )

    def forward(self, input_features: Tensor, decoder_input_ids: Tensor) -> Tensor:
        return self.model(input_features=input_features, decoder_input_ids=decoder_input_ids).logits

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        return self.model(
            input_features=batch["input_features"],
            decoder_input_ids=batch["decoder_input_ids"],
            labels=batch["labels"],
        ).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])


AUDIO_SAMPLES = 400  # 39 frames after wav2vec2's two convolutions (kernel 10 stride 5, 3/2)
CTC_VOCAB, CTC_LABELS = 16, 8


class AudioDataModule(ZooDataModule):
    """wav2vec2 CTC batches: normalised raw audio ``input_values`` ``[400]`` and character
    ``labels`` padded with -100 (what ``DataCollatorCTCWithPadding`` makes)."""

    def examples(self, size: int, seed: int) -> list[dict[str, Any]]:
        generator = torch.Generator().manual_seed(seed)
        items = []
        for index in range(size):
            length = int(torch.randint(3, CTC_LABELS + 1, (1,), generator=generator))
            labels = torch.randint(1, CTC_VOCAB, (length,), generator=generator)
            audio = torch.randn(AUDIO_SAMPLES, generator=generator)
            items.append(
                {
                    "ids": torch.tensor(index),
                    "input_values": (audio - audio.mean()) / audio.std(),
                    "labels": _padded(labels, CTC_LABELS, -100),
                }
            )
        return items


class SpeechCTC(LoggedLossSteps, pl.LightningModule):
    """``Wav2Vec2ForCTC`` (SpecAugment time masking on, as configured by default)."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = wav2vec2_ctc(
            vocab_size=CTC_VOCAB,
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=8,
            pad_token_id=PAD,
        )

    def forward(self, input_values: Tensor) -> Tensor:
        return self.model(input_values=input_values).logits

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        return self.model(input_values=batch["input_values"], labels=batch["labels"]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])


# ------------------------------------------------------------------------------------------------
# Diffusion: a UNet2DModel predicting the noise a DDPMScheduler added
# ------------------------------------------------------------------------------------------------

IMAGE = 8


class ImageDataModule(ZooDataModule):
    """Unlabelled images ``{"input": [3, 8, 8]}`` in ``[-1, 1]``."""

    def examples(self, size: int, seed: int) -> list[dict[str, Any]]:
        generator = torch.Generator().manual_seed(seed)
        images = torch.rand(size, 3, IMAGE, IMAGE, generator=generator) * 2 - 1
        return [{"input": image} for image in images]


class Denoiser(LoggedLossSteps, pl.LightningModule):
    """diffusers' unconditional training recipe: noise, a random timestep, predict the noise.

    ``eval_in_training=True`` (planted) switches the model to eval mode in ``on_train_start``
    (its dropout of 0.1 is then off for the whole fit).
    """

    def __init__(
        self, lr: float = 1e-3, dropout: float = 0.1, eval_in_training: bool = False
    ) -> None:
        super().__init__()
        from diffusers import DDPMScheduler

        self.save_hyperparameters()
        self.model = unet2d(sample_size=IMAGE, dropout=dropout)
        self.scheduler = DDPMScheduler(num_train_timesteps=100)

    def on_train_start(self) -> None:
        if self.hparams["eval_in_training"]:
            self.model.eval()

    def forward(self, noisy: Tensor, timesteps: Tensor) -> Tensor:
        return self.model(noisy, timesteps).sample

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        images = batch["input"]
        noise = torch.randn_like(images)
        steps = self.scheduler.config["num_train_timesteps"]
        timesteps = torch.randint(0, steps, (len(images),), device=images.device)
        noisy = self.scheduler.add_noise(images, noise, timesteps)
        return F.mse_loss(self(noisy, timesteps), noise)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.hparams["lr"])


# ------------------------------------------------------------------------------------------------
# Contrastive image-text: CLIP
# ------------------------------------------------------------------------------------------------

CAPTIONS = 4


class CaptionDataModule(ZooDataModule):
    """``(input_ids, attention_mask, pixel_values)`` pairs: each image is new, its caption one of
    ``CAPTIONS`` shared by every split (a caption describes many images)."""

    def examples(self, size: int, seed: int) -> list[dict[str, Any]]:
        captions = torch.Generator().manual_seed(0)  # the same captions in every split
        pool = []
        for _ in range(CAPTIONS):
            words = _tokens(int(torch.randint(4, 12, (1,), generator=captions)), captions)
            real = torch.cat([torch.tensor([BOS]), words, torch.tensor([EOS])])
            pool.append((_padded(real, SEQ_LEN, PAD), _padded(torch.ones_like(real), SEQ_LEN, 0)))
        generator = torch.Generator().manual_seed(seed)
        items = []
        for index in range(size):
            input_ids, mask = pool[index % CAPTIONS]
            items.append(
                {
                    "ids": torch.tensor(index),
                    "input_ids": input_ids,
                    "attention_mask": mask,
                    "pixel_values": torch.randn(3, 16, 16, generator=generator),
                }
            )
        return items


class ContrastiveImageText(LoggedLossSteps, pl.LightningModule):
    """``CLIPModel`` trained with its symmetric contrastive loss.

    Planted: ``detach_text=True`` computes the text tower under ``torch.no_grad()`` (only the
    projection after it learns); ``freeze_vision=True`` freezes the vision tower with
    ``requires_grad_(False)`` before the fit, while the optimizer still gets every parameter.
    """

    def __init__(
        self, lr: float = 1e-3, detach_text: bool = False, freeze_vision: bool = False
    ) -> None:
        super().__init__()
        from transformers import CLIPConfig, CLIPModel

        self.save_hyperparameters()
        tower = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
        config = CLIPConfig(
            text_config={
                **tower,
                "num_attention_heads": 2,
                "vocab_size": VOCAB,
                "max_position_embeddings": SEQ_LEN,
                "pad_token_id": PAD,
                "bos_token_id": BOS,
                "eos_token_id": EOS,
            },
            vision_config={**tower, "num_attention_heads": 2, "image_size": 16, "patch_size": 8},
            projection_dim=8,
        )
        self.model = CLIPModel(config)
        if freeze_vision:
            self.model.vision_model.requires_grad_(False)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, pixel_values: Tensor) -> Tensor:
        """The image-text similarity logits ``[images, texts]``."""
        return self._logits(input_ids, attention_mask, pixel_values)

    def _logits(self, input_ids: Tensor, attention_mask: Tensor, pixel_values: Tensor) -> Tensor:
        model = self.model
        if not self.hparams["detach_text"]:
            out = model(
                input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values
            )
            logits: Tensor = out.logits_per_image
            return logits
        image = model.visual_projection(model.vision_model(pixel_values=pixel_values).pooler_output)
        with torch.no_grad():
            pooled = model.text_model(
                input_ids=input_ids, attention_mask=attention_mask
            ).pooler_output
        text = model.text_projection(pooled)
        image = image / image.norm(dim=-1, keepdim=True)
        text = text / text.norm(dim=-1, keepdim=True)
        return model.logit_scale.exp() * image @ text.T

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self._logits(batch["input_ids"], batch["attention_mask"], batch["pixel_values"])
        targets = torch.arange(len(logits), device=logits.device)
        return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])


# ------------------------------------------------------------------------------------------------
# Object detection with dict targets: DETR
# ------------------------------------------------------------------------------------------------

DETECTION_IMAGE, DETECTION_CLASSES = 32, 3


def detection_collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """What DETR's image processor and the usual ``collate_fn`` make: stacked pixels and mask,
    ``labels`` a list of one dict per image (its boxes differ in number)."""
    return {
        "ids": torch.stack([item["ids"] for item in items]),
        "pixel_values": torch.stack([item["pixel_values"] for item in items]),
        "pixel_mask": torch.stack([item["pixel_mask"] for item in items]),
        "labels": [item["labels"] for item in items],
    }


class DetectionDataModule(ZooDataModule):
    """Images with 1 to 3 boxes each: ``class_labels`` and ``boxes`` (cx, cy, w, h in [0, 1])."""

    collate_fn = staticmethod(detection_collate)

    def examples(self, size: int, seed: int) -> list[dict[str, Any]]:
        generator = torch.Generator().manual_seed(seed)
        items = []
        for index in range(size):
            count = int(torch.randint(1, 4, (1,), generator=generator))
            centres = torch.rand(count, 2, generator=generator) * 0.5 + 0.25
            sizes = torch.rand(count, 2, generator=generator) * 0.2 + 0.1
            side = DETECTION_IMAGE
            items.append(
                {
                    "ids": torch.tensor(index),
                    "pixel_values": torch.randn(3, side, side, generator=generator),
                    "pixel_mask": torch.ones(side, side, dtype=torch.long),
                    "labels": {
                        "class_labels": torch.randint(
                            0, DETECTION_CLASSES, (count,), generator=generator
                        ),
                        "boxes": torch.cat([centres, sizes], dim=1),
                    },
                }
            )
        return items


class Detector(pl.LightningModule):
    """``DetrForObjectDetection`` with a transformers ResNet backbone built from its config
    (``use_timm_backbone=False``, nothing pretrained); the loss is a DETR set loss matched
    exactly without scipy (``tiny_models.detr_set_loss``)."""

    def __init__(self, lr: float = 1e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        backbone = {
            "embedding_size": 8,
            "hidden_sizes": [8, 16],
            "depths": [1, 1],
            "layer_type": "basic",
            "out_features": ["stage2"],
        }
        self.model = detr(backbone, num_labels=DETECTION_CLASSES, auxiliary_loss=False)

    def forward(self, pixel_values: Tensor, pixel_mask: Tensor | None = None) -> Tensor:
        return self.model(pixel_values=pixel_values, pixel_mask=pixel_mask).logits

    def _loss(self, batch: dict[str, Any]) -> Tensor:
        return detr_set_loss(self.model, batch)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, batch_size=len(batch["labels"]))
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), batch_size=len(batch["labels"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])


# ------------------------------------------------------------------------------------------------
# torch.compile: a small (x, y) classifier compiled whole, as Lightning's docs compile a module
# ------------------------------------------------------------------------------------------------


class VectorDataModule(ZooDataModule):
    """``(x [16], y)`` tuples of 4 classes."""

    def examples(self, size: int, seed: int) -> list[Any]:
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(size, 16, generator=generator)
        y = torch.randint(0, 4, (size,), generator=generator)
        return list(zip(x, y, strict=True))


class CompiledClassifier(pl.LightningModule):
    """A two-layer MLP with dropout on ``(x, y)`` batches, compiled with ``torch.compile``
    (default mode) in ``configure_model``, the hook Lightning's docs compile a model in.

    ``compiled_graphs`` lists each graph dynamo handed to the backend: ``"train"`` when it was
    captured with gradients on (the training step), ``"eval"`` otherwise.
    """

    def __init__(self, hidden: int = 32, lr: float = 1e-2, backend: str = "inductor") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net: nn.Module = nn.Sequential(
            nn.Linear(16, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 4)
        )
        self.compiled_graphs: list[str] = []

    def configure_model(self) -> None:
        if hasattr(self.net, "_orig_mod"):
            return
        from torch._dynamo.backends.registry import lookup_backend

        compile_graph = lookup_backend(self.hparams["backend"])

        def backend(graph: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Any:
            self.compiled_graphs.append("train" if torch.is_grad_enabled() else "eval")
            return compile_graph(graph, example_inputs)

        self.net = torch.compile(self.net, backend=backend)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])


# ------------------------------------------------------------------------------------------------
# Loaders passed straight to fit
# ------------------------------------------------------------------------------------------------


def text_loaders(loader: str = "stateful") -> tuple[DataLoader[Any], DataLoader[Any]]:
    """Training and validation loaders of the grouped text classification data, for
    ``trainer.fit(model, train_loader, val_loader)``; ``loader="plain"`` (planted) trains on a
    plain shuffled ``DataLoader``."""
    from conformance_modules import GroupedTextDataset

    train = GroupedTextDataset(list(range(4)), 4, label_values=3)
    val = GroupedTextDataset([4, 5], 4, label_values=3)
    cls = DataLoader if loader == "plain" else StatefulDataLoader
    return cls(train, batch_size=BATCH, shuffle=True), DataLoader(val, batch_size=BATCH)
