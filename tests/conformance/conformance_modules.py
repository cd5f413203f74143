"""Real modules the pilot must handle on their first run: Hugging Face, Lightning demos, GANs.

Every class lives at module level, so ResumeVerifier's new process imports it by its path
(``conformance_modules:<Class>``: pytest puts this folder on ``sys.path`` and the verifier hands
``sys.path`` to the child as ``PYTHONPATH``) and rebuilds it from the hyperparameters saved with
``save_hyperparameters()`` (plain ints, floats, strings and bools: the checkpoint loads with
``weights_only=True``).

All tiny, CPU, no downloads: a few thousand parameters, sequences of 16, batches of 4. Every
dataset draws its content from its own seeded ``torch.Generator`` at construction, so a new
process builds the same examples.

Planted bugs are switched on with constructor arguments (``labels=``, ``leak=``,
``freeze_head=``, ...); the defaults are the clean modules.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F  # noqa: N812
from lightning.pytorch.demos import Transformer
from tiny_models import LoggedLossSteps, bert_config, t5
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import (
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    ResNetConfig,
    ResNetForImageClassification,
)

SEQ_LEN = 16
VOCAB = 64
PAD = 0
BATCH = 4
LABEL_MODES = ("masked", "unmasked", "ignored", "shifted")


def _train_loader(dataset: Dataset[Any], batch_size: int, stateful: bool = True) -> DataLoader[Any]:
    """A shuffled training loader: torchdata's StatefulDataLoader resumes mid-epoch exactly."""
    if stateful:
        return StatefulDataLoader(dataset, batch_size=batch_size, shuffle=True)
    return DataLoader(dataset, batch_size=batch_size, shuffle=True)


# ------------------------------------------------------------------------------------------------
# a. Hugging Face causal LM (GPT-2) on prompt/response sequences
# ------------------------------------------------------------------------------------------------


class PromptResponseDataset(Dataset[dict[str, Tensor]]):
    """Prompt + response token sequences, right-padded to ``SEQ_LEN``, with HF-style labels.

    ``labels`` modes: ``masked`` (the HF convention: labels = input_ids with -100 on the prompt
    and the padding; the model shifts internally), ``unmasked`` (planted: the prompt is a
    target too), ``ignored`` (planted: -100 everywhere), ``shifted`` (planted: the response
    labels shifted left by hand, then shifted again inside GPT2LMHeadModel).
    """

    def __init__(self, size: int, *, seed: int, labels: str = "masked") -> None:
        if labels not in LABEL_MODES:
            raise ValueError(f"labels={labels!r}: expected one of {LABEL_MODES}")
        generator = torch.Generator().manual_seed(seed)
        self.items: list[dict[str, Tensor]] = []
        for index in range(size):
            prompt = int(torch.randint(3, 6, (1,), generator=generator))
            response = int(torch.randint(4, 9, (1,), generator=generator))
            length = prompt + response  # at most 13 < SEQ_LEN: nothing truncated
            input_ids = torch.full((SEQ_LEN,), PAD, dtype=torch.long)
            input_ids[:length] = torch.randint(1, VOCAB, (length,), generator=generator)
            mask = torch.zeros(SEQ_LEN, dtype=torch.long)
            mask[:length] = 1
            target = torch.full((SEQ_LEN,), -100, dtype=torch.long)
            if labels == "masked":
                target[prompt:length] = input_ids[prompt:length]
            elif labels == "unmasked":
                target[:length] = input_ids[:length]
            elif labels == "shifted":
                # Labels aligned by hand for a model that does not shift (label t = token t+1).
                target[prompt - 1 : length - 1] = input_ids[prompt:length]
            self.items.append(
                {
                    "ids": torch.tensor(index),
                    "input_ids": input_ids,
                    "attention_mask": mask,
                    "labels": target,
                }
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return self.items[index]


class PromptResponseDataModule(pl.LightningDataModule):
    """Train and validation prompt/response splits (``loader="plain"``: a plain DataLoader)."""

    max_length = SEQ_LEN

    def __init__(
        self,
        train_size: int = 16,
        val_size: int = 8,
        batch_size: int = BATCH,
        labels: str = "masked",
        loader: str = "stateful",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        labels = self.hparams["labels"]
        if stage == "fit":
            self.train_set = PromptResponseDataset(
                self.hparams["train_size"], seed=1, labels=labels
            )
        if stage in ("fit", "validate"):
            self.val_set = PromptResponseDataset(self.hparams["val_size"], seed=2, labels=labels)

    def train_dataloader(self) -> DataLoader[Any]:
        return _train_loader(
            self.train_set, self.hparams["batch_size"], self.hparams["loader"] == "stateful"
        )

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_set, batch_size=self.hparams["batch_size"])


class HFCausalLMSteps(LoggedLossSteps, pl.LightningModule):
    """The steps of a Hugging Face causal LM in ``self.model``: its own loss (``labels=``, the
    model shifts), logged as ``train_loss`` and ``val_loss``."""

    model: nn.Module

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        out = self.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=batch["labels"],
        )
        return out.loss


class CausalLM(HFCausalLMSteps):
    """``GPT2LMHeadModel`` fine-tuned the Hugging Face way: the loss comes from the model."""

    def __init__(
        self,
        n_layer: int = 1,
        n_head: int = 2,
        n_embd: int = 16,
        vocab_size: int = VOCAB,
        n_positions: int = 32,
        lr: float = 1e-2,
        optimizer: str = "adamw",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = GPT2Config(
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            vocab_size=vocab_size,
            n_positions=n_positions,
            bos_token_id=vocab_size - 1,
            eos_token_id=vocab_size - 1,
            pad_token_id=PAD,
        )
        self.model = GPT2LMHeadModel(config)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams["optimizer"] == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])


# ------------------------------------------------------------------------------------------------
# b. / h. Hugging Face encoder classifier on a DataModule that splits by group, per stage
# ------------------------------------------------------------------------------------------------


class GroupedTextDataset(Dataset[dict[str, Tensor]]):
    """Token sequences with one class each and a ``group`` (say, the document they come from)."""

    def __init__(self, groups: list[int], per_group: int, *, label_values: int) -> None:
        self.items: list[dict[str, Tensor]] = []
        for group in groups:
            generator = torch.Generator().manual_seed(1000 + group)
            for member in range(per_group):
                index = group * per_group + member
                length = int(torch.randint(8, SEQ_LEN - 2, (1,), generator=generator))
                input_ids = torch.full((SEQ_LEN,), PAD, dtype=torch.long)
                input_ids[:length] = torch.randint(1, VOCAB, (length,), generator=generator)
                mask = torch.zeros(SEQ_LEN, dtype=torch.long)
                mask[:length] = 1
                self.items.append(
                    {
                        "ids": torch.tensor(index),
                        "group": torch.tensor(group),
                        "input_ids": input_ids,
                        "attention_mask": mask,
                        "labels": torch.tensor(index % label_values),
                    }
                )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return self.items[index]


def example_group(item: dict[str, Tensor]) -> int:
    """BatchInspector's ``group_fn``: the group an example belongs to."""
    return int(item["group"])


class GroupedTextDataModule(pl.LightningDataModule):
    """Builds its splits per stage: ``fit`` train + val, ``test`` test (only in setup("test")).

    Groups ``0..train_groups-1`` train, the next ``val_groups`` validate, the next two test.
    ``leak=True`` (planted) also puts the first example of every training group in validation.
    ``label_values`` above the model's ``num_labels`` plants labels outside its head.
    """

    def __init__(
        self,
        train_groups: int = 4,
        val_groups: int = 2,
        per_group: int = 4,
        batch_size: int = BATCH,
        label_values: int = 3,
        leak: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def _split(self, first: int, count: int) -> GroupedTextDataset:
        return GroupedTextDataset(
            list(range(first, first + count)),
            self.hparams["per_group"],
            label_values=self.hparams["label_values"],
        )

    def setup(self, stage: str) -> None:
        train_groups, val_groups = self.hparams["train_groups"], self.hparams["val_groups"]
        if stage == "fit":
            self.train_set = self._split(0, train_groups)
        if stage in ("fit", "validate"):
            self.val_set = self._split(train_groups, val_groups)
            if self.hparams["leak"]:
                train = self._split(0, train_groups)
                per_group = self.hparams["per_group"]
                self.val_set.items += [train.items[g * per_group] for g in range(train_groups)]
        if stage == "test":
            self.test_set = self._split(train_groups + val_groups, 2)

    def train_dataloader(self) -> DataLoader[Any]:
        return _train_loader(self.train_set, self.hparams["batch_size"])

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_set, batch_size=self.hparams["batch_size"])

    def test_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.test_set, batch_size=self.hparams["batch_size"])


def _bert_config(num_labels: int) -> Any:
    return bert_config(vocab_size=VOCAB, num_labels=num_labels)


class EncoderClassifier(LoggedLossSteps, pl.LightningModule):
    """``BertForSequenceClassification`` on dict batches with one label per example.

    ``detach_head=True`` (planted) feeds the classifier a detached pooled output: the encoder
    never receives a gradient.
    """

    def __init__(self, num_labels: int = 3, lr: float = 1e-2, detach_head: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = BertForSequenceClassification(_bert_config(num_labels))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        if self.hparams["detach_head"]:
            pooled = self.model.bert(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).pooler_output
            logits = self.model.classifier(self.model.dropout(pooled.detach()))
            return F.cross_entropy(logits, batch["labels"])
        out = self.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=batch["labels"],
        )
        return out.loss

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])


# ------------------------------------------------------------------------------------------------
# c. Hugging Face vision model, torchvision style: (x, y) batches, forward(x)
# ------------------------------------------------------------------------------------------------


class RandomImages(Dataset[tuple[Tensor, Tensor]]):
    """``(image [3, 16, 16], class)`` pairs."""

    def __init__(self, size: int, *, seed: int, num_classes: int = 10) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.randn(size, 3, 16, 16, generator=generator)
        self.labels = torch.randint(0, num_classes, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.images[index], self.labels[index]


class ImageClassifier(pl.LightningModule):
    """``ResNetForImageClassification`` with the data in the module (its own dataloaders).

    Planted: ``freeze_head=True`` freezes the classifier but still hands it to the optimizer
    (``self.parameters()``); ``validate_in_train_mode=True`` switches the model back to train
    mode inside ``validation_step`` (its BatchNorm layers then use and update batch statistics).
    """

    def __init__(
        self,
        num_labels: int = 10,
        lr: float = 1e-2,
        train_size: int = 16,
        val_size: int = 8,
        batch_size: int = BATCH,
        freeze_head: bool = False,
        validate_in_train_mode: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = ResNetConfig(
            num_channels=3,
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            layer_type="basic",
            num_labels=num_labels,
        )
        self.model = ResNetForImageClassification(config)
        if freeze_head:
            self.model.classifier.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(pixel_values=x).logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        if self.hparams["validate_in_train_mode"]:
            self.model.train()
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])

    def train_dataloader(self) -> DataLoader[Any]:
        return _train_loader(
            RandomImages(self.hparams["train_size"], seed=3), self.hparams["batch_size"]
        )

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(
            RandomImages(self.hparams["val_size"], seed=4), batch_size=self.hparams["batch_size"]
        )


# ------------------------------------------------------------------------------------------------
# d. Lightning's demo Transformer on random tokens (not WikiText2: it downloads)
# ------------------------------------------------------------------------------------------------


class RandomTokenPairs(Dataset[tuple[Tensor, Tensor]]):
    """``(inputs, target)`` next-token pairs of length ``SEQ_LEN``, as the demo's WikiText2."""

    def __init__(self, size: int, *, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (size, SEQ_LEN + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.tokens[index, :-1], self.tokens[index, 1:]


class DemoTransformerLM(pl.LightningModule):
    """``lightning.pytorch.demos.Transformer``, trained as ``LightningTransformer`` trains it."""

    def __init__(
        self,
        vocab_size: int = VOCAB,
        ninp: int = 16,
        nhead: int = 2,
        nhid: int = 32,
        nlayers: int = 1,
        lr: float = 0.1,
        train_size: int = 16,
        val_size: int = 8,
        batch_size: int = BATCH,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = Transformer(
            vocab_size=vocab_size, ninp=ninp, nhead=nhead, nhid=nhid, nlayers=nlayers
        )

    def forward(self, inputs: Tensor, target: Tensor) -> Tensor:
        return self.model(inputs, target)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, target = batch
        loss = F.nll_loss(self(inputs, target), target.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        inputs, target = batch
        self.log("val_loss", F.nll_loss(self(inputs, target), target.reshape(-1)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=self.hparams["lr"])

    def train_dataloader(self) -> DataLoader[Any]:
        return _train_loader(
            RandomTokenPairs(self.hparams["train_size"], seed=5), self.hparams["batch_size"]
        )

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(
            RandomTokenPairs(self.hparams["val_size"], seed=6),
            batch_size=self.hparams["batch_size"],
        )


# ------------------------------------------------------------------------------------------------
# f. Manual optimisation with two optimizers: a tiny GAN
# ------------------------------------------------------------------------------------------------


class RealVectors(Dataset[dict[str, Tensor]]):
    """Samples of the "real" distribution the GAN learns, with ids."""

    def __init__(self, size: int, *, seed: int, dim: int = 8) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, dim, generator=generator) * 0.5 + 1.0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"ids": torch.tensor(index), "x": self.x[index]}


class TinyGAN(pl.LightningModule):
    """The Lightning manual-optimisation GAN recipe: toggle, zero_grad, manual_backward, step."""

    def __init__(
        self,
        latent: int = 4,
        dim: int = 8,
        hidden: int = 16,
        lr: float = 1e-2,
        train_size: int = 16,
        val_size: int = 8,
        batch_size: int = BATCH,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(latent, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        self.discriminator = nn.Sequential(
            nn.Linear(dim, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, 1)
        )

    def forward(self, z: Tensor) -> Tensor:
        return self.generator(z)

    def _z(self, size: int) -> Tensor:
        return torch.randn(size, self.hparams["latent"], device=self.device)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        opt_g, opt_d = self.optimizers()
        real = batch["x"]
        ones = torch.ones(len(real), 1, device=self.device)

        self.toggle_optimizer(opt_d)
        fake = self.generator(self._z(len(real))).detach()
        d_loss = F.binary_cross_entropy_with_logits(
            self.discriminator(real), ones
        ) + F.binary_cross_entropy_with_logits(self.discriminator(fake), torch.zeros_like(ones))
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(
            self.discriminator(self.generator(self._z(len(real)))), ones
        )
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})
        return (d_loss + g_loss).detach()

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        real = batch["x"]
        fake = self(self._z(len(real)))
        self.log("val_score", self.discriminator(real).mean() - self.discriminator(fake).mean())

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        lr = self.hparams["lr"]
        return [
            torch.optim.Adam(self.generator.parameters(), lr=lr),
            torch.optim.Adam(self.discriminator.parameters(), lr=lr),
        ]

    def train_dataloader(self) -> DataLoader[Any]:
        return _train_loader(
            RealVectors(self.hparams["train_size"], seed=7), self.hparams["batch_size"]
        )

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(
            RealVectors(self.hparams["val_size"], seed=8), batch_size=self.hparams["batch_size"]
        )


# ------------------------------------------------------------------------------------------------
# g. A frozen base with a LoRA-style adapter: only the adapter is optimized
# ------------------------------------------------------------------------------------------------


class LoRAClassifier(LoggedLossSteps, pl.LightningModule):
    """A frozen ``BertForSequenceClassification`` plus a rank-2 adapter on its classifier.

    As LoRA does: the adapter's down-projection is random and its up-projection starts at zero,
    so the model starts as the base; only the adapter is in the optimizer.
    """

    def __init__(self, num_labels: int = 3, rank: int = 2, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.base = BertForSequenceClassification(_bert_config(num_labels))
        self.base.requires_grad_(False)
        hidden = self.base.config.hidden_size
        self.lora_a = nn.Linear(hidden, rank, bias=False)
        self.lora_b = nn.Linear(rank, num_labels, bias=False)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        pooled = self.base.bert(input_ids=input_ids, attention_mask=attention_mask).pooler_output
        pooled = self.base.dropout(pooled)
        return self.base.classifier(pooled) + self.lora_b(self.lora_a(pooled))

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        return F.cross_entropy(self(batch["input_ids"], batch["attention_mask"]), batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        adapter = [*self.lora_a.parameters(), *self.lora_b.parameters()]
        return torch.optim.AdamW(adapter, lr=self.hparams["lr"])


# ------------------------------------------------------------------------------------------------
# i. Hugging Face encoder-decoder (T5): labels are decoder targets, padded like the inputs
# ------------------------------------------------------------------------------------------------


class TranslationPairs(Dataset[dict[str, Tensor]]):
    """Source and target token sequences of their own lengths, both padded to ``SEQ_LEN`` (the
    ``padding="max_length"`` pattern): labels hold -100 past the target, not past the source."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(size):
            source_len = int(torch.randint(4, SEQ_LEN, (1,), generator=generator))
            target_len = int(torch.randint(3, SEQ_LEN, (1,), generator=generator))
            source = torch.randint(2, VOCAB, (source_len,), generator=generator)
            target = torch.randint(2, VOCAB, (target_len,), generator=generator)
            input_ids = torch.full((SEQ_LEN,), PAD, dtype=torch.long)
            attention_mask = torch.zeros(SEQ_LEN, dtype=torch.long)
            labels = torch.full((SEQ_LEN,), -100, dtype=torch.long)
            input_ids[: len(source)] = source
            attention_mask[: len(source)] = 1
            labels[: len(target)] = target
            self.items.append(
                {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return self.items[index]


class TranslationDataModule(pl.LightningDataModule):
    def __init__(self, batch_size: int = BATCH) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        self.train = TranslationPairs(32, seed=5)
        self.val = TranslationPairs(8, seed=6)

    def train_dataloader(self) -> DataLoader[Any]:
        return _train_loader(self.train, self.hparams["batch_size"])

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val, batch_size=self.hparams["batch_size"])


class Seq2SeqLM(pl.LightningModule):
    """``T5ForConditionalGeneration`` trained the Hugging Face way (the model shifts the labels
    into decoder inputs and computes the loss)."""

    def __init__(self, d_model: int = 16, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = t5(
            d_model=d_model, vocab_size=VOCAB, decoder_start_token_id=PAD, pad_token_id=PAD
        )

    def forward(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor) -> Any:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self(**batch).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
