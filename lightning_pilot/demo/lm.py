"""A tiny causal transformer language model on a synthetic instruction -> response task,
generated from a seed: ``<bos> COMMAND s1 ... sn <sep> r1 ... rn <eos>``, the response being
the symbols transformed by ``copy``, ``reverse`` or ``sort``. Batches hold ``ids``,
``input_ids``, ``attention_mask`` and ``labels`` aligned with ``input_ids`` (the model shifts
internally); only the response (``<eos>`` included) is not :data:`IGNORE_INDEX`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from torch.nn.functional import cross_entropy, scaled_dot_product_attention
from torch.utils.data import Dataset, Subset

from lightning_pilot.core import validate
from lightning_pilot.demo._data import EvaluatedModule, SplitDataModule

#: Label of the positions the loss skips (instruction and padding); PyTorch's default.
IGNORE_INDEX = -100
#: Structural tokens, in id order: padding, begin of sequence, instruction end, response end.
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<sep>", "<eos>")
#: The instructions the model learns to follow.
COMMANDS: tuple[str, ...] = ("copy", "reverse", "sort")
#: The tokens the commands operate on; ``sort`` orders them alphabetically (= by id).
SYMBOLS: tuple[str, ...] = tuple("abcdefghijklmnop")
#: Every token string, indexed by token id.
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + COMMANDS + SYMBOLS
#: Number of token ids (23).
VOCAB_SIZE = len(VOCAB)
#: Token id -> token string (the same tuple as :data:`VOCAB`).
ID_TO_TOKEN: tuple[str, ...] = VOCAB
#: Token string -> token id (read-only).
TOKEN_TO_ID: Mapping[str, int] = MappingProxyType({token: i for i, token in enumerate(VOCAB)})
PAD_ID, BOS_ID, SEP_ID, EOS_ID = (TOKEN_TO_ID[token] for token in SPECIAL_TOKENS)

_FIRST_COMMAND_ID = TOKEN_TO_ID[COMMANDS[0]]
_FIRST_SYMBOL_ID = TOKEN_TO_ID[SYMBOLS[0]]
#: The response each command makes of its operands.
_RESPONSES: Mapping[str, Callable[[list[int]], list[int]]] = {
    "copy": list,
    "reverse": lambda symbols: symbols[::-1],
    "sort": sorted,
}


def encode(text: str) -> list[int]:
    """The token ids of whitespace-separated tokens; ``ValueError`` for one not in :data:`VOCAB`.

    Example:
        >>> encode("<bos> copy a b <sep>")
        [1, 4, 7, 8, 2]
    """
    unknown = [token for token in text.split() if token not in TOKEN_TO_ID]
    if unknown:
        raise ValueError(
            f"encode() got the unknown token {unknown[0]!r}: tokens must be one of {VOCAB}."
        )
    return [TOKEN_TO_ID[token] for token in text.split()]


def decode(ids: Iterable[int] | Tensor, *, skip_padding: bool = True) -> str:
    """Token ids (a list or a 1-d tensor) as space-separated tokens; ``ValueError`` for an id
    that is not a token id. ``skip_padding`` drops :data:`PAD_ID` and :data:`IGNORE_INDEX`.

    Example:
        >>> decode([1, 5, 7, 8, 2, 8, 7, 3, 0, 0])
        '<bos> reverse a b <sep> b a <eos>'
        >>> decode([-100, -100, 9, 3])
        'c <eos>'
    """
    if isinstance(ids, Tensor):
        if ids.dim() != 1:
            raise ValueError(
                f"decode() got a tensor of shape {tuple(ids.shape)}: ids must be 1-d; "
                "decode batches row by row."
            )
        ids = ids.tolist()
    tokens = []
    for token_id in ids:
        if skip_padding and token_id in (PAD_ID, IGNORE_INDEX):
            continue
        if not 0 <= token_id < VOCAB_SIZE:
            raise ValueError(
                f"decode() got the token id {token_id!r}: ids must be in [0, {VOCAB_SIZE})."
            )
        tokens.append(ID_TO_TOKEN[token_id])
    return " ".join(tokens)


def _check_symbols(owner: str, min_symbols: object, max_symbols: object) -> tuple[int, int]:
    low = validate.integer(owner, "min_symbols", min_symbols, minimum=1)
    high = validate.integer(owner, "max_symbols", max_symbols, minimum=1)
    if high < low:
        raise ValueError(validate.invalid(owner, "max_symbols", high, f">= min_symbols ({low})"))
    return low, high


class InstructionDataset(Dataset[dict[str, Any]]):
    """Seeded synthetic instruction -> response examples: item ``i`` holds ``ids`` (``i``),
    ``input_ids``, ``attention_mask`` and ``labels`` (1-d, unpadded). An instruction operates
    on ``min_symbols`` to ``max_symbols`` symbols; ``n`` symbols make ``2 * n + 4`` tokens.

    Example:
        >>> dataset = InstructionDataset(size=4, seed=0)
        >>> len(dataset)
        4
        >>> sorted(dataset[0])
        ['attention_mask', 'ids', 'input_ids', 'labels']
        >>> decode(dataset[0]["input_ids"]).startswith("<bos>")
        True
    """

    def __init__(self, size: int, seed: int, *, min_symbols: int = 2, max_symbols: int = 8) -> None:
        owner = type(self).__name__
        validate.integer(owner, "size", size, minimum=1)
        validate.integer(owner, "seed", seed, minimum=0)
        _check_symbols(owner, min_symbols, max_symbols)
        generator = torch.Generator().manual_seed(seed)
        commands = torch.randint(len(COMMANDS), (size,), generator=generator).tolist()
        lengths = torch.randint(min_symbols, max_symbols + 1, (size,), generator=generator)
        symbols = torch.randint(len(SYMBOLS), (size, max_symbols), generator=generator)
        symbols += _FIRST_SYMBOL_ID
        # One padded matrix instead of thousands of small tensors: compact, quick to index.
        self._tokens = torch.full((size, 2 * max_symbols + 4), PAD_ID, dtype=torch.long)
        self._lengths = torch.empty(size, dtype=torch.long)
        self._prompt_lengths = torch.empty(size, dtype=torch.long)
        for i, (command, length, row) in enumerate(
            zip(commands, lengths.tolist(), symbols.tolist(), strict=True)
        ):
            operands = row[:length]
            prompt = [BOS_ID, _FIRST_COMMAND_ID + command, *operands, SEP_ID]
            sequence = [*prompt, *_RESPONSES[COMMANDS[command]](operands), EOS_ID]
            self._tokens[i, : len(sequence)] = torch.tensor(sequence)
            self._lengths[i] = len(sequence)
            self._prompt_lengths[i] = len(prompt)

    def __len__(self) -> int:
        return int(self._tokens.shape[0])

    def __getitem__(self, index: int) -> dict[str, Any]:
        length = int(self._lengths[index])
        # clone(): a view would drag the whole matrix along when sent to a DataLoader worker.
        input_ids = self._tokens[index, :length].clone()
        labels = input_ids.clone()
        labels[: int(self._prompt_lengths[index])] = IGNORE_INDEX
        mask = torch.ones(length, dtype=torch.long)
        return {"ids": int(index), "input_ids": input_ids, "attention_mask": mask, "labels": labels}


class InstructionCollator:
    """Pad (right) and truncate instruction examples into a batch of the longest example's
    length, capped at ``max_length`` (longer examples lose their tail). Padding gets
    :data:`PAD_ID`, 0 in ``attention_mask`` and :data:`IGNORE_INDEX` in ``labels``. A class,
    not a closure, so that DataLoader workers can pickle it.

    Example:
        >>> collate = InstructionCollator(max_length=6)
        >>> batch = collate([InstructionDataset(size=2, seed=0)[i] for i in range(2)])
        >>> batch["input_ids"].shape[1] <= 6
        True
    """

    def __init__(self, max_length: int) -> None:
        self.max_length = validate.integer(type(self).__name__, "max_length", max_length, minimum=1)

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        """Merge unbatched examples (dicts from :class:`InstructionDataset`) into one batch."""
        width = min(self.max_length, max(len(example["input_ids"]) for example in examples))
        shape = (len(examples), width)
        input_ids = torch.full(shape, PAD_ID, dtype=torch.long)
        mask = torch.zeros(shape, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        for row, example in enumerate(examples):
            length = min(width, len(example["input_ids"]))
            input_ids[row, :length] = example["input_ids"][:length]
            mask[row, :length] = 1
            labels[row, :length] = example["labels"][:length]
        ids = torch.tensor([int(example["ids"]) for example in examples], dtype=torch.long)
        return {"ids": ids, "input_ids": input_ids, "attention_mask": mask, "labels": labels}


class InstructionDataModule(SplitDataModule):
    """Train/validation/test loaders of the instruction task, split in id order (predict
    serves test) and truncated to ``max_length``; the other arguments are as in
    :class:`~lightning_pilot.demo.ClassificationDataModule`.

    Example:
        >>> datamodule = InstructionDataModule(dataset_size=64, seed=0, batch_size=4)
        >>> datamodule.setup("fit")
        >>> batch = next(iter(datamodule.train_dataloader()))
        >>> sorted(batch)
        ['attention_mask', 'ids', 'input_ids', 'labels']
        >>> batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
        True
        >>> len(batch["ids"])
        4
    """

    def __init__(
        self,
        dataset_size: int = 2048,
        seed: int = 0,
        batch_size: int = 32,
        max_length: int = 32,
        val_size: float = 0.1,
        test_size: float = 0.1,
        stateful: bool = False,
        shuffle: bool = True,
        num_workers: int = 0,
        min_symbols: int = 2,
        max_symbols: int = 8,
    ) -> None:
        super().__init__(
            dataset_size, seed, batch_size, val_size, test_size, stateful, shuffle, num_workers
        )
        owner = type(self).__name__
        self.max_length = validate.integer(owner, "max_length", max_length, minimum=1)
        self.min_symbols, self.max_symbols = _check_symbols(owner, min_symbols, max_symbols)
        self._split_counts = self._counts(self.dataset_size, "example")
        self.save_hyperparameters()

    def _collate(self) -> Callable[[list[Any]], Any] | None:
        return InstructionCollator(self.max_length)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, the ``vocab_size`` a model of this data needs."""
        return VOCAB_SIZE

    def _make_splits(self) -> dict[str, Subset[dict[str, Any]]]:
        symbols = {"min_symbols": self.min_symbols, "max_symbols": self.max_symbols}
        dataset = InstructionDataset(self.dataset_size, self.seed, **symbols)
        n_train, n_val, _ = self._split_counts
        return {
            "train": Subset(dataset, range(n_train)),
            "val": Subset(dataset, range(n_train, n_train + n_val)),
            "test": Subset(dataset, range(n_train + n_val, self.dataset_size)),
        }


class _CausalSelfAttention(nn.Module):
    """Multi-head self-attention under a boolean "may attend" mask."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor, allowed: Tensor) -> Tensor:
        batch, length, width = x.shape
        # [B, T, 3 * C] -> three [B, heads, T, C / heads] tensors.
        qkv = self.qkv(x).view(batch, length, 3, self.n_heads, width // self.n_heads)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        dropout = self.dropout if self.training else 0.0
        attended = scaled_dot_product_attention(query, key, value, allowed, dropout)
        merged: Tensor = self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return merged


class _Block(nn.Module):
    """Pre-norm transformer block: attention then MLP, each around a residual connection."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(d_model)
        self.attention = _CausalSelfAttention(d_model, n_heads, dropout)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor, allowed: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x), allowed)
        updated: Tensor = x + self.mlp(self.mlp_norm(x))
        return updated


class TinyCausalLM(EvaluatedModule):
    """A small GPT-style decoder (``n_layers`` pre-norm blocks) trained on
    :class:`InstructionDataModule` batches with next-token cross-entropy over the response
    tokens; logs ``train_loss``, ``val_loss``/``val_acc`` and ``test_loss``/``test_acc``. Keep
    ``max_length`` equal to the data module's. AdamW at peak ``lr`` (``warmup_steps`` of linear
    warm-up; ``lr_schedule="cosine"`` decays to ``lr / 10``).

    Example:
        >>> model = TinyCausalLM(d_model=32, n_heads=2, n_layers=1)
        >>> batch = InstructionCollator(32)([InstructionDataset(size=2, seed=0)[i] for i in (0, 1)])
        >>> logits = model(batch["input_ids"], batch["attention_mask"])
        >>> logits.shape == (*batch["input_ids"].shape, VOCAB_SIZE)
        True
    """

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        max_length: int = 32,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        lr_schedule: Literal["constant", "cosine"] = "constant",
        warmup_steps: int = 0,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self.vocab_size = validate.integer(owner, "vocab_size", vocab_size, minimum=1)
        validate.integer(owner, "d_model", d_model, minimum=1)
        validate.integer(owner, "n_heads", n_heads, minimum=1)
        if d_model % n_heads != 0:
            raise ValueError(
                validate.invalid(owner, "n_heads", n_heads, f"a divisor of d_model={d_model}")
            )
        validate.integer(owner, "n_layers", n_layers, minimum=1)
        self.max_length = validate.integer(owner, "max_length", max_length, minimum=1)
        dropout = validate.number(
            owner, "dropout", dropout, minimum=0, maximum=math.nextafter(1, 0), hint="below 1"
        )
        self.lr = validate.number(owner, "lr", lr, minimum=0, allow_minimum=False)
        self.weight_decay = validate.number(owner, "weight_decay", weight_decay, minimum=0)
        self.lr_schedule: Literal["constant", "cosine"] = validate.choice(
            owner, "lr_schedule", lr_schedule, ("constant", "cosine")
        )
        self.warmup_steps = validate.integer(owner, "warmup_steps", warmup_steps, minimum=0)
        self.save_hyperparameters()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_length, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.final_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        # Small embeddings (GPT-2's 0.02) keep the first logits near uniform, so the initial
        # loss is close to ln(vocab_size) and loss-ratio checks have a stable reference.
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.position_embedding.weight, std=0.02)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Next-token logits ``[B, T, vocab_size]`` of ``input_ids`` (``T <= max_length``);
        ``attention_mask`` is nonzero on real tokens (``None``: no padding)."""
        length = input_ids.shape[1]
        if length > self.max_length:
            raise ValueError(
                f"{type(self).__name__}.forward() got sequences of length {length}: the "
                f"length must be at most max_length={self.max_length}; truncate the data "
                "or build the model with a larger max_length."
            )
        positions = torch.arange(length, device=input_ids.device)
        x = self.token_embedding(input_ids) + self.position_embedding(positions)
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
        allowed = causal[None, None]
        if attention_mask is not None:
            keys = attention_mask.bool()[:, None, None, :]
            # Every position attends to itself, so a padding row never masks all keys (NaN).
            diagonal = torch.eye(length, dtype=torch.bool, device=input_ids.device)
            allowed = causal & (keys | diagonal)
        for block in self.blocks:
            x = block(x, allowed)
        logits: Tensor = self.head(self.final_norm(x))
        return logits

    def _loss_and_accuracy(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, int]:
        """(mean loss, accuracy, counted tokens) over the response tokens of a batch."""
        logits = self.forward(batch["input_ids"], batch["attention_mask"])
        shifted_logits = logits[:, :-1].reshape(-1, logits.shape[-1])
        targets = batch["labels"][:, 1:].reshape(-1)
        counted = targets != IGNORE_INDEX
        n_counted = int(counted.sum())
        # Not reduction="mean": NaN when nothing is counted (truncated before the responses).
        total = cross_entropy(shifted_logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
        loss = total / max(n_counted, 1)
        # By hand, not torchmetrics, whose other temporaries would change the measured memory.
        correct = (shifted_logits.argmax(dim=-1) == targets) & counted
        accuracy = correct.sum() / max(n_counted, 1)
        return loss, accuracy, n_counted

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        """Compute and log ``train_loss`` on one batch."""
        loss, _, _ = self._loss_and_accuracy(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=len(batch["ids"]))
        return loss

    def _evaluate(self, batch: Mapping[str, Tensor], prefix: str) -> Tensor:
        loss, accuracy, n_counted = self._loss_and_accuracy(batch)
        weight = max(n_counted, 1)  # the epoch average over response tokens, as the loss
        self.log(f"{prefix}_loss", loss, prog_bar=True, batch_size=weight)
        self.log(f"{prefix}_acc", accuracy, batch_size=weight)
        return loss

    def predict_step(
        self, batch: Mapping[str, Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, Tensor]:
        """Every next token, teacher-forced and greedy: ``ids``, ``predictions`` aligned with
        ``labels`` (entry 0 holds :data:`PAD_ID`) and ``labels`` when the batch has them."""
        logits = self.forward(batch["input_ids"], batch["attention_mask"])
        predictions = torch.full_like(batch["input_ids"], PAD_ID)
        predictions[:, 1:] = logits[:, :-1].argmax(dim=-1)
        output = {"ids": batch["ids"], "predictions": predictions}
        return output | ({"labels": batch["labels"]} if "labels" in batch else {})

    @torch.no_grad()
    def generate(
        self, prompt: Sequence[int] | Tensor, max_new_tokens: int | None = None
    ) -> list[int]:
        """The tokens greedily generated after one prompt, until ``<eos>`` (included),
        ``max_new_tokens`` or ``max_length``.

        Example:
            >>> model = TinyCausalLM(d_model=16, n_heads=2, n_layers=1)
            >>> answer = model.generate(encode("<bos> sort c a b <sep>"), max_new_tokens=3)
            >>> len(answer) <= 3
            True
        """
        tokens = [int(token) for token in prompt]
        budget = self.max_length - len(tokens)
        if max_new_tokens is not None:
            budget = min(budget, max_new_tokens)
        was_training = self.training
        self.eval()
        generated: list[int] = []
        try:
            for _ in range(budget):
                input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
                next_token = int(self.forward(input_ids)[0, -1].argmax())
                tokens.append(next_token)
                generated.append(next_token)
                if next_token == EOS_ID:
                    break
        finally:
            self.train(was_training)
        return generated

    def configure_optimizers(self) -> OptimizerLRScheduler:
        """AdamW, with an optional warm-up / cosine schedule stepped every optimizer step."""
        # Biases and LayerNorm gains are not decayed.
        decayed = [p for p in self.parameters() if p.dim() >= 2]
        groups = [
            {"params": decayed, "weight_decay": self.weight_decay},
            {"params": [p for p in self.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.lr)
        if self.lr_schedule == "constant" and self.warmup_steps == 0:
            return optimizer
        cosine = self.lr_schedule == "cosine"
        total_steps = max(int(self.trainer.estimated_stepping_batches), 1) if cosine else 0
        warmup_steps = self.warmup_steps

        def factor(step: int) -> float:
            if step < warmup_steps:
                return (step + 1) / warmup_steps
            if not cosine:
                return 1.0
            progress = min(1.0, (step - warmup_steps) / max(total_steps - warmup_steps, 1))
            # From 1 down to 0.1: a floor keeps the last steps learning.
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }
