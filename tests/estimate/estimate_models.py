"""Tiny real models for the estimate tests and benchmarks (built from configs, nothing downloaded).

This folder is on ``sys.path`` while the tests run (pytest's default import mode)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn


class HFCausalLM(LightningModule):
    """A transformers causal LM (GPT-2 or Llama from a tiny config) in a LightningModule."""

    def __init__(self, kind: str = "gpt2") -> None:
        super().__init__()
        import transformers

        if kind == "gpt2":
            config = transformers.GPT2Config(
                vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=2
            )
            self.model = transformers.GPT2LMHeadModel(config)
        else:
            config = transformers.LlamaConfig(
                vocab_size=96,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
            )
            self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class HFClassifier(LightningModule):
    """A tiny BertForSequenceClassification."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.BertConfig(
            vocab_size=96,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            num_labels=3,
        )
        self.model = transformers.BertForSequenceClassification(config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class ConvNet(LightningModule):
    """A small convolutional image classifier (batch: images, labels)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(32, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).flatten(1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        images, labels = batch
        return {"loss": nn.functional.cross_entropy(self(images), labels)}

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        images, labels = batch
        return nn.functional.cross_entropy(self(images), labels)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def token_batch(
    vocab: int = 96, rows: int = 4, length: int = 16, labels: bool = True
) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, length), generator=generator)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if labels:
        batch["labels"] = ids.clone()
    return batch


def class_batch(rows: int = 4, length: int = 16) -> dict[str, torch.Tensor]:
    batch = token_batch(rows=rows, length=length, labels=False)
    batch["labels"] = torch.arange(rows) % 3
    return batch


def image_batch(rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, 3, 16, 16, generator=generator), torch.arange(rows) % 10


def transformer_module() -> LightningModule:
    from lightning.pytorch.demos import LightningTransformer, Transformer

    module = LightningTransformer(vocab_size=64)
    module.model = Transformer(vocab_size=64, ninp=32, nhead=2, nhid=64, nlayers=1, dropout=0.0)
    return module


def transformer_batch(rows: int = 4, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, 64, (rows, length), generator=generator)
    return inputs, torch.roll(inputs, -1, dims=1)


class HFEncoder(LightningModule):
    """A tiny BertForSequenceClassification with eager attention (softmax and dropout on the
    T x T probabilities, as Hugging Face's ``attn_implementation="eager"``) and dropout 0.1."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        import transformers

        config = transformers.BertConfig(
            vocab_size=96,
            hidden_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
            num_labels=3,
            attn_implementation="eager",
        )
        self.model = transformers.BertForSequenceClassification(config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class HFMixtral(LightningModule):
    """A tiny ``MixtralForCausalLM`` (4 experts, top-2): the default grouped experts
    (``torch._grouped_mm``) or ``experts="eager"`` (a loop over the experts each token picked,
    gathered with ``nonzero``)."""

    def __init__(self, experts: str | None = None) -> None:
        super().__init__()
        import transformers

        config = transformers.MixtralConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
        )
        if experts is not None:
            config._experts_implementation = experts
        self.model = transformers.MixtralForCausalLM(config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
