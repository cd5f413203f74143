"""Tests of the synthetic instruction task and TinyCausalLM (lightning_pilot.demo.lm)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from demo_helpers import LossRecorder, assert_same_batches, make_trainer
from lightning.pytorch import Callback, Trainer, seed_everything
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_pilot.demo import (
    BOS_ID,
    COMMANDS,
    EOS_ID,
    IGNORE_INDEX,
    PAD_ID,
    SEP_ID,
    SYMBOLS,
    TOKEN_TO_ID,
    VOCAB,
    VOCAB_SIZE,
    InstructionCollator,
    InstructionDataModule,
    InstructionDataset,
    TinyCausalLM,
    decode,
    encode,
)


def expected_response(command: str, operands: list[int]) -> list[int]:
    """The task's rule, restated independently of the library."""
    if command == "copy":
        return operands
    if command == "reverse":
        return list(reversed(operands))
    assert command == "sort"
    return sorted(operands)


def fitted_datamodule(**overrides: Any) -> InstructionDataModule:
    options: dict[str, Any] = {"dataset_size": 200, "seed": 3, "batch_size": 16}
    datamodule = InstructionDataModule(**{**options, **overrides})
    datamodule.setup("fit")
    return datamodule


# --- vocabulary -------------------------------------------------------------------------------


def test_vocabulary_layout() -> None:
    assert PAD_ID == 0
    assert IGNORE_INDEX == -100
    assert len(set(VOCAB)) == VOCAB_SIZE == 4 + len(COMMANDS) + len(SYMBOLS)
    assert all(TOKEN_TO_ID[token] == i for i, token in enumerate(VOCAB))
    assert len({PAD_ID, BOS_ID, SEP_ID, EOS_ID}) == 4


def test_encode_decode_round_trip() -> None:
    text = "<bos> reverse a b p <sep> p b a <eos>"
    assert decode(encode(text)) == text
    # Padding and ignored labels are skipped by default, kept on request.
    assert decode(torch.tensor([*encode(text), PAD_ID, PAD_ID])) == text
    assert decode([BOS_ID, PAD_ID], skip_padding=False) == "<bos> <pad>"
    assert decode([IGNORE_INDEX, IGNORE_INDEX, TOKEN_TO_ID["c"], EOS_ID]) == "c <eos>"


def test_encode_and_decode_reject_unknown_tokens() -> None:
    with pytest.raises(ValueError, match=r"unknown token 'z'"):
        encode("<bos> copy z")
    with pytest.raises(ValueError, match=r"token id 99: ids must be in \[0, 23\)"):
        decode([BOS_ID, 99])
    with pytest.raises(ValueError, match=r"ids must be 1-d"):
        decode(torch.zeros(2, 3, dtype=torch.long))


# --- data ---------------------------------------------------------------------------------------


def test_examples_follow_their_command() -> None:
    dataset = InstructionDataset(size=300, seed=1, min_symbols=2, max_symbols=8)
    seen_commands = set()
    for index in range(len(dataset)):
        example = dataset[index]
        assert example["ids"] == index
        tokens = example["input_ids"].tolist()
        sep = tokens.index(SEP_ID)
        assert tokens[0] == BOS_ID
        assert tokens[-1] == EOS_ID
        command, operands, response = VOCAB[tokens[1]], tokens[2:sep], tokens[sep + 1 : -1]
        seen_commands.add(command)
        assert 2 <= len(operands) <= 8
        assert all(VOCAB[token] in SYMBOLS for token in operands)
        assert response == expected_response(command, operands)
        # Only the response (and its <eos>) is labelled.
        labels = example["labels"].tolist()
        assert labels[: sep + 1] == [IGNORE_INDEX] * (sep + 1)
        assert labels[sep + 1 :] == tokens[sep + 1 :]
        assert example["attention_mask"].tolist() == [1] * len(tokens)
    assert seen_commands == set(COMMANDS)


def test_same_seed_gives_identical_batches_and_another_seed_does_not() -> None:
    first = fitted_datamodule()
    second = fitted_datamodule()
    assert_same_batches(list(first.train_dataloader()), list(second.train_dataloader()))
    assert_same_batches(list(first.val_dataloader()), list(second.val_dataloader()))
    # A second fit would call train_dataloader() again: same order again.
    assert_same_batches(list(first.train_dataloader()), list(second.train_dataloader()))
    other = fitted_datamodule(seed=4)
    assert not torch.equal(
        next(iter(first.train_dataloader()))["ids"], next(iter(other.train_dataloader()))["ids"]
    )


def test_shuffle_false_serves_ids_in_order() -> None:
    datamodule = fitted_datamodule(shuffle=False)
    ids = torch.cat([batch["ids"] for batch in datamodule.train_dataloader()])
    assert ids.tolist() == list(range(len(datamodule.train_dataset)))


def test_batch_format_padding_and_labels() -> None:
    datamodule = fitted_datamodule(max_length=32)
    for batch in datamodule.train_dataloader():
        assert set(batch) == {"ids", "input_ids", "attention_mask", "labels"}
        for key in batch:
            assert batch[key].dtype == torch.long, key
        input_ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        assert batch["ids"].shape == (input_ids.shape[0],)
        assert input_ids.shape == mask.shape == labels.shape
        lengths = mask.sum(dim=1)
        # T is the longest example of the batch (nothing is truncated at max_length=32).
        assert input_ids.shape[1] == int(lengths.max())
        positions = torch.arange(input_ids.shape[1])
        # Right padding: ones, then zeros.
        assert torch.equal(mask, (positions[None, :] < lengths[:, None]).long())
        # <pad> appears exactly where the mask is 0.
        assert torch.equal(input_ids == PAD_ID, mask == 0)
        # Labels are -100 exactly at instruction positions (up to <sep>) and padding.
        sep = (input_ids == SEP_ID).long().argmax(dim=1)
        instruction = positions[None, :] <= sep[:, None]
        ignored = instruction | (mask == 0)
        assert torch.equal(labels == IGNORE_INDEX, ignored)
        assert torch.equal(labels[~ignored], input_ids[~ignored])


def test_ids_are_unique_across_splits_and_cover_the_data() -> None:
    datamodule = fitted_datamodule()
    seen: list[int] = []
    for loader in (
        datamodule.train_dataloader(),
        datamodule.val_dataloader(),
        datamodule.test_dataloader(),
    ):
        seen += torch.cat([batch["ids"] for batch in loader]).tolist()
    assert sorted(seen) == list(range(200))
    assert len(datamodule.val_dataset) == len(datamodule.test_dataset) == 20


def test_truncation_at_max_length() -> None:
    full = fitted_datamodule(shuffle=False, max_length=32)
    cut = fitted_datamodule(shuffle=False, max_length=9)
    truncated_rows = 0
    for long_batch, short_batch in zip(
        full.train_dataloader(), cut.train_dataloader(), strict=True
    ):
        assert short_batch["input_ids"].shape[1] == 9  # every example is >= 2 * 2 + 4 = 8 long
        width = 9
        for key in ("input_ids", "attention_mask", "labels"):
            assert torch.equal(short_batch[key], long_batch[key][:, :width]), key
        truncated_rows += int((long_batch["attention_mask"].sum(dim=1) > width).sum())
    assert truncated_rows > 0


def test_collator_pads_to_the_longest_example_below_max_length() -> None:
    dataset = InstructionDataset(size=2, seed=0)
    short = {**dataset[0], "input_ids": torch.tensor([BOS_ID, 4, 7, SEP_ID, 7, EOS_ID])}
    short["labels"] = torch.tensor([IGNORE_INDEX] * 4 + [7, EOS_ID])
    short["attention_mask"] = torch.ones(6, dtype=torch.long)
    batch = InstructionCollator(max_length=32)([short, short])
    assert batch["input_ids"].shape == (2, 6)
    assert decode(batch["labels"][0]) == "a <eos>"


def test_a_batch_without_response_tokens_has_zero_loss_not_nan() -> None:
    datamodule = fitted_datamodule(max_length=4)  # instructions are at least 5 tokens long
    batch = next(iter(datamodule.train_dataloader()))
    assert bool((batch["labels"] == IGNORE_INDEX).all())
    model = TinyCausalLM(max_length=4)
    # The private helper, because training_step's self.log needs a Trainer.
    loss, _, counted = model._loss_and_accuracy(batch)
    assert counted == 0
    assert float(loss.detach()) == 0.0
    assert not loss.isnan()


# --- stateful loaders ---------------------------------------------------------------------------


def test_stateful_loader_state_dict_round_trips() -> None:
    datamodule = fitted_datamodule(stateful=True)
    loader = datamodule.train_dataloader()
    assert isinstance(loader, StatefulDataLoader)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = loader.state_dict()
    remaining = list(iterator)

    resumed = fitted_datamodule(stateful=True).train_dataloader()
    assert isinstance(resumed, StatefulDataLoader)
    resumed.load_state_dict(state)
    assert_same_batches(list(resumed), remaining)
    # And the stateful order is the plain loader's order.
    plain = list(fitted_datamodule().train_dataloader())
    assert_same_batches(plain[3:], remaining)


def test_stateful_without_torchdata_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes the import fail as if torchdata were not installed.
    monkeypatch.setitem(sys.modules, "torchdata.stateful_dataloader", None)
    with pytest.raises(ImportError, match=r"pip install 'lightning-pilot\[stateful\]'"):
        InstructionDataModule(stateful=True)
    InstructionDataModule(stateful=False)  # the plain loaders do not need torchdata


# --- argument validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"batch_size": 0},
            ValueError,
            r"InstructionDataModule\(batch_size=0\) is invalid: expected an integer >= 1\.",
        ),
        ({"batch_size": "8"}, TypeError, r"\(batch_size='8'\) is invalid"),
        ({"batch_size": True}, TypeError, r"\(batch_size=True\) is invalid"),
        ({"dataset_size": 2}, ValueError, r"\(dataset_size=2\) is invalid"),
        ({"seed": -1}, ValueError, r"\(seed=-1\).*integer >= 0"),
        ({"max_length": 0}, ValueError, r"\(max_length=0\).*integer >= 1"),
        ({"num_workers": -1}, ValueError, r"\(num_workers=-1\).*integer >= 0"),
        ({"stateful": "yes"}, TypeError, r"\(stateful='yes'\).*True or False"),
        ({"shuffle": 1}, TypeError, r"\(shuffle=1\).*True or False"),
        ({"val_size": 0.0}, ValueError, r"\(val_size=0\.0\).*number in \(0, 1\]"),
        ({"test_size": 1.5}, ValueError, r"\(test_size=1\.5\).*number in \(0, 1\]"),
        ({"val_size": 0.5, "test_size": 0.5}, ValueError, r"val_size \+ test_size must be below 1"),
        ({"min_symbols": 5, "max_symbols": 3}, ValueError, r"\(max_symbols=3\).*>= min_symbols"),
        (
            {"dataset_size": 4, "val_size": 0.4, "test_size": 0.4},
            ValueError,
            r"\(dataset_size=4\).*large enough",
        ),
    ],
)
def test_datamodule_rejects_bad_arguments(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        InstructionDataModule(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"n_heads": 3},
            ValueError,
            r"TinyCausalLM\(n_heads=3\) is invalid: expected a divisor of d_model=64\.",
        ),
        ({"d_model": 0}, ValueError, r"\(d_model=0\).*integer >= 1"),
        ({"lr": 0.0}, ValueError, r"\(lr=0\.0\).*finite number > 0"),
        ({"lr": float("nan")}, ValueError, r"\(lr=nan\)"),
        ({"lr": "fast"}, TypeError, r"\(lr='fast'\)"),
        ({"dropout": 1.0}, ValueError, r"\(dropout=1\.0\).*number from 0 to 1 \(below 1\)"),
        ({"weight_decay": -0.1}, ValueError, r"\(weight_decay=-0\.1\).*>= 0"),
        ({"lr_schedule": "linear"}, ValueError, r"\(lr_schedule='linear'\).*'constant', 'cosine'"),
        ({"warmup_steps": -1}, ValueError, r"\(warmup_steps=-1\)"),
    ],
)
def test_model_rejects_bad_arguments(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        TinyCausalLM(**kwargs)


def test_forward_rejects_sequences_longer_than_max_length() -> None:
    model = TinyCausalLM(d_model=16, n_heads=2, n_layers=1, max_length=8)
    with pytest.raises(ValueError, match=r"length 9.*max_length=8"):
        model(torch.ones(1, 9, dtype=torch.long))


# --- model --------------------------------------------------------------------------------------


def test_padding_does_not_change_the_logits_of_real_tokens() -> None:
    torch.manual_seed(0)
    model = TinyCausalLM(d_model=32, n_heads=2, n_layers=2).eval()
    datamodule = fitted_datamodule(shuffle=False)
    batch = next(iter(datamodule.train_dataloader()))
    padded = model(batch["input_ids"], batch["attention_mask"])
    for row in range(batch["input_ids"].shape[0]):
        length = int(batch["attention_mask"][row].sum())
        alone = model(batch["input_ids"][row : row + 1, :length])
        torch.testing.assert_close(padded[row, :length], alone[0], rtol=1e-4, atol=1e-5)
    assert not padded.isnan().any()


def test_training_learns_the_responses(tmp_path: Path) -> None:
    # Measured on seeds 0-9 (400 steps, one thread): final / initial response loss 0.12-0.20.
    seed_everything(0, verbose=False)
    datamodule = InstructionDataModule(dataset_size=2048, seed=0, batch_size=32)
    model = TinyCausalLM(lr=3e-3, warmup_steps=30)
    recorder = LossRecorder()
    trainer = make_trainer(
        tmp_path, max_steps=400, limit_val_batches=2, callbacks=[recorder], num_sanity_val_steps=0
    )
    trainer.fit(model, datamodule)
    initial = recorder.losses[0]
    final = sum(recorder.losses[-10:]) / 10
    # Untrained logits are near uniform: about ln(vocab_size) nats per token.
    assert initial == pytest.approx(torch.log(torch.tensor(VOCAB_SIZE)).item(), rel=0.15)
    assert final / initial < 0.3
    assert {"train_loss", "val_loss", "val_acc"} <= set(trainer.callback_metrics)
    assert float(trainer.callback_metrics["val_acc"]) > 0.5


def test_checkpoint_rebuilds_model_and_datamodule(tmp_path: Path) -> None:
    datamodule = InstructionDataModule(dataset_size=96, seed=5, batch_size=8, max_length=24)
    model = TinyCausalLM(d_model=32, n_heads=2, n_layers=1, max_length=24, lr=1e-3)
    trainer = make_trainer(tmp_path, max_steps=2, limit_val_batches=1, num_sanity_val_steps=0)
    trainer.fit(model, datamodule)
    path = tmp_path / "tiny.ckpt"
    trainer.save_checkpoint(path)

    restored = TinyCausalLM.load_from_checkpoint(path)
    assert dict(restored.hparams) == dict(model.hparams)
    assert restored.hparams["d_model"] == 32
    for name, tensor in model.state_dict().items():
        assert torch.equal(restored.state_dict()[name], tensor), name

    rebuilt = InstructionDataModule.load_from_checkpoint(path)
    assert dict(rebuilt.hparams) == dict(datamodule.hparams)
    rebuilt.setup("fit")
    assert_same_batches(list(rebuilt.train_dataloader()), list(datamodule.train_dataloader()))


def test_predict_returns_ids_and_aligned_predictions(tmp_path: Path) -> None:
    datamodule = InstructionDataModule(dataset_size=64, seed=0, batch_size=8)
    model = TinyCausalLM(d_model=16, n_heads=2, n_layers=1)
    predicted = make_trainer(tmp_path).predict(model, datamodule=datamodule)
    assert predicted is not None
    outputs = [output for output in predicted if isinstance(output, dict)]
    assert len(outputs) == len(predicted)
    ids = torch.cat([output["ids"] for output in outputs])
    assert ids.tolist() == list(range(64 - len(datamodule.test_dataset), 64))
    for output in outputs:
        predictions, labels = output["predictions"], output["labels"]
        assert predictions.shape == labels.shape
        assert predictions.dtype == torch.long
        assert bool((predictions[:, 0] == PAD_ID).all())
        assert int(predictions.min()) >= 0
        assert int(predictions.max()) < VOCAB_SIZE


def test_generate_stops_at_the_budget_and_restores_training_mode() -> None:
    model = TinyCausalLM(d_model=16, n_heads=2, n_layers=1, max_length=12)
    prompt = encode("<bos> sort c a b <sep>")
    assert model.training
    assert len(model.generate(prompt, max_new_tokens=2)) <= 2
    assert len(model.generate(prompt)) <= 12 - len(prompt)
    assert model.training


def test_cosine_schedule_with_warmup_moves_the_learning_rate(tmp_path: Path) -> None:
    datamodule = InstructionDataModule(dataset_size=64, seed=0, batch_size=8)
    model = TinyCausalLM(d_model=16, n_heads=2, n_layers=1, lr_schedule="cosine", warmup_steps=2)
    seen: list[float] = []

    class LearningRates(Callback):
        def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
            seen.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer = make_trainer(tmp_path, max_steps=10, limit_val_batches=0, callbacks=[LearningRates()])
    trainer.fit(model, datamodule)
    assert seen[0] == pytest.approx(model.lr / 2)  # warm-up
    assert seen[1] == pytest.approx(model.lr)
    assert seen[-1] < seen[2]  # decaying
    assert min(seen[1:]) >= model.lr / 10 - 1e-12
