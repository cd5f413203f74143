"""Pieces the test files share: the logged-loss steps, a seeded dataset with ids, tiny configs.

Importable from every test file: ``tests/conftest.py`` makes pytest put ``tests/`` on
``sys.path`` (prepend import mode), and ResumeVerifier hands ``sys.path`` to its new process as
``PYTHONPATH``, so a class defined here is rebuilt there by its path (``tiny_models:<Class>``).

The config builders hold the sizes every tiny model shares (hidden sizes 16 to 32, one layer,
two heads); each caller passes what is its own (vocabulary, special tokens, input shapes).
Nothing is downloaded.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset


class LoggedLossSteps:
    """``training_step`` and ``validation_step`` of a module whose ``_loss(batch)`` is its loss:
    logged as ``train_loss`` and ``val_loss``. Put it before ``pl.LightningModule`` in the
    bases."""

    def _loss(self, batch: Any) -> Tensor:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)  # type: ignore[attr-defined]
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))  # type: ignore[attr-defined]


class IdExamples(Dataset[dict[str, Any]]):
    """``{"ids", "inputs" [8], "labels"}`` examples fixed by seed 0: the label says whether the
    inputs sum above 0."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 8, generator=generator)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"ids": index, "inputs": self.x[index], "labels": self.y[index]}


#: The sizes of a one-layer, two-head transformer stack: hidden 16, feed-forward 32.
STACK = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


def bert_config(**config: Any) -> Any:
    """A ``BertConfig`` of :data:`STACK` sizes, 32 positions, and ``config``."""
    from transformers import BertConfig

    return BertConfig(**STACK, max_position_embeddings=32, **config)


def llama(**config: Any) -> Any:
    """``LlamaForCausalLM`` of :data:`STACK` sizes, 32 positions, and ``config``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**STACK, max_position_embeddings=32, **config))


def mixtral(**config: Any) -> Any:
    """``MixtralForCausalLM`` of :data:`STACK` sizes, 32 positions, 4 experts (2 per token), one
    key-value head, and ``config``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            **STACK,
            max_position_embeddings=32,
            num_key_value_heads=1,
            num_local_experts=4,
            num_experts_per_tok=2,
            **config,
        )
    )


def t5(**config: Any) -> Any:
    """``T5ForConditionalGeneration``: d_model 16 (unless ``config`` says), feed-forward 32,
    one layer each side, two heads of 8, and ``config``."""
    from transformers import T5Config, T5ForConditionalGeneration

    sizes = {"d_model": 16, "d_ff": 32, "d_kv": 8, "num_layers": 1, "num_decoder_layers": 1}
    return T5ForConditionalGeneration(T5Config(**{**sizes, "num_heads": 2, **config}))


def unet2d(sample_size: int, **config: Any) -> Any:
    """diffusers' ``UNet2DModel`` on 3-channel ``sample_size`` images: two plain blocks of 8
    and 16 channels, one layer each, groups of 4, and ``config``."""
    from diffusers import UNet2DModel

    return UNet2DModel(
        sample_size=sample_size,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
        **config,
    )


#: The sizes of a one-layer, two-head encoder-decoder (Whisper, DETR): d_model 16, FFN 32.
ENCODER_DECODER = {
    "d_model": 16,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 32,
    "decoder_ffn_dim": 32,
}


def whisper(**config: Any) -> Any:
    """``WhisperForConditionalGeneration`` of :data:`ENCODER_DECODER` sizes and ``config``."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    return WhisperForConditionalGeneration(WhisperConfig(**ENCODER_DECODER, **config))


def wav2vec2_ctc(**config: Any) -> Any:
    """``Wav2Vec2ForCTC`` of :data:`STACK` sizes, two 8-channel convolutions (their
    strides and kernels from ``config``), mean CTC loss."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    return Wav2Vec2ForCTC(
        Wav2Vec2Config(
            **STACK,
            conv_dim=(8, 8),
            num_conv_pos_embedding_groups=2,
            ctc_loss_reduction="mean",
            **config,
        )
    )


def detr_set_loss(model: Any, batch: dict[str, Any]) -> Tensor:
    """DETR's set loss for ``batch`` (``pixel_values``, ``pixel_mask``, ``labels`` a list of
    dicts with ``class_labels`` and ``boxes``), matched exactly by trying every assignment of an
    image's targets to the queries (5 queries: at most 60 assignments). transformers' own loss
    matches with scipy's ``linear_sum_assignment``; scipy is left out of the test environment
    because torchmetrics imports ``scipy.signal`` with Lightning when it is installed, which
    costs every Lightning process of the suite about 3.5 s. The loss: cross-entropy over every
    query (unmatched ones target the no-object class) plus the L1 distance of the matched boxes.
    """
    out = model(pixel_values=batch["pixel_values"], pixel_mask=batch["pixel_mask"])
    logits, boxes = out.logits, out.pred_boxes  # [B, Q, classes + 1], [B, Q, 4]
    no_object = logits.shape[-1] - 1
    total = logits.new_zeros(())
    for image, target in enumerate(batch["labels"]):
        classes, wanted = target["class_labels"], target["boxes"]
        probs = logits[image].softmax(-1).detach()
        cost = -probs[:, classes] + torch.cdist(boxes[image].detach(), wanted, p=1)  # [Q, n]
        queries = range(logits.shape[1])
        best = min(
            itertools.permutations(queries, len(classes)),
            key=lambda chosen: float(sum(cost[q, t] for t, q in enumerate(chosen))),
        )
        matched = torch.tensor(best, dtype=torch.long)
        target_classes = torch.full((logits.shape[1],), no_object, dtype=torch.long)
        target_classes[matched] = classes
        total = total + torch.nn.functional.cross_entropy(logits[image], target_classes)
        total = total + (boxes[image][matched] - wanted).abs().sum(-1).mean()
    return total / len(batch["labels"])


def detr(backbone: dict[str, Any], **config: Any) -> Any:
    """``DetrForObjectDetection`` of :data:`ENCODER_DECODER` sizes, 5 queries, on a
    transformers ResNet ``backbone`` built from its config (no timm, nothing pretrained)."""
    from transformers import DetrConfig, DetrForObjectDetection, ResNetConfig

    return DetrForObjectDetection(
        DetrConfig(
            use_timm_backbone=False,
            use_pretrained_backbone=False,
            backbone_config=ResNetConfig(**backbone),
            num_queries=5,
            **ENCODER_DECODER,
            **config,
        )
    )
