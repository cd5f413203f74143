"""Hugging Face encoder tasks through the pilot, from small configs: a masked LM trained on
``DataCollatorForLanguageModeling``-style batches, token classification (NER-style labels) and
multiple choice. A correct loop fails no check; one planted bug per task fails the check that
names it (docs/data-and-overfit.md)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from tiny_models import bert_config
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_pilot import pilot_callbacks, read_phase_table
from lightning_pilot.callbacks.batch_inspector import BatchInspector
from lightning_pilot.callbacks.overfit_tiny_subset import OverfitTinySubset

transformers = pytest.importorskip("transformers")

VOCAB, WIDTH, PAD, CLS, SEP, MASK, LABELS, CHOICES = 64, 16, 0, 1, 2, 3, 5, 4
Items = list[dict[str, Tensor]]


def _sentence(gen: torch.Generator) -> tuple[Tensor, Tensor, int]:
    """``[CLS] words [SEP]`` padded to WIDTH, its attention mask and real length."""
    length = int(torch.randint(8, WIDTH, (1,), generator=gen))
    ids = torch.full((WIDTH,), PAD)
    ids[0], ids[length - 1] = CLS, SEP
    ids[1 : length - 1] = torch.randint(5, VOCAB, (length - 2,), generator=gen)
    return ids, (torch.arange(WIDTH) < length).long(), length


def mlm_items(count: int, seed: int, bug: bool = False) -> Items:
    """15% of word positions masked: labels the original ids there, -100 elsewhere, input_ids
    the mask token (``bug``: labels = input_ids on every real token)."""
    gen, items = torch.Generator().manual_seed(seed), []
    for i in range(count):
        ids, mask, length = _sentence(gen)
        words = torch.arange(1, length - 1)
        chosen = words[torch.rand(len(words), generator=gen) < 0.15]
        chosen = chosen if len(chosen) else words[:1]
        labels = torch.full((WIDTH,), -100)
        labels[chosen] = ids[chosen]
        ids[chosen] = MASK
        if bug:
            labels = torch.where(mask.bool(), ids, -100)
        items.append({"input_ids": ids, "attention_mask": mask, "labels": labels, "id": i})
    return items


def ner_items(count: int, seed: int, bug: bool = False) -> Items:
    """A label on each word's first sub-token, -100 on continuations and special tokens
    (``bug``: the labels shifted left by one position)."""
    gen, items = torch.Generator().manual_seed(seed), []
    for i in range(count):
        ids, mask, length = _sentence(gen)
        labels = torch.full((WIDTH,), -100)
        for t in range(1, length - 1):
            if t == 1 or float(torch.rand(1, generator=gen)) > 0.3:  # else a continuation
                labels[t] = int(ids[t]) % LABELS
        if bug:
            labels = torch.cat([labels[1:], torch.tensor([-100])])
        items.append({"input_ids": ids, "attention_mask": mask, "labels": labels, "id": i})
    return items


def choice_items(count: int, seed: int, bug: bool = False) -> Items:
    """CHOICES sequences per example, the right one marked; ``bug``: labels 1-based."""
    gen, items = torch.Generator().manual_seed(seed), []
    for i in range(count):
        ids = torch.randint(5, VOCAB, (CHOICES, WIDTH), generator=gen)
        ids[:, 0], ids[:, -1] = CLS, SEP
        label = i % CHOICES
        ids[label, 1] = 4
        items.append(
            {
                "input_ids": ids,
                "attention_mask": torch.ones(CHOICES, WIDTH, dtype=torch.long),
                "labels": torch.tensor(label + int(bug)),
                "id": torch.tensor(i),
            }
        )
    return items


TASKS: dict[str, tuple[Callable[[], Any], Callable[..., Items]]] = {
    "masked_lm": (lambda: transformers.BertForMaskedLM(bert_config(vocab_size=VOCAB)), mlm_items),
    "token_classification": (
        lambda: transformers.BertForTokenClassification(
            bert_config(vocab_size=VOCAB, num_labels=LABELS)
        ),
        ner_items,
    ),
    "multiple_choice": (
        lambda: transformers.BertForMultipleChoice(bert_config(vocab_size=VOCAB)),
        choice_items,
    ),
}


class ItemList(Dataset[dict[str, Tensor]]):
    def __init__(self, items: Items) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return self.items[index]


class EncoderData(pl.LightningDataModule):
    def __init__(self, make: Callable[..., Items], bug: bool) -> None:
        super().__init__()
        self.make, self.bug = make, bug

    def setup(self, stage: str) -> None:
        self.train = ItemList(self.make(32, 1, self.bug))
        self.val = ItemList(self.make(8, 2, self.bug))

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train, batch_size=8, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val, batch_size=8)


class EncoderTask(pl.LightningModule):
    """The usual wrapper: the model's own loss, in training and validation."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        loss: Tensor = self.model(**{k: v for k, v in batch.items() if k != "id"}).loss
        return loss

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def _fit(
    task: str, callbacks: list[Any], tmp_path: Path, bug: bool = False, **trainer: Any
) -> None:
    pl.seed_everything(0)
    build, make = TASKS[task]
    options = {"max_steps": 4, "val_check_interval": 2} | trainer
    fit = pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=callbacks, **options,
    )  # fmt: skip
    fit.fit(EncoderTask(build()), datamodule=EncoderData(make, bug))


@pytest.mark.parametrize("task", list(TASKS))
def test_a_correct_encoder_loop_fails_no_check(task: str, tmp_path: Path) -> None:
    callbacks = pilot_callbacks(tmp_path / "pilot", resume=False)
    _fit(task, callbacks, tmp_path)
    table = read_phase_table(tmp_path / "pilot")
    assert "fail" not in set(table["verdict"]), table[["phase", "verdict", "reason"]]
    inspector = next(c for c in callbacks if isinstance(c, BatchInspector))
    head = {
        "masked_lm": "masked_lm_labels",
        "token_classification": "token_labels",
        "multiple_choice": "choice_labels",
    }[task]
    assert inspector.checks[head].verdict == "pass", inspector.checks[head]


def test_masked_lm_given_its_inputs_as_labels_fails(tmp_path: Path) -> None:
    inspector = BatchInspector()
    _fit("masked_lm", [inspector], tmp_path, bug=True)
    check = inspector.checks["masked_lm_labels"]
    assert check.verdict == "fail"
    assert "BertForMaskedLM at 'model' was given labels equal to its input_ids" in check.detail
    assert "the label equals the input token at" in check.detail
    assert "(100%;" in check.detail
    for name in ("train/label_shift", "train/instruction_masked"):  # not a shift, not a prompt
        assert inspector.checks[name].verdict == "not_checked", inspector.checks[name]
        assert inspector.checks[name].detail == (
            "BertForMaskedLM at 'model' (masked_lm_labels) predicts each position's own label"
            " (no prompt, no shift): its labels are checked there"
        )


def test_token_labels_shifted_by_one_position_fail(tmp_path: Path) -> None:
    inspector = BatchInspector()
    _fit("token_classification", [inspector], tmp_path, bug=True)
    check = inspector.checks["token_labels"]
    assert check.verdict == "fail"
    assert check.detail.startswith("special tokens are in the loss: the first real token (id 1")


def test_choice_labels_out_of_range_fail_before_the_index_error(tmp_path: Path) -> None:
    inspector = BatchInspector()
    with pytest.raises(IndexError):
        _fit("multiple_choice", [inspector], tmp_path, bug=True)
    check = inspector.checks["choice_labels"]
    assert check.verdict == "fail"
    assert "outside [0, 3]" in check.detail
    assert "values 4" in check.detail
    assert "1-based?" in check.detail
    # The one-logit classifier is not mistaken for a regression head.
    label_range = inspector.checks["val/label_range"]
    assert "regression" not in label_range.detail
    assert "scores each choice with one logit" in label_range.detail


@pytest.mark.parametrize(
    ("task", "metric"), [("token_classification", "exact_match"), ("multiple_choice", "accuracy")]
)
def test_overfit_defaults_score_encoder_heads(task: str, metric: str, tmp_path: Path) -> None:
    overfit = OverfitTinySubset()
    _fit(task, [overfit], tmp_path, max_steps=-1, max_epochs=1000, val_check_interval=None)
    assert overfit.verdict == "pass", overfit.checks
    assert overfit.checks["targets_recovered"].detail.startswith(f"{metric} 1.000")
    expected = {"token_classification": LABELS, "multiple_choice": CHOICES}[task]
    assert f"-log(1/{expected})" in overfit.checks["initial_loss"].detail


def test_choice_lengths_are_read_per_choice(tmp_path: Path) -> None:
    """``[batch, choices, length]`` inputs and mask: truncation is judged on each choice."""
    inspector = BatchInspector(max_length=WIDTH)
    _fit("multiple_choice", [inspector], tmp_path)
    check = inspector.checks["train/truncation"]
    assert check.verdict == "warn"
    assert check.detail.startswith(f"64 of 64 sequence(s) (100%) reach max_length={WIDTH}")


def test_one_fixed_label_on_the_special_tokens_warns_varying_labels_fail() -> None:
    """[CLS]/[SEP] labelled with one fixed class (an "O") in every row may be deliberate: a
    warning; varying labels there are words' labels moved onto them: a failure."""
    from lightning_pilot.core.label_checks import EncoderHeadWatch

    ids = torch.tensor([[1, 5, 6, 7, 2], [1, 8, 9, 2, 0], [1, 4, 5, 6, 2]])
    mask = (ids != 0).long()
    fixed = torch.tensor([[0, 3, 4, 0, 0], [0, 1, 2, 0, -100], [0, 4, 4, 3, 0]])
    varying = torch.tensor([[3, 4, 0, 0, -100], [1, 2, 0, -100, -100], [4, 4, 3, 0, -100]])
    verdicts = []
    for labels in (fixed, varying):
        watch = EncoderHeadWatch("BertForTokenClassification", -100, max_calls=4)
        watch(torch.nn.Identity(), (), {"input_ids": ids, "attention_mask": mask, "labels": labels})
        verdicts.append(watch.check().verdict)
    assert verdicts == ["warn", "fail"]
